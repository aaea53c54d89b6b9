"""Side by side: the shipped kernel (``--baseline FILE``, e.g. ``git show REV:kernels/triton_modulation.py``)
against this kernel with the table rows loaded ahead and without (``LaunchConfig.tables_ahead``: the
first chunk's weight/scale/shift rows loaded with the activations, before the reduction, and each next
chunk's before the current chunk's ``y`` store), each on the warps and chunks ``launch_config`` picks.
Median of ``--rounds`` alternating rounds of device time after an L2 flush; outputs checked
bit-identical to the baseline's.

    python benchmarks/probe_table_order.py --baseline FILE [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_medians, relative_times  # noqa: E402
from sites import (  # noqa: E402
    calls_agree,
    kernel_launch,
    load_kernel_module,
    make_inputs,
    shipped_launch_config,
    with_launch_config,
)

ORDERS = {"tables_after": False, "tables_ahead": True}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", default=["A:1024", "A:3072", "A:6144", "A:15808", "A:63232",
                                                        "B:3072", "B:15808", "B:63232"])
    args = parser.parse_args()
    baseline = load_kernel_module(args.baseline)
    for case in args.cases:
        site, tokens = case.split(":")
        tokens = int(tokens)
        inputs = make_inputs(site, tokens, HIDDEN)
        shipped = shipped_launch_config(site, HIDDEN, tokens)
        for policy in ("bf16", "fp32"):
            runs = {"baseline": kernel_launch(site, inputs, policy, kernel_module=baseline)}
            outputs = runs["baseline"].outputs
            for name, ahead in ORDERS.items():
                runs[name] = with_launch_config(kernel_launch(site, inputs, policy, outputs=outputs),
                                                dataclasses.replace(shipped, tables_ahead=ahead))
            regs = {name: run().n_regs for name, run in runs.items()}
            same = calls_agree(runs.values(), outputs)
            med = alternating_medians(runs, args.rounds)
            print(f"{site} T={tokens:6d} {policy} w{shipped.num_warps} "
                  + relative_times(med, "baseline", lambda name: f" r{regs[name]}") + f"  identical: {same}", flush=True)


if __name__ == "__main__":
    main()
