"""diffusers' ``MiniMaxH3Transformer3DModel`` (a tiny one, random weights, the checkpoint's mixed precision) as
its users compile it: whole with ``backend="h3_fused"``, and through diffusers' ``compile_repeated_blocks``."""

import copy

import pytest
import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers_h3 import TINY, build_model, make_request
from helpers import assert_bf16_policy, fused_sites_in
from torch._dynamo.utils import counters

pytestmark = pytest.mark.usefixtures("fresh_compile")
SIGMA = torch.tensor(0.7)


@pytest.fixture(scope="module")
def model():
    return build_model("cpu", TINY)


@pytest.fixture(scope="module")
def inputs(model):
    request, video, audio = make_request(model, video_rows=24, audio_rows=6, text_rows=10, batch=2)
    return request.model_inputs(video, audio, SIGMA)


def outputs(fn, inputs):
    with torch.no_grad():
        out = fn(**inputs)
    return out.sample, out.audio_sample


def rms_error(got, expected):
    return (got.float() - expected.float()).pow(2).mean().sqrt().item()


def assert_policy(policy, got, eager, model, inputs, slack=1.0):
    """``bf16``: eager's outputs; ``fp32``: no further from the model computed in fp32 than eager is (times
    ``slack``)."""
    if policy == "bf16":
        for g, e in zip(got, eager):
            assert_bf16_policy(g, e)
        return
    fp32_model = copy.deepcopy(model)
    for t in [*fp32_model.parameters(), *fp32_model.buffers()]:
        t.data = t.data.float()
    for g, e, f in zip(got, eager, outputs(fp32_model, inputs)):
        assert rms_error(g, f) <= slack * rms_error(e, f)


def test_the_models_precision_is_what_from_pretrained_loads(model, tmp_path):
    model.save_pretrained(tmp_path)
    loaded = MiniMaxH3Transformer3DModel.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    dtypes = {n: t.dtype for n, t in [*model.named_parameters(), *model.named_buffers()]}
    assert dtypes == {n: t.dtype for n, t in [*loaded.named_parameters(), *loaded.named_buffers()]}
    assert torch.float32 in dtypes.values() and torch.bfloat16 in dtypes.values()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16"])  # fp32's sites are the same: by blocks below (CI's time)
def test_whole_compile_fuses_two_sites_per_block_and_the_output_norm(model, inputs, policy):
    eager = outputs(model, inputs)
    got = outputs(torch.compile(model, backend="h3_fused", options={"dtype_policy": policy}), inputs)
    blocks = model.config.num_layers
    c = counters["h3_fused"]
    # block 0's A; one B inside each block and one across each boundary; the last block's C; norm_out's A (its
    # own index and tables)
    assert (c["norm_modulate"], c["gate_norm_modulate"], c["gate_residual"], c["refused"]) == (2, 2 * blocks - 1, 1, 0)
    assert_policy(policy, got, eager, model, inputs)


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_diffusers_compile_repeated_blocks_fuses_three_sites_per_block_graph(model, inputs, policy):
    eager = outputs(model, inputs)
    regional = copy.deepcopy(model)
    per_graph = []
    regional.compile_repeated_blocks(backend="h3_fused", options={
        "dtype_policy": policy, "post_grad_custom_post_pass": lambda graph: per_graph.append(fused_sites_in(graph))})
    got = outputs(regional, inputs)
    # one graph for the transformer blocks, one for the token refiner's blocks (no modulation: no site)
    assert sorted(per_graph) == [0, 3]
    assert counters["h3_fused"]["refused"] == 0
    # under bf16 the norms outside the sites are eager's: q and k in the block graph; norm1, norm2, q and k in the
    # refiner's
    assert counters["h3_fused"]["eager_rms_norm"] == (6 if policy == "bf16" else 0)
    # each block graph keeps eager's bf16 matmuls, attention and block outputs, the bulk of its distance to the
    # fp32 model: the sites' fp32 arithmetic moves it by noise either way (within 2% over seeds), where the
    # whole compile, fp32 between the blocks too, comes a third closer
    assert_policy(policy, got, eager, model, inputs, slack=1.05)


def test_a_lora_adapter_added_through_diffusers_still_fuses(model, inputs):
    from peft import LoraConfig

    adapted = copy.deepcopy(model)
    adapted.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "ff.net.2"],
                                   init_lora_weights=False))
    eager = outputs(adapted, inputs)
    assert not torch.equal(eager[0], outputs(model, inputs)[0]), "the adapter changes the output"
    adapted.compile_repeated_blocks(backend="h3_fused", options={"dtype_policy": "bf16"})
    got = outputs(adapted, inputs)
    c = counters["h3_fused"]
    assert (c["norm_modulate"], c["gate_norm_modulate"], c["gate_residual"]) == (1, 1, 1)
    assert_policy("bf16", got, eager, model, inputs)
