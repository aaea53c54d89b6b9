"""What the policy and the index check cost: the kernel under ``bf16`` and under ``fp32``, each also
compiled without its device-side index assertion, timed in alternation.

    python benchmarks/bench_check_cost.py --out benchmarks/results/check_cost.json [--baseline FILE]
        [--sites A B C] [--tokens 3072 15808 63232] [--hidden 5376]

``--baseline FILE`` (a ``kernels/triton_modulation.py`` of another commit, ``git show
REV:kernels/triton_modulation.py > FILE``) adds that kernel under both policies to the alternation, and
the change of this kernel against it: a kernel change measured side by side, in one process.

Each site and T is timed in ``--rounds`` rounds, every round measuring the kernels one after
the other (device time under CUDA graphs after an L2 flush, as ``bench_ops.py``), so that drift of the
GPU's clocks between variants cancels; the table gives the median of the rounds and the ratios to
``bf16``. Every variant writes into the same output buffers: with buffers of their own, two identical
kernels differed by up to 1.7%, the same way in every run (runs 84-85, docs/BENCHMARKS.md).
``--index runs``: the index in contiguous runs, as the model lays it out (``sites.make_inputs``).
``--flush read``: L2 emptied before each replay by reading a large buffer rather than writing it
(``bench_ops.FLUSHES``), so that the kernel does not also write back the flush's dirty lines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import FLUSHES, HIDDEN, TOKENS, alternating_rounds  # noqa: E402
from sites import INDEX_LAYOUTS, SITES, LaunchOptions, kernel_launch, load_kernel_module, make_inputs  # noqa: E402


def launchers(site, inputs, baseline=None):
    """The calls to time, all writing into the same output buffers."""
    outputs = kernel_launch(site, inputs, "bf16").outputs

    def launch(policy, **options):
        return kernel_launch(site, inputs, policy, outputs=outputs, **options)

    runs = {}
    for policy in ("bf16", "fp32"):
        runs[policy] = launch(policy)
        runs[f"{policy}_no_index_check"] = launch(policy, wrap=LaunchOptions(debug=False))
    if baseline is not None:
        runs |= {f"baseline_{policy}": launch(policy, kernel_module=baseline) for policy in ("bf16", "fp32")}
    return runs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/check_cost.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline", help="a kernels/triton_modulation.py of another commit to compare with")
    parser.add_argument("--index", default="uniform", choices=INDEX_LAYOUTS, help="layout of the index (sites.make_inputs)")
    parser.add_argument("--flush", default="write", choices=FLUSHES, help="how L2 is emptied (bench_ops.FLUSHES)")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--hidden", nargs="+", type=int, default=[HIDDEN])
    args = parser.parse_args()
    baseline = load_kernel_module(args.baseline) if args.baseline else None
    rows = []
    extra = " baseline bf16 us (this vs it) | baseline fp32 us (this vs it) |" if baseline else ""
    print("| site | H | T | bf16 us | fp32 us (vs bf16) | bf16 without index check us (check costs) |"
          " fp32 without index check us (check costs; vs bf16 without) |" + extra
          + "\n|---|---|---|---|---|---|---|" + "---|---|" * bool(baseline))
    for hidden, site, tokens in itertools.product(args.hidden, args.sites, args.tokens):
        runs = launchers(site, make_inputs(site, tokens, hidden, index_layout=args.index), baseline)
        asserts = {name: "__assertfail" in run().asm["ptx"] for name, run in runs.items()}
        if asserts != {name: not name.endswith("_no_index_check") for name in runs}:
            raise RuntimeError(f"unexpected assertions in the compiled kernels: {asserts}")
        times = alternating_rounds(runs, args.rounds, args.flush)
        us = {name: statistics.median(t) for name, t in times.items()}
        rows.append(dict(site=site, H=hidden, T=tokens, index=args.index, flush=args.flush, us=us, rounds=times, gpu=torch.cuda.get_device_name(),
                         torch=torch.__version__, triton=triton.__version__))
        line = (f"| {site} | {hidden:,} | {tokens:,} | {us['bf16']:.1f} | {us['fp32']:.1f} ({us['fp32'] / us['bf16'] - 1:+.1%}) | "
                f"{us['bf16_no_index_check']:.1f} ({us['bf16'] / us['bf16_no_index_check'] - 1:+.1%}) | "
                f"{us['fp32_no_index_check']:.1f} ({us['fp32'] / us['fp32_no_index_check'] - 1:+.1%}; "
                f"{us['fp32_no_index_check'] / us['bf16_no_index_check'] - 1:+.1%}) |")
        if baseline:
            line += "".join(f" {us[f'baseline_{p}']:.1f} ({us[p] / us[f'baseline_{p}'] - 1:+.1%}) |"
                            for p in ("bf16", "fp32"))
        print(line, flush=True)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
