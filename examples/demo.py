"""h3_fused demo: eager vs regional and whole-model compile with the h3_fused backend, per policy.

    python examples/demo.py            # tiny model on the CPU; a few real-size blocks on a GPU

Prints, per policy and compile mode, which sites the compile fused (counts per fused op: one compiled graph
serves every block under regional compile), how many fused ops run per forward, the compile time, and the
share of output elements bit-identical to eager with the largest difference. ``bf16`` keeps eager's
roundings; ``fp32`` keeps intermediate values in fp32 and rounds once per output, so its outputs differ from
eager's by design (closer to the model computed in fp32).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h3_fused  # noqa: E402
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
    fused = {k: v for k, v in counters["h3_fused"].items() if k != "refused"}
    same = (got == expected).float().mean().item()
    diff = (got - expected).abs().max().item()
    print(f"{mode:8s} {policy:5s} fused {fused} refused {counters['h3_fused']['refused']:3d}, "
          f"{fused_ops_per_forward(fn, latents, layout, device):3d} fused ops per forward, "
          f"compile {compile_s:6.1f}s, bit-identical {100 * same:7.3f}%, max|diff| {diff:.3e}")


@contextlib.contextmanager
def native_stderr_silenced():
    """The profiler's native library prints a line to stderr as it starts and stops on a CPU-only build."""
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def fused_ops_per_forward(fn, latents, layout, device) -> int:
    """The fused ops one forward runs: the Triton kernel's launches on a GPU, the reference op's calls on the CPU."""
    activity = torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU
    name = "modulation_kernel" if device == "cuda" else "h3_fused::reference_modulation"
    with torch.no_grad(), native_stderr_silenced(), torch.profiler.profile(activities=[activity]) as prof:
        fn(latents, layout)
        if device == "cuda":
            torch.cuda.synchronize()
    return sum(1 for e in prof.events() if name in e.name)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"h3_fused demo on {device} (torch {torch.__version__})")
    for policy in ("bf16", "fp32"):
        for mode in ("regional", "whole"):
            run(mode, policy, device)
    print("bf16: eager's roundings (on the CPU, outputs equal to eager's where Inductor compiles the ops around the "
          "sites as eager computes them); fp32: fp32 intermediates, one rounding per output, so not eager's bits")


if __name__ == "__main__":
    main()
