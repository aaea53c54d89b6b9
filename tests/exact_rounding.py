"""Oracle for the ``fp32`` policy's stored residual ``u = R_A(res + gate * branch)``: the exact sum,
computed with fractions, rounded once to ``A`` (bf16 or fp16) to nearest even; and the inputs on which
rounding it once and rounding it through fp32 first disagree."""

from __future__ import annotations

import math
from fractions import Fraction

import torch

SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11}


def exactly_rounded(value: Fraction, dtype: torch.dtype) -> float:
    """``value`` rounded once to nearest even in ``dtype`` (subnormals and overflow to infinity included)."""
    info = torch.finfo(dtype)
    if value == 0:
        return 0.0
    magnitude = abs(value)
    exponent = magnitude.numerator.bit_length() - magnitude.denominator.bit_length()
    while Fraction(2) ** exponent > magnitude:
        exponent -= 1
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    smallest_normal_exponent = math.frexp(info.smallest_normal)[1] - 1
    last_place = Fraction(2) ** (max(exponent, smallest_normal_exponent) - SIGNIFICANT_BITS[dtype] + 1)
    steps, rest = divmod(magnitude, last_place)
    if 2 * rest > last_place or (2 * rest == last_place and steps % 2 == 1):
        steps += 1
    rounded = steps * last_place
    result = float("inf") if rounded > Fraction(info.max) else float(rounded)
    return result if value > 0 else -result


def exact_gated_residual(residual: torch.Tensor, gate: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    """Element by element ``R_A(res + gate * branch)`` rounded once from the exact value (finite inputs)."""
    values = [exactly_rounded(Fraction(r) + Fraction(g) * Fraction(b), residual.dtype)
              for r, g, b in zip(residual.flatten().tolist(), gate.flatten().tolist(), branch.flatten().tolist())]
    return torch.tensor(values, dtype=residual.dtype).view(residual.shape)


def double_rounding_cases(dtype: torch.dtype, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``count`` triples ``(res, gate, branch)`` of ``dtype`` where ``gate * branch`` (exact) is a tie of
    ``dtype`` between 2**12 and 2**14 and ``res`` is +-``dtype``'s smallest normal, far below fp32's last
    place of the product: rounded once, the sum goes toward ``res``; rounded through fp32 it is the tie
    again, which goes to the even neighbour (against ``res`` in about half the cases)."""
    bits = SIGNIFICANT_BITS[dtype]
    mantissas = torch.arange(2 ** (bits - 1), 2**bits, dtype=torch.int64)
    products = mantissas[:, None] * mantissas[None, :]
    dropped = torch.where(products >= 2 ** (2 * bits - 1), bits, bits - 1)  # bits beyond dtype's
    ties = (products % (2**dropped)) == 2 ** (dropped - 1)
    first, second = ties.nonzero(as_tuple=True)
    if count > first.numel():
        raise ValueError(f"{dtype} has {first.numel()} such products, asked for {count}")
    pick = torch.randperm(first.numel(), generator=torch.Generator().manual_seed(0))[:count]
    gate = (mantissas[first[pick]].double() * 2.0 ** (7 - bits)).to(dtype)
    branch = (mantissas[second[pick]].double() * 2.0 ** (7 - bits)).to(dtype)
    tiny = torch.where(torch.arange(count) % 2 == 0, 1.0, -1.0) * torch.finfo(dtype).smallest_normal
    return tiny.to(dtype), gate, branch


def assert_fp32_gated_residual_rounds_once(dtype: torch.dtype, device: str = "cpu") -> None:
    """Under ``fp32``, ``gate_residual`` (site C) and ``gate_norm_modulate`` (site B) store the exact
    ``res + gate * branch`` rounded once on ``double_rounding_cases``, where rounding through fp32 would
    differ (asserted too, so that the cases bite)."""
    from h3_fused.kernels import gate_norm_modulate, gate_residual

    res, gate, branch = (v.view(8, 32) for v in double_rounding_cases(dtype, 256))
    exact = exact_gated_residual(res, gate, branch).to(device)
    res, gate, branch = res.to(device), gate.to(device), branch.to(device)
    assert not torch.equal(exact, (res.float() + gate.float() * branch.float()).to(dtype)), "no double rounding"
    index = torch.arange(8, device=device)  # row t reads gate row t
    assert torch.equal(gate_residual(res, gate, branch, index, policy="fp32"), exact), dtype
    weight, shift, scale = torch.ones(32, dtype=dtype, device=device), 0.3 * gate, 0.1 * gate
    u, _ = gate_norm_modulate(res, gate, branch, weight, shift, scale, index, eps=1e-5, policy="fp32")
    assert torch.equal(u, exact), dtype
