"""Soak: one process compiles the stand-in model once for dynamic token counts and runs it for many of them.

(Resident memory grows over such a loop on the CPU, by as much in eager as compiled: oneDNN's per-shape
primitive cache and the allocator, not the pass; docs/RELIABILITY.md.)
"""

import h3_fused
import pytest
import torch
from helpers import fused_ops_run
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights
from torch._dynamo.utils import counters
from tqdm import tqdm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile")]


def test_many_token_counts_reuse_the_compiled_graphs_and_every_site_stays_fused():
    cfg = H3Config.tiny()
    model = init_weights(H3Model(cfg))
    h3_fused.compile_repeated_blocks(model, dynamic_token_dim=0, options={"dtype_policy": "bf16"})
    blocks = cfg.num_blocks + cfg.num_refiner_blocks
    with torch.no_grad():
        for i in tqdm(range(60), desc="token counts", leave=False):
            latents, layout = example_inputs(cfg, 16 + 3 * i, seed=i)
            model(latents, layout)
        assert fused_ops_run(lambda: model(latents, layout)) == 3 * blocks
    assert counters["stats"]["unique_graphs"] <= 3, "one dynamic graph per frame, not one per token count"
    assert counters["frames"]["ok"] <= 4, "no recompiles after the first token counts"
