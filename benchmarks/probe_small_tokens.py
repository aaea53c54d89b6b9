"""Where sites A and B lose time at small T: the shipped kernel, variants of its launch, and kernels of
the same shape that do less.

    python benchmarks/probe_small_tokens.py --out benchmarks/results/probe_small_tokens.json

``row_probe_kernel`` has the shipped kernel's structure for site A (one row per program, the row read
in chunks of one 16-byte vector per thread with ``.cg`` loads, the many-rows launch configuration: 4
warps) and does one of three things with the row:

    copy      y = x                                   (every load, then every store)
    norm      y = R(x * rsqrt(mean(x^2) + eps))       (+ the reduction between loads and stores)
    modulate  y = R(x * r * w * (1 + scale[i]) + shift[i])  (+ the table rows, read after the reduction)

For each site and T, in alternating rounds (device time after an L2 flush, as ``bench_ops.py``): a copy
of the same bytes; the shipped kernel under ``bf16`` and ``fp32``, with its registers capped
(``maxnreg``: more programs per SM), and with every index 0 (one row of each table); for site A, the
kernel on 4 and on 8 warps (where the two cross) and the three probes (how much of the gap to the copy is
the one-row-per-program structure, the reduction, and the table rows). Then each probe runs once with
``TIMELINE``: every program records ``%globaltimer`` when it starts, once its reduction has the whole
row, and after its stores, and ``%smid``; the summary gives when programs start and end, how long each
phase lasts, and how many programs are loading and running in each 0.5 us (the ramp and the tail).
Run 22 also timed the table rows loaded with the activations, before the reduction, with a knob of
commit b920002 since removed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_rounds, graph_ms  # noqa: E402
from sites import (  # noqa: E402
    LaunchOptions,
    kernel_launch,
    make_inputs,
    minimal_bytes,
    shipped_launch_config,
    with_launch_config,
)

TOKENS = (1024, 3072, 6144, 9216, 15808)
WORK = ("copy", "norm", "modulate")


@triton.jit
def _now(after):
    """``%globaltimer`` (ns), read once ``after`` is available."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [after], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def row_probe_kernel(x_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, y_ptr, times_ptr, stride_table, eps,
                     HIDDEN: tl.constexpr, CHUNK: tl.constexpr, NORM: tl.constexpr, TABLES: tl.constexpr,
                     TIMELINE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, CHUNK)[None, :]
    if TIMELINE:
        started = _now(tl.program_id(0) + tl.zeros([1], tl.int32))
    kept = ()
    squares = tl.zeros([1, CHUNK], tl.float32)
    for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
        v = tl.load(x_ptr + row * HIDDEN + c * CHUNK + lanes, mask=lanes < HIDDEN - c * CHUNK, other=0.0,
                    cache_modifier=".cg")
        kept = kept + (v,)
        squares += v.to(tl.float32) * v.to(tl.float32)
    r = tl.rsqrt(tl.sum(squares, axis=1) * (1.0 / HIDDEN) + eps)
    if TIMELINE:
        loaded = _now(r.to(tl.int32, bitcast=True))
    i = tl.load(idx_ptr + row)
    for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
        mask = lanes < HIDDEN - c * CHUNK
        y = kept[c].to(tl.float32)
        if NORM:
            y = y * r[:, None]
        if TABLES:
            w = tl.load(w_ptr + c * CHUNK + lanes, mask=mask, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + i * stride_table + c * CHUNK + lanes, mask=mask, other=0.0).to(tl.float32)
            shift = tl.load(shift_ptr + i * stride_table + c * CHUNK + lanes, mask=mask, other=0.0).to(tl.float32)
            y = y * w * (1.0 + scale) + shift
        tl.store(y_ptr + row * HIDDEN + c * CHUNK + lanes, y.to(y_ptr.dtype.element_ty), mask=mask)
    if TIMELINE:
        ended = _now(r.to(tl.int32, bitcast=True))
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [ended.to(tl.int32)], dtype=tl.int32,
                                         is_pure=False, pack=1)
        base = times_ptr + row * 4 + tl.arange(0, 1)
        tl.store(base, started)
        tl.store(base + 1, loaded)
        tl.store(base + 2, ended)
        tl.store(base + 3, smid.to(tl.int64))


def probe(work: str, inputs: dict, times: torch.Tensor | None = None, y: torch.Tensor | None = None):
    """A launch of ``row_probe_kernel`` doing ``work`` on site A's ``inputs`` (``times``: record a timeline),
    writing into ``y`` (by default its own)."""
    x = inputs["x"]
    y = torch.empty_like(x) if y is None else y
    config = shipped_launch_config("A", HIDDEN, None)
    timeline = times is not None

    def run():
        row_probe_kernel[(x.shape[0],)](
            x, inputs["weight"], inputs["shift"], inputs["scale"], inputs["index"], y,
            times if timeline else x, inputs["shift"].stride(0), inputs["eps"], HIDDEN=HIDDEN, CHUNK=config.chunk,
            NORM=work != "copy", TABLES=work == "modulate", TIMELINE=timeline, num_warps=config.num_warps)
        return y

    return run


def timeline_summary(times: torch.Tensor) -> dict:
    """Phases and the number of programs loading over time, from ``[programs, 4]`` records (start,
    row loaded, end in ns; SM)."""
    t = times.double().cpu()
    t[:, :3] -= t[:, 0].min()
    start, loaded, end, sm = t.unbind(1)
    span = end.max().item()
    bins = torch.arange(0, span + 500, 500.0)
    loading = [((start <= b) & (b < loaded)).sum().item() for b in bins]
    running = [((start <= b) & (b < end)).sum().item() for b in bins]
    per_sm = torch.bincount(sm.long())
    return dict(
        span_us=span / 1e3, last_start_us=start.max().item() / 1e3, first_end_us=end.min().item() / 1e3,
        last_loaded_us=loaded.max().item() / 1e3,
        load_phase_us=dict(median=(loaded - start).median().item() / 1e3, max=(loaded - start).max().item() / 1e3),
        after_load_us=dict(median=(end - loaded).median().item() / 1e3, max=(end - loaded).max().item() / 1e3),
        programs_per_sm=dict(min=per_sm[per_sm > 0].min().item(), max=per_sm.max().item()),
        bins_us=[b / 1e3 for b in bins.tolist()], loading=loading, running=running)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/probe_small_tokens.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--sites", nargs="+", default=["A", "B"], choices=["A", "B"])
    parser.add_argument("--register-caps", nargs="+", type=int, help="maxnreg values to time (0: none)")
    parser.add_argument("--no-probes", dest="probes", action="store_false", help="time only the shipped kernel")
    parser.add_argument("--timeline-tokens", nargs="+", type=int, default=[1024, 3072])
    args = parser.parse_args()
    from h3_fused.kernels.triton_modulation import LaunchConfig

    rows = []
    for site, tokens in [(site, tokens) for site in args.sites for tokens in args.tokens]:
        inputs = make_inputs(site, tokens, HIDDEN)
        nbytes = minimal_bytes(site, tokens, HIDDEN)
        src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
        dst = torch.empty_like(src)
        shipped = kernel_launch(site, inputs, "bf16")

        def launch(policy="bf16", wrap=lambda kernel: kernel, **changed):  # into the shipped call's outputs
            return kernel_launch(site, dict(inputs, **changed), policy, wrap, outputs=shipped.outputs)

        runs = {"copy_same_bytes": lambda: dst.copy_(src), "shipped_bf16": shipped}
        caps = args.register_caps or ((48, 56, 64) if site == "A" else (32, 40))
        runs |= {f"shipped_bf16_maxnreg{n}": launch(wrap=LaunchOptions(maxnreg=n)) for n in caps if n}
        runs["shipped_fp32"] = launch("fp32")
        runs["shipped_bf16_one_table_row"] = launch(index=torch.zeros_like(inputs["index"]))
        if site == "A":
            runs |= {f"bf16_{warps}_warps": with_launch_config(launch(), LaunchConfig(1, 32 * warps * 8, warps))
                     for warps in (4, 8)}
            runs |= {f"probe_{work}": probe(work, inputs, y=shipped.outputs[1]) for work in WORK if args.probes}
        for name, run in runs.items():
            compiled = run()
            if hasattr(compiled, "n_regs"):
                print(f"   {name}: {compiled.n_regs} registers, {compiled.n_spills} spilled", flush=True)
        times = alternating_rounds(runs, args.rounds)
        us = {name: statistics.median(t) for name, t in times.items()}
        copy = us["copy_same_bytes"]
        print(f"{site} T={tokens:6d}  " + "  ".join(f"{name} {t:.1f} us ({copy / t:.1%} of copy)" for name, t in us.items()),
              flush=True)
        timelines = {}
        for work in WORK if args.probes and site == "A" and tokens in args.timeline_tokens else ():
            record = torch.zeros(tokens, 4, dtype=torch.int64, device="cuda")
            run = probe(work, inputs, record)
            run()
            torch.cuda.synchronize()
            graph_ms(lambda run=run: run())  # the last replay's records: after a flush, as timed above
            timelines[work] = summary = timeline_summary(record)
            print(f"   timeline {work:8s} span {summary['span_us']:.1f} us, last start {summary['last_start_us']:.1f}, "
                  f"first end {summary['first_end_us']:.1f}, last row loaded {summary['last_loaded_us']:.1f}; "
                  f"load phase median {summary['load_phase_us']['median']:.2f} max {summary['load_phase_us']['max']:.2f}, "
                  f"after it median {summary['after_load_us']['median']:.2f} max {summary['after_load_us']['max']:.2f}; "
                  f"programs per SM {summary['programs_per_sm']}", flush=True)
            print("      loading per 0.5 us: " + " ".join(str(n) for n in summary["loading"]), flush=True)
            print("      running per 0.5 us: " + " ".join(str(n) for n in summary["running"]), flush=True)
        rows.append(dict(site=site, T=tokens, us=us, rounds=times, timelines=timelines, nbytes=nbytes,
                         gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
