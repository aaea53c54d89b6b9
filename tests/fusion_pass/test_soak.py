"""Soak: one process compiles the stand-in model once for dynamic token counts and runs it for many of them.

(Resident memory grows over such a loop on the CPU, by as much in eager as compiled: oneDNN's per-shape
primitive cache and the allocator, not the pass; docs/RELIABILITY.md.)
"""

import h3_fused
import pytest
import torch
from helpers import sites_fused
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights
from torch._dynamo.utils import counters
from tqdm import tqdm

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_compile")]


def test_many_token_counts_reuse_the_compiled_graphs_and_hold_the_policy():
    cfg = H3Config.tiny()
    model, eager = init_weights(H3Model(cfg)), init_weights(H3Model(cfg))
    h3_fused.compile_repeated_blocks(model, dynamic_token_dim=0, options={"dtype_policy": "bf16"})
    with torch.no_grad():
        for i in tqdm(range(30), desc="token counts", leave=False):
            latents, layout = example_inputs(cfg, 16 + 3 * i, seed=i)
            expected = eager(latents, layout)
            # the CPU's sites are Inductor's code, reducing in its order: held to the bound, not to eager's bits
            torch.testing.assert_close(model(latents, layout), expected, rtol=0.05,
                                       atol=0.02 * expected.abs().max().item(), msg=f"T = {latents.shape[0]}")
    assert counters["stats"]["unique_graphs"] <= 3, "one dynamic graph per frame, not one per token count"
    assert 3 <= sites_fused() <= 3 * 3, "3 sites per graph"
    assert counters["frames"]["ok"] <= 4, "no recompiles after the first token counts"
