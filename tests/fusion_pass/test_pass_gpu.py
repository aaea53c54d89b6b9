"""GPU suite for the pass (``pytest -m gpu``): inlined kernels, real-size blocks, CUDA graphs."""

import dataclasses
import re

import pytest
import torch
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

pytestmark = pytest.mark.gpu
REAL_TOKENS = 15808


def real_blocks(num_blocks=2, inline=True):
    cfg = dataclasses.replace(H3Config.real(), num_blocks=num_blocks, num_refiner_blocks=0,
                              inline_attention=inline)
    model = init_weights(H3Model(cfg, device="cuda"))
    latents, layout = example_inputs(cfg, REAL_TOKENS, segments=1, device="cuda")
    return model, latents, layout


def test_kernel_is_inlined_in_inductor_output_code():
    torch._dynamo.reset()
    model, latents, layout = real_blocks(1)
    block = model.blocks[0]
    tables = model.adaln_proj(model.time_embed(layout.timesteps))
    x = model.patch_embed(latents.to(torch.bfloat16))
    compiled = torch.compile(block, backend="h3_fused", options={"dtype_policy": "bf16"})
    with torch.no_grad():
        _, codes = run_and_get_code(compiled, x, tables, layout.index, layout.positions, layout.cu_seqlens)
    code = "\n".join(line for c in codes for line in c.splitlines() if not line.lstrip().startswith("#"))
    assert "modulation_kernel" in code
    calls = set(re.findall(r"torch\.ops\.h3_fused\.(\w+\.\w+)", code))
    assert not calls, f"the fused ops and the q/k norms' eager_rms_norm must not be dispatcher calls: {calls}"


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_real_size_blocks_obey_the_policy(policy):
    torch._dynamo.reset()
    counters.clear()
    model, latents, layout = real_blocks(2)
    with torch.no_grad():
        expected = model(latents, layout)
        inductor = torch.compile(model, backend="inductor")(latents, layout)
        torch._dynamo.reset()
        got = torch.compile(model, backend="h3_fused", options={"dtype_policy": policy})(latents, layout)
    assert counters["h3_fused"]["gate_norm_modulate"] >= 3
    err = (got - expected).abs().max().item()
    err_inductor = (inductor - expected).abs().max().item()
    print(f"{policy}: max|h3_fused - eager| = {err:.3e}, max|inductor - eager| = {err_inductor:.3e}, "
          f"bit-identical share {(got == expected).float().mean().item():.6f}")
    if policy == "bf16":
        assert err <= err_inductor


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_bf16_policy_compiles_the_stand_in_to_eagers_bits(mode):
    """Two real-size blocks of the stand-in (``nn.RMSNorm`` sites, H = 5,376), 15,808 rows: compiled with the
    ``bf16`` policy, whole or block by block, the output is eager's, every element (``benchmarks/exactness.py``
    measures the same, with diffusers' model beside it)."""
    torch._dynamo.reset()
    cfg = dataclasses.replace(H3Config.real(), num_blocks=2, num_refiner_blocks=0)
    model = init_weights(H3Model(cfg, device="cuda"))
    latents, layout = example_inputs(cfg, REAL_TOKENS, device="cuda")
    options = {"dtype_policy": "bf16"}
    with torch.no_grad():
        expected = model(latents, layout)
        if mode == "whole":
            got = torch.compile(model, backend="h3_fused", options=options)(latents, layout)
        else:
            for block in model.blocks:
                block.compile(backend="h3_fused", options=options)
            got = model(latents, layout)
    assert torch.equal(got, expected), f"{(got != expected).float().mean().item():.2e} of the output differs"


def test_reduce_overhead_mode_runs_cuda_graphs():
    torch._dynamo.reset()
    model, latents, layout = real_blocks(1)
    with torch.no_grad():
        expected = model(latents, layout)
        # torch.compile takes mode= or options=, not both (as for Inductor): the policy is "auto" here
        compiled = torch.compile(model, backend="h3_fused", mode="reduce-overhead")
        for _ in range(3):
            got = compiled(latents, layout)
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05)


def test_kernels_per_block():
    torch._dynamo.reset()
    model, latents, layout = real_blocks(2, inline=True)
    with torch.no_grad():
        compiled = torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})
        compiled(latents, layout)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(latents, layout)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fused = [e for e in kernels if "modulation_kernel" in e.name]
    print(f"CUDA kernels per forward of 2 real blocks: {len(kernels)}, modulation kernels: {len(fused)}")
    # the sites: A, then B per block and across the boundary, last C, final A; and the forward kernel as each
    # block's q and k norms (eager_rms_norm)
    assert len(fused) == 2 * 2 + 2 + 2 * 2


def test_a_value_computed_in_the_graph_is_written_once_for_the_fused_kernel():
    """A site whose residual is a sum computed in the graph and whose rows are computed per token (Wan 2.2 TI2V's
    ``table + temb.float()``, LTX-Video's residual after its cross-attention): Inductor writes the residual once,
    for the kernel slot that reads it, and nothing for the slots of the inputs the site has not (which once took an
    alias of one it has, each such slot a copy: the residual four times, a row three); the rows not at all (the
    kernel reads ``temb`` and adds the table's rows, its biases)."""
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    t, h = 1024, 3072

    def site_b(a, b, branch, table, temb):  # Wan's spelling: fp32 rows, residual and affine, one cast after each
        shift, scale, gate = (table + temb.float()).chunk(3, dim=2)
        u = ((a + b).float() + branch * gate.squeeze(2)).to(torch.bfloat16)
        n = torch.nn.functional.layer_norm(u.float(), (h,), eps=1e-6)
        return u, (n * (1 + scale.squeeze(2)) + shift.squeeze(2)).to(torch.bfloat16)

    a, b, branch = (torch.randn(1, t, h, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    table = torch.randn(1, 1, 3, h, generator=g, device="cuda")
    temb = torch.randn(1, t, 3, h, generator=g, device="cuda", dtype=torch.bfloat16)
    counters.clear()
    compiled = torch.compile(site_b, backend="h3_fused", options={"dtype_policy": "bf16"})
    with torch.no_grad():
        got, codes = run_and_get_code(compiled, a, b, branch, table, temb)
    assert counters["h3_fused"]["gate_norm_modulate"] == 1
    assert all(torch.equal(x, y) for x, y in zip(got, site_b(a, b, branch, table, temb), strict=True))
    code = "\n".join(codes)
    kernels = re.findall(r"def (triton_\w+)\(.*?\n(.*?)''', device_str", code, flags=re.S)
    stores = {name: body.count("tl.store(") for name, body in kernels}
    # the residual's sum, once (an alias in the absent slots made it 7 stores, with the rows written too)
    assert sum(stores.values()) == 1, stores


@pytest.mark.large_memory
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_real_size_blocks_train_with_the_fused_backward(policy):
    """Two real-size blocks compiled regionally, forward and backward: every site fused, no table gradient left to
    a scatter, and every parameter's gradient as close to the fp32 model's as eager's (or closer: eager sums the
    table gradients in bf16)."""
    import h3_fused

    torch._dynamo.reset()
    counters.clear()
    cfg = dataclasses.replace(H3Config.real(), num_blocks=2, num_refiner_blocks=0)
    model = init_weights(H3Model(cfg, device="cuda"))
    reference = init_weights(H3Model(dataclasses.replace(cfg, dtype=torch.float32), device="cuda"))
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    latents, layout = example_inputs(cfg, 4096, segments=1, device="cuda")
    incoming = torch.randn(4096, cfg.in_channels, device="cuda")

    def gradients(m):
        m.zero_grad(set_to_none=True)
        torch.autograd.backward(m(latents, layout), incoming)
        return {n: p.grad.float().clone() for n, p in m.named_parameters()}

    exact, eager = gradients(reference), gradients(model)
    targets = []

    def spy(graph):
        targets.extend(str(n.target) for n in graph.nodes if n.op == "call_function")

    with torch._inductor.config.patch(post_grad_custom_post_pass=spy):
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
        ours = gradients(model)
    assert counters["h3_fused"]["gate_norm_modulate"] == 1 and counters["h3_fused"]["gate_residual"] == 1
    assert not [t for t in targets if any(s in t for s in ("index_put", "index_add", "scatter_add"))]
    for name, e in exact.items():
        mine, theirs = (ours[name] - e).norm().item(), (eager[name] - e).norm().item()
        assert mine <= 1.1 * theirs + 1e-3 * e.norm().item(), (name, mine, theirs)


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_diffusers_model_at_real_dims_under_its_regional_compile(policy):
    """diffusers' MiniMaxH3Transformer3DModel, the checkpoint's dims and precision, 2 blocks, 15,808 rows: the
    three fused kernels run per block (and the norms' under bf16), and the output stays within the policy's bound
    of eager."""
    pytest.importorskip("diffusers", reason="needs diffusers (on the GPU box: .ci/fetch-wheels, carry .whl)")
    from diffusers_h3 import REAL_DIMS_FEW_BLOCKS, build_model, make_request

    torch._dynamo.reset()
    counters.clear()
    model = build_model("cuda", REAL_DIMS_FEW_BLOCKS)
    request, video, audio = make_request(model, video_rows=REAL_TOKENS - 1024, audio_rows=512, text_rows=512,
                                         batch=1, device="cuda")
    inputs = request.model_inputs(video, audio, torch.tensor(0.7))
    with torch.no_grad():
        expected = model(**inputs).sample
        model.compile_repeated_blocks(backend="h3_fused", options={"dtype_policy": policy})
        got = model(**inputs).sample
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(**inputs)
            torch.cuda.synchronize()
    assert (counters["h3_fused"]["norm_modulate"], counters["h3_fused"]["gate_norm_modulate"],
            counters["h3_fused"]["gate_residual"]) == (1, 1, 1)
    blocks, refiners = model.config.num_layers, model.config.num_refiner_layers
    # three sites per block; under bf16 the forward kernel also computes the q/k norms of every block and the
    # four norms of every token-refiner block (norm1, norm2, q, k: eager_rms_norm)
    norms = 2 * blocks + 4 * refiners if policy == "bf16" else 0
    assert sum(1 for e in prof.events() if "modulation_kernel" in e.name) == 3 * blocks + norms
    err = (got - expected).abs().max().item()
    print(f"diffusers {policy}: max|h3_fused - eager| = {err:.3e}, "
          f"bit-identical share {(got == expected).float().mean().item():.6f}")
    torch.testing.assert_close(got, expected, rtol=0.05, atol=0.05 * expected.abs().max().item())


@pytest.mark.parametrize("mode", ["regional", "whole"])
def test_bf16_policy_compiles_diffusers_model_to_eagers_bits(mode):
    """diffusers' MiniMaxH3Transformer3DModel at the checkpoint's dims and precision, 2 blocks, 15,808 rows:
    compiled with the ``bf16`` policy, whole or by its own ``compile_repeated_blocks``, both outputs (video and
    audio) are eager's, every element."""
    pytest.importorskip("diffusers", reason="needs diffusers (on the GPU box: .ci/fetch-wheels, carry .whl)")
    from diffusers_h3 import REAL_DIMS_FEW_BLOCKS, build_model, make_request

    torch._dynamo.reset()
    model = build_model("cuda", REAL_DIMS_FEW_BLOCKS)
    request, video, audio = make_request(model, video_rows=REAL_TOKENS - 1024, audio_rows=512, text_rows=512,
                                         batch=1, device="cuda")
    inputs = request.model_inputs(video, audio, torch.tensor(0.7))
    options = {"dtype_policy": "bf16"}
    with torch.no_grad():
        expected = model(**inputs)
        if mode == "whole":
            got = torch.compile(model, backend="h3_fused", options=options)(**inputs)
        else:
            model.compile_repeated_blocks(backend="h3_fused", options=options)
            got = model(**inputs)
    for name in ("sample", "audio_sample"):
        g, e = getattr(got, name), getattr(expected, name)
        assert torch.equal(g, e), f"{name}: {(g != e).float().mean().item():.2e} of the elements differ"
