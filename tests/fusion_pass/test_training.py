"""The backend on graphs that compute gradients: sites fused before autograd, so the compiled forward runs the
fused forward and the compiled backward the fused backward (on the CPU: their pure-torch references)."""

import h3_fused
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    GraphSpy,
    assert_bf16_policy,
    assert_gradients_close,
    inductor_matches_eager_on_cpu,
    sites_fused,
    tiny,
)
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

pytestmark = pytest.mark.usefixtures("fresh_compile")
bf16 = torch.bfloat16


def loss_of(output):
    g = torch.Generator().manual_seed(7)
    return (output.float() * torch.randn(output.shape, generator=g)).sum()


def train_step(fn, model, *args):
    """One forward and backward: the output and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = fn(*args)
    loss_of(out).backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["whole", "regional"])
@pytest.mark.slow
def test_training_graphs_use_the_fused_forward_and_backward(mode):
    model, latents, layout = tiny(inline_attention=True, num_blocks=2)
    model.train()
    expected, expected_grads = train_step(model, model, latents, layout)
    spy = GraphSpy()
    with torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        if mode == "whole":
            fn = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        else:
            fn = h3_fused.compile_repeated_blocks(model, options={"dtype_policy": "bf16"})
        got, grads = train_step(fn, model, latents, layout)
    fused = counters["h3_fused"]
    blocks = len(model.blocks) + len(model.refiner_blocks)
    if mode == "whole":  # as in inference: C of each block and A of the next merge into a B
        assert (fused["norm_modulate"], fused["gate_norm_modulate"], fused["gate_residual"]) == (2, 2 * blocks - 1, 1)
    else:  # one compiled graph serves every block
        assert (fused["norm_modulate"], fused["gate_norm_modulate"], fused["gate_residual"]) == (1, 1, 1)
    assert fused["refused"] == 0
    assert spy.count("h3_fused.reference_modulation_backward.default") == sum(fused.values()), \
        "each fused site has its fused backward"
    assert not spy.scatters(), "no table gradient is left to a scatter"
    assert_bf16_policy(got, expected)
    assert_gradients_close(grads, expected_grads)


@pytest.mark.slow
def test_frozen_tables_and_weights_get_no_gradient_computed():
    """LoRA-like fine-tuning: only the linears train; the fused backward is asked for the activations' gradients
    alone (its ``needs`` argument)."""
    model, latents, layout = tiny(inline_attention=True, num_blocks=1)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(("blocks", "refiner_blocks")) and ("attn" in name or "mlp" in name))
    needs = []

    def record(graph):
        schema = torch.ops.h3_fused.reference_modulation_backward.default._schema
        position = [a.name for a in schema.arguments].index("needs")
        needs.extend(n.kwargs.get("needs", n.args[position] if len(n.args) > position else None) for n in graph.nodes
                     if n.op == "call_function" and "reference_modulation_backward" in str(n.target))

    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        fn = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        _, grads = train_step(fn, model, latents, layout)
    assert needs and all(n[2:] == [False, False, False, False] for n in needs), needs  # gate, weight, shift, scale
    assert grads and all("attn" in name or "mlp" in name for name in grads)


class CheckpointedBlocks(torch.nn.Module):
    """The stand-in's blocks, each under ``torch.utils.checkpoint`` (non-reentrant), as fine-tuning runs them."""

    def __init__(self, model, use_checkpoint=True):
        super().__init__()
        self.model, self.use_checkpoint = model, use_checkpoint

    def forward(self, latents, layout):
        m = self.model
        x = m.patch_embed(latents.to(m.cfg.dtype))
        t_emb = m.time_embed(layout.timesteps)
        tables = m.adaln_proj(t_emb)
        for block in (*m.refiner_blocks, *m.blocks):
            args = (x, tables, layout.index, layout.positions, layout.cu_seqlens)
            x = checkpoint(block, *args, use_reentrant=False) if self.use_checkpoint else block(*args)
        return m.final_layer(x, t_emb, layout.timestep_index)


@pytest.mark.slow
def test_activation_checkpointing_keeps_working_and_saves_less():
    """With each block under checkpoint, the compiled forward saves fewer tensors for the backward, and output and
    gradients are those of the same model compiled without it, bit for bit where Inductor keeps eager's
    roundings on the CPU (else the two graphs' code rounds apart: held to the policy's bounds)."""
    model, latents, layout = tiny(inline_attention=True, num_blocks=1)
    saved, results = {}, {}
    for use in (False, True):
        torch._dynamo.reset()
        counters.clear()
        outputs = []

        def forward_outputs(graph):
            outputs.append(len(next(n for n in graph.nodes if n.op == "output").args[0]))

        with torch._inductor.config.patch(post_grad_custom_post_pass=forward_outputs):
            fn = torch.compile(CheckpointedBlocks(model, use), backend="h3_fused", options={"dtype_policy": "bf16"})
            results[use] = train_step(fn, model, latents, layout)
        saved[use] = outputs[0]  # the forward graph's outputs: the result and what it saves for the backward
        assert counters["h3_fused"]["gate_norm_modulate"] >= 1
    (plain, plain_grads), (got, grads) = results[False], results[True]
    if inductor_matches_eager_on_cpu():
        assert torch.equal(got, plain) and all(torch.equal(grads[k], plain_grads[k]) for k in grads)
    else:
        assert_bf16_policy(got, plain)
        assert_gradients_close(grads, plain_grads)
    assert saved[True] < saved[False], saved


def test_a_no_grad_region_inside_the_model_stays_without_gradient():
    """The trace before autograd records grad-mode switches: what the model computes under ``torch.no_grad()``
    still gets no gradient (a gradient through ``x * 2`` would triple ``x``'s; the norm's backward may differ
    from eager's in a last place, its fp32 sum in its own order)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((1 + 0.1 * torch.randn(64, generator=g)).to(bf16))
    tables = (0.3 * torch.randn(6, 128, generator=g)).to(bf16).chunk(2, -1)
    idx = torch.randint(0, 6, (16,), generator=g)

    def fn(x):
        with torch.no_grad():
            detached = x * 2
        n = F.rms_norm(x + detached, (64,), weight, 1e-5)
        return n * (1 + tables[1][idx]) + tables[0][idx]

    x = torch.randn(16, 64, generator=g).to(bf16).requires_grad_()
    loss_of(fn(x)).backward()
    expected = x.grad.clone()
    x.grad = None
    loss_of(torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(x)).backward()
    assert counters["h3_fused"]["norm_modulate"] == 1
    assert (x.grad != expected).float().mean() <= 0.01
    torch.testing.assert_close(x.grad, expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())


def test_rows_broadcast_over_a_batch_get_their_table_gradients_summed_over_the_batch():
    """Activations [2, T, H] with one index [T] (one layout for both samples): each table row's gradient sums
    its rows of both samples."""
    g = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter((1 + 0.1 * torch.randn(64, generator=g)).to(bf16))
    table = torch.nn.Parameter((0.3 * torch.randn(6, 3 * 64, generator=g)).to(bf16))
    idx = torch.randint(0, 6, (16,), generator=g)
    branch = torch.randn(2, 16, 64, generator=g).to(bf16)

    def fn(x):
        shift, scale, gate = table.chunk(3, -1)
        u = x + gate[idx] * branch
        return u, F.rms_norm(u, (64,), weight, 1e-5) * (1 + scale[idx]) + shift[idx]

    x = torch.randn(2, 16, 64, generator=g).to(bf16).requires_grad_()
    grads = []
    for f in (fn, torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})):
        x.grad = table.grad = weight.grad = None
        u, y = f(x)
        (loss_of(u) + loss_of(y)).backward()
        grads.append({"x": x.grad, "table": table.grad, "weight": weight.grad})
    assert counters["h3_fused"]["gate_norm_modulate"] == 1
    assert_gradients_close(grads[1], grads[0])


def test_a_near_miss_in_a_training_graph_compiles_as_inductor_compiles_it():
    weight = torch.nn.Parameter((1 + 0.1 * torch.randn(64)).to(bf16))
    table = torch.nn.Parameter((0.3 * torch.randn(6, 128)).to(bf16))
    idx, other = torch.randint(0, 6, (16,)), torch.randint(0, 6, (16,))

    def fn(x):  # the shift gathered with another index than the scale: not a site
        shift, scale = table.chunk(2, -1)
        return F.rms_norm(x, (64,), weight, 1e-5) * (1 + scale[idx]) + shift[other]

    x = torch.randn(16, 64).to(bf16).requires_grad_()
    results = []
    for backend, options in (("inductor", {"emulate_precision_casts": True}), ("h3_fused", {"dtype_policy": "bf16"})):
        torch._dynamo.reset()
        x.grad = table.grad = weight.grad = None
        out = torch.compile(fn, backend=backend, options=options)(x)
        loss_of(out).backward()
        results.append((out, x.grad, table.grad, weight.grad))
    assert sites_fused() == 0
    assert counters["h3_fused"]["refused"] >= 1
    (out, x_grad, table_grad, weight_grad), inductor = results[1], results[0]
    assert torch.equal(out, inductor[0]) and torch.equal(x_grad, inductor[1]) and torch.equal(weight_grad, inductor[3])
    # Inductor's CPU scatter of the table gradient adds with atomics: its bits vary from run to run
    torch.testing.assert_close(table_grad, inductor[2], rtol=1e-2, atol=1e-2 * inductor[2].abs().max().item())


def test_a_graph_the_trace_cannot_keep_faithful_compiles_unfused():
    """A custom ``autograd.Function`` is a higher-order op in Dynamo's graph: the graph is compiled as it is."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 3

    weight = torch.nn.Parameter(torch.ones(64, dtype=bf16))
    tables = (0.3 * torch.randn(6, 128)).to(bf16).chunk(2, -1)
    idx = torch.randint(0, 6, (16,))

    def fn(x):
        n = F.rms_norm(Scale.apply(x), (64,), weight, 1e-5)
        return n * (1 + tables[1][idx]) + tables[0][idx]

    x = torch.randn(16, 64).to(bf16).requires_grad_()
    loss_of(fn(x)).backward()
    expected = x.grad.clone()
    x.grad = None
    loss_of(torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(x)).backward()
    assert sites_fused() == 0
    torch.testing.assert_close(x.grad, expected, rtol=0.02, atol=0.02)


@pytest.mark.slow
def test_a_lora_fine_tune_with_peft_fuses_and_follows_eager():
    """peft LoRA adapters on the stand-in's attention and MLP linears, everything else frozen: a few AdamW steps
    compiled with h3_fused by blocks give eager's losses within the ``bf16`` policy, every site fused."""
    peft = pytest.importorskip("peft")

    def losses(compiled: bool):
        torch._dynamo.reset()
        counters.clear()
        model, latents, layout = tiny(inline_attention=True, num_blocks=2, seed=3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "out", "fc1", "fc2"], init_lora_weights=False)
        torch.manual_seed(0)  # the adapters' random initial weights
        model = peft.inject_adapter_in_model(config, model)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
        if compiled:  # by blocks, as diffusers' compile_repeated_blocks (the whole model's training: above)
            h3_fused.compile_repeated_blocks(model, options={"dtype_policy": "bf16"})
        fn = model
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        values = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = loss_of(fn(latents, layout))
            loss.backward()
            optimizer.step()
            values.append(loss.item())
        return values, counters["h3_fused"].copy()

    expected, _ = losses(compiled=False)
    got, fused = losses(compiled=True)
    # the block's and the refiner block's graphs, three sites each
    assert (fused["norm_modulate"], fused["gate_norm_modulate"], fused["gate_residual"]) == (2, 2, 2)
    assert fused["refused"] == 0
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2 * max(map(abs, expected)))
