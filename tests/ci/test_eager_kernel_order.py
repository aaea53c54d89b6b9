"""``.ci/eager-kernel-order``'s comparison of two builds of an eager kernel, on SASS lines written here."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / ".ci" / "eager-kernel-order"


def load_script():
    loader = importlib.machinery.SourceFileLoader("eager_kernel_order", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


SUM = ["LDG.E.64.CONSTANT R10, desc[UR8][R10.64] ;", "IMAD.U32 R17, R10, 0x10000, RZ ;",
       "FFMA R17, R17, R17, R8 ;", "SHFL.DOWN PT, R11, R17, 0x10, 0x1f ;", "FADD R10, R11, R17 ;",
       "SHFL.DOWN PT, R11, R10, 0x8, 0x1f ;", "FADD R12, R10, R11 ;", "@!P0 FMUL R11, R12, 16777216 ;",
       "MUFU.RSQ R0, R11 ;"]
PRODUCTS = ["FMUL R14, R0, R13 ;", "FMUL R15, R0, R15 ;", "FMUL R14, R23, R14 ;"]


def test_registers_and_the_products_schedule_do_not_count_the_order_of_the_sum_does():
    ops = load_script().float_ops
    renamed = [line.replace("R1", "R3").replace("P0", "P2") for line in SUM]
    assert ops(SUM + PRODUCTS) == ops(renamed + PRODUCTS[::-1]), "registers and the products' order are free"
    swapped = SUM[:3] + SUM[5:7] + SUM[3:5] + SUM[7:]  # the shuffle tree's offsets in the other order
    assert ops(SUM + PRODUCTS) != ops(swapped + PRODUCTS)
    fused = PRODUCTS[:2] + ["FFMA R14, R23, R14, RZ ;"]
    assert ops(SUM + PRODUCTS) != ops(SUM + fused), "another rounding after the rsqrt is another kernel"
    assert ops(SUM)[0] == ops(SUM[:2] + ["BRA `(.L_x_1) ;"] + SUM[2:])[0], "integer and branch code is ignored"
