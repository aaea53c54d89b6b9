"""Side by side: the shipped kernel on the same activations and tables under different layouts of the
index (which table row each row reads), median of ``--rounds`` alternating rounds of device time after
an L2 flush, each with the coming table rows warmed into L2 ``--ahead`` rows ahead
(``LaunchConfig.prefetch_ahead``; ``_ahead0``: not warmed), percentages against the first layout
under the last ``--ahead``; ``identical`` says whether every build's outputs are bit-identical to the
first one's (per layout):

- ``uniform``: each row's table row drawn independently (the op benchmark's default);
- ``runs``: the same draw sorted, ``K`` contiguous runs (the model's layout);
- ``one_row``: every row reads table row 0;
- ``cycle_1``: ``t mod K`` (neighbouring rows differ, every program's neighbours read other rows);
- ``cycle_64``: ``(t // 64) mod K`` (runs of 64 rows, every table row seen early).

    python benchmarks/probe_index_layout.py [--rounds 5] [--cases A:3072 A:15808 B:15808]
        [--layouts uniform runs] [--ahead 1024 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_medians, relative_times  # noqa: E402
from sites import (  # noqa: E402
    INDEX_LAYOUTS,
    calls_agree,
    kernel_launch,
    make_inputs,
    shipped_launch_config,
    with_launch_config,
)

TABLE_ROWS = 6


def layouts(tokens: int, device="cuda") -> dict[str, torch.Tensor]:
    t = torch.arange(tokens, device=device)
    drawn = {layout: make_inputs("A", tokens, HIDDEN, TABLE_ROWS, device=device, index_layout=layout)["index"]
             for layout in INDEX_LAYOUTS}
    return drawn | {"one_row": torch.zeros_like(t), "cycle_1": t % TABLE_ROWS, "cycle_64": (t // 64) % TABLE_ROWS}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", default=["A:3072", "A:15808", "B:3072", "B:15808", "C:15808"])
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--layouts", nargs="+", default=None, help="default: all")
    parser.add_argument("--ahead", nargs="+", type=int, default=[1024, 0])
    args = parser.parse_args()
    for case in args.cases:
        site, tokens = case.split(":")
        tokens = int(tokens)
        inputs = make_inputs(site, tokens, HIDDEN, TABLE_ROWS)
        shipped = shipped_launch_config(site, HIDDEN, tokens)
        runs, same, outputs = {}, {}, None
        for name, index in layouts(tokens).items():
            if args.layouts and name not in args.layouts:
                continue
            layout_runs = {}
            for ahead in args.ahead:
                launch = kernel_launch(site, dict(inputs, index=index), args.policy, outputs=outputs)
                outputs = launch.outputs
                layout_runs[f"{name}_ahead{ahead}"] = with_launch_config(
                    launch, dataclasses.replace(shipped, prefetch_ahead=ahead))
            same[name] = calls_agree(layout_runs.values(), outputs)
            runs |= layout_runs
        med = alternating_medians(runs, args.rounds)
        print(f"{site} T={tokens:6d} {args.policy} " + relative_times(med, f"{next(iter(same))}_ahead{args.ahead[-1]}")
              + f"  identical: {same}", flush=True)


if __name__ == "__main__":
    main()
