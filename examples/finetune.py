"""A short flow-matching fine-tune of the H3 stand-in, compiled with h3_fused and with plain Inductor.

    python examples/finetune.py                # tiny model on the CPU; two real-size blocks on a GPU
    python examples/finetune.py --steps 20 --policy fp32

Each step draws noise and a timestep per sample, moves the latents along the straight path between them,
and regresses the model's velocity on ``noise - latents`` (the sampler's convention, ``minimax_h3.sampler``).
Every block is compiled on its own (``h3_fused.compile_repeated_blocks``), so the fused forward and backward
of its three modulation sites run in each step. Prints each step's loss and time for both compiles, and the
fused sites the h3_fused compile found.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h3_fused  # noqa: E402
from minimax_h3 import H3Config, H3Model, TokenLayout, example_inputs, init_weights  # noqa: E402


def build(device: str):
    if device == "cuda":
        cfg = dataclasses.replace(H3Config.real(), num_blocks=2, num_refiner_blocks=0)
        tokens = 4096
    else:
        cfg = H3Config.tiny(num_blocks=2)
        tokens = 128
    model = init_weights(H3Model(cfg, device=device))
    latents, layout = example_inputs(cfg, tokens, device=device)
    return model, latents, layout


def noisy(latents: torch.Tensor, layout: TokenLayout, step: int):
    """``(x_t, layout at t, velocity target)`` for a timestep per segment drawn with seed ``step``."""
    g = torch.Generator().manual_seed(step)
    noise = torch.randn(latents.shape, generator=g).to(latents.device)
    t = torch.rand(len(layout.timesteps), generator=g).to(latents.device)
    per_token = t[layout.timestep_index.long()].unsqueeze(-1)
    timesteps = t.clamp(1e-3, 1.0)
    return (1 - per_token) * latents + per_token * noise, dataclasses.replace(layout, timesteps=timesteps), noise - latents


def finetune(backend: str, policy: str, steps: int, device: str) -> list[tuple[float, float]]:
    torch._dynamo.reset()
    counters.clear()
    model, latents, layout = build(device)
    model.train()
    if backend == "h3_fused":
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
    else:
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    log = []
    for step in tqdm(range(steps), desc=f"{backend} {policy if backend == 'h3_fused' else ''}".strip(), leave=False):
        x_t, layout_t, target = noisy(latents, layout, step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x_t, layout_t), target)
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        log.append((loss.item(), time.perf_counter() - start))
    return log


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fine-tuning the H3 stand-in on {device} (torch {torch.__version__}), {args.steps} steps")
    ours = finetune("h3_fused", args.policy, args.steps, device)
    fused = {k: v for k, v in counters["h3_fused"].items() if k != "refused"}
    theirs = finetune("inductor", args.policy, args.steps, device)
    print(f"h3_fused fused per compiled block graph: {fused}")
    print("step | loss h3_fused | loss Inductor | s h3_fused | s Inductor (the first steps compile)")
    for i, ((loss, s), (ref, ref_s)) in enumerate(zip(ours, theirs)):
        print(f"{i:4d} | {loss:13.5f} | {ref:13.5f} | {s:10.3f} | {ref_s:10.3f}")


if __name__ == "__main__":
    main()
