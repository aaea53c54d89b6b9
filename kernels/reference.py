"""Pure-torch implementation of the fused modulation, on any device.

It performs the eager graph's operations in the eager order, rounding to the activation dtype ``A``
exactly where ``Rounding`` says, so on the CPU under the ``bf16`` policy it is bit-identical to the
unfused model (the norm with one rounding *is* ``F.rms_norm``, as ``nn.RMSNorm`` calls it). Used for
CPU tensors, for devices Triton must not be launched on, and as the test oracle of the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .arguments import ModulationArgs

f32 = torch.float32


def _round(v: torch.Tensor, dtype: torch.dtype, rounds: bool) -> torch.Tensor:
    return v.to(dtype).to(f32) if rounds else v


def sum_rounded_once(residual: torch.Tensor, gate_rows: torch.Tensor, branch: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """``R_A(res + gate_rows * branch)`` of the exact sum, rounded once to ``A`` = ``dtype`` (bf16 or fp16,
    the operands' dtype), as fp32 values: what one fused multiply-add in ``A`` stores.

    The product of two bf16/fp16 values is exact in fp64; TwoSum gives the fp64 sum ``s`` and its exact
    error ``e``. ``s + e`` is then rounded to fp32 by round-to-odd (toward zero, the last bit set where
    inexact), which keeps what the final rounding needs: fp32 has more than one bit beyond ``A``'s, so
    rounding that value to ``A`` rounds the exact sum once. Rounding through fp32 instead (fp32
    arithmetic, or torch's fp64 -> bf16 conversion, which passes through fp32) rounds twice, which differs
    where the product is a tie of ``A`` and the residual lies below fp32's last place of it: 103.75 (a
    tie of bf16) minus 3e-7 rounds to 103.5 once and to 104 twice."""
    r = residual.double()
    p = gate_rows.double() * branch.double()
    s = r + p
    t = s - r
    e = (r - (s - t)) + (p - t)
    f = s.float()
    rest = (s - f.double()) + e  # the exact sum minus f: 0 exactly where f is exact, else of its sign
    beyond = ((rest < 0) & (f > 0)) | ((rest > 0) & (f < 0))
    f = torch.where(beyond, torch.nextafter(f, torch.zeros_like(f)), f)
    odd = (f.view(torch.int32) | (rest != 0).to(torch.int32)).view(f32)
    return torch.where(torch.isfinite(s), odd, s.float()).to(dtype).to(f32)


def gated_residual(a: ModulationArgs) -> torch.Tensor:
    """``u = R_A(res + [R_A](gate[idx] * branch))`` as fp32 values.

    Under ``fp32`` (``Rounding.fused_multiply_add``) with the gate table in the activation dtype (bf16 or
    fp16), the exact sum is rounded once (``sum_rounded_once``), as the CUDA kernel's multiply-add in that
    dtype does; otherwise the fp32 product is added in fp32 and rounded, as eager does (for an fp32 gate
    table under ``fp32`` the kernel's fp32 FMA skips the rounding of the product: the sums can differ in
    fp32's last place, and so, rarely, the stored residuals)."""
    gate_rows = a.gate.index_select(0, a.index.long())
    if a.rounding.fused_multiply_add and gate_rows.dtype == a.dtype != f32:
        return sum_rounded_once(a.residual, gate_rows, a.branch, a.dtype)
    product = _round(gate_rows.to(f32) * a.branch.to(f32), a.dtype, a.rounding.gate_product)
    return _round(a.residual.to(f32) + product, a.dtype, True)


def rms_norm(u: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    """``n`` as fp32 values: ``R_A(u*r*w)``, ``R_A(R_A(u*r)*w)`` or unrounded, ``r = rsqrt(mean(u^2)+eps)``."""
    r = a.rounding
    if r.norm_output and not r.norm_before_weight:
        return F.rms_norm(u.to(a.dtype), (a.hidden,), a.weight, a.eps).to(f32)
    normed = u * torch.rsqrt(u.pow(2).mean(-1, keepdim=True) + a.eps)
    if a.weight is None:
        return _round(normed, a.dtype, r.norm_output)
    normed = _round(normed, a.dtype, r.norm_before_weight)
    return _round(normed * a.weight.to(f32), a.dtype, r.norm_output)


def modulate(n: torch.Tensor, a: ModulationArgs) -> torch.Tensor:
    """``y = R_A([R_A](n * [R_A](1 + scale[idx])) + shift[idx])`` in the activation dtype.

    Under ``fp32`` (``Rounding.fused_multiply_add``) the CUDA kernel computes ``n * p + shift`` as one
    FMA; this reference rounds the product to fp32 first, so the two can differ by a last-bit flip of the
    output, each within the policy."""
    idx = a.index.long()
    one_plus = _round(1.0 + a.scale.index_select(0, idx).to(f32), a.dtype, a.rounding.affine)
    product = _round(n * one_plus, a.dtype, a.rounding.affine)
    return (product + a.shift.index_select(0, idx).to(f32)).to(a.dtype)


def reference_modulation(a: ModulationArgs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(u, y)`` for the site ``a`` describes: A gives ``(None, y)``, B ``(u, y)``, C ``(u, None)``."""
    u = gated_residual(a) if a.gate is not None else None
    if a.scale is None:
        return u.to(a.dtype).view(a.out_shape), None
    n = rms_norm(u if u is not None else a.x.to(f32), a)
    y = modulate(n, a).view(a.out_shape)
    return (u.to(a.dtype).view(a.out_shape) if u is not None else None), y
