"""Training compiles of diffusers' DiT family, unmodified, tiny configs on the CPU: every site the inference
compile fuses also fuses in the graph that computes gradients, each with its fused backward (on the CPU the
reference backward, one op a site), so no row gradient is left to Inductor; the output and every parameter's
gradient follow eager's within the ``bf16`` policy; peft LoRA fine-tunes (``examples/finetune.py``) give
eager's losses within it, by blocks and with diffusers' gradient checkpointing too."""

import pytest
import torch
import torch.nn.functional as F
from dit_family import MODELS, compile_regionally
from finetune import finetune
from h3_fused.kernels.testing import FamilyForm, family_inputs
from helpers import GraphSpy, assert_bf16_policy, assert_gradients_close
from test_dit_family import REGIONAL, WHOLE
from torch._dynamo.utils import counters

pytestmark = [pytest.mark.usefixtures("fresh_compile"), pytest.mark.slow]
OPS = ("norm_modulate", "gate_norm_modulate", "gate_residual")


def step(fn, model, inputs):
    """One forward and backward of a fixed random projection of the output: the output and the gradients."""
    model.zero_grad(set_to_none=True)
    out = fn(**inputs)[0]
    g = torch.Generator().manual_seed(7)
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


# Wan's training by blocks: its LoRA test below (with checkpointing); its fp32 rows' backward: the CPU backward tests
@pytest.mark.parametrize("name, mode", [("flux", "whole"), ("qwen_image_edit", "regional")])
def test_training_compiles_fuse_every_site_with_its_backward(name, mode):
    """Flux whole (LayerNorm, rows per sample) and Qwen-Image-Edit by blocks (rows chosen per token between two):
    the inference compile's sites, each with its backward."""
    model, inputs = MODELS[name].example("cpu", real=False)
    model.train()
    expected, expected_grads = step(model, model, inputs)
    spy = GraphSpy()
    with torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        if mode == "whole":
            fn = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        else:
            compile_regionally(model, {"dtype_policy": "bf16"})
            fn = model
        got, grads = step(fn, model, inputs)
    fused = counters["h3_fused"]
    assert tuple(fused[op] for op in OPS) == (WHOLE if mode == "whole" else REGIONAL)[name]
    assert fused["refused"] == 0
    assert spy.count("h3_fused.reference_modulation_backward.default") == sum(fused[op] for op in OPS)
    assert not spy.scatters(), "no row gradient is left to a scatter"
    assert_bf16_policy(got, expected)
    # a block graph computes the gradients of outputs the model then drops (the last block's text stream) as zeros,
    # where eager leaves them None: plain Inductor does the same
    unused = set(grads) - set(expected_grads)
    assert all(not grads[name].any() for name in unused), unused
    assert_gradients_close({k: g for k, g in grads.items() if k not in unused}, expected_grads)


def test_a_norm_modulated_twice_fuses_with_its_backward():
    """SD3.5's ``SD35AdaLayerNormZeroX`` modulates one norm twice: in a graph that computes gradients the gated
    residual before it, the norm and both modulations are one site B with the fused backward; the outputs and
    the gradients follow eager's within the ``bf16`` policy."""
    from diffusers.models.normalization import SD35AdaLayerNormZeroX

    torch.manual_seed(0)
    norm = SD35AdaLayerNormZeroX(64).to(torch.bfloat16)
    residual, branch = (torch.randn(2, 9, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    gate, emb = (torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def block(residual, branch, gate, emb):
        u = residual + gate.unsqueeze(1) * branch
        out = norm(u, emb)
        return u, out[0], out[5]  # the two modulations of the one norm

    def run(fn):
        outputs = fn(residual, branch, gate, emb)
        sum(o.float().mul(k + 1).sum() for k, o in enumerate(outputs)).backward()
        grads = {name: t.grad.clone() for name, t in
                 (("residual", residual), ("branch", branch), ("gate", gate), ("emb", emb), *norm.named_parameters())}
        for t in (residual, branch, gate, emb, *norm.parameters()):
            t.grad = None
        return outputs, grads

    expected, expected_grads = run(block)
    spy = GraphSpy()
    with torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        got, grads = run(torch.compile(block, backend="h3_fused", options={"dtype_policy": "bf16"}))
    fused = counters["h3_fused"]
    assert fused["refused"] == 0 and tuple(fused[op] for op in OPS) == (0, 1, 0)
    assert spy.count("h3_fused.reference_modulation_backward.default") == 1
    for g, e in zip(got, expected, strict=True):
        assert_bf16_policy(g, e)
    assert_gradients_close(grads, expected_grads)


@pytest.mark.parametrize("name, regional, checkpointing", [("flux", True, False), ("wan", True, True)],
                         ids=["flux-regional", "wan-regional-checkpointing"])
def test_lora_fine_tunes_follow_eager(name, regional, checkpointing):
    """peft LoRA adapters on the attention and MLP linears, the rest frozen (so the sites' backward computes the
    activations' gradients alone): three AdamW steps give eager's losses within the ``bf16`` policy."""
    pytest.importorskip("peft")
    kwargs = dict(steps=3, lora=True, regional=regional, checkpointing=checkpointing, lr=1e-3)
    expected = [loss for loss, _ in finetune(name, "eager", **kwargs)]
    got = [loss for loss, _ in finetune(name, "h3_fused", **kwargs)]
    assert sum(counters["h3_fused"][op] for op in OPS) > 0 and counters["h3_fused"]["refused"] == 0
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * max(map(abs, expected)))


@pytest.mark.parametrize("mixed", [False, True], ids=["rows_alike", "gate_per_sample_rows_per_token"])
def test_rows_that_broadcast_differently_stay_two_sites_under_grad_with_the_reason(mixed, h3_fused_log):
    """The backward restates given rows with one index for all a site's tables: a gate per sample beside shift
    and scale per token has none, so in a graph that computes gradients the gated residual and the norm stay two
    sites (C and A, each with rows alike), the log saying why; rows alike make one site B."""
    t = family_inputs("B", FamilyForm("layer", "per_token"), 2, 9, 64, device="cpu")

    def site(residual, branch, modulation):
        shift, scale, gate = modulation.chunk(6, -1)[:3]
        gate = gate[:, :1] if mixed else gate
        u = residual + gate * branch
        return u, F.layer_norm(u, (64,), eps=1e-6) * (1 + scale) + shift

    leaves = {k: v.detach().requires_grad_() for k, v in t.items()}
    u, y = torch.compile(site, backend="h3_fused", options={"dtype_policy": "bf16"})(**leaves)
    (u.float().sum() + y.float().sum()).backward()
    fused = sum(counters["h3_fused"][op] for op in OPS)
    reasons = [r.getMessage() for r in h3_fused_log if "broadcast differently" in r.getMessage()]
    assert (fused, bool(reasons)) == ((2, True) if mixed else (1, False)), (fused, reasons)
    assert counters["h3_fused"]["refused"] == 0
