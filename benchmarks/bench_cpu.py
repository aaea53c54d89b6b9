"""The sites compiled on the CPU: h3_fused under each policy against Inductor on the same graph.

    python benchmarks/bench_cpu.py                   # -> benchmarks/results/cpu.json

Each site's eager function (``testing.eager_site``) at T = 16,384 rows, H = 1,024, bf16: eager, Inductor,
Inductor with ``emulate_precision_casts``, and compiled with ``backend="h3_fused"`` under ``bf16`` and ``fp32``.
Median wall time of ``torch.utils.benchmark.Timer`` on this machine's threads, and the share of output
elements not bit-identical to eager.
"""

from __future__ import annotations

import argparse

import torch
from h3_fused.kernels.testing import SITES, eager_site, make_inputs
from record import write_results
from timing import mismatch
from torch.utils.benchmark import Timer


def variants(site: str) -> dict:
    eager = eager_site(site)
    return {"eager": eager, "inductor": torch.compile(eager, dynamic=False),
            "inductor_epc": torch.compile(eager, dynamic=False, options={"emulate_precision_casts": True}),
            "h3_fused_bf16": torch.compile(eager, dynamic=False, backend="h3_fused", options={"dtype_policy": "bf16"}),
            "h3_fused_fp32": torch.compile(eager, dynamic=False, backend="h3_fused", options={"dtype_policy": "fp32"})}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/cpu.json")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    rows = []
    with torch.no_grad():
        for site in args.sites:
            inputs = make_inputs(site, args.tokens, args.hidden, device="cpu")
            reference = eager_site(site)(**inputs)
            reference = reference if isinstance(reference, tuple) else (reference,)
            for name, fn in variants(site).items():
                got = fn(**inputs)
                got = got if isinstance(got, tuple) else (got,)
                ms = Timer("fn(**inputs)", globals=dict(fn=fn, inputs=inputs),
                           num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=2).median * 1e3
                share = max(mismatch(g, r) for g, r in zip(got, reference))
                rows.append(dict(site=site, T=args.tokens, H=args.hidden, variant=name, ms=ms, mismatch=share))
                print(f"{site} T={args.tokens} H={args.hidden} {name:14s} {ms:8.2f} ms  mismatch {share:.2e}",
                      flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
