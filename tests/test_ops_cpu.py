"""The fused ops on the CPU: the rounding contract against eager sequences, bad input, opcheck, and
the Triton kernel's logic under the interpreter."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from exact_rounding import assert_fp32_gated_residual_rounds_once, double_rounding_cases, exact_gated_residual
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels.reference import sum_rounded_once
from helpers import run_interpreted
from hypothesis import given, settings
from hypothesis import strategies as st

bf16, f32 = torch.bfloat16, torch.float32


def make(tokens=33, hidden=96, rows=6, dtype=bf16, table_dtype=None, lead=None, seed=0, index_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    table_dtype = table_dtype or dtype
    shape = (*(lead or (tokens,)), hidden)
    tables = (0.3 * torch.randn(rows, 6 * hidden, generator=g)).to(table_dtype).chunk(6, dim=-1)
    return dict(
        x=torch.randn(shape, generator=g).to(dtype),
        branch=torch.randn(shape, generator=g).to(dtype),
        weight=(1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype),
        shift=tables[0], scale=tables[1], gate=tables[2],
        index=torch.randint(0, rows, shape[:-1], generator=g).to(index_dtype),
    )


def eager_norm(x, weight, eps, native):
    if not native:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    n = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return n * weight if weight is not None else n


def eager_modulate(n, shift, scale, idx, upcast):
    if upcast:
        shift, scale = shift.float(), scale.float()
    return (n * (1.0 + scale[idx.long()]) + shift[idx.long()]).to(n.dtype)


def eager_gate(res, gate, branch, idx, upcast):
    if upcast:
        gate = gate.float()
    return (res + gate[idx.long()] * branch).to(res.dtype)


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


@settings(max_examples=400, deadline=None)
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


BAD = [
    (dict(index=torch.tensor([0, 7])), IndexError, "index out of range"),
    (dict(index=torch.tensor([0, -1])), IndexError, "index out of range"),
    (dict(index=torch.tensor([0.0, 1.0])), TypeError, "index must have dtype"),
    (dict(index=torch.tensor([0, 1, 2])), ValueError, "index must have the shape"),
    (dict(weight=torch.ones(5, dtype=bf16)), ValueError, "weight must have shape"),
    (dict(shift=torch.ones(6, 5, dtype=bf16)), ValueError, r"shift must be a \[K, H=64\] table"),
    (dict(scale=torch.ones(6, 64, dtype=torch.float16)), TypeError, "shift and scale must share a dtype"),
    (dict(x=torch.ones(2, 64, dtype=torch.int32)), TypeError, "x must have dtype"),
    (dict(policy="bf17"), ValueError, "policy must be one of"),
    (dict(eps=-1.0), ValueError, "eps must be a non-negative"),
    (dict(x=torch.ones(2, 64, dtype=bf16, device="meta")), ValueError, "is on cpu but x is on meta"),
]


@pytest.mark.parametrize("override,error,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_names_the_argument(override, error, message):
    t = make(tokens=2, hidden=64)
    args = dict(x=t["x"], weight=t["weight"], shift=t["shift"], scale=t["scale"], index=t["index"], eps=1e-5,
                policy="bf16")
    args.update(override)
    with pytest.raises(error, match=message):
        norm_modulate(args.pop("x"), args.pop("weight"), args.pop("shift"), args.pop("scale"), args.pop("index"),
                      **args)


@pytest.mark.parametrize("name", ["x", "weight", "shift", "scale"])
def test_inputs_that_require_grad_are_refused_where_the_call_is_made(name):
    t = make(tokens=4, hidden=64)
    args = dict(x=t["x"], weight=t["weight"], shift=t["shift"], scale=t["scale"], index=t["index"])
    args[name] = args[name].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match=f"{name} requires grad, but h3_fused::norm_modulate has no backward yet"):
        norm_modulate(**args, eps=1e-5, policy="bf16")
    with torch.no_grad():
        assert torch.equal(norm_modulate(**args, eps=1e-5, policy="bf16"),
                           norm_modulate(**{k: v.detach() for k, v in args.items()}, eps=1e-5, policy="bf16"))


def test_gated_residual_inputs_that_require_grad_are_refused():
    t = make(tokens=4, hidden=64)
    with pytest.raises(NotImplementedError, match="gate requires grad"):
        gate_residual(t["x"], t["gate"].clone().requires_grad_(), t["branch"], t["index"], policy="bf16")
    with pytest.raises(NotImplementedError, match="residual requires grad"):
        gate_norm_modulate(t["x"].clone().requires_grad_(), t["gate"], t["branch"], t["weight"], t["shift"],
                           t["scale"], t["index"], eps=1e-5, policy="bf16")


def test_branch_mismatch_is_refused():
    t = make(tokens=4, hidden=64)
    with pytest.raises(ValueError, match="branch must have the shape of residual"):
        gate_residual(t["x"], t["gate"], t["branch"][:2], t["index"], policy="bf16")
    with pytest.raises(TypeError, match="branch must have the dtype of residual"):
        gate_residual(t["x"], t["gate"], t["branch"].float(), t["index"], policy="bf16")


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


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), hidden=st.integers(1, 40).map(lambda h: 8 * h), rows=st.integers(1, 12),
       seed=st.integers(0, 2**16), native=st.booleans(), upcast=st.booleans())
def test_property_bf16_matches_eager(tokens, hidden, rows, seed, native, upcast):
    t = make(tokens=tokens, hidden=hidden, rows=rows, seed=seed)
    u, y = gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                              eps=1e-5, policy="bf16", norm_rounds_before_weight=native, upcast_tables=upcast)
    u_ref = eager_gate(t["x"], t["gate"], t["branch"], t["index"], upcast)
    assert torch.equal(u, u_ref)
    assert torch.equal(y, eager_modulate(eager_norm(u_ref, t["weight"], 1e-5, native), t["shift"], t["scale"],
                                         t["index"], upcast))


SITE_INPUTS = r"""
import torch


def site_inputs(tokens, hidden):
    # bf16 residual/x, branch and weight, three strided [3, H] table views (shift, scale, gate) and an
    # index whose last row reads the last table row
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    br = torch.randn(tokens, hidden).to(torch.bfloat16)
    w = torch.randn(hidden).to(torch.bfloat16)
    t = (0.3 * torch.randn(3, 6 * hidden)).to(torch.bfloat16).chunk(6, -1)
    idx = torch.randint(0, 3, (tokens,))
    idx[-1] = 2
    return x, br, w, t, idx
"""

INTERPRETED = SITE_INPUTS + r"""
from h3_fused.kernels import gate_norm_modulate, norm_modulate, gate_residual
from h3_fused.kernels.contract import check_args
from h3_fused.kernels.reference import reference_modulation
torch.manual_seed(0)


def same_but_for_sum_order(got, ref):
    # the kernel's fp32 sum of squares has its own order: a last-bit change of rsqrt may flip a rare rounding
    assert (got != ref).float().mean() <= 1e-3
    torch.testing.assert_close(got, ref)


for hidden in (1, 31, 64, 101, 200):
    for tokens in (1, 5, 33):
        for policy in ("bf16", "fp32"):
            for native in (False, True):
                x, br, w, t, idx = site_inputs(tokens, hidden)
                kw = dict(eps=1e-5, policy=policy, norm_rounds_before_weight=native)
                u, y = gate_norm_modulate(x, t[2], br, w, t[0], t[1], idx, **kw)
                a = check_args(residual=x, branch=br, gate=t[2], weight=w, shift=t[0], scale=t[1], index=idx,
                               has_norm=True, **kw)
                ur, yr = reference_modulation(a)
                assert torch.equal(u, ur), (hidden, tokens, policy, native)
                same_but_for_sum_order(y, yr)
                y = norm_modulate(x, None, t[0], t[1], idx, **kw)
                a = check_args(x=x, shift=t[0], scale=t[1], index=idx, has_norm=True, **kw)
                same_but_for_sum_order(y, reference_modulation(a)[1])
                assert torch.equal(gate_residual(x, t[2], br, idx, policy=policy),
                                   reference_modulation(check_args(residual=x, branch=br, gate=t[2], index=idx,
                                                                   policy=policy, has_norm=False))[0])
try:
    norm_modulate(x, None, t[0], t[1], idx + 3, eps=1e-5, policy="bf16")
    raise SystemExit("no error for an out-of-range index")
except IndexError as e:
    assert "index out of range" in str(e)
print("interpreted kernel OK")
"""


def test_triton_kernel_logic_under_the_interpreter():
    """Every site, policy and spelling of the norm at H = 1 and 31 (below the issue's range: 2,048 and 64
    rows per program), 64, 101 and 200, against the reference; an out-of-range index raises."""
    assert "interpreted kernel OK" in run_interpreted(INTERPRETED)


TIES = r"""
import sys
import torch
sys.path.insert(0, TESTS)
from exact_rounding import assert_fp32_gated_residual_rounds_once
for dtype in (torch.bfloat16, torch.float16):
    assert_fp32_gated_residual_rounds_once(dtype)
print("ties OK")
""".replace("TESTS", repr(os.path.dirname(os.path.abspath(__file__))))


def test_fp32_gated_residual_rounds_once_under_the_interpreter():
    """The kernel's interpreted path (TwoSum, round-to-odd) on the ties where fp32 would round twice."""
    assert "ties OK" in run_interpreted(TIES)


CHUNKED = SITE_INPUTS + r"""
import itertools
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels import triton_modulation as tm
from h3_fused.kernels.contract import check_args
from h3_fused.kernels.reference import reference_modulation
torch.manual_seed(1)
# rows read in 32-column chunks: H = 101 is four chunks, the last one 5 columns wide
# (each with its table rows loaded just before their use and ahead of it), with and without a weight
hidden, tokens = 101, 9
for policy, ahead, weighted in itertools.product(("bf16", "fp32"), (False, True), (True, False)):
    tm.launch_config = lambda hidden, has_gate, has_norm, rows: tm.LaunchConfig(1, 32, 1, tables_ahead=ahead)
    x, br, w, t, idx = site_inputs(tokens, hidden)
    w = w if weighted else None
    kw = dict(eps=1e-5, policy=policy)
    u, y = gate_norm_modulate(x, t[2], br, w, t[0], t[1], idx, **kw)
    ur, yr = reference_modulation(check_args(residual=x, branch=br, gate=t[2], weight=w, shift=t[0], scale=t[1],
                                             index=idx, has_norm=True, **kw))
    assert torch.equal(u, ur), policy
    assert (y != yr).float().mean() <= 1e-2, policy  # the chunked sum of squares has its own order
    torch.testing.assert_close(y, yr)
    y = norm_modulate(x, w, t[0], t[1], idx, **kw)
    a = check_args(x=x, weight=w, shift=t[0], scale=t[1], index=idx, has_norm=True, **kw)
    torch.testing.assert_close(y, reference_modulation(a)[1])
    assert torch.equal(gate_residual(x, t[2], br, idx, policy=policy),
                       reference_modulation(check_args(residual=x, branch=br, gate=t[2], index=idx, policy=policy,
                                                       has_norm=False))[0])
print("chunked rows OK")
"""


def test_rows_read_in_chunks_under_the_interpreter():
    """The chunked path (only the last chunk masked) on a small H, forced by a small chunk width, with the
    table rows loaded before their use and ahead of it, with and without a norm weight."""
    assert "chunked rows OK" in run_interpreted(CHUNKED)


MIXED_TABLES = SITE_INPUTS + r"""
from h3_fused.kernels import gate_norm_modulate
from h3_fused.kernels.contract import check_args
from h3_fused.kernels.reference import reference_modulation
torch.manual_seed(4)
# site B whose gate table has another dtype than shift and scale (each program's warming of the coming
# table rows reads the gate row with a load of its own), at H = 64 and 200, both policies
for hidden, tokens in ((64, 70), (200, 33)):
    x, br, w, t, idx = site_inputs(tokens, hidden)
    for gate_dtype, table_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        gate, shift, scale = t[2].to(gate_dtype), t[0].to(table_dtype), t[1].to(table_dtype)
        for policy in ("bf16", "fp32"):
            kw = dict(eps=1e-5, policy=policy)
            u, y = gate_norm_modulate(x, gate, br, w, shift, scale, idx, **kw)
            ur, yr = reference_modulation(check_args(residual=x, branch=br, gate=gate, weight=w, shift=shift,
                                                     scale=scale, index=idx, has_norm=True, **kw))
            assert torch.equal(u, ur), (hidden, gate_dtype, policy)
            assert (y != yr).float().mean() <= 1e-3, (hidden, gate_dtype, policy)
            torch.testing.assert_close(y, yr)
print("mixed tables OK")
"""


def test_gate_table_of_another_dtype_than_shift_and_scale_under_the_interpreter():
    """Site B with an fp32 gate table and bf16 shift and scale tables, and the reverse: the kernel (its
    warming of coming table rows included) compiles and gives the reference's residual bit for bit."""
    assert "mixed tables OK" in run_interpreted(MIXED_TABLES)


WARMED = SITE_INPUTS + r"""
import dataclasses
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels import triton_modulation as tm
shipped = tm.launch_config
torch.manual_seed(2)
# the warming of coming table rows (prefetch_ahead) reads index rows and table sectors ahead of the
# programs that use them: 1, 2 and 7 rows ahead (within and past the last row) against none; and the
# warming programs ahead of the programs of rows (warm_tables) read every table row, with a weight and
# without one, every site
for hidden, tokens in ((64, 70), (101, 9), (200, 33)):
    x, br, w, t, idx = site_inputs(tokens, hidden)
    outputs = {}
    for ahead, warm in ((0, False), (1, False), (2, False), (7, False), (0, True), (1, True)):
        tm.launch_config = lambda h, g, n, rows: dataclasses.replace(shipped(h, g, n, rows), prefetch_ahead=ahead,
                                                                     warm_tables=warm)
        for policy in ("bf16", "fp32"):
            kw = dict(eps=1e-5, policy=policy)
            outputs[ahead, warm, policy] = (gate_norm_modulate(x, t[2], br, w, t[0], t[1], idx, **kw),
                                            norm_modulate(x, w, t[0], t[1], idx, **kw),
                                            norm_modulate(x, None, t[0], t[1], idx, **kw),
                                            gate_residual(x, t[2], br, idx, policy=policy))
    for (ahead, warm, policy), got in outputs.items():
        (u, y), *rest = got
        (u0, y0), *rest0 = outputs[0, False, policy]
        assert torch.equal(u, u0) and torch.equal(y, y0) and all(map(torch.equal, rest, rest0)), (
            hidden, tokens, ahead, warm, policy)
print("warmed rows OK")
"""


def test_warming_coming_table_rows_changes_no_result_under_the_interpreter():
    """``LaunchConfig.prefetch_ahead``: the kernel's reads of coming index rows and table sectors, from
    one row ahead to past the last row (the small-H builds have 64 lanes: every fourth program warms the
    lines of four), and ``warm_tables``, its warming programs, leave every output of every site and policy
    bit-identical to the build without them."""
    assert "warmed rows OK" in run_interpreted(WARMED)


def test_launch_config_gives_the_normed_sites_more_warps_only_for_few_known_rows():
    """Site A runs on 8 warps up to ``FEWEST_ROWS`` rows, site B up to ``FEW_ROWS``, and both on 4
    beyond, or where the count is symbolic (``None``: chosen without a guard on it); site C always on 8."""
    from h3_fused.kernels.triton_modulation import FEW_ROWS, FEWEST_ROWS, launch_config

    counts = (1, FEWEST_ROWS, FEWEST_ROWS + 1, FEW_ROWS, FEW_ROWS + 1, None)
    wide, narrow = (1, 2048, 8), (1, 1024, 4)
    site_a = [launch_config(5376, False, True, rows) for rows in counts]
    assert [(c.block_t, c.chunk, c.num_warps) for c in site_a] == [wide] * 2 + [narrow] * 4
    site_b = [launch_config(5376, True, True, rows) for rows in counts]
    assert [(c.block_t, c.chunk, c.num_warps) for c in site_b] == [wide] * 4 + [narrow] * 2
    site_c = [launch_config(5376, True, False, rows) for rows in counts]
    assert {(c.block_t, c.chunk, c.num_warps) for c in site_c} == {wide}


@settings(max_examples=300, deadline=None)
@given(hidden=st.integers(1, 16384), site=st.sampled_from([(False, True), (True, True), (True, False)]),
       rows=st.none() | st.integers(1, 100_000))
def test_launch_config_never_runs_on_fewer_than_min_warps(hidden, site, rows):
    """At every H, site and row count a program has ``MIN_WARPS`` to 16 warps, each thread holding 8
    elements of every chunk (16 at H = 1, whose 2,048 rows per program are one column each), in chunks no
    wider than the row padded to a power of two; one row per program where that padding is 2,048 or more.
    The warming loads (``lanes``) have one lane per thread (two at H = 1)."""
    from h3_fused.kernels.triton_modulation import MIN_WARPS, launch_config

    c = launch_config(hidden, *site, rows)
    assert MIN_WARPS == 4 <= c.num_warps <= 16
    assert c.block_t * c.chunk == 32 * c.num_warps * (16 if hidden == 1 else 8)
    assert c.lanes == 32 * c.num_warps * (2 if hidden == 1 else 1)
    assert c.chunk <= 1 << (hidden - 1).bit_length()
    assert (c.block_t == 1) == (hidden > 1024)


@pytest.mark.parametrize("hidden", [2048, 2049, 5376])
def test_launch_config_loads_table_rows_ahead_for_site_b_and_site_a_but_many_narrow_rows(hidden):
    """Site B always loads its table rows ahead; site A too, except at H up to ``SITE_A_NARROW_H`` beyond
    ``SITE_A_FEW_ROWS`` rows or where the count is symbolic; site C has no table rows of a norm; every
    build warms the coming table rows 1,024 rows ahead, and site A's also every table row as it starts."""
    from h3_fused.kernels.triton_modulation import FEWEST_ROWS, SITE_A_FEW_ROWS, SITE_A_NARROW_H, launch_config

    counts = (1, FEWEST_ROWS, FEWEST_ROWS + 1, SITE_A_FEW_ROWS, SITE_A_FEW_ROWS + 1, None)
    ahead = {(gated, normed): [launch_config(hidden, gated, normed, rows).tables_ahead for rows in counts]
             for gated, normed in ((False, True), (True, True), (True, False))}
    site_a = [True] * 4 + [hidden > SITE_A_NARROW_H] * 2
    assert ahead == {(False, True): site_a, (True, True): [True] * 6, (True, False): [False] * 6}
    assert {launch_config(hidden, g, n, rows).prefetch_ahead for g, n in ahead for rows in counts} == {1024}
    warm = {(g, n): {launch_config(hidden, g, n, rows).warm_tables for rows in counts} for g, n in ahead}
    assert warm == {(False, True): {True}, (True, True): {False}, (True, False): {False}}


@pytest.mark.parametrize("gate_dtype, table_dtype", [(bf16, bf16), (f32, bf16), (bf16, f32)])
def test_warming_programs_cover_every_table_row_and_the_weight(gate_dtype, table_dtype):
    """``warming_programs``: enough programs of ``lanes`` 32-byte sectors for every row of each table the
    site reads, in its own dtype, and the (bf16) weight; none for tables over ``WARM_TABLES_MAX_BYTES``."""
    from h3_fused.kernels.contract import check_args
    from h3_fused.kernels.triton_modulation import WARM_TABLES_MAX_BYTES, warming_programs

    t = make(tokens=4, hidden=5376, rows=6, table_dtype=table_dtype)
    gate = t["gate"].to(gate_dtype)
    row_sectors = {bf16: 5376 * 2 // 32, f32: 5376 * 4 // 32}
    a = check_args(x=t["x"], weight=t["weight"], shift=t["shift"], scale=t["scale"], index=t["index"], eps=1e-5,
                   policy="bf16", has_norm=True)
    assert warming_programs(a, 128) == math.ceil((2 * 6 * row_sectors[table_dtype] + row_sectors[bf16]) / 128)
    b = check_args(residual=t["x"], gate=gate, branch=t["branch"], weight=t["weight"], shift=t["shift"],
                   scale=t["scale"], index=t["index"], eps=1e-5, policy="bf16", has_norm=True)
    sectors = 6 * (2 * row_sectors[table_dtype] + row_sectors[gate_dtype]) + row_sectors[bf16]
    assert warming_programs(b, 256) == math.ceil(sectors / 256)
    c = check_args(residual=t["x"], gate=gate, branch=t["branch"], index=t["index"], policy="bf16", has_norm=False)
    assert warming_programs(c, 256) == math.ceil(6 * row_sectors[gate_dtype] / 256)
    big = make(tokens=4, hidden=8192, rows=1 + WARM_TABLES_MAX_BYTES // (2 * 8192 * 2))
    a = check_args(x=big["x"], shift=big["shift"], scale=big["scale"], index=big["index"], eps=1e-5,
                   policy="bf16", has_norm=True)
    assert warming_programs(a, 128) == 0
