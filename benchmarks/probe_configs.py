"""Side by side: the kernel under named launch configurations, per site, row count, policy and index
layout, median of ``--rounds`` alternating rounds of device time after an L2 flush (as
``bench_ops.py``), each against the configuration ``launch_config`` ships for that row count:

- ``shipped``: what ``launch_config`` picks for the site at ``T`` rows;
- ``w4_ahead`` / ``w8_ahead``: one row per program on 4 / 8 warps, chunks of one 16-byte vector per
  thread, the table rows loaded ahead (``tables_ahead``), the shipped warming of coming table rows;
- ``w4`` / ``w8``: the same with the table rows loaded just before their use.

    python benchmarks/probe_configs.py [--cases A:2048 A:3072 A:4096] [--policies bf16 fp32]
        [--index uniform runs] [--configs shipped w4_ahead w8]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_medians, relative_times  # noqa: E402
from sites import INDEX_LAYOUTS, kernel_launch, make_inputs, shipped_launch_config, with_launch_config  # noqa: E402

TABLE_ROWS = 6


def configurations(site: str, tokens: int) -> dict:
    from h3_fused.kernels.triton_modulation import LaunchConfig

    named = {"shipped": shipped_launch_config(site, HIDDEN, tokens)}
    for warps in (4, 8):
        for ahead in (False, True):
            named[f"w{warps}" + ("_ahead" if ahead else "")] = LaunchConfig(1, 32 * warps * 8, warps, ahead)
    return named


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", nargs="+", default=["A:2048", "A:3072", "A:4096", "A:6144"])
    parser.add_argument("--policies", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--index", nargs="+", default=list(INDEX_LAYOUTS), choices=INDEX_LAYOUTS)
    parser.add_argument("--configs", nargs="+", default=["shipped", "w4_ahead", "w8_ahead"])
    args = parser.parse_args()
    for case in args.cases:
        site, tokens = case.split(":")
        tokens = int(tokens)
        named = configurations(site, tokens)
        for layout in args.index:
            inputs = make_inputs(site, tokens, HIDDEN, TABLE_ROWS, index_layout=layout)
            runs = {}
            for policy in args.policies:
                for name in args.configs:
                    runs[name, policy] = with_launch_config(kernel_launch(site, inputs, policy), named[name])
                    runs[name, policy]()
            med = alternating_medians(runs, args.rounds)
            for policy in args.policies:
                print(f"{site} T={tokens:6d} {layout:7s} {policy} shipped={named['shipped']}: "
                      + relative_times({name: med[name, policy] for name in args.configs}, "shipped"), flush=True)


if __name__ == "__main__":
    main()
