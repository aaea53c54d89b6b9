"""GPU suite for the fused ops (``pytest -m gpu`` on the H200): real sizes, bit-exactness, bad indices."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
from exact_rounding import assert_fp32_gated_residual_rounds_once
from h3_fused.kernels.reference import sum_rounded_once
from h3_fused.kernels.testing import eager_gate, eager_modulate, eager_norm, eager_site, fused_site, make_inputs

pytestmark = pytest.mark.gpu


def _diff(got, ref):
    return (got.view(torch.int16) != ref.view(torch.int16)).float().mean().item()


@pytest.mark.parametrize("tokens", [1, 1024, 3072, 15808, 63232])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_bf16_policy_matches_eager_at_real_size(site, tokens):
    """Every build at H = 5376: site B on 8 warps up to 6,144 rows (1, 1,024, 3,072) and on 4 beyond; site A
    on 8 warps up to 1,024 rows and on 4 from 3,072 on; both with their table rows loaded ahead."""
    inputs = make_inputs(site, tokens, seed=tokens)
    _assert_bf16_policy_matches_eager(site, fused_site(site, "bf16")(**inputs), eager_site(site)(**inputs))


def _assert_bf16_policy_matches_eager(site, got, ref):
    """Bit for bit, every element: the norm's sum of squares adds in the order of eager's fused RMSNorm kernel."""
    if site == "B":
        assert torch.equal(got[0], ref[0]), "the stored residual must be bit-identical"
        assert torch.equal(got[1], ref[1]), f"y differs on {_diff(got[1], ref[1]):.2e} of its elements"
    else:
        assert torch.equal(got, ref), f"differs on {_diff(got, ref):.2e} of its elements"


@pytest.mark.parametrize("tokens", [4096])
@pytest.mark.parametrize("hidden", [4, 64, 128, 200, 256, 1024, 2048, 3072, 4100, 5120, 16384])
@pytest.mark.parametrize("site", ["A", "B"])
def test_bf16_policy_matches_eager_at_other_widths(site, hidden, tokens):
    """Every width eager's fused RMSNorm kernel takes its vectorized path at (``H`` a multiple of 4): rows of
    fewer than 128 vectors (a head's q/k norm at 128), of several chunks, and with a partial last chunk."""
    inputs = make_inputs(site, tokens, hidden, seed=hidden)
    _assert_bf16_policy_matches_eager(site, fused_site(site, "bf16")(**inputs), eager_site(site)(**inputs))


@pytest.mark.parametrize("site, hidden, tokens", [
    *itertools.product("AB", [16, 32, 64, 96, 128, 200, 1024, 5376], [16, 3072, 15808]),
    # the widest row eager's warp sums: one build of 64 unrolled chunks, minutes to compile, started first
    pytest.param("B", 8160, 3072, marks=pytest.mark.slow)])
def test_bf16_policy_matches_the_native_rms_norm_from_16_rows(site, hidden, tokens):
    """The native spelling's mean sums in the order of torch's generic reduction (one warp a row from 16 rows
    on, up to H = 8,160): every output bit for bit (site A with its tables warmed as the kernel starts)."""
    _assert_bf16_policy_matches_eager(site, *_native_site(site, tokens, hidden))


@pytest.mark.parametrize("head_dim", [32, 64, 96])
def test_the_native_rms_norm_of_attention_heads_is_eagers_in_one_launch(head_dim):
    """The q/k norms of SD3.5 (diffusers' ``RMSNorm``, weighted, over ``[B, heads, T, head_dim]``, the projection's
    view transposed): ``eager_rms_norm`` runs the forward kernel (rows shorter than 128 read element by element,
    as torch's reduction reads them) on the rows in memory order, and gives eager's bits in eager's layout."""
    from h3_fused.kernels.eager_norm import eager_rms_norm, kernel_args

    g = torch.Generator(device="cuda").manual_seed(head_dim)
    projected = torch.randn(2, 4104, 38 * head_dim, generator=g, device="cuda").to(torch.bfloat16)
    x = projected.view(2, 4104, 38, head_dim).transpose(1, 2)
    weight = (1 + torch.randn(head_dim, generator=g, device="cuda") / 4).to(torch.bfloat16)
    assert kernel_args(x.transpose(1, 2), weight, 1e-6, True) is not None
    x32 = x.float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * weight
    got = eager_rms_norm(x, weight, 1e-6, True)
    assert got.stride() == expected.stride() == x.stride()
    assert torch.equal(got, expected), f"differs on {_diff(got, expected):.2e} of its elements"


def test_bf16_policy_native_rms_norm_of_rows_eager_splits_over_warps():
    """From H = 8,161 on torch's reduction splits a row's mean over 16 warps, an order the kernel does not
    reproduce: the residual bit for bit, ``y`` on all but a few elements."""
    (got_u, got_y), (u, ref_y) = _native_site("B", 3072, 8192)
    assert torch.equal(got_u, u) and _diff(got_y, ref_y) <= 1e-4


def _native_site(site, tokens, hidden):
    """Site A (``y``) or B (``(u, y)``) under ``bf16`` with the native RMSNorm: ``(fused, eager)``."""
    from h3_fused.kernels import gate_norm_modulate, norm_modulate

    inputs = make_inputs(site, tokens, hidden, seed=hidden)
    tables = inputs["shift"], inputs["scale"], inputs["index"]
    if site == "A":
        ref_y = eager_modulate(eager_norm(inputs["x"], inputs["weight"], inputs["eps"], native=True), *tables,
                               upcast=False)
        return norm_modulate(**inputs, policy="bf16", norm_rounds_before_weight=True), ref_y
    u = eager_gate(inputs["residual"], inputs["gate"], inputs["branch"], inputs["index"], upcast=False)
    ref_y = eager_modulate(eager_norm(u, inputs["weight"], inputs["eps"], native=True), *tables, upcast=False)
    return gate_norm_modulate(**inputs, policy="bf16", norm_rounds_before_weight=True), (u, ref_y)


@pytest.mark.parametrize("hidden", [1, 101, 4097])
def test_bf16_policy_at_widths_eager_reduces_otherwise(hidden):
    """At ``H`` not a multiple of 4 eager's RMSNorm takes another kernel, whose order the fused kernel does not
    reproduce: the residual bit for bit, ``y`` on all but a few elements."""
    inputs = make_inputs("B", 257, hidden)
    ref_u, ref_y = eager_site("B")(**inputs)
    u, y = fused_site("B", "bf16")(**inputs)
    assert torch.equal(u, ref_u) and _diff(y, ref_y) <= 1e-4


def test_fp32_policy_error_no_larger_than_eager():
    inputs = make_inputs("B", 4096)
    exact = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    _, y_eager = eager_site("B")(**inputs)
    u, y = fused_site("B", "fp32")(**inputs)
    # fp64 reference of y from the stored (rounded) residual, as the policy defines
    y64 = eager_site("A")(u.double(), exact["weight"], exact["shift"], exact["scale"], inputs["index"], 1e-5)
    stored = sum_rounded_once(inputs["residual"], inputs["gate"][inputs["index"]], inputs["branch"], torch.bfloat16)
    assert torch.equal(u, stored.to(torch.bfloat16)), "fp32: the residual is rounded once, where it is stored"
    assert (y.double() - y64).abs().mean() <= (y_eager.double() - y64).abs().mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_policy_rounds_the_gated_residual_once_where_fp32_would_round_twice(dtype):
    """The kernel's multiply-add in the activation dtype: products that are ties of it plus a residual far
    below fp32's last place of them, against the exact sum rounded once (fractions), in sites B and C."""
    assert_fp32_gated_residual_rounds_once(dtype, "cuda")


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_nan_and_inf_propagate_as_in_eager(policy):
    """NaN, +Inf and -Inf in the residual, the branch and a gate row reach ``u`` and ``y`` where eager's
    graph puts them (the finite values follow the policy)."""
    inputs = make_inputs("B", 64, 5376)
    inputs["residual"][1, 3], inputs["residual"][2, 5] = float("nan"), float("inf")
    inputs["branch"][3, 0], inputs["branch"][4, 7] = -float("inf"), float("inf")
    inputs["gate"][inputs["index"][5], 9] = float("inf")
    inputs["branch"][5, 9] = 0.0  # inf * 0: NaN
    got, ref = fused_site("B", policy)(**inputs), eager_site("B")(**inputs)
    assert got[0].isnan().any() and got[0].isinf().any() and got[1].isnan().any()  # the norm turns Inf into NaN
    for g, r in zip(got, ref):
        assert torch.equal(g.isnan(), r.isnan()) and torch.equal(g.isinf(), r.isinf())
        assert torch.equal(g[g.isinf()], r[r.isinf()])


@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_in_compiled_graph_obeys_the_policy(site):
    """Each site's op inlined in a compiled graph gives the bare op's outputs, bit for bit, and eager's to
    the policy (where Inductor's analysis of the kernel fails it assumes every input written, and site A's
    ``y`` came out wrong in an earlier draft)."""
    inputs = make_inputs(site, 15808)
    got = torch.compile(fused_site(site, "bf16"))(**inputs)
    bare = fused_site(site, "bf16")(**inputs)
    assert all(map(torch.equal, got if site == "B" else [got], bare if site == "B" else [bare]))
    _assert_bf16_policy_matches_eager(site, got, eager_site(site)(**inputs))


@pytest.mark.parametrize("compiled", [False, True], ids=["bare", "in_compiled_graph"])
def test_out_of_range_index_traps_with_a_message(compiled):
    """Bare, the kernel is built with ``debug=True``; inlined by Inductor, its launcher compiles user
    kernels with ``debug = assert_indirect_indexing`` (default on): both keep the device assertion."""
    call = "torch.compile(fused_site('A', 'bf16'))" if compiled else "fused_site('A', 'bf16')"
    code = (
        "import torch; from h3_fused.kernels.testing import make_inputs, fused_site\n"
        "inp = make_inputs('A', 64); inp['index'][17] = 6\n"
        f"{call}(**inp); torch.cuda.synchronize()\n"
    )
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode != 0
    assert "index out of range" in proc.stdout + proc.stderr


@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_direct_calls_of_a_layout_launch_the_kernel_its_first_call_compiled(site):
    """A layout's first direct call launches through Triton's ``JITFunction.run`` and keeps the kernel it
    compiled; later calls launch that kernel (``launch.CompiledLaunch``): on new values, on a side stream, and
    interleaved with a view 2 bytes off 16-byte alignment (another layout: Triton specialises a pointer on its
    alignment), each gives the dispatched op's outputs."""
    from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate

    public = {"A": norm_modulate, "B": gate_norm_modulate, "C": gate_residual}[site]
    public.launches.clear()
    op, dispatched = fused_site(site, "bf16"), fused_site(site, "bf16", dispatcher=True)
    lead = "x" if site == "A" else "residual"

    def off_alignment(inputs):  # the same values, the activations one bf16 element past an aligned start
        wide = torch.empty(inputs[lead].numel() + 1, dtype=inputs[lead].dtype, device="cuda")
        shifted = wide[1:].view_as(inputs[lead]).copy_(inputs[lead])
        assert shifted.data_ptr() % 16 == 2
        return {**inputs, lead: shifted}

    def same(got, want):
        return all(torch.equal(g, w) for g, w in zip(got if isinstance(got, tuple) else (got,),
                                                     want if isinstance(want, tuple) else (want,)))

    op(**make_inputs(site, 3072, seed=1))
    (launch,) = public.launches.values()
    assert launch is not None and launch.compiled is not None
    side = torch.cuda.Stream()
    for seed in (2, 3):
        inputs = make_inputs(site, 3072, seed=seed)
        shifted = off_alignment(inputs)
        assert same(op(**inputs), dispatched(**inputs))
        assert same(op(**shifted), dispatched(**shifted))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got = op(**inputs)
        torch.cuda.current_stream().wait_stream(side)
        assert same(got, dispatched(**inputs))
    assert len(public.launches) == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dispatcher", [False, True], ids=["direct", "dispatched"])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_tensors_on_another_device_than_the_current_one(site, dispatcher):
    """Triton launches on the current device: the op must launch where its tensors are, whether the public
    function runs its body directly or the call goes through the dispatcher."""
    inputs = make_inputs(site, 1024, seed=1, device="cuda:1")
    expected = eager_site(site)(**inputs)
    assert torch.cuda.current_device() == 0
    got = fused_site(site, "bf16", dispatcher=dispatcher)(**inputs)
    torch.cuda.synchronize("cuda:1")
    _assert_bf16_policy_matches_eager(site, got, expected)


def test_opcheck_on_cuda():
    inputs = make_inputs("B", 33, 320)
    a = make_inputs("A", 33, 320)
    c = make_inputs("C", 33, 320)
    torch.library.opcheck(torch.ops.h3_fused.gate_norm_modulate.default,
                          tuple(inputs[k] for k in ("residual", "gate", "branch", "weight", "shift", "scale",
                                                    "index")), dict(eps=1e-5, policy="bf16"))
    torch.library.opcheck(torch.ops.h3_fused.norm_modulate.default,
                          tuple(a[k] for k in ("x", "weight", "shift", "scale", "index")),
                          dict(eps=1e-5, policy="fp32"))
    torch.library.opcheck(torch.ops.h3_fused.gate_residual.default,
                          tuple(c[k] for k in ("residual", "gate", "branch", "index")), dict(policy="bf16"))


@pytest.mark.large_memory
def test_64_bit_offsets_past_2_to_the_31_elements():
    tokens = (2**31) // 5376 + 64  # T x H >= 2^31 elements per activation tensor
    inputs = make_inputs("C", tokens)
    ref = eager_site("C")(**inputs)
    got = fused_site("C", "bf16")(**inputs)
    assert torch.equal(got[-128:], ref[-128:]) and torch.equal(got, ref)


@pytest.mark.parametrize("site, threshold", [("A", "FEWEST_ROWS"), ("B", "FEW_ROWS")])
def test_dynamic_shapes_compile_once_across_the_few_rows_threshold(site, threshold):
    """Compiled for dynamic shapes, the row count is symbolic: the launch configuration must not guard on
    it, so row counts on both sides of the site's bound (A: ``FEWEST_ROWS``, B: ``FEW_ROWS``, where it goes
    from 8 warps to 4) run the one compiled graph, exactly."""
    from h3_fused.kernels import launch

    bound = getattr(launch, threshold)
    torch._dynamo.reset()  # the site's function may be cached from a static compile of an earlier test
    compiled = torch.compile(fused_site(site, "bf16"), dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for tokens in (bound // 2, bound + 1):
            inputs = make_inputs(site, tokens, seed=tokens)
            _assert_bf16_policy_matches_eager(site, compiled(**inputs), eager_site(site)(**inputs))


@pytest.mark.parametrize("tokens", [3072, 15808])
@pytest.mark.parametrize("gate_dtype, table_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_gate_table_of_another_dtype_than_shift_and_scale(gate_dtype, table_dtype, tokens):
    """Site B's builds for few and for many rows, with the gate table in another dtype than shift and scale
    (the warming of coming table rows reads the gate row with a load of its own): the residual bit for bit
    the op's reference (pure torch, on the GPU), `y` up to the norm's sum order."""
    from h3_fused.kernels import gate_norm_modulate
    from h3_fused.kernels.arguments import check_args
    from h3_fused.kernels.reference import reference_modulation

    inputs = make_inputs("B", tokens, seed=7)
    inputs["gate"] = inputs["gate"].to(gate_dtype)
    inputs["shift"], inputs["scale"] = inputs["shift"].to(table_dtype), inputs["scale"].to(table_dtype)
    for policy in ("bf16", "fp32"):
        u, y = gate_norm_modulate(**inputs, policy=policy)
        ref_u, ref_y = reference_modulation(check_args(**inputs, policy=policy, has_norm=True))
        assert torch.equal(u, ref_u), policy
        assert _diff(y, ref_y) <= 1e-4, policy
