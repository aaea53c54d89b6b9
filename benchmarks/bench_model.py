"""Block-, model- and trajectory-level benchmark of h3_fused against eager and Inductor (CUDA).

    python benchmarks/bench_model.py --out benchmarks/results/model.json [--blocks 49] [--whole-blocks 4]

1. Block: one real-size block (H=5376, 56x128 heads, FFN 14,336), T=15,808, attention in its
   ``torch.compiler.disable`` island as upstream: eager, Inductor regional, h3_fused regional under
   each policy. ms per block, CUDA kernels per block, the modulation kernels' share of GPU time.
2. Model: ``--blocks`` real-size blocks (inline attention, random weights) eager and under regional
   compile, and ``--whole-blocks`` of them under whole-model compile (whose compile time grows with
   the depth): CUDA kernels and ms per forward.
3. Trajectory: a flow-matching Euler run (``--steps``, fixed seed) of a ``--traj-blocks`` deep model:
   PSNR of every step's latent against eager, per variant.
4. Compile time: first compile (empty caches, a process per variant) and warm-cache compile of the
   regional block, per variant, with the warm compile's FX graph / AOT autograd cache hits and
   Dynamo's time per compile phase.
5. diffusers (``--parts diffusers``; needs diffusers): ``MiniMaxH3Transformer3DModel`` at the checkpoint's
   dims and precision, ``--diffusers-blocks`` blocks, T = 15,808 rows, under diffusers' own
   ``compile_repeated_blocks`` per variant, in interleaved rounds: ms and CUDA kernels per forward and per call
   of its first block.
6. Inventory (``--parts inventory``, not in the default parts): the CUDA kernels of one block of the
   model-level graph by name, under Inductor and h3_fused, and what each launches that the other does not.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
from h3_fused.backend import eager_numerics_patches
from torch._dynamo.utils import counters
from tqdm import tqdm
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from minimax_h3 import H3Config, H3Model, TokenLayout, euler_sample, example_inputs, init_weights  # noqa: E402
from record import write_results  # noqa: E402
from timing import cuda_kernels, device_us_by_kind, kernel_kind  # noqa: E402

TOKENS = 15808
# the eager-numerics settings the bf16 policy turns on beyond emulate_precision_casts, off
INDUCTOR_ROUNDING = {name: False for name in eager_numerics_patches() if name != "emulate_precision_casts"}
VARIANTS = {  # name -> (backend, options)
    "eager": None,
    "inductor": ("inductor", {}),
    "inductor_epc": ("inductor", {"emulate_precision_casts": True}),
    "h3_fused_fp32": ("h3_fused", {"dtype_policy": "fp32"}),
    "h3_fused_bf16": ("h3_fused", {"dtype_policy": "bf16"}),
    # the cost of the model-level exactness (docs/DESIGN.md, "The RMSNorms outside the sites", "Inductor's own
    # numerics"), part by part: the norms outside the sites left to Inductor; Inductor's divisions and denormals
    # left as it computes them by default; both
    "h3_fused_bf16_inductor_norms": ("h3_fused", {"dtype_policy": "bf16", "eager_norms": False}),
    "h3_fused_bf16_inductor_rounding": ("h3_fused", {"dtype_policy": "bf16", **INDUCTOR_ROUNDING}),
    "h3_fused_bf16_sites_only": ("h3_fused", {"dtype_policy": "bf16", "eager_norms": False, **INDUCTOR_ROUNDING}),
}


def real_model(blocks: int, inline: bool, seed: int = 0) -> H3Model:
    cfg = dataclasses.replace(H3Config.real(), num_blocks=blocks, num_refiner_blocks=0, inline_attention=inline)
    return init_weights(H3Model(cfg, device="cuda"), seed=seed)


def compile_regional(model, variant):
    spec = VARIANTS[variant]
    if spec is None:
        return model
    backend, options = spec
    for block in model.blocks:
        block.compile(backend=backend, options=options or None, dynamic=False)
    return model


def profile_kernels(fn) -> tuple[int, float, float, int]:
    """(CUDA kernels, total kernel us, h3_fused's kernels' us, h3_fused's kernels) of one call."""
    kernels = cuda_kernels(fn)
    us = device_us_by_kind(kernels)
    return len(kernels), us["total"], us["h3_fused"], sum(kernel_kind(e.name) == "h3_fused" for e in kernels)


def block_level(rows):
    for variant in tqdm(VARIANTS, desc="block"):
        release()
        model = real_model(1, inline=False)
        latents, layout = example_inputs(model.cfg, TOKENS, segments=2, device="cuda")
        block = model.blocks[0]
        with torch.no_grad():
            tables = model.adaln_proj(model.time_embed(layout.timesteps))
            x = model.patch_embed(latents.to(torch.bfloat16))
            compile_regional(model, variant)
            start = time.perf_counter()
            block(x, tables, layout.index, layout.positions, layout.cu_seqlens)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            call = lambda: block(x, tables, layout.index, layout.positions, layout.cu_seqlens)  # noqa: E731
            ms = do_bench(call, return_mode="median")
            n, total, mod, fused = profile_kernels(call)
        rows.append(dict(level="block", variant=variant, T=TOKENS, ms=ms, kernels=n, first_call_s=first,
                         fused_kernels=fused, fused_share=mod / total if total else None,
                         counters=dict(counters["h3_fused"])))
        print(f"block {variant:14s} {ms:7.3f} ms  {n:3d} kernels ({fused} fused)  first call {first:6.1f} s  "
              f"fused-kernel share {100 * mod / total if total else 0:5.1f}%", flush=True)


def release():
    torch._dynamo.reset()
    counters.clear()
    gc.collect()
    torch.cuda.empty_cache()


def model_level(rows, regional_blocks, whole_blocks):
    for mode, blocks in (("regional", regional_blocks), ("whole", whole_blocks)):
        for variant in tqdm(("eager", "inductor", "h3_fused_bf16"), desc=f"model {mode}"):
            if variant == "eager" and mode == "whole":
                continue
            release()
            model = real_model(blocks, inline=True)
            latents, layout = example_inputs(model.cfg, TOKENS, segments=2, device="cuda")
            with torch.no_grad():
                if variant == "eager":
                    fn = model
                elif mode == "regional":
                    fn = compile_regional(model, variant)
                else:
                    backend, options = VARIANTS[variant]
                    fn = torch.compile(model, backend=backend, options=options or None, dynamic=False)
                call = lambda fn=fn: fn(latents, layout)  # noqa: E731
                start = time.perf_counter()
                call()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                ms = do_bench(call, return_mode="median", rep=200)
                n, _, _, fused = profile_kernels(call)
            rows.append(dict(level="model", mode=mode, variant=variant, blocks=blocks, T=TOKENS, ms=ms, kernels=n,
                             fused_kernels=fused, first_call_s=first, counters=dict(counters["h3_fused"])))
            print(f"model {mode:8s} {variant:14s} {blocks} blocks: {ms:8.2f} ms  {n:5d} kernels/forward "
                  f"({fused} fused)  compile+run {first:6.1f} s  counters {dict(counters['h3_fused'])}", flush=True)
            del model, fn, call


def kernel_inventory(rows):
    """The CUDA kernels of one regional-compiled real-size block with inline attention (the model
    level's graph), by name, under Inductor and h3_fused: what each launches that the other does not."""
    names = {}
    for variant in ("inductor", "h3_fused_bf16"):
        release()
        model = real_model(1, inline=True)
        latents, layout = example_inputs(model.cfg, TOKENS, segments=2, device="cuda")
        with torch.no_grad():
            compile_regional(model, variant)
            names[variant] = collections.Counter(e.name for e in cuda_kernels(lambda: model(latents, layout)))
        rows.append(dict(level="inventory", variant=variant, T=TOKENS, kernels=sum(names[variant].values()),
                         names=dict(names[variant])))
    for variant, other in (("inductor", "h3_fused_bf16"), ("h3_fused_bf16", "inductor")):
        only = names[variant] - names[other]
        print(f"inventory: {variant} launches {sum(names[variant].values())} kernels; not in {other}: "
              f"{dict(only)}", flush=True)


def first_block_inputs(model, inputs) -> tuple:
    """The ``(args, kwargs)`` the first transformer block of diffusers' ``model`` receives in an eager forward."""
    captured = []
    hook = model.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args, kwargs: captured.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    hook.remove()
    return captured[0]


def diffusers_model(rows, blocks, rounds):
    """diffusers' model, each variant compiled as its users do (``compile_repeated_blocks``), all held at once:
    the whole forward (level ``diffusers``) and its first transformer block alone on the inputs it receives in
    eager (level ``diffusers_block``), timed in ``rounds`` interleaved rounds (a drift of the card's clocks
    reaches every variant alike): the median of the rounds' medians, and their spread. Then, per variant, the
    kernels of the forward whose GPU time differs by more than 20 us from h3_fused ``bf16``'s, by name, for the
    variants that take a part of its exactness away (where its cost comes from)."""
    from diffusers_h3 import REAL_DIMS_FEW_BLOCKS, build_model, make_request

    # every variant's blocks share ``nn.Module._call_impl``'s code, whose compiled entries Dynamo counts together
    torch._dynamo.config.recompile_limit = 8 * len(VARIANTS)
    release()
    calls, profiles, measured = {}, {}, {}
    for variant in tqdm(VARIANTS, desc="diffusers compile"):
        model = build_model("cuda", dict(REAL_DIMS_FEW_BLOCKS, num_layers=blocks))
        request, video, audio = make_request(model, video_rows=TOKENS - 1024, audio_rows=512, text_rows=512,
                                             batch=1, device="cuda")
        inputs = request.model_inputs(video, audio, torch.tensor(0.7))
        block_args, block_kwargs = first_block_inputs(model, inputs)
        if VARIANTS[variant] is not None:
            backend, options = VARIANTS[variant]
            model.compile_repeated_blocks(backend=backend, options=options or None, dynamic=False)
        counters.clear()

        @torch.no_grad()
        def forward(model=model, inputs=inputs):
            return model(**inputs)

        @torch.no_grad()
        def first_block(block=model.transformer_blocks[0], args=block_args, kwargs=block_kwargs):
            return block(*args, **kwargs)

        profiles[variant] = cuda_kernels(forward)  # compiles first
        for level, call in (("diffusers", forward), ("diffusers_block", first_block)):
            kernels = profiles[variant] if level == "diffusers" else cuda_kernels(first_block)
            calls[level, variant] = call
            measured[level, variant] = dict(
                level=level, variant=variant, blocks=blocks if level == "diffusers" else 1, T=TOKENS,
                kernels=len(kernels), fused_kernels=sum(kernel_kind(e.name) == "h3_fused" for e in kernels),
                counters=dict(counters["h3_fused"]))
    times = collections.defaultdict(list)
    for _ in tqdm(range(rounds), desc="diffusers rounds"):
        for key, call in calls.items():
            times[key].append(do_bench(call, warmup=100, rep=600, return_mode="median"))
    for key, row in measured.items():
        ms = sorted(times[key])
        row.update(ms=ms[len(ms) // 2], ms_rounds=ms)
        rows.append(row)
        print(f"{row['level']:15s} {row['variant']:32s} {row['blocks']} blocks: {row['ms']:8.2f} ms (rounds "
              f"{ms[0]:.2f}-{ms[-1]:.2f})  {row['kernels']:5d} kernels ({row['fused_kernels']} fused)", flush=True)
    by_name = {v: collections.Counter() for v in profiles}
    for variant, events in profiles.items():
        for e in events:
            by_name[variant][e.name] += e.device_time
    base = by_name.get("h3_fused_bf16", collections.Counter())
    for variant, us in [(v, us) for v, us in by_name.items() if v.startswith("h3_fused_bf16_")]:
        moved = {n[:90]: round(us[n] - base[n]) for n in us.keys() | base.keys() if abs(us[n] - base[n]) > 20}
        print(f"kernels of {variant} against h3_fused_bf16 (us): {dict(sorted(moved.items(), key=lambda kv: kv[1]))}",
              flush=True)


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x.double() - ref.double()).pow(2).mean().item()
    peak = ref.double().abs().max().item()
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def trajectory(rows, blocks, steps, tokens):
    model = real_model(blocks, inline=True, seed=3)  # one set of weights; each variant compiles it anew
    noise, layout0 = example_inputs(model.cfg, tokens, segments=2, device="cuda", seed=7)
    video = layout0.index % 3 != 1  # text tokens stay clean (t=0), the rest follow sigma

    def layout_at(sigma):
        per_token = torch.where(video.cpu(), torch.tensor(sigma), torch.tensor(0.0))
        modality = (layout0.index.cpu() % 3).long()
        built = TokenLayout.build(per_token, modality, layout0.positions.cpu(), layout0.cu_seqlens)
        return TokenLayout(built.timesteps.cuda(), built.index.cuda(), built.timestep_index.cuda(),
                           built.positions.cuda(), built.cu_seqlens)

    latents = {}
    for variant in tqdm(VARIANTS, desc="trajectory"):
        release()
        spec = VARIANTS[variant]
        fn = model if spec is None else torch.compile(model, backend=spec[0], options=spec[1] or None)
        steps_out = []
        with torch.no_grad():
            euler_sample(fn, noise, layout_at, steps=steps, on_step=lambda i, x: steps_out.append(x.clone()))
        latents[variant] = steps_out
        del fn
    for variant in VARIANTS:
        curve = [psnr(x, r) for x, r in zip(latents[variant], latents["eager"])]
        rows.append(dict(level="trajectory", variant=variant, blocks=blocks, steps=steps, T=tokens, psnr=curve))
        print(f"trajectory {variant:14s} PSNR step 1 {curve[0]:6.2f} dB  final {curve[-1]:6.2f} dB", flush=True)


def compile_times(rows, variants):
    """Each variant in a process of its own with empty Inductor and Triton caches (no variant warms the
    caches for the next): the first compile, then a second one after a Dynamo reset (warm caches)."""
    for variant in tqdm(variants, desc="compile time"):
        caches = tempfile.mkdtemp(prefix="h3_fused_compile_")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(caches, "triton"))
        proc = subprocess.run([sys.executable, __file__, "--compile-variant", variant], env=env,
                              capture_output=True, text=True, check=True)
        timed = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append(dict(level="compile", variant=variant, **timed))
        print(f"compile {variant:14s} first {timed['first_s']:6.1f} s  warm cache {timed['warm_cache_s']:6.1f} s  "
              f"warm cache hits {timed['warm_cache_hits']}", flush=True)
        print(timed["warm_phases"], flush=True)


def time_compiles(variant) -> dict:
    """Seconds to compile and run one regional block: cold caches, then warm after a Dynamo reset; for
    the warm compile, the FX graph and AOT autograd cache hits and Dynamo's time per compile phase."""
    times = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        torch._dynamo.utils.compilation_time_metrics.clear()
        model = real_model(1, inline=True)
        latents, layout = example_inputs(model.cfg, 3072, device="cuda")
        with torch.no_grad():
            compile_regional(model, variant)
            start = time.perf_counter()
            model(latents, layout)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    hits = dict(fxgraph=counters["inductor"]["fxgraph_cache_hit"], aot_autograd=counters["aot_autograd"]["autograd_cache_hit"])
    return dict(first_s=times[0], warm_cache_s=times[1], warm_cache_hits=hits,
                warm_phases=torch._dynamo.utils.compile_times(repr="str", aggregate=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/model.json")
    parser.add_argument("--blocks", type=int, default=49, help="depth of the eager and regional model runs")
    parser.add_argument("--whole-blocks", type=int, default=4, help="depth of the whole-model compile runs")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--traj-blocks", type=int, default=2)
    parser.add_argument("--traj-tokens", type=int, default=2048)
    parser.add_argument("--diffusers-blocks", type=int, default=4)
    parser.add_argument("--diffusers-rounds", type=int, default=5)
    parser.add_argument("--parts", default="compile,block,model,trajectory")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="the variants the block, diffusers and trajectory parts run (eager always)")
    parser.add_argument("--compile-variants", default="inductor,inductor_epc,h3_fused_fp32,h3_fused_bf16")
    parser.add_argument("--compile-variant", help=argparse.SUPPRESS)  # one compile-time child process
    args = parser.parse_args()
    for name in [v for v in VARIANTS if v != "eager" and v not in args.variants.split(",")]:
        del VARIANTS[name]
    if args.compile_variant:
        print(json.dumps(time_compiles(args.compile_variant)))
        return
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"/tmp/h3_fused_bench_cache_{os.getpid()}")
    parts = {
        "compile": lambda rows: compile_times(rows, args.compile_variants.split(",")),
        "block": block_level,
        "model": lambda rows: model_level(rows, args.blocks, args.whole_blocks),
        "trajectory": lambda rows: trajectory(rows, args.traj_blocks, args.steps, args.traj_tokens),
        "inventory": kernel_inventory,
        "diffusers": lambda rows: diffusers_model(rows, args.diffusers_blocks, args.diffusers_rounds),
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    rows = []
    for part in args.parts.split(","):
        parts[part](rows)
        write_results(args.out, rows)  # after every part: a run cut short keeps what it measured


if __name__ == "__main__":
    main()
