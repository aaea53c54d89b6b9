"""Op-level benchmark of the modulation sites on a CUDA GPU (one JSON object per row).

    python benchmarks/bench_ops.py --out benchmarks/results/ops.json [--sweep]

Variants, measured side by side in one process: eager, Inductor default, Inductor with
``emulate_precision_casts``, the hand-fused one-row kernel (``hand_fused.py``) under ``fp32`` and ``bf16``,
the fused op under ``fp32`` and ``bf16``, and the ``bf16`` op inside a compiled graph. Time: median of
``triton.testing.do_bench`` (L2 flushed before each repetition).
``roof_gbs`` is the device-to-device copy bandwidth measured in the same run; ``mismatch`` the share of
output elements not bit-identical to eager (for site B: of ``y``; ``mismatch_u`` of the residual).
Every variant is timed twice: ``ms``, ``do_bench`` as a user calls it (host overhead included), and
``ms_graph``, the call replayed in a CUDA graph after an L2 flush, minus the flush (device time, no
host overhead); ``roof_share`` uses ``ms_graph``. Each site and T also times ``copy_same_bytes``, a
copy of the site's minimal bytes: what a pure stream of that size reaches (small T pays ramp-up and
tail as the kernels do). ``--sweep`` (or ``--sweep-only``) times the kernel the same way at every T
over launch configurations (``sweep_configs``), under each of ``--sweep-policies``, and prints
registers and spills of each. ``--index runs`` lays the index out in contiguous runs, as the model
does, instead of drawing each row's table row independently (``sites.make_inputs``). ``--hidden`` times
every site and T at each of several H (default: the model's 5,376).
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
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.dirname(__file__))
from hand_fused import hand_fused_site  # noqa: E402
from sites import (  # noqa: E402
    INDEX_LAYOUTS,
    SITES,
    eager_site,
    fused_site,
    identical_outputs,
    kernel_launch,
    make_inputs,
    minimal_bytes,
    with_launch_config,
)

TOKENS = (3072, 15808, 63232)
HIDDEN = 5376


def copy_bandwidth() -> float:
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


FLUSH = None
FLUSHES = {  # how ``graph_ms`` evicts L2 before each replay, from a 256 MB buffer
    "write": lambda buffer: buffer.zero_(),  # as do_bench does: L2 is left full of dirty lines
    "read": lambda buffer: buffer.max(),  # L2 is left full of clean lines: evicting them writes nothing
}


def graph_ms(fn, flush: str = "write") -> float:
    """Median device time of ``fn`` with a cold L2 and no host overhead (CUDA-graph replay); ``flush``
    names how L2 is emptied first (``FLUSHES``)."""
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 * 1024**2, dtype=torch.int8, device="cuda").zero_()
    evict = FLUSHES[flush]
    both = do_bench_cudagraph(lambda: (evict(FLUSH), fn()), return_mode="median")
    alone = do_bench_cudagraph(lambda: evict(FLUSH), return_mode="median")
    return both - alone


def alternating_rounds(runs: dict, rounds: int, flush: str = "write") -> dict[str, list[float]]:
    """Each call of ``runs`` timed with ``graph_ms`` (in us) in ``rounds`` rounds, every round timing them
    one after the other, so that drift of the GPU's clocks between them cancels in the medians."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(graph_ms(run, flush) * 1e3)
    return times


def alternating_medians(runs: dict, rounds: int) -> dict[str, float]:
    """The median of each call's ``alternating_rounds`` (in us)."""
    return {name: statistics.median(t) for name, t in alternating_rounds(runs, rounds).items()}


def relative_times(medians: dict[str, float], reference: str, note=lambda name: "") -> str:
    """``medians`` on one line, each with its difference to ``medians[reference]`` (and ``note(name)``)."""
    return "  ".join(f"{name} {m:6.1f} us ({m / medians[reference] - 1:+.1%}){note(name)}"
                     for name, m in medians.items())


def mismatch(got, ref) -> float:
    return (got.view(torch.int16) != ref.view(torch.int16)).float().mean().item()


def inductor_epc(site: str):
    """The eager site compiled by Inductor with ``emulate_precision_casts`` (bit-exact to eager, as the
    ``bf16`` policy is)."""
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
    return result if site == "B" else (None, result) if site == "A" else (result, None)


def run(args) -> list[dict]:
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}; index layout {args.index}", flush=True)
    rows = []
    for hidden, site, tokens in itertools.product(args.hidden, args.sites, args.tokens):
        inputs = make_inputs(site, tokens, hidden, index_layout=args.index)
        ref_u, ref_y = outputs(site, eager_site(site)(**inputs))
        nbytes = minimal_bytes(site, tokens, hidden)
        for name, fn in ([] if args.sweep_only else variants(site)):
            u, y = outputs(site, fn(**inputs))
            mismatches = dict(mismatch=mismatch(y, ref_y) if y is not None else mismatch(u, ref_u),
                              mismatch_u=mismatch(u, ref_u) if u is not None else None)
            del u, y
            ms = do_bench(lambda fn=fn, inputs=inputs: fn(**inputs), return_mode="median")
            ms_graph = graph_ms(lambda fn=fn, inputs=inputs: fn(**inputs))
            gbs = nbytes / ms_graph / 1e6
            row = dict(site=site, T=tokens, H=hidden, index=args.index, variant=name, ms=ms, us=ms * 1e3, ms_graph=ms_graph,
                       us_graph=ms_graph * 1e3, gbs=gbs, roof_gbs=roof, roof_share=gbs / roof, **mismatches)
            rows.append(row)
            print(f"{site} H={hidden} T={tokens:6d} {name:24s} {row['us']:9.1f} us (graph {row['us_graph']:8.1f} us) "
                  f"{gbs:7.0f} GB/s "
                  f"{100 * row['roof_share']:5.1f}%  mismatch {row['mismatch']:.2e}", flush=True)
        again_u, again_y = outputs(site, eager_site(site)(**inputs))
        if not identical_outputs((again_u, again_y), (ref_u, ref_y)):
            raise RuntimeError(f"site {site} T={tokens}: eager's output changed during the run (inputs or "
                               f"reference overwritten); its mismatch column cannot be trusted")
        rows.append(same_bytes_copy(site, tokens, hidden, nbytes, roof))
        if args.sweep or args.sweep_only:
            rows += sweep(site, tokens, hidden, inputs, nbytes, roof, args.sweep_policies, (ref_u, ref_y))
    return rows


def sweep_configs(hidden: int):
    """The launch configurations the sweep times, one row per program: 1 to 8 warps reading the row in
    chunks of one 16-byte vector per thread (on 4 and 8 warps also with the table rows loaded ahead),
    and 4 and 8 warps reading it as one padded block (where that is not already one of the chunks). Two
    rows per program and 16 warps lost everywhere in run 2; storing every chunk's ``y`` after the last
    table load never beat the shipped configuration in run 13; persistent programs with a
    software-pipelined row loop lost everywhere in run 26."""
    from h3_fused.kernels.triton_modulation import LaunchConfig

    padded = triton.next_power_of_2(hidden)
    vectors = [(w, 32 * w * 8) for w in (1, 2, 4, 8)]
    for warps, chunk in vectors + [(w, padded) for w in (4, 8) if (w, padded) not in vectors]:
        yield LaunchConfig(1, chunk, warps)
    for warps in (4, 8):
        yield LaunchConfig(1, 32 * warps * 8, warps, tables_ahead=True)


def sweep(site, tokens, hidden, inputs, nbytes, roof, policies, reference) -> list[dict]:
    """Each configuration timed as ``graph_ms``; ``mismatch``: the share of elements not bit-identical to
    ``reference`` (eager's ``(u, y)``; for site B of ``y``, and ``mismatch_u`` of the residual)."""
    rows = []
    for policy in policies:
        for config in sweep_configs(hidden):
            base = kernel_launch(site, inputs, policy)
            launch = with_launch_config(base, config)
            compiled = launch()
            ms = graph_ms(launch)
            gbs = nbytes / ms / 1e6
            u, y = base.outputs
            exact = {"mismatch": mismatch(y, reference[1]) if y is not None else mismatch(u, reference[0]),
                     "mismatch_u": mismatch(u, reference[0]) if u is not None else None}
            name = (f"sweep_w{config.num_warps}_chunk{config.chunk}" + ("_ahead" if config.tables_ahead else "")
                    + ("_fp32" if policy == "fp32" else ""))
            rows.append(dict(site=site, T=tokens, H=hidden, variant=name, policy=policy, ms=ms, gbs=gbs, roof_gbs=roof,
                             roof_share=gbs / roof, regs=compiled.n_regs, spills=compiled.n_spills, **exact))
            print(f"   {name:36s} {ms * 1e3:8.1f} us {100 * gbs / roof:5.1f}% "
                  f"regs {compiled.n_regs} spills {compiled.n_spills} "
                  f"mismatch {exact['mismatch']}", flush=True)
    return rows


def same_bytes_copy(site, tokens, hidden, nbytes, roof) -> dict:
    """A device-to-device copy moving the site's minimal bytes (half read, half written), timed as the
    kernels are: what a pure stream of this size reaches, ramp-up and tail included."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src))
    gbs = nbytes / ms / 1e6
    print(f"{site} H={hidden} T={tokens:6d} {'copy of the same bytes':24s} (graph {ms * 1e3:8.1f} us) {gbs:7.0f} GB/s "
          f"{100 * gbs / roof:5.1f}%", flush=True)
    return dict(site=site, T=tokens, H=hidden, variant="copy_same_bytes", ms_graph=ms, us_graph=ms * 1e3, gbs=gbs,
                roof_gbs=roof, roof_share=gbs / roof)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/ops.json")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--hidden", nargs="+", type=int, default=[HIDDEN])
    parser.add_argument("--sweep", action="store_true", help="also time the launch configurations")
    parser.add_argument("--sweep-only", action="store_true", help="time only the launch configurations")
    parser.add_argument("--sweep-policies", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    parser.add_argument("--index", default="uniform", choices=INDEX_LAYOUTS, help="layout of the index (sites.make_inputs)")
    args = parser.parse_args()
    rows = run(args)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    with open(args.out, "w") as f:
        json.dump([dict(meta, **r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
