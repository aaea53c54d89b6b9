"""The backend on the stand-in model: what fuses, numerics per policy, graphs, regional compile."""

import dataclasses

import h3_fused
import pytest
import torch
from helpers import PUBLIC_SPELLINGS, assert_bf16_policy, regional_against_eager, sites_fused, tiny
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights
from torch._dynamo.utils import counters

pytestmark = pytest.mark.usefixtures("fresh_compile")


def blocks_of(model):
    return len(model.blocks) + len(model.refiner_blocks)


@pytest.mark.parametrize("policy", ["bf16", "auto"])
def test_regional_compile_fuses_three_sites_per_block_bit_exact(policy):
    model, latents, layout = tiny()
    with torch.no_grad():
        expected = model(latents, layout)
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
        got = model(latents, layout)
    assert_bf16_policy(got, expected)
    # one compiled graph serves every block (two frames: before and after the attention island)
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["h3_fused"]["norm_modulate"] == 1 and counters["h3_fused"]["gate_norm_modulate"] == 1
    assert counters["h3_fused"]["gate_residual"] == 1


def test_regional_fp32_policy_within_its_bound():
    model, latents, layout = tiny()
    with torch.no_grad():
        expected = model(latents, layout)
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": "fp32"})
        got = model(latents, layout)
    assert not torch.equal(got, expected)  # fp32 intermediates really differ from eager
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.02 * expected.abs().max().item())


@pytest.mark.slow
def test_whole_model_merges_across_blocks_and_is_bit_exact():
    model, latents, layout = tiny(inline_attention=True, num_blocks=3)
    with torch.no_grad():
        expected = model(latents, layout)
        compiled = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        got = compiled(latents, layout)
    n = blocks_of(model)
    assert counters["stats"]["unique_graphs"] == 1, "no graph break added"
    c = counters["h3_fused"]
    # block 0's A, then one B inside each block and one across each block boundary, the last C,
    # and the final layer's A (its index differs from the blocks', so it does not merge)
    assert (c["norm_modulate"], c["gate_norm_modulate"], c["gate_residual"]) == (2, 2 * n - 1, 1)
    assert sites_fused() == 2 * n + 2 < 3 * n
    assert c["eager_rms_norm"] == 2 * n, "each block's q and k norms (inline attention) computed by eager's kernels"
    assert_bf16_policy(got, expected)


def test_attention_island_still_fuses_a_and_b():
    model, latents, layout = tiny(num_blocks=1, num_refiner_blocks=0)
    with torch.no_grad():
        expected = model(latents, layout)
        compiled = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        got = compiled(latents, layout)
    assert counters["h3_fused"]["norm_modulate"] >= 1 and counters["h3_fused"]["gate_norm_modulate"] == 1
    assert_bf16_policy(got, expected)


def test_no_graph_break_added():
    def graphs(backend):
        torch._dynamo.reset()
        counters.clear()
        model, latents, layout = tiny()
        with torch.no_grad():
            torch.compile(model, backend=backend)(latents, layout)
        return counters["stats"]["unique_graphs"]

    assert graphs("h3_fused") == graphs("inductor")




@pytest.mark.parametrize("spell", PUBLIC_SPELLINGS, ids=repr)
def test_every_public_spelling_fuses_bit_exact(spell):
    model, latents, layout = tiny(spellings=spell)
    got, expected, fused = regional_against_eager(model, latents, layout)
    assert fused == 3  # one compiled graph serves every block
    assert_bf16_policy(got, expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes_fuse(dtype):
    model, latents, layout = tiny(dtype=dtype)
    got, expected, fused = regional_against_eager(model, latents, layout)
    assert fused == 3  # one compiled graph serves every block
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())


def test_norm_without_weight_fuses():
    model, latents, layout = tiny()
    for block in (*model.blocks, *model.refiner_blocks):
        block.norm1 = torch.nn.RMSNorm(model.cfg.hidden_size, eps=1e-6, elementwise_affine=False,
                                       dtype=torch.bfloat16)
    got, expected, fused = regional_against_eager(model, latents, layout)
    assert fused == 3  # one compiled graph serves every block
    assert_bf16_policy(got, expected)


def test_dynamic_token_count_reuses_one_compile():
    model, latents, layout = tiny()
    h3_fused.compile_repeated_blocks(model, dynamic_token_dim=0, options={"dtype_policy": "bf16"})
    with torch.no_grad():
        for tokens in (48, 64, 80, 112):
            lat, lay = example_inputs(model.cfg, tokens)
            eager = init_weights(H3Model(model.cfg))
            assert_bf16_policy(model(lat, lay), eager(lat, lay))
    assert sites_fused() <= 3 * 3, "3 sites per graph compiled"
    # the frame before the attention island is dynamic from the start; the one after it (fed by the
    # island's output) becomes dynamic on the second T (automatic dynamic): 3 graphs for 4 Ts
    assert counters["stats"]["unique_graphs"] <= 3, "several T reuse one compile"


def test_real_config_builds_and_a_block_is_found():
    cfg = H3Config.real()
    with torch.device("meta"):
        model = H3Model(dataclasses.replace(cfg, num_blocks=3), device="meta")
    assert h3_fused.find_repeated_block_classes(model) == [type(model.blocks[0])]
