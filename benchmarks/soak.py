"""Soak: one process compiles and runs the stand-in model for many token counts (``dynamic``).

    python benchmarks/soak.py --shapes 200 [--device cpu|cuda] [--mode regional|whole]

Reports the compiled graphs, recompiles and resident memory (first, after warm-up, last, max).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import h3_fused  # noqa: E402
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mode", default="regional", choices=["regional", "whole"])
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = H3Config.tiny()
    model = init_weights(H3Model(cfg, device=args.device))
    if args.mode == "regional":
        h3_fused.compile_repeated_blocks(model, dynamic_token_dim=0, options={"dtype_policy": "bf16"})
        run = model
    else:
        run = torch.compile(model, backend="h3_fused", dynamic=True, options={"dtype_policy": "bf16"})
    token_counts = [16 + 3 * i for i in range(args.shapes)]
    memory = []
    with torch.no_grad():
        for i, tokens in enumerate(token_counts):
            latents, layout = example_inputs(cfg, tokens, device=args.device, seed=i)
            run(latents, layout)
            memory.append(rss_mb())
    warm = memory[min(9, len(memory) - 1)]
    print(f"shapes {len(token_counts)} (T = {token_counts[0]}..{token_counts[-1]}), mode {args.mode}, "
          f"device {args.device}")
    print(f"unique graphs {counters['stats']['unique_graphs']}, frames compiled "
          f"{counters['frames']['ok']}, fused replacements {dict(counters['h3_fused'])}")
    print(f"RSS MB: first {memory[0]:.0f}, after 10 shapes {warm:.0f}, last {memory[-1]:.0f}, "
          f"max {max(memory):.0f}, growth after warm-up {memory[-1] - warm:+.0f}")


if __name__ == "__main__":
    main()
