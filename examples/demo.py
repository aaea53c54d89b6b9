"""h3_fused demo: eager vs regional and whole-model compile with the h3_fused backend, per policy.

    python examples/demo.py            # tiny model on the CPU; a few real-size blocks on a GPU

Prints, per policy and compile mode, which sites the compile fused (counts per fused op: one compiled graph
serves every block under regional compile) and, apart, how many RMSNorms outside the sites it computes in
eager's order (``eager_norms``, under ``bf16``), on a GPU how many times the fused kernel runs per forward (for
the sites and those norms; on the CPU there is no fused kernel: Inductor compiles each site's reference
operations), the compile time, and the share of
output elements bit-identical to eager with the largest difference. ``bf16`` keeps eager's
roundings; ``fp32`` keeps intermediate values in fp32 and rounds once per output, so its outputs differ from
eager's by design (closer to the model computed in fp32).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h3_fused  # noqa: E402
from h3_fused.patterns import SiteKind  # noqa: E402
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights  # noqa: E402


def build(device):
    if device == "cuda":
        cfg = dataclasses.replace(H3Config.real(), num_blocks=3, num_refiner_blocks=0, inline_attention=True)
        tokens = 4096
    else:
        cfg = H3Config.tiny(inline_attention=True, num_blocks=3)
        tokens = 128
    model = init_weights(H3Model(cfg, device=device))
    latents, layout = example_inputs(cfg, tokens, device=device)
    return model, latents, layout


def run(mode, policy, device):
    torch._dynamo.reset()
    counters.clear()
    model, latents, layout = build(device)
    with torch.no_grad():
        expected = model(latents, layout)
        start = time.perf_counter()
        if mode == "regional":
            h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
            fn = model
        else:
            fn = torch.compile(model, backend="h3_fused", options={"dtype_policy": policy})
        got = fn(latents, layout)
        compile_s = time.perf_counter() - start
    made = counters["h3_fused"]
    sites = {kind.value: made[kind.value] for kind in SiteKind if made[kind.value]}
    same = (got == expected).float().mean().item()
    diff = (got - expected).abs().max().item()
    kernels = f"{kernels_per_forward(fn, latents, layout):3d} fused kernel launches per forward, " \
        if device == "cuda" else ""
    print(f"{mode:8s} {policy:5s} sites fused {sites}, RMSNorms in eager's order {made['eager_rms_norm']:2d}, "
          f"refused {made['refused']:2d}, {kernels}compile {compile_s:5.1f}s, bit-identical {100 * same:7.3f}%, "
          f"max|diff| {diff:.3e}")


def kernels_per_forward(fn, latents, layout) -> int:
    """The launches of the fused kernel in one forward (the sites', and the RMSNorms' it computes in eager's order)."""
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(latents, layout)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if "modulation_kernel" in e.name)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"h3_fused demo on {device} (torch {torch.__version__})")
    for policy in ("bf16", "fp32"):
        for mode in ("regional", "whole"):
            run(mode, policy, device)
    print("bf16: eager's roundings (equal to eager's outputs where the compiled code sums as eager does); "
          "fp32: fp32 intermediates, one rounding per output, so not eager's bits")


if __name__ == "__main__":
    main()
