"""The kernel's code for Hopper (sm_90), compiled without a GPU: the rounding points survive LLVM.

Under ``bf16`` every product that eager rounds before an add must stay rounded. LLVM narrows
``R(a*b)`` and ``R(c + R(a*b))`` of bf16 values to bf16 arithmetic, and with contraction allowed it
would fuse the pair into one ``fma.rn.bf16x2`` (a single rounding where eager has two): these tests
hold the compiled PTX to no bf16 FMA at all (the rounded products are packed bf16 multiplies, kept
apart from their adds), and under ``fp32`` to a bf16 FMA for the gated residual (rounded once, as stored)
and fp32 FMAs for the affine, in the builds for many rows and for few (site A on 8 warps, the table rows
loaded ahead). They also hold the kernel to widening bf16 values on their bits (one instruction per
element, where a conversion of a packed pair's high half is two).
"""

from __future__ import annotations

import re

import pytest
from h3_fused.kernels.testing import TABLE_PLUS_ROWS, FamilyForm, shipped_launch_config
from sass import compile_backward, compile_family_site, compile_site

HIDDEN = 5376
FLOAT_OPS = re.compile(r"^\s+((?:fma|mul|add|sub|neg|div|rsqrt|sqrt)\.[\w.]+\s[^;]*;)", re.M)
ROW_COUNTS = pytest.mark.parametrize("rows", [None, 1], ids=["many_rows", "few_rows"])


def ptx_ops(site: str, policy: str, rows: int | None, constants=None) -> list[str]:
    ptx = compile_site(site, policy, HIDDEN, shipped_launch_config(site, HIDDEN, rows, policy),
                       constants=constants).asm["ptx"]
    return re.findall(r"^\s+((?:fma|mul|add)\.[\w.]+)", ptx, re.M)


@ROW_COUNTS
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_bf16_policy_never_fuses_a_product_into_an_add(site, rows):
    ops = ptx_ops(site, "bf16", rows)
    assert any(op.startswith("mul.") and ("f32" in op or "bf16" in op) for op in ops), "expected products"
    assert not [op for op in ops if op.startswith("fma.") and "bf16" in op]


@ROW_COUNTS
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_fp32_policy_fuses_its_multiply_adds(site, rows):
    """Under ``fp32`` the gated residual ``res + gate*branch`` (sites B, C) is one bf16 FMA per element
    (the exact sum rounded once, as stored), and the affine ``n*p + shift`` (sites A, B) fp32 FMAs: at least one
    per element of a thread's rows more than in the same build with ``FUSE_MULTIPLY_ADD`` off."""
    fp32_ops = ptx_ops(site, "fp32", rows)
    bf16_fmas = [op for op in fp32_ops if op.startswith("fma.rn.bf16")]
    assert bool(bf16_fmas) == (site != "A")
    if site == "C":  # nothing else: no product or sum of its own
        assert not [op for op in fp32_ops if op.startswith(("mul.f", "add.f", "mul.bf16", "add.bf16"))]
    else:
        config = shipped_launch_config(site, HIDDEN, rows, "fp32")
        per_thread = -(-HIDDEN // config.chunk) * config.chunk * config.block_t // (32 * config.num_warps)
        unfused = ptx_ops(site, "fp32", rows, constants={"FUSE_MULTIPLY_ADD": False})
        assert fp32_ops.count("fma.rn.f32") - unfused.count("fma.rn.f32") >= per_thread


@ROW_COUNTS
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_bf16_values_widen_through_their_bits(site, policy, rows):
    """No ``cvt.f32.bf16``: every bf16 value is widened to fp32 on its bits (``_widened``: an AND of the
    packed pair's register for the high half, a shift for the low one; ptxas makes the conversion of a
    high half two instructions), or LLVM narrows its arithmetic to packed bf16 and never widens it."""
    ptx = compile_site(site, policy, HIDDEN, shipped_launch_config(site, HIDDEN, rows, policy)).asm["ptx"]
    assert "cvt.f32.bf16" not in ptx
    if site != "C":
        assert re.search(r"and\.b32\s+%r\d+, %r\d+, -65536;", ptx), "expected the high halves widened by a mask"


@ROW_COUNTS
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_every_build_compiles_with_the_counts_as_constants(site, rows):
    """The row and table-row counts may arrive as constants: Triton makes an argument of value 1 one (a
    single row, or a single table row), and Inductor's analysis of the kernel on torch 2.11 passes them so.
    The kernel must not call tensor methods such as ``.to`` on them (an earlier draft of site A's warming programs did)."""
    config = shipped_launch_config(site, HIDDEN, rows, "bf16")
    for constants in ({"n_rows": 1}, {"num_table_rows": 1}, {"n_rows": 1, "num_table_rows": 1}):
        assert compile_site(site, "bf16", HIDDEN, config, constants=constants).asm["ptx"]


@pytest.mark.parametrize("native", [False, True], ids=["nn_rmsnorm", "native"])
@pytest.mark.parametrize("site", ["A", "B"])
def test_each_norm_sum_order_compiles_at_the_edge_widths(site, native):
    """The widths where the launch changes the norm's sum order or its chunk: H = 4 (one vector a row), 12 (not
    a power of 2), 16 (the native order's narrowest), 64 (a row eager reads element by element: one chunk wider
    than it), 128 (the native order's first in vectors), 8,196 (past its widest: the kernel's own order)."""
    for hidden in (4, 12, 16, 64, 128, 8196):
        assert compile_site(site, "bf16", hidden, native=native).asm["ptx"]
        if site == "A":  # a plain norm storing its statistics alone (``eager_rms_norm_rstd``): no tables, no y
            plain = dict(HAS_AFFINE=False, HAS_WEIGHT=False, PRELOAD_TABLE_CHUNKS=False, WARM_TABLES_FIRST=False,
                         WARM_ROWS_AHEAD=0, STORE_RSTD=True)
            ptx = compile_site(site, "bf16", hidden, native=native, constants=plain).asm["ptx"]
            assert len(re.findall(r"\bst\.global\.", ptx)) == 1, "one store: r"


@pytest.mark.parametrize("site", ["A", "B"])
def test_native_spelling_rounds_every_product(site):
    """The native RMSNorm's eager graph rounds every product it forms (``pow``, the mean's factor, ``* rstd``, ``*
    weight``, the affine) before any add: its build holds no FMA, the mean's product with the factor included
    (a plain product there fused with ``+ eps``, and missed eager's ``rstd`` on rare rows at H = 200 and 5,376).
    The products are the same instructions at every width from 16 on, where the mean takes eager's order; H3's
    5,376 unrolls 42 chunks, a build of over a minute here, and is held to eager's bits on the GPU instead
    (``test_ops_gpu.py``)."""
    for hidden in (64, 200, 1024):
        ptx = compile_site(site, "bf16", hidden, native=True).asm["ptx"]
        assert not re.findall(r"^\s+fma\.", ptx, re.M)


def float_arithmetic(ptx: str) -> list[str]:
    """The PTX's float instructions in order, without the ``.rn`` that a build without contraction writes on
    every multiply and add (to keep ptxas from contracting them) and without register numbers."""
    return [re.sub(r"%\w+", "%", op.replace(".rn", "")) for op in FLOAT_OPS.findall(ptx)]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_the_builds_do_not_depend_on_triton_contracting_multiply_adds(site, policy):
    """Every multiply-add of the kernels is written out (``tl.fma``, or kept apart by ``device_math.mul_rn``),
    so Triton's ``enable_fp_fusion`` (whose default, ``TRITON_DEFAULT_FP_FUSION``, Inductor's compile of a user
    kernel takes, and Triton 3.10 turns off) changes no float instruction of the forward or the backward."""
    forward = [compile_site(site, policy, HIDDEN, fp_fusion=on).asm["ptx"] for on in (True, False)]
    backward = [compile_backward(site, policy, HIDDEN, fp_fusion=on).asm["ptx"] for on in (True, False)]
    for contracted, apart in (forward, backward):
        assert float_arithmetic(contracted) == float_arithmetic(apart)


FAMILY_FORWARD_BUILDS = [(site, form) for site in "AB" for form in (  # B's gate takes the path of C's
    FamilyForm("layer", TABLE_PLUS_ROWS, True), FamilyForm("diffusers_rms", TABLE_PLUS_ROWS))]


@pytest.mark.slow
@pytest.mark.parametrize("site, form", FAMILY_FORWARD_BUILDS, ids=[f"{s}-{f}" for s, f in FAMILY_FORWARD_BUILDS])
def test_the_family_forward_builds_with_biases_keep_their_arithmetic(site, form):
    """Rows per token with biases (Wan 2.2 TI2V's fp32 sums; LTX-Video's bf16 sums, rounded to bf16 as the graph's
    add): each build compiles for sm_90 with the same float instructions whether or not Triton
    contracts multiply-adds, and no bf16 FMA (which would drop a rounding). That the bf16 sums round as the graph's
    add: the interpreted and GPU tests, on the values."""
    builds = [compile_family_site(site, form, "bf16", HIDDEN, fp_fusion=on).asm["ptx"] for on in (True, False)]
    assert float_arithmetic(builds[0]) == float_arithmetic(builds[1])
    assert not re.findall(r"^\s+fma\.rn\.bf16", builds[0], re.M)


FAMILY_BACKWARD_BUILDS = [(site, form) for site in "ABC" for form in (
    FamilyForm("layer", "per_sample"), FamilyForm("layer", "per_token", True))] + [
    (site, FamilyForm("layer", "per_sample", modulations=2)) for site in "AB"]


@pytest.mark.slow
@pytest.mark.parametrize("site, form", FAMILY_BACKWARD_BUILDS, ids=[f"{s}-{f}" for s, f in FAMILY_BACKWARD_BUILDS])
def test_the_family_backward_builds_do_not_depend_on_triton_contracting_multiply_adds(site, form):
    """The backward of a LayerNorm site with rows given per sample (bf16), or per token in fp32 (the norm of the
    fp32 upcast; the sums compensated), or modulated twice (the copies' gradients summed in bf16): every
    multiply-add written out, so the same float instructions whether or not Triton contracts them (a compensated
    sum contracted would lose what it compensates)."""
    builds = [compile_backward(site, "bf16", HIDDEN, fp_fusion=on, form=form).asm["ptx"] for on in (True, False)]
    assert float_arithmetic(builds[0]) == float_arithmetic(builds[1])


@pytest.mark.parametrize("site", ["A", "B"])
def test_the_layer_norm_builds_keep_eagers_arithmetic(site):
    """A LayerNorm site under ``bf16`` (its statistics by Welford's updates and combines in the order of eager's
    kernel, every multiply-add written out): no bf16 FMA, and the same float instructions whether or not Triton
    contracts multiply-adds, at a width whose last chunk leaves eager's threads idle (H = 3,200)."""
    builds = [compile_site(site, "bf16", 3200, norm="layer", fp_fusion=on).asm["ptx"] for on in (True, False)]
    assert not re.findall(r"^\s+fma\.rn\.bf16", builds[0], re.M)
    assert float_arithmetic(builds[0]) == float_arithmetic(builds[1])
