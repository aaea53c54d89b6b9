"""The Triton kernels' logic on CPU tensors, under Triton's interpreter.

Run by a second pytest call, ``TRITON_INTERPRET=1 pytest -m interpreted`` (the variable must be set
before Triton is imported; ``tests/conftest.py`` skips these tests in any other session). The interpreter
truncates conversions to bf16, so the kernels round on the bits there (``INTERPRETED``): results are held to
the pure-torch reference, bit for bit where the order of an fp32 sum does not enter.
"""

import dataclasses
import functools
import itertools

import pytest
import torch
import triton
import triton.language as tl
from exact_rounding import assert_fp32_gated_residual_rounds_once
from h3_fused.kernels import gate_norm_modulate, gate_residual, launch, norm_modulate
from h3_fused.kernels.arguments import check_args
from h3_fused.kernels.contract import SumOrder
from h3_fused.kernels.forward_kernel import (
    EAGER_THREADS,
    FUSED_RMS_NORM_ORDER,
    _add_as_fused_layer_norm,
    _add_squares_as_fused_rms_norm,
    _add_squares_as_mean,
    _eager_norm_mean,
    _eager_welford_total,
)
from h3_fused.kernels.reference import reference_modulation

pytestmark = pytest.mark.interpreted
bf16 = torch.bfloat16


def site_inputs(tokens, hidden, seed=0):
    """bf16 residual/x, branch and weight, three strided [3, H] table views (shift, scale, gate) and an index
    whose last row reads the last table row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(bf16)
    branch = torch.randn(tokens, hidden, generator=g).to(bf16)
    w = torch.randn(hidden, generator=g).to(bf16)
    tables = (0.3 * torch.randn(3, 6 * hidden, generator=g)).to(bf16).chunk(6, -1)
    idx = torch.randint(0, 3, (tokens,), generator=g)
    idx[-1] = 2
    return x, branch, w, tables, idx


def reference(**kwargs):
    return reference_modulation(check_args(**kwargs, has_norm=kwargs.get("scale") is not None))


def same_but_for_sum_order(got, ref, share=1e-3):
    """The kernel's fp32 sum of squares has its own order: a last-bit change of rsqrt may flip a rare rounding."""
    assert (got != ref).float().mean() <= share
    torch.testing.assert_close(got, ref)


def launched(config=None, **kwargs):
    """``(u, y)`` of the forward kernel launched directly with ``config`` (default: the shipped one)."""
    a = check_args(**kwargs, has_norm=kwargs.get("scale") is not None)
    u, y = (torch.empty(a.out_shape, dtype=a.dtype) if wanted else None
            for wanted in (a.gate is not None, a.scale is not None))
    launch.launch_modulation(a, u, y, lambda kernel: kernel, config)
    return u, y


@pytest.mark.parametrize("hidden", [4, 64, 101, 128, 200])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("native", [False, True])
def test_a_plain_rms_norm_matches_its_spelling(hidden, weighted, native):
    """Site A without tables or index (what ``eager_rms_norm`` launches on CUDA): ``R(norm(x))`` with one
    rounding or, native, two; held to the spelling's eager ops on the CPU (whose sum has its own order)."""
    x, _, w, _, _ = site_inputs(40, hidden)
    weight = w if weighted else None
    a = check_args(x=x, weight=weight, eps=1e-5, policy="bf16", norm_rounds_before_weight=native, has_norm=True)
    y = torch.empty(a.out_shape, dtype=a.dtype)
    launch.launch_modulation(a, None, y, lambda kernel: kernel)
    same_but_for_sum_order(y, torch.ops.h3_fused.eager_kernels_rms_norm(x, weight, 1e-5, native))


@pytest.mark.parametrize("hidden", [4, 64, 101, 128, 200])
@pytest.mark.parametrize("native", [False, True])
def test_a_plain_rms_norm_stores_its_statistics_alone(hidden, native):
    """``stores_rstd`` (what ``eager_rms_norm_rstd`` launches on CUDA): each row's ``r`` in fp32, nothing else
    written; held to the spelling's eager ops on the CPU (whose sum has its own order), and the norm applied
    from it as the pass applies it, ``R(x32 * r)``, to the kernel's own norm."""
    x, _, _, _, _ = site_inputs(40, hidden)
    a = check_args(x=x, eps=1e-5, policy="bf16", norm_rounds_before_weight=native, has_norm=True, stores_rstd=True)
    r = torch.full((40, 1), float("nan"))
    launch.launch_modulation(a, None, r, lambda kernel: kernel)
    torch.testing.assert_close(r, torch.ops.h3_fused.eager_kernels_rms_norm_rstd(x, 1e-5, native), rtol=2e-7, atol=0)
    plain = check_args(x=x, eps=1e-5, policy="bf16", norm_rounds_before_weight=native, has_norm=True)
    y = torch.empty(plain.out_shape, dtype=plain.dtype)
    launch.launch_modulation(plain, None, y, lambda kernel: kernel)
    assert torch.equal((x.float() * r).to(bf16), y)


def test_only_a_plain_rms_norm_without_weight_stores_its_statistics():
    x, _, w, t, idx = site_inputs(4, 8)
    for kwargs in (dict(weight=w), dict(shift=t[0], scale=t[1], index=idx), dict(norm="layer")):
        with pytest.raises(ValueError, match="stores_rstd"):
            check_args(x=x, eps=1e-5, policy="bf16", has_norm=True, stores_rstd=True, **kwargs)


@pytest.mark.parametrize("hidden", [1, 31, 64, 101, 200])
@pytest.mark.parametrize("tokens", [1, 33])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("native", [False, True])
def test_every_site_policy_and_norm_spelling_matches_the_reference(hidden, tokens, policy, native):
    """At H = 1 and 31 (2,048 and 64 rows per program), 64, 101 and 200."""
    x, br, w, t, idx = site_inputs(tokens, hidden)
    kw = dict(eps=1e-5, policy=policy, norm_rounds_before_weight=native)
    u, y = gate_norm_modulate(x, t[2], br, w, t[0], t[1], idx, **kw)
    ur, yr = reference(residual=x, branch=br, gate=t[2], weight=w, shift=t[0], scale=t[1], index=idx, **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr)
    same_but_for_sum_order(norm_modulate(x, None, t[0], t[1], idx, **kw),
                           reference(x=x, shift=t[0], scale=t[1], index=idx, **kw)[1])
    assert torch.equal(gate_residual(x, t[2], br, idx, policy=policy),
                       reference(residual=x, branch=br, gate=t[2], index=idx, policy=policy)[0])


def given_rows(source: str, batch: int, tokens: int, hidden: int, dtype=bf16, seed=0):
    """``(shift, scale, gate)`` rows given without an index for activations ``[batch, tokens, H]``: one per
    sample as ``[B, 1, H]`` chunks of one projection, as ``[B, H]`` chunks viewed ``[:, None]``, one per token as
    ``[B, T, H]`` chunks, or one for all as ``[H]``."""
    g = torch.Generator().manual_seed(seed)
    if source == "per_token":
        return (0.3 * torch.randn(batch, tokens, 6 * hidden, generator=g)).to(dtype).chunk(6, -1)[:3]
    if source == "one_for_all":
        return (0.3 * torch.randn(6 * hidden, generator=g)).to(dtype).chunk(6, -1)[:3]
    rows = (0.3 * torch.randn(batch, 6 * hidden, generator=g)).to(dtype).chunk(6, -1)[:3]
    return tuple(r[:, None] for r in rows) if source == "per_sample_view" else tuple(r.unsqueeze(1).contiguous()
                                                                                      for r in rows)


@pytest.mark.parametrize("source", ["per_sample", "per_sample_view", "per_token", "one_for_all"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("in_fp32", [False, True], ids=["norm_in_act", "norm_in_fp32"])
def test_rows_given_without_an_index_match_the_reference(source, norm, policy, in_fp32):
    """The DiT family's forms: modulation rows per sample, per token or one for all instead of a gathered table,
    a LayerNorm or an RMSNorm, and (with fp32 rows) the norm and affine in fp32 rounded once: every site's
    kernel against the pure-torch reference, the residual exactly, ``y`` but for the norm's sum order."""
    batch, tokens, hidden = 2, 9, 96
    g = torch.Generator().manual_seed(1)
    x, br = (torch.randn(batch, tokens, hidden, generator=g).to(bf16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(bf16)
    shift, scale, gate = given_rows(source, batch, tokens, hidden, torch.float32 if in_fp32 else bf16)
    kw = dict(eps=1e-6, policy=policy, norm=norm, norm_in_fp32=in_fp32)
    u, y = gate_norm_modulate(x, gate, br, w, shift, scale, None, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, weight=w, shift=shift, scale=scale, **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr)
    same_but_for_sum_order(norm_modulate(x, None, shift, scale, None, **kw),
                           reference(x=x, shift=shift, scale=scale, **kw)[1])
    assert torch.equal(gate_residual(x, gate, br, None, policy=policy),
                       reference(residual=x, branch=br, gate=gate, policy=policy)[0])


@pytest.mark.parametrize("rows_dtype, bias_dtype", [(bf16, torch.float32), (bf16, bf16), (torch.float16, bf16)],
                         ids=["wan_fp32_sum", "ltx_bf16_sum", "mixed_fp32_sum"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_rows_given_with_biases_match_the_reference(rows_dtype, bias_dtype, norm, policy):
    """Rows per token plus an ``[H]`` row each (Wan 2.2 TI2V's ``scale_shift_table + temb``, fp32; LTX-Video's,
    bf16, whose sum rounds to bf16 under ``bf16``): every site's kernel against the reference, which adds them as
    the graph does (and so against the sums given as rows)."""
    batch, tokens, hidden = 2, 9, 96
    g = torch.Generator().manual_seed(3)
    x, br = (torch.randn(batch, tokens, hidden, generator=g).to(bf16) for _ in range(2))
    shift, scale, gate = given_rows("per_token", batch, tokens, hidden, rows_dtype)
    bias = (0.3 * torch.randn(3, hidden, generator=g)).to(bias_dtype)
    in_fp32 = torch.promote_types(rows_dtype, bias_dtype) == torch.float32
    kw = dict(eps=1e-6, policy=policy, norm=norm, norm_in_fp32=in_fp32)
    biases = dict(shift_bias=bias[0], scale_bias=bias[1])
    u, y = gate_norm_modulate(x, gate, br, None, shift, scale, None, gate_bias=bias[2], **biases, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, shift=shift, scale=scale, gate_bias=bias[2], **biases, **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr)
    if policy == "bf16":  # the sums as the graph computes them, given as rows: the same bits
        summed = {name: rows + b for name, rows, b in (("shift", shift, bias[0]), ("scale", scale, bias[1]))}
        same_but_for_sum_order(y, reference(residual=x, branch=br, gate=gate + bias[2], **summed, **kw)[1])
    same_but_for_sum_order(norm_modulate(x, None, shift, scale, None, **biases, **kw),
                           reference(x=x, shift=shift, scale=scale, **biases, **kw)[1])
    assert torch.equal(gate_residual(x, gate, br, None, bias[2], policy=policy),
                       reference(residual=x, branch=br, gate=gate, gate_bias=bias[2], policy=policy)[0])


@pytest.mark.parametrize("source", ["per_sample_view", "per_token", "one_for_all"])
@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_a_norm_modulated_by_copies_of_its_rows_matches_the_reference(source, norm, policy):
    """Rows with a leading dim of copies (SD3.5 modulates one norm twice; three copies here): ``y`` is
    ``[M, ...]``, copy ``j`` the one norm modulated by rows ``j``, as torch broadcasts the rows; at sites A and B,
    against the reference and against the op called once per copy."""
    batch, tokens, hidden = 2, 9, 96
    g = torch.Generator().manual_seed(2)
    x, br = (torch.randn(batch, tokens, hidden, generator=g).to(bf16) for _ in range(2))
    copies = [given_rows(source, batch, tokens, hidden, seed=seed) for seed in range(3)]
    shift, scale = (torch.stack([rows[k].view(-1, 1, hidden) if source == "one_for_all" else rows[k]
                                 for rows in copies]) for k in (0, 1))  # one for all: [M, 1, 1, H]
    gate = copies[0][2]
    kw = dict(eps=1e-6, policy=policy, norm=norm)
    y = norm_modulate(x, None, shift, scale, None, **kw)
    assert y.shape == (3, batch, tokens, hidden)
    same_but_for_sum_order(y, reference(x=x, shift=shift, scale=scale, **kw)[1])
    u, y = gate_norm_modulate(x, gate, br, None, shift, scale, None, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, shift=shift, scale=scale, **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr)
    for j, (s, c, _) in enumerate(copies):  # the same bits as one call per copy: the norm computed once
        assert torch.equal(y[j], gate_norm_modulate(x, gate, br, None, s, c, None, **kw)[1])


@pytest.mark.parametrize("norm, policy", [("layer", "bf16"), ("rms", "fp32")])
def test_copies_of_tables_gathered_by_an_index_match_the_reference(norm, policy):
    """``shift`` and ``scale`` as ``[M, K, H]`` tables with an index (M = 3): copy ``j``'s ``y`` the one norm modulated
    by table ``j``'s rows, as the reference and as the op called once per copy."""
    g = torch.Generator().manual_seed(5)
    x, br = (torch.randn(2, 7, 96, generator=g).to(bf16) for _ in range(2))
    gate = torch.randn(4, 96, generator=g).to(bf16)
    shift, scale = (0.3 * torch.randn(3, 4, 96, generator=g).to(bf16) for _ in range(2))
    index = torch.randint(0, 4, (2, 7), generator=g)
    kw = dict(eps=1e-6, policy=policy, norm=norm)
    u, y = gate_norm_modulate(x, gate, br, None, shift, scale, index, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, shift=shift, scale=scale, index=index, **kw)
    assert y.shape == (3, 2, 7, 96) and torch.equal(u, ur)
    same_but_for_sum_order(y, yr)
    for j in range(3):
        assert torch.equal(y[j], gate_norm_modulate(x, gate, br, None, shift[j], scale[j], index, **kw)[1])


@pytest.mark.parametrize("batch, tokens, hidden, dtype", [(1, 1, 100, bf16), (3, 5, 98, torch.float16),
                                                         (2, 7, 36, torch.float32)],
                         ids=["one_token_H100", "fp16_H98", "fp32_H36"])
@pytest.mark.parametrize("source", ["per_sample_view", "per_token"])
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_given_rows_at_odd_shapes_match_the_reference(batch, tokens, hidden, dtype, source, norm):
    """Given rows at the shapes a DiT can hand the kernel beside the usual: one token, a width that is no multiple
    of the vector width (the last chunk masked; H = 98 and 100 not multiples of 8, 98 not of 4: the kernel's own
    sum order), fp16 and fp32 activations with rows of their dtype."""
    g = torch.Generator().manual_seed(hidden)
    x, br = (torch.randn(batch, tokens, hidden, generator=g).to(dtype) for _ in range(2))
    shift, scale, gate = given_rows(source, batch, tokens, hidden, dtype)
    kw = dict(eps=1e-6, policy="bf16", norm=norm)
    u, y = gate_norm_modulate(x, gate, br, None, shift, scale, None, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, shift=shift, scale=scale, **kw)
    assert torch.equal(u, ur)
    assert y.shape == x.shape and y.dtype == dtype
    if dtype == torch.float32:  # no rounding to hide the sums' order: fp32's last places
        torch.testing.assert_close(y, yr)
    else:
        same_but_for_sum_order(y, yr, share=0.05)  # a last place on a few of the few hundred elements


def test_an_out_of_range_index_raises_naming_the_row():
    x, _, _, t, idx = site_inputs(5, 64)
    with pytest.raises(IndexError, match=r"index\[0\] = 3 is not in \[0, 3\)"):
        norm_modulate(x, None, t[0], t[1], idx + 3, eps=1e-5, policy="bf16")


def test_an_index_of_another_layout_is_read_as_its_rows():
    """An index view with a stride of 2 (every other entry of a longer index) reads the entries it shows."""
    x, br, w, t, _ = site_inputs(7, 64)
    idx = torch.randint(0, 3, (14,), generator=torch.Generator().manual_seed(3))
    strided, dense = idx[::2], idx[::2].contiguous()
    assert strided.stride() == (2,)
    kw = dict(eps=1e-5, policy="bf16")
    assert torch.equal(norm_modulate(x, w, t[0], t[1], strided, **kw), norm_modulate(x, w, t[0], t[1], dense, **kw))
    for got, expected in zip(gate_norm_modulate(x, t[2], br, w, t[0], t[1], strided, **kw),
                             gate_norm_modulate(x, t[2], br, w, t[0], t[1], dense, **kw)):
        assert torch.equal(got, expected)
    assert torch.equal(gate_residual(x, t[2], br, strided), gate_residual(x, t[2], br, dense))


@pytest.mark.parametrize("dtype", [bf16, torch.float16])
def test_fp32_gated_residual_rounds_once(dtype):
    """The kernel's interpreted path (TwoSum, round-to-odd) on the ties where fp32 would round twice."""
    assert_fp32_gated_residual_rounds_once(dtype)


@pytest.mark.parametrize("policy, preload, weighted", list(itertools.product(("bf16", "fp32"), (False, True), (True, False))))
def test_rows_read_in_chunks(policy, preload, weighted):
    """Rows read in 32-column chunks (H = 101: four chunks, the last one 5 columns wide), the table chunks
    loaded just before their use and one chunk early, with and without a weight."""
    config = launch.LaunchConfig(1, 32, 1, preload_table_chunks=preload)
    x, br, w, t, idx = site_inputs(9, 101, seed=1)
    kw = dict(weight=w if weighted else None, shift=t[0], scale=t[1], index=idx, eps=1e-5, policy=policy)
    u, y = launched(config, residual=x, branch=br, gate=t[2], **kw)
    ur, yr = reference(residual=x, branch=br, gate=t[2], **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr, share=1e-2)
    torch.testing.assert_close(launched(config, x=x, **kw)[1], reference(x=x, **kw)[1])
    gated = dict(residual=x, branch=br, gate=t[2], index=idx, policy=policy)
    assert torch.equal(launched(config, **gated)[0], reference(**gated)[0])


@pytest.mark.parametrize("hidden, tokens", [(64, 70), (200, 33)])
@pytest.mark.parametrize("gate_dtype, table_dtype", [(torch.float32, bf16), (bf16, torch.float32)])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_gate_table_of_another_dtype_than_shift_and_scale(hidden, tokens, gate_dtype, table_dtype, policy):
    """Site B whose gate table has another dtype than shift and scale (the warming of coming table rows reads
    the gate row with a load of its own): the reference's residual bit for bit."""
    x, br, w, t, idx = site_inputs(tokens, hidden, seed=4)
    gate, shift, scale = t[2].to(gate_dtype), t[0].to(table_dtype), t[1].to(table_dtype)
    kw = dict(eps=1e-5, policy=policy)
    u, y = gate_norm_modulate(x, gate, br, w, shift, scale, idx, **kw)
    ur, yr = reference(residual=x, branch=br, gate=gate, weight=w, shift=shift, scale=scale, index=idx, **kw)
    assert torch.equal(u, ur)
    same_but_for_sum_order(y, yr)


@pytest.mark.parametrize("hidden, tokens", [(64, 70), (101, 9), (200, 17)])
def test_warming_table_rows_changes_no_result(hidden, tokens):
    """``warm_rows_ahead`` 1, 2 and 7 rows (within and past the last row; the small-H builds have 64 lanes, so
    every fourth program warms the lines of four) and ``warm_tables_first`` leave every output of every site
    and policy bit-identical to the build without them, the native spelling's too (at H = 200 and 33 rows in
    the mean's order, on 2 warps, from 16 rows)."""
    x, br, w, t, idx = site_inputs(tokens, hidden, seed=2)
    sites = dict(B=dict(residual=x, branch=br, gate=t[2], weight=w, shift=t[0], scale=t[1], index=idx, eps=1e-5),
                 A=dict(x=x, weight=w, shift=t[0], scale=t[1], index=idx, eps=1e-5),
                 A_unweighted=dict(x=x, shift=t[0], scale=t[1], index=idx, eps=1e-5),
                 C=dict(residual=x, branch=br, gate=t[2], index=idx))
    sites |= {f"{name}_native": dict(sites[name], norm_rounds_before_weight=True) for name in ("A", "B")}
    for (name, kwargs), policy in itertools.product(sites.items(), ("bf16", "fp32")):
        a = check_args(**kwargs, policy=policy, has_norm="scale" in kwargs)
        shipped = launch.launch_config(a.hidden, a.gate is not None, a.scale is not None, a.rows,
                                       launch.norm_sum_order(a.rounding, a.hidden, a.scale is not None, a.rows))
        plain = launched(dataclasses.replace(shipped, warm_rows_ahead=0, warm_tables_first=False), **kwargs,
                         policy=policy)
        for ahead, first in ((1, False), (2, False), (7, False), (0, True), (1, True)):
            config = dataclasses.replace(shipped, warm_rows_ahead=ahead, warm_tables_first=first)
            got = launched(config, **kwargs, policy=policy)
            assert all(g is None or torch.equal(g, p) for g, p in zip(got, plain)), (name, policy, ahead, first)


def eager_fused_rms_norm_mean(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (``[T, H]``, H a multiple of 4), ``mean(x*x)`` in fp32 as torch's fused RMSNorm CUDA
    kernel computes it, one fp32 add at a time: thread ``t`` of 128 adds the squares of its vectors
    ``t, t + 128, ...`` of 4, in order; a shuffle-down tree over each warp's 32 threads; warp 0 + 2 and 1 + 3,
    then the two; divided by H. (The squares of bf16 values are exact in fp32: FMA or not is the same.)"""
    rows, hidden = x.shape
    vectors = torch.zeros(rows, -(-hidden // 512) * 128, 4)
    vectors.view(rows, -1)[:, :hidden] = x.float().square()
    per_thread = torch.zeros(rows, 128)
    for j in range(vectors.shape[1] // 128):
        for i in range(4):
            per_thread = per_thread + vectors[:, j * 128:(j + 1) * 128, i]
    warps = _shuffle_down(per_thread.view(rows, 4, 32))
    return ((warps[:, 0] + warps[:, 2]) + (warps[:, 1] + warps[:, 3])) / hidden


def eager_mean_of_squares(x: torch.Tensor, rows_counted: int) -> torch.Tensor:
    """Per row of ``x``, ``x.float().pow(2).mean(-1)`` as torch's generic CUDA reduction computes it from 16 rows
    on (for a tensor of ``rows_counted`` rows): each of a warp's ``L`` lanes keeps 4 sums. From H = 128 on the
    row is read in 4-element vectors, ``L = 32``, lane ``l`` adding element ``i`` of its vectors ``l, l + 32,
    ...`` to sum ``i``; a shorter row element by element, ``L = min(32, last power of 2 <= H)``, lane ``l``
    taking element ``l + L*i`` as its sum ``i``. Then ``((s0 + s1) + s2) + s3``; a shuffle-down tree over the
    lanes; times ``float(rows) / float(rows * H)``."""
    rows, hidden = x.shape
    if hidden >= 128:
        lanes = 32
        vectors = torch.zeros(rows, -(-hidden // (4 * lanes)) * lanes, 4)
        vectors.view(rows, -1)[:, :hidden] = x.float().square()
        sums = torch.zeros(rows, lanes, 4)
        for k in range(vectors.shape[1] // lanes):
            sums = sums + vectors[:, k * lanes:(k + 1) * lanes]
    else:
        lanes = min(32, 1 << (hidden.bit_length() - 1))
        elements = torch.zeros(rows, 4, lanes)
        elements.view(rows, -1)[:, :hidden] = x.float().square()
        sums = elements.transpose(1, 2)
    per_lane = ((sums[..., 0] + sums[..., 1]) + sums[..., 2]) + sums[..., 3]
    factor = torch.tensor(float(rows_counted), dtype=torch.float32) / torch.tensor(float(rows_counted * hidden),
                                                                                   dtype=torch.float32)
    return _shuffle_down(per_lane.view(rows, 1, lanes))[:, 0] * factor


def _shuffle_down(sums: torch.Tensor) -> torch.Tensor:
    """``[rows, warps, lanes]`` -> ``[rows, warps]``: lane ``l`` adds lane ``l + lanes/2``, and so on, to one."""
    while sums.shape[-1] > 1:
        half = sums.shape[-1] // 2
        sums = sums[..., :half] + sums[..., half:]
    return sums[..., 0]


@triton.jit
def eager_order_means(x_ptr, out_ptr, n_rows, HIDDEN: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr,
                      NORM_SUM_ORDER: tl.constexpr):
    """``mean(x*x)`` of ``ROWS`` rows by the forward kernel's device functions for ``NORM_SUM_ORDER``, chunk by
    chunk as the kernel calls them; ``n_rows``: the row count the mean's factor takes."""
    rows = tl.arange(0, ROWS)
    zero = tl.zeros([ROWS, 1], tl.int32)
    partial = tl.zeros([ROWS, CHUNK // 4 if NORM_SUM_ORDER == FUSED_RMS_NORM_ORDER else CHUNK], tl.float32)
    for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        u = tl.load(x_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=(cols < HIDDEN)[None, :], other=0.0)
        if NORM_SUM_ORDER == FUSED_RMS_NORM_ORDER:
            partial = _add_squares_as_fused_rms_norm(partial, u.to(tl.float32))
        else:
            partial = _add_squares_as_mean(partial, u.to(tl.float32), zero)
    tl.store(out_ptr + rows, _eager_norm_mean(partial, n_rows, tl.program_id(0).to(tl.int64), zero, HIDDEN,
                                              NORM_SUM_ORDER))


@pytest.mark.parametrize("order, hidden", [(SumOrder.FUSED_RMS_NORM, h) for h in (4, 64, 128, 200, 1024, 2052)]
                         + [(SumOrder.MEAN, h) for h in (8, 16, 24, 32, 64, 96, 124, 128, 200, 1024, 2052)])
def test_the_norm_mean_takes_the_order_of_eagers_kernel(order, hidden):
    """``NORM_SUM_ORDER``'s device functions, with the chunks the launch gives them, against each eager kernel's
    order written out add by add: the same fp32 mean, bit for bit, on data whose sums depend on the order
    (and, for the mean, a row count whose product with H is not an fp32 integer)."""
    from h3_fused.kernels.launch import sum_order_chunk

    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(8, hidden, generator=g) * torch.logspace(-3, 3, hidden)[torch.randperm(hidden, generator=g)]).to(bf16)
    got, counted = torch.empty(8), 100_003
    eager_order_means[(1,)](x, got, counted, HIDDEN=hidden, CHUNK=sum_order_chunk(hidden, order), ROWS=8,
                            NORM_SUM_ORDER=int(order))
    expected = eager_fused_rms_norm_mean(x) if order is SumOrder.FUSED_RMS_NORM else eager_mean_of_squares(x, counted)
    assert torch.equal(got, expected)
    if hidden > 4:  # one vector: a single thread's sum, in any order
        assert not torch.equal(expected * hidden, x.float().square().sum(-1)), "the data must make the order matter"


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 tensors rounded once to fp32: the product is exact in fp64, and the fp64 sum with
    its exact error (TwoSum) rounded to odd keeps what the one rounding to fp32 needs."""
    p, r = a.double() * b.double(), c.double()
    s = p + r
    t = s - r
    e = (r - (s - t)) + (p - t)
    beyond = ((e < 0) & (s > 0)) | ((e > 0) & (s < 0))
    bits = (s.view(torch.int64) - beyond.to(torch.int64)) | (e != 0).to(torch.int64)
    return bits.view(torch.float64).float()


def welford_combine(b, a):
    """``cuWelfordCombine(b, a)`` of torch's LayerNorm CUDA kernel on ``(mean, spread, count)`` triples."""
    n = a[2] + b[2]
    coef = 1.0 / torch.clamp(n, min=1.0)
    share_a, share_b = a[2] * coef, b[2] * coef
    delta = b[0] - a[0]
    mean = fma32(share_a, a[0], share_b * b[0])
    spread = fma32(delta * delta * a[2], share_b, a[1] + b[1])
    return torch.where(n > 0, mean, 0.0), torch.where(n > 0, spread, 0.0), n


def eager_fused_layer_norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` (``[T, H]``, H a multiple of 4), the mean and biased variance in fp32 as torch's LayerNorm
    CUDA kernel computes them, one operation at a time: thread ``t`` of 128 takes the elements of its vectors
    ``t, t + 128, ...`` of 4 in order, each by Welford's update (``delta = v - mean``, ``mean += delta * (1/k)``,
    ``spread += delta * (v - mean)``, each a contracted multiply-add); a shuffle-down tree of Welford combines
    over each warp's 32 threads; warp 0 with 2 and 1 with 3, then the two; the spread divided by H."""
    rows, hidden = x.shape
    threads = EAGER_THREADS.value
    vectors = hidden // 4
    chunks = -(-vectors // threads)
    padded = torch.zeros(rows, chunks * threads, 4)
    padded[:, :vectors] = x.float().view(rows, vectors, 4)
    thread = torch.arange(threads)
    mean, spread = torch.zeros(rows, threads), torch.zeros(rows, threads)
    for j in range(chunks):
        active = j * threads + thread < vectors
        for i in range(4):
            v = padded[:, j * threads:(j + 1) * threads, i]
            delta = v - mean
            new_mean = fma32(delta, torch.tensor(1.0) / (4 * j + i + 1), mean)
            spread = torch.where(active, fma32(delta, v - new_mean, spread), spread)
            mean = torch.where(active, new_mean, mean)
    count = 4.0 * torch.clamp(torch.div(vectors - thread + threads - 1, threads, rounding_mode="floor"), 0)
    stats = (mean.view(rows, 4, 32), spread.view(rows, 4, 32), count.expand(rows, -1).reshape(rows, 4, 32))
    while stats[0].shape[-1] > 1:
        half = stats[0].shape[-1] // 2
        stats = welford_combine([s[..., :half] for s in stats], [s[..., half:] for s in stats])
    stats = [s[..., 0] for s in stats]
    stats = welford_combine([s[:, :2] for s in stats], [s[:, 2:] for s in stats])
    mean, spread, _ = welford_combine([s[:, :1] for s in stats], [s[:, 1:] for s in stats])
    return mean[:, 0], spread[:, 0] / hidden


@triton.jit
def eager_order_layer_norm_stats(x_ptr, mean_ptr, var_ptr, HIDDEN: tl.constexpr, CHUNK: tl.constexpr,
                                 ROWS: tl.constexpr):
    """Mean and variance of ``ROWS`` rows by the forward kernel's device functions for the LayerNorm's order,
    chunk by chunk as the kernel calls them."""
    rows = tl.arange(0, ROWS)
    mean = tl.zeros([ROWS, CHUNK // 4], tl.float32)
    spread = tl.zeros([ROWS, CHUNK // 4], tl.float32)
    for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        u = tl.load(x_ptr + rows[:, None] * HIDDEN + cols[None, :], mask=(cols < HIDDEN)[None, :], other=0.0)
        mean, spread = _add_as_fused_layer_norm(mean, spread, u.to(tl.float32), c, HIDDEN)
    mean, var = _eager_welford_total(mean, spread, HIDDEN)
    tl.store(mean_ptr + rows, mean)
    tl.store(var_ptr + rows, var)


@triton.jit
def _fma_of(a_ptr, b_ptr, c_ptr, out_ptr):
    tl.store(out_ptr, tl.fma(tl.load(a_ptr), tl.load(b_ptr), tl.load(c_ptr)))


@functools.cache
def interpreter_fma_rounds_once() -> bool:
    """Whether this Triton's interpreter computes ``tl.fma`` rounded once, as the GPU does (Triton 3.9's; 3.7's
    computes numpy's ``a * b + c``, two roundings): ``(1 + 2^-13)(1 - 2^-13) - 1`` is ``-2^-26`` fused, 0 not."""
    a, b, c, out = (torch.tensor([v]) for v in (1 + 2 ** -13, 1 - 2 ** -13, -1.0, 0.0))
    _fma_of[(1,)](a, b, c, out)
    return out.item() == -2.0 ** -26


@pytest.mark.parametrize("hidden", [4, 200, 512, 1536, 2052])
@pytest.mark.parametrize("dtype", [bf16, torch.float32])
def test_the_layer_norm_statistics_take_the_order_of_eagers_kernel(hidden, dtype):
    """The LayerNorm's device functions, with the chunk the launch gives them, against torch's LayerNorm CUDA
    kernel's Welford order written out operation by operation: the same fp32 mean and variance, bit for bit,
    on rows whose statistics depend on the order (an offset mean, magnitudes over six decades), with threads
    that read fewer vectors (H = 2,052) or none (H < 512)."""
    from h3_fused.kernels.launch import sum_order_chunk

    if not interpreter_fma_rounds_once():
        pytest.skip("this Triton's interpreter rounds tl.fma twice: Welford's multiply-adds cannot be eager's here "
                    "(the GPU tests hold the LayerNorm forms to eager's bits)")
    g = torch.Generator().manual_seed(hidden)
    spread = torch.logspace(-3, 3, hidden)[torch.randperm(hidden, generator=g)]
    x = (torch.randn(8, hidden, generator=g) * spread + 3.0).to(dtype)
    mean, var = torch.empty(8), torch.empty(8)
    eager_order_layer_norm_stats[(1,)](x, mean, var, HIDDEN=hidden, CHUNK=sum_order_chunk(hidden, SumOrder.FUSED_LAYER_NORM),
                                       ROWS=8)
    expected_mean, expected_var = eager_fused_layer_norm_stats(x)
    assert torch.equal(mean, expected_mean) and torch.equal(var, expected_var)
    if hidden > 4:
        exact = x.double()
        assert not torch.equal(expected_var, exact.var(-1, unbiased=False).float()), "the data must make the order matter"
