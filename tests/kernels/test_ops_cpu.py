"""The fused ops on the CPU: the rounding contract against eager sequences, bad input, opcheck, and
the Triton kernel's logic under the interpreter."""

import math

import pytest
import torch
from exact_rounding import assert_fp32_gated_residual_rounds_once, double_rounding_cases, exact_gated_residual
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels.reference import sum_rounded_once
from h3_fused.kernels.testing import eager_gate, eager_modulate, eager_norm
from h3_fused.kernels.testing import site_tensors as make
from hypothesis import given, settings
from hypothesis import strategies as st

bf16, f32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("upcast", [False, True])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("lead", [(33,), (3, 11)])
def test_bf16_policy_is_bit_identical_to_eager(native, upcast, with_weight, index_dtype, lead):
    t = make(lead=lead, index_dtype=index_dtype)
    w = t["weight"] if with_weight else None
    kw = dict(eps=1e-5, policy="bf16", norm_rounds_before_weight=native, upcast_tables=upcast)
    y = norm_modulate(t["x"], w, t["shift"], t["scale"], t["index"], **kw)
    assert torch.equal(y, eager_modulate(eager_norm(t["x"], w, 1e-5, native), t["shift"], t["scale"], t["index"], upcast))
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], w, t["shift"], t["scale"], t["index"], **kw)
    u_ref = eager_gate(t["x"], t["gate"], t["branch"], t["index"], upcast)
    assert torch.equal(u, u_ref)
    assert torch.equal(y, eager_modulate(eager_norm(u_ref, w, 1e-5, native), t["shift"], t["scale"], t["index"], upcast))
    u = gate_residual(t["x"], t["gate"], t["branch"], t["index"], policy="bf16", upcast_tables=upcast)
    assert torch.equal(u, u_ref)


def test_fp32_tables_with_bf16_activations():
    t = make(table_dtype=f32)
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-6, policy="bf16")
    u_ref = eager_gate(t["x"], t["gate"], t["branch"], t["index"], False)
    assert torch.equal(u, u_ref)
    assert torch.equal(y, eager_modulate(eager_norm(u_ref, t["weight"], 1e-6, False), t["shift"], t["scale"],
                                         t["index"], False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_activation_dtypes(dtype):
    t = make(dtype=dtype)
    y = norm_modulate(t["x"], t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16")
    assert y.dtype == dtype
    assert torch.equal(y, eager_modulate(eager_norm(t["x"], t["weight"], 1e-5, False), t["shift"], t["scale"],
                                         t["index"], False))


def test_fp32_policy_rounds_only_where_stored_and_is_closer_to_fp64():
    t = make(tokens=512, hidden=256)
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-5, policy="fp32")
    idx = t["index"]
    assert torch.equal(u, exact_gated_residual(t["x"], t["gate"][idx], t["branch"]))  # the exact sum, rounded once
    ud = u.double()
    n = ud * torch.rsqrt(ud.pow(2).mean(-1, keepdim=True) + 1e-5) * t["weight"].double()
    y64 = n * (1 + t["scale"].double()[idx]) + t["shift"].double()[idx]
    y_eager = eager_modulate(eager_norm(u, t["weight"], 1e-5, False), t["shift"], t["scale"], idx, False)
    assert (y.double() - y64).abs().mean() < (y_eager.double() - y64).abs().mean()


def _any_finite(dtype):
    bits = st.integers(0, 0xFFFF).map(lambda b: torch.tensor([b], dtype=torch.int32).to(torch.int16).view(dtype))
    return bits.filter(lambda v: bool(v.isfinite()))


def _tie_plus_power_of_two(dtype):
    """A product that is a tie of ``dtype`` (``double_rounding_cases``) and a residual of +-2**k, from
    ``dtype``'s smallest subnormal up to 1 (mostly below fp32's last place of the product)."""
    ties = double_rounding_cases(dtype, 256)
    smallest = math.frexp(torch.finfo(dtype).smallest_normal)[1] - 1 - {bf16: 7, torch.float16: 10}[dtype]
    return st.tuples(st.integers(0, 255), st.integers(smallest, 0), st.sampled_from([1.0, -1.0])).map(
        lambda c: (torch.tensor([c[2] * 2.0 ** c[1]], dtype=dtype), ties[1][c[0]:c[0] + 1], ties[2][c[0]:c[0] + 1]))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([bf16, torch.float16]))
def test_sum_rounded_once_is_the_exact_sum_rounded_once(data, dtype):
    """Any finite residual, gate and branch (every bit pattern: subnormals, overflow of the product), and
    ties of ``dtype`` plus a residual that fp32 would round away."""
    anything = st.tuples(_any_finite(dtype), _any_finite(dtype), _any_finite(dtype))
    r, g, b = data.draw(st.one_of(anything, _tie_plus_power_of_two(dtype)))
    assert torch.equal(sum_rounded_once(r, g, b, dtype).to(dtype), exact_gated_residual(r, g, b))


@pytest.mark.parametrize("dtype", [bf16, torch.float16])
def test_fp32_policy_rounds_the_gated_residual_once_where_fp32_would_round_twice(dtype):
    """Products that are ties of the activation dtype plus a residual far below fp32's last place of them."""
    assert_fp32_gated_residual_rounds_once(dtype)


def test_strided_activations_and_tables_are_read_in_place():
    t = make(tokens=20, hidden=64)
    wide = torch.randn(20, 200).to(bf16)
    x = wide[:, 10:74]  # row stride 200, offset 10
    assert x.stride() == (200, 1)
    y = norm_modulate(x, t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16")
    assert torch.equal(y, eager_modulate(eager_norm(x, t["weight"], 1e-5, False), t["shift"], t["scale"], t["index"], False))
    xt = torch.randn(64, 20).to(bf16).t()  # column-strided: copied, still correct
    y = norm_modulate(xt, t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16")
    assert torch.equal(y, eager_modulate(eager_norm(xt, t["weight"], 1e-5, False), t["shift"], t["scale"], t["index"], False))


def test_nan_and_inf_propagate_as_in_eager():
    t = make(tokens=8, hidden=64)
    x = t["x"].clone()
    x[1, 3], x[2, 5], x[3, 0] = float("nan"), float("inf"), -float("inf")
    u, y = gate_norm_modulate(x, t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-5, policy="bf16")
    u_ref = eager_gate(x, t["gate"], t["branch"], t["index"], False)
    y_ref = eager_modulate(eager_norm(u_ref, t["weight"], 1e-5, False), t["shift"], t["scale"], t["index"], False)
    assert torch.equal(u.isnan(), u_ref.isnan()) and torch.equal(y.isnan(), y_ref.isnan())
    assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(y_ref))


def test_empty_inputs_give_empty_outputs():
    t = make(tokens=0, hidden=64)
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-5, policy="bf16")
    assert u.shape == (0, 64) and y.shape == (0, 64)


def test_opcheck_on_cpu():
    t = make(tokens=9, hidden=64)
    ops = torch.ops.h3_fused
    torch.library.opcheck(ops.norm_modulate.default, (t["x"], t["weight"], t["shift"], t["scale"], t["index"]),
                          dict(eps=1e-5, policy="bf16"))
    torch.library.opcheck(ops.gate_norm_modulate.default,
                          (t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"]),
                          dict(eps=1e-5, policy="fp32"))
    torch.library.opcheck(ops.gate_residual.default, (t["x"], t["gate"], t["branch"], t["index"]),
                          dict(policy="bf16"))


@pytest.mark.parametrize("rows", ["given", "gathered"])
def test_opcheck_on_cpu_with_copies_of_the_rows(rows):
    """``shift`` and ``scale`` with a leading dim of copies (a norm modulated twice): given rows ``[2, B, 1, H]``, or
    ``[2, K, H]`` tables with an index; ``y`` ``[2, ...]`` in the fake tensors too, and the autograd formula's
    table gradients of the tables' shape."""
    g = torch.Generator().manual_seed(0)
    x, branch = (torch.randn(2, 5, 64, generator=g).to(bf16) for _ in range(2))
    shapes = ((2, 1), (2, 2, 1), (2, 2, 1)) if rows == "given" else ((3,), (2, 3), (2, 3))
    gate, shift, scale = (torch.randn(*shape, 64, generator=g).to(bf16) for shape in shapes)
    index = None if rows == "given" else torch.randint(0, 3, (2, 5), generator=g)
    ops = torch.ops.h3_fused
    kw = dict(eps=1e-6, policy="bf16", norm="layer")
    torch.library.opcheck(ops.norm_modulate.default, (x, None, shift, scale, index), kw)
    torch.library.opcheck(ops.gate_norm_modulate.default, (x, gate, branch, None, shift, scale, index), kw)


@pytest.mark.parametrize("rows_dtype, bias_dtype", [(bf16, torch.float32), (bf16, bf16)], ids=["wan", "ltx"])
def test_rows_with_biases_are_eagers_sums_and_take_no_gradient(rows_dtype, bias_dtype):
    """Rows per token plus an ``[H]`` bias each, as Wan 2.2 TI2V (an fp32 table plus the bf16 projection upcast) and
    LTX-Video (both bf16: the sum rounds to bf16) sum them: under ``bf16`` the sums given as rows, bit for bit;
    ``opcheck`` (no gradient wanted); a gradient through the biased op is refused by name."""
    g = torch.Generator().manual_seed(0)
    x, branch = (torch.randn(2, 5, 64, generator=g).to(bf16) for _ in range(2))
    temb = (0.3 * torch.randn(2, 5, 6, 64, generator=g)).to(rows_dtype)
    table = (0.3 * torch.randn(6, 64, generator=g)).to(bias_dtype)
    gate, shift, scale = (temb[:, :, k] for k in range(3))
    biases = dict(gate_bias=table[0], shift_bias=table[1], scale_bias=table[2])
    summed = (table + (temb.float() if bias_dtype == torch.float32 else temb))  # the model's sum
    kw = dict(eps=1e-6, policy="bf16", norm="layer", norm_in_fp32=bias_dtype == torch.float32)
    u, y = gate_norm_modulate(x, gate, branch, None, shift, scale, None, **biases, **kw)
    u_ref, y_ref = gate_norm_modulate(x, summed[:, :, 0], branch, None, summed[:, :, 1], summed[:, :, 2], None, **kw)
    assert torch.equal(u, u_ref) and torch.equal(y, y_ref)
    ops = torch.ops.h3_fused
    torch.library.opcheck(ops.gate_norm_modulate.default, (x, gate, branch, None, shift, scale, None, *biases.values()),
                          kw)
    torch.library.opcheck(ops.gate_residual.default, (x, gate, branch, None, table[0]), dict(policy="bf16"))
    with pytest.raises(NotImplementedError, match=r"modulation rows given with biases \(gate_bias\)"):
        ops.gate_residual(x.requires_grad_(), gate, branch, None, table[0], policy="bf16").sum().backward()


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), hidden=st.integers(1, 40).map(lambda h: 8 * h), rows=st.integers(1, 12),
       seed=st.integers(0, 2**16), native=st.booleans(), upcast=st.booleans())
def test_property_bf16_matches_eager(tokens, hidden, rows, seed, native, upcast):
    t = make(tokens=tokens, hidden=hidden, table_rows=rows, seed=seed)
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-5, policy="bf16", norm_rounds_before_weight=native, upcast_tables=upcast)
    u_ref = eager_gate(t["x"], t["gate"], t["branch"], t["index"], upcast)
    assert torch.equal(u, u_ref)
    assert torch.equal(y, eager_modulate(eager_norm(u_ref, t["weight"], 1e-5, native), t["shift"], t["scale"],
                                         t["index"], upcast))
