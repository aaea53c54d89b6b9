"""A short flow-matching fine-tune of the H3 stand-in (``examples/minimax_h3``, an unfused port of MiniMax-H3 with
random weights): eager, compiled with plain Inductor, and compiled with h3_fused.

    python examples/finetune.py                # tiny model on the CPU; two real-size blocks on a GPU
    python examples/finetune.py --steps 20 --policy fp32

Each step draws noise and a timestep per sample, moves the latents along the straight path between them,
and regresses the model's velocity on ``noise - latents`` (the sampler's convention, ``minimax_h3.sampler``).
Every block is compiled on its own (``compile_repeated_blocks``), so with h3_fused the fused forward and backward
of its three modulation sites run in each step. Prints each step's loss and time for the three, and the sites
the h3_fused compile fused.

On the CPU there is no fused kernel: a site's forward is its reference's operations, which Inductor compiles as
it compiles the unfused site, and its backward is the reference backward, one op per site that runs as eager
torch operations (so that the table gradients are summed in fp32 in a fixed order), where Inductor compiles the
unfused backward into its own code. So on the CPU h3_fused's steps are slower than Inductor's (and, at the tiny
model's sizes, any compiled step than eager's); the fused kernels, and the speed, are on the GPU.
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
from h3_fused.patterns import SiteKind  # noqa: E402
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


VARIANTS = ("eager", "inductor", "h3_fused")


def finetune(variant: str, policy: str, steps: int, device: str) -> list[tuple[float, float]]:
    """``(loss, seconds)`` of each step of the fine-tune with ``variant`` (one of ``VARIANTS``)."""
    torch._dynamo.reset()
    counters.clear()
    model, latents, layout = build(device)
    model.train()
    if variant == "h3_fused":
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
    elif variant == "inductor":
        for block in model.blocks:
            block.compile()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    log = []
    for step in tqdm(range(steps), desc=variant, leave=False):
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
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per variant (default 8; the first "
                        "steps of the compiled variants include their compile)")
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"],
                        help="h3_fused's dtype policy: bf16 rounds where eager rounds, fp32 once per output "
                             "(default bf16)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fine-tuning the H3 stand-in on {device} (torch {torch.__version__}), {args.steps} steps")
    logs = {}
    for variant in VARIANTS:
        logs[variant] = finetune(variant, args.policy, args.steps, device)
        if variant == "h3_fused":
            fused = {kind.value: counters["h3_fused"][kind.value] for kind in SiteKind}
    print(f"h3_fused ({args.policy}) fused per compiled block graph: {fused}")
    if device == "cpu":
        print("on the CPU the sites' backward runs as eager torch operations (no fused kernel): slower than Inductor")
    print("step | " + " | ".join(f"loss {v:>8s}" for v in VARIANTS) + " | "
          + " | ".join(f"s {v:>8s}" for v in VARIANTS))
    for i, rows in enumerate(zip(*logs.values())):
        print(f"{i:4d} | " + " | ".join(f"{loss:13.5f}" for loss, _ in rows) + " | "
              + " | ".join(f"{s:10.3f}" for _, s in rows))


if __name__ == "__main__":
    main()
