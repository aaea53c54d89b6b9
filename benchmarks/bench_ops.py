"""Op-level benchmark of the three modulation sites' forward on a CUDA GPU.

    python benchmarks/bench_ops.py                      # -> benchmarks/results/ops.json
    python benchmarks/bench_ops.py --sites A --index runs --out benchmarks/results/ops_index_runs.json

Variants, measured side by side in one process: eager, Inductor default, Inductor with
``emulate_precision_casts``, the hand-fused one-row kernel (``hand_fused.py``) under ``fp32`` and ``bf16``,
the fused op under ``fp32`` and ``bf16``, and the ``bf16`` op inside a compiled graph; per site and T also
``copy_same_bytes``, a copy of the site's minimal bytes. Each row: ``us_graph`` (device time,
``timing.graph_ms``), ``us`` (a plain call, host overhead included), ``roof_share`` (the minimal bytes over
``us_graph`` against the copy bandwidth of the same run) and ``mismatch`` (the share of ``y``'s elements, for
site C of ``u``'s, not bit-identical to eager; ``mismatch_u`` of ``u``'s).
"""

from __future__ import annotations

import argparse
import itertools

import torch
from h3_fused.kernels.testing import INDEX_LAYOUTS, SITES, eager_site, fused_site, make_inputs, minimal_bytes
from hand_fused import hand_fused_site
from harness import identical_outputs
from record import write_results
from timing import call_ms, copy_bandwidth, copy_same_bytes_ms, graph_ms, mismatch

TOKENS = (3072, 15808, 63232)
HIDDEN = 5376


def inductor_epc(site: str):
    """The eager site compiled by Inductor with ``emulate_precision_casts`` (eager's roundings)."""
    return torch.compile(eager_site(site), dynamic=False, options={"emulate_precision_casts": True})


def variants(site: str):
    eager = eager_site(site)
    yield "eager", eager
    yield "inductor", torch.compile(eager, dynamic=False)
    yield "inductor_epc", inductor_epc(site)
    yield "hand_fused", hand_fused_site(site, "fp32")
    yield "hand_fused_bf16", hand_fused_site(site, "bf16")
    yield "h3_fused_fp32", fused_site(site, "fp32")
    yield "h3_fused_bf16", fused_site(site, "bf16")
    yield "h3_fused_bf16_in_graph", torch.compile(fused_site(site, "bf16"), dynamic=False)


def outputs(site, result):
    """``(u, y)`` of a site's result (None where it has no such output)."""
    return result if site == "B" else (None, result) if site == "A" else (result, None)


def run(args) -> list[dict]:
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}; index layout {args.index}", flush=True)
    rows = []
    for hidden, site, tokens in itertools.product(args.hidden, args.sites, args.tokens):
        inputs = make_inputs(site, tokens, hidden, index_layout=args.index)
        ref_u, ref_y = outputs(site, eager_site(site)(**inputs))
        nbytes = minimal_bytes(site, tokens, hidden)
        case = dict(site=site, T=tokens, H=hidden, index=args.index, roof_gbs=roof)
        for name, fn in variants(site):
            if args.variants and name not in args.variants:
                continue
            u, y = outputs(site, fn(**inputs))
            exact = dict(mismatch=mismatch(y, ref_y) if y is not None else mismatch(u, ref_u),
                         mismatch_u=mismatch(u, ref_u) if u is not None else None)
            del u, y
            ms = call_ms(lambda fn=fn: fn(**inputs))
            ms_graph = graph_ms(lambda fn=fn: fn(**inputs))
            gbs = nbytes / ms_graph / 1e6
            rows.append(dict(case, variant=name, us=ms * 1e3, us_graph=ms_graph * 1e3, gbs=gbs, roof_share=gbs / roof,
                             **exact))
            print(f"{site} H={hidden} T={tokens:6d} {name:24s} {ms * 1e3:9.1f} us (graph {ms_graph * 1e3:8.1f} us) "
                  f"{100 * gbs / roof:5.1f}%  mismatch {exact['mismatch']:.2e}", flush=True)
        if not identical_outputs(outputs(site, eager_site(site)(**inputs)), (ref_u, ref_y)):
            raise RuntimeError(f"site {site} T={tokens}: eager's output changed during the run (inputs or "
                               f"reference overwritten); its mismatch column cannot be trusted")
        ms = copy_same_bytes_ms(nbytes)
        rows.append(dict(case, variant="copy_same_bytes", us_graph=ms * 1e3, gbs=nbytes / ms / 1e6,
                         roof_share=nbytes / ms / 1e6 / roof))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/ops.json")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--hidden", nargs="+", type=int, default=[HIDDEN])
    parser.add_argument("--index", default="uniform", choices=INDEX_LAYOUTS, help="layout of the index (h3_fused.kernels.testing.make_inputs)")
    parser.add_argument("--variants", nargs="+", help="time only these variants (default: all)")
    args = parser.parse_args()
    write_results(args.out, run(args))


if __name__ == "__main__":
    main()
