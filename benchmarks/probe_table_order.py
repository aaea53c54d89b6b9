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
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_rounds  # noqa: E402
from sites import kernel_launch, load_kernel_module, make_inputs, with_launch_config  # noqa: E402

ORDERS = {"tables_after": False, "tables_ahead": True}


def main():
    from h3_fused.kernels.triton_modulation import launch_config

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
        shipped = launch_config(HIDDEN, site == "B", tokens)
        for policy in ("bf16", "fp32"):
            launches = {"baseline": kernel_launch(site, inputs, policy, kernel_module=baseline)}
            runs = dict(launches)
            for name, ahead in ORDERS.items():
                launches[name] = kernel_launch(site, inputs, policy)
                runs[name] = with_launch_config(launches[name], dataclasses.replace(shipped, tables_ahead=ahead))
            regs = {name: run().n_regs for name, run in runs.items()}
            outs = {name: [t for t in launch.outputs if t is not None] for name, launch in launches.items()}
            same = all(all(a.equal(b) for a, b in zip(outs["baseline"], o)) for o in outs.values())
            med = {name: statistics.median(v) for name, v in alternating_rounds(runs, args.rounds).items()}
            print(f"{site} T={tokens:6d} {policy} w{shipped.num_warps} " + "  ".join(
                f"{n} {m:6.1f} us {m / med['baseline'] - 1:+.1%} r{regs[n]}" for n, m in med.items())
                + f"  identical: {same}", flush=True)


if __name__ == "__main__":
    main()
