"""Outputs of the installed kernel against another version of it, element by element.

    python benchmarks/compare_builds.py --baseline FILE [--tokens 3072 15808]

``FILE`` is a ``kernels/triton_modulation.py`` of another commit (``git show REV:kernels/triton_modulation.py
> FILE``). For each site, policy, index layout and T, both kernels run on the same inputs (``sites.make_inputs``,
H = 5,376) and the script prints the share of elements of ``u`` and ``y`` that are not bit-identical, and
the largest absolute difference.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import mismatch  # noqa: E402
from sites import INDEX_LAYOUTS, SITES, kernel_launch, load_kernel_module, make_inputs  # noqa: E402


def differences(got: torch.Tensor | None, other: torch.Tensor | None) -> str:
    if got is None:
        return "-"
    largest = (got.float() - other.float()).abs().max().item()
    return f"{mismatch(got, other):.2e} (largest {largest:.3g})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--tokens", nargs="+", type=int, default=[3072, 15808])
    parser.add_argument("--policies", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = parser.parse_args()
    baseline = load_kernel_module(args.baseline)
    print("| site | policy | index | T | u differs | y differs |\n|---|---|---|---|---|---|")
    for site, policy, layout, tokens in itertools.product(SITES, args.policies, INDEX_LAYOUTS, args.tokens):
        inputs = make_inputs(site, tokens, index_layout=layout)
        this, other = kernel_launch(site, inputs, policy), kernel_launch(site, inputs, policy, kernel_module=baseline)
        this(), other()
        (u, y), (u0, y0) = this.outputs, other.outputs
        print(f"| {site} | {policy} | {layout} | {tokens:,} | {differences(u, u0)} | {differences(y, y0)} |", flush=True)


if __name__ == "__main__":
    main()
