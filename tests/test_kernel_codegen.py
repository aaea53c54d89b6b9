"""The kernel's code for Hopper (sm_90), compiled without a GPU: the rounding points survive LLVM.

Under ``bf16`` every product that eager rounds before an add must stay rounded. LLVM narrows
``R(a*b)`` and ``R(c + R(a*b))`` of bf16 values to bf16 arithmetic, and with contraction allowed it
would fuse the pair into one ``fma.rn.bf16x2`` (a single rounding where eager has two): these tests
hold the compiled PTX to no bf16 FMA at all (the rounded products are packed bf16 multiplies, kept
apart from their adds), and to fp32 FMAs under ``fp32`` (where the affine and the gated residual fuse),
in the builds for many rows and for few (site A on 8 warps, the table rows loaded ahead).
"""

from __future__ import annotations

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from sass_counts import compile_site  # noqa: E402
from sites import shipped_launch_config  # noqa: E402

HIDDEN = 5376
ROW_COUNTS = pytest.mark.parametrize("rows", [None, 1], ids=["many_rows", "few_rows"])


def ptx_ops(site: str, policy: str, rows: int | None) -> list[str]:
    ptx = compile_site(site, policy, HIDDEN, shipped_launch_config(site, HIDDEN, rows)).asm["ptx"]
    return re.findall(r"^\s+((?:fma|mul|add)\.[\w.]+)", ptx, re.M)


@ROW_COUNTS
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_bf16_policy_never_fuses_a_product_into_an_add(site, rows):
    ops = ptx_ops(site, "bf16", rows)
    assert any(op.startswith("mul.") and ("f32" in op or "bf16" in op) for op in ops), "expected products"
    assert not [op for op in ops if op.startswith("fma.") and "bf16" in op]


@ROW_COUNTS
@pytest.mark.parametrize("site", ["A", "C"], ids=["affine", "gated_residual"])
def test_fp32_policy_fuses_its_multiply_adds(site, rows):
    """Under ``fp32`` ``n*p + shift`` (site A) and ``res + gate*branch`` (site C) are fp32 FMAs."""
    assert not [op for op in ptx_ops(site, "fp32", rows) if op.startswith("fma.") and "bf16" in op]
    fp32_fmas = [op for op in ptx_ops(site, "fp32", rows) if op == "fma.rn.f32"]
    bf16_fmas = [op for op in ptx_ops(site, "bf16", rows) if op == "fma.rn.f32"]
    assert len(fp32_fmas) > len(bf16_fmas)
