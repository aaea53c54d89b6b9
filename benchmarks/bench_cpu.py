"""The sites compiled on the CPU: h3_fused under each policy against Inductor on the same graph.

    python benchmarks/bench_cpu.py                   # -> benchmarks/results/cpu.json
    python benchmarks/bench_cpu.py --family --out benchmarks/results/cpu_family.json

Each site's eager function (``testing.eager_site``; with ``--family`` the DiT family's forms of ``FAMILY_FORMS``,
``testing.family_eager_site``, batch 1) at T = 16,384 rows, H = 1,024, bf16: eager, Inductor, Inductor with
``emulate_precision_casts``, and compiled with ``backend="h3_fused"`` under ``bf16`` and ``fp32``. Median wall
time of ``torch.utils.benchmark.Timer`` on this machine's threads, and the share of output elements not
bit-identical to eager.
"""

from __future__ import annotations

import argparse

import torch
from h3_fused.kernels.testing import SITES, FamilyForm, eager_site, family_eager_site, family_inputs, make_inputs
from record import write_results
from timing import mismatch
from torch.utils.benchmark import Timer

FAMILY_FORMS = [FamilyForm("layer", "per_sample"), FamilyForm("layer", "per_sample", in_fp32=True),
                FamilyForm("layer", "per_token", in_fp32=True), FamilyForm("diffusers_rms", "per_sample"),
                FamilyForm("layer", "chosen")]


def cases(args):
    """``(site, form label, eager function, inputs)`` of each case the arguments ask for."""
    for site in args.sites:
        if not args.family:
            yield site, "h3", eager_site(site), make_inputs(site, args.tokens, args.hidden, device="cpu")
            continue
        for form in FAMILY_FORMS:
            label = f"{form.norm}:{form.source}" + (":fp32" if form.in_fp32 else "")
            yield site, label, family_eager_site(site, form), family_inputs(site, form, 1, args.tokens, args.hidden,
                                                                             device="cpu")


def variants(eager) -> dict:
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
    parser.add_argument("--family", action="store_true", help="the DiT family's site forms (FAMILY_FORMS)")
    args = parser.parse_args()
    rows = []
    with torch.no_grad():
        for site, form, eager, inputs in cases(args):
            reference = eager(**inputs)
            reference = reference if isinstance(reference, tuple) else (reference,)
            for name, fn in variants(eager).items():
                got = fn(**inputs)
                got = got if isinstance(got, tuple) else (got,)
                ms = Timer("fn(**inputs)", globals=dict(fn=fn, inputs=inputs),
                           num_threads=torch.get_num_threads()).blocked_autorange(min_run_time=2).median * 1e3
                share = max(mismatch(g, r) for g, r in zip(got, reference))
                rows.append(dict(site=site, form=form, T=args.tokens, H=args.hidden, variant=name, ms=ms,
                                 mismatch=share))
                print(f"{site} {form:24s} T={args.tokens} H={args.hidden} {name:14s} {ms:8.2f} ms  "
                      f"mismatch {share:.2e}", flush=True)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
