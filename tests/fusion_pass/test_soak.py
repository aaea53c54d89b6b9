"""Soak: one process compiles the stand-in model once for dynamic token counts and runs it for many of them."""

import os

import h3_fused
import pytest
import torch
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights
from torch._dynamo.utils import counters
from tqdm import tqdm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile")]


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux) to read resident memory")
def test_many_token_counts_reuse_the_compiled_graphs_and_memory_stays_flat():
    cfg = H3Config.tiny()
    model = init_weights(H3Model(cfg))
    h3_fused.compile_repeated_blocks(model, dynamic_token_dim=0, options={"dtype_policy": "bf16"})
    memory = []
    with torch.no_grad():
        for i in tqdm(range(60), desc="token counts", leave=False):
            latents, layout = example_inputs(cfg, 16 + 3 * i, seed=i)
            model(latents, layout)
            memory.append(resident_mb())
    assert counters["stats"]["unique_graphs"] <= 3, "one dynamic graph per frame, not one per token count"
    assert memory[-1] - memory[9] < 64, f"resident memory grew after warm-up: {memory[9]:.0f} -> {memory[-1]:.0f} MB"
