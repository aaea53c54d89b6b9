"""Device-side arithmetic shared by the forward and backward kernels: rounding to the activation dtype
exactly where the rounding contract (``contract.Rounding``) says, and never anywhere else.

``R(v)`` is ``v`` rounded to nearest even in the activation dtype. Multiplies that feed an add are kept
from contracting into an FMA where eager rounds the product (``mul_rn``, ``rounded_product``), and fused
on purpose where the ``fp32`` policy computes one (``sum_rounded_once``). ``INTERPRETED`` is true under the
Triton interpreter (``TRITON_INTERPRET=1``), which truncates conversions to bf16 instead of rounding them
and has neither bf16 arithmetic nor libdevice: there the same results are computed on the bits.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``v`` (fp32) rounded to nearest even in ``dtype``, as fp32."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype).to(tl.float32)


@triton.jit
def widened(v):
    """``v`` as fp32 (exact), a bf16 ``v`` through its bits (its 16 bits are the fp32 value's high half).

    A plain conversion of the high bf16 of a packed pair is two instructions (PRMT, then a shift), the bits
    one (an AND, or a shift for the low one): fewer instructions per element at the same registers
    (docs/DESIGN.md, "Widening bf16 through its bits"). Where LLVM narrows rounded fp32 arithmetic on bf16
    values to packed bf16 arithmetic (``R(1 + scale)``), the conversion stays plain: the bits would hide it."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def mul_rn(a, b, zero):
    """``a * b`` rounded once in fp32 and never contracted into an FMA with a following add, even where
    the product is then rounded to bf16: LLVM narrows ``R(a*b)`` and ``R(c + R(a*b))`` of bf16 values
    to bf16 arithmetic and would contract the pair into one ``fma.rn.bf16x2``, dropping the rounding.

    The product passes through an integer XOR with ``zero``, a per-row value derived from the loaded
    index (0 for every valid row; Inductor would fold a scalar 0 argument into a constant), which
    leaves its bits unchanged but stops LLVM and ptxas from fusing it into an add.
    """
    return ((a * b).to(tl.int32, bitcast=True) ^ zero).to(tl.float32, bitcast=True)


@triton.jit
def rounded_product(a, b, zero, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``R(a * b)`` (``a``, ``b`` fp32), as fp32, never contracted into an FMA with a following add.

    Where ``a`` and ``b`` are bf16 values LLVM computes this as one packed bf16 multiply (exact: the
    fp32 product of two bf16 values needs no rounding, so one rounding to bf16 is eager's), and the
    XOR of the rounded bits with ``zero`` (see ``mul_rn``) keeps it from fusing with the next add.
    """
    if INTERPRETED:
        return rounded(a * b, dtype, INTERPRETED)
    bits = (a * b).to(dtype).to(tl.int16, bitcast=True) ^ zero.to(tl.int16)
    return bits.to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def sum_rounded_once(gate, branch, res, INTERPRETED: tl.constexpr):
    """``res + gate * branch`` of operands in the activation dtype, as fp32 values whose rounding to that
    dtype (``rounded``) is the exact sum's one rounding. Compiled: one FMA in the dtype
    (``fma.rn.bf16x2``), already rounded. Interpreted (``INTERPRETED``: no bf16 arithmetic there): the fp32
    sum and its exact error (TwoSum; the product of two bf16/fp16 values is exact in fp32 within its
    range) rounded to odd, toward zero with the last bit set where inexact, which leaves the one rounding
    that follows to decide as the exact sum would."""
    if not INTERPRETED:
        return tl.fma(gate, branch, res).to(tl.float32)
    p = gate.to(tl.float32) * branch.to(tl.float32)
    r = res.to(tl.float32)
    s = r + p
    t = s - r
    e = (r - (s - t)) + (p - t)
    inexact = (e != 0) & (e == e)  # e is NaN where the sum is not finite: left as it is
    beyond = inexact & ((e < 0) == (s > 0))  # s lies past the exact sum, away from zero
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(beyond, bits - 1, bits) | inexact.to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rsqrt(v, INTERPRETED: tl.constexpr):
    """CUDA's ``rsqrtf`` (what eager ``torch.rsqrt`` calls); the interpreter has no libdevice."""
    if INTERPRETED:
        return tl.rsqrt(v)
    return libdevice.rsqrt(v)
