"""The hand-fused baseline: the one-row design of the public hand-fused H3 kernels, for comparison.

What users run today when they edit the model by hand (spec section 4, "one-row Triton"): one program
per row, the whole row in one ``next_power_of_2(H)`` block (34% of lanes masked at H = 5,376), 8 warps;
the row's activations first, then, after the norm's reduction, the weight and table rows; no index
check. Per row ``t``, ``i = index[t]``, ``R`` = round to the activation dtype:

    u = R(residual + gate[i] * branch)                                 (sites B, C; stored)
    y = R(u * rsqrt(mean(u^2) + eps) * w * (1 + scale[i]) + shift[i])  (sites A, B; stored)

Under ``policy="fp32"`` (the public kernels) that is all the rounding: fp32 arithmetic, rounded once at
each store, so it drifts from eager like the ``fp32`` policy. Under ``policy="bf16"`` (the spec's bf16
one-row column) it also rounds where eager does, each time through the activation dtype:
``g = R(gate[i] * branch)``, ``n = R(u * r * w)``, ``p = R(1 + scale[i])``, ``q = R(n * p)``, and it is
compiled with ``enable_fp_fusion=False``: LLVM narrows a rounded product of bf16 values to a bf16
multiply and would otherwise contract it with the add that follows into one bf16 FMA, dropping eager's
rounding of the product. The norm's fp32 sum order is the kernel's, so ``y`` may still differ from eager
in a few elements (the mismatch columns).

sm_90 registers per thread (Triton 3.6, H = 5,376, 8 warps): sites A / B / C 79 / 80 / 62 under ``fp32``
(3 programs of 256 threads per SM for A and B) and 63 / 63 / 40 under ``bf16`` (4 programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

POLICIES = ("fp32", "bf16")


@triton.jit
def _round(v, ROUND: tl.constexpr, dtype: tl.constexpr):
    """``v`` rounded to ``dtype`` and back to fp32 where ``ROUND``, else ``v``."""
    if ROUND:
        return v.to(dtype).to(tl.float32)
    return v


@triton.jit
def one_row_kernel(x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, u_ptr, y_ptr,
                   hidden, eps, stride_act, stride_table,
                   HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, ROUND_LIKE_EAGER: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    i = tl.load(idx_ptr + row)
    act: tl.constexpr = y_ptr.dtype.element_ty
    if HAS_GATE:
        res = tl.load(res_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
        branch = tl.load(branch_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        u = (res + _round(gate * branch, ROUND_LIKE_EAGER, act)).to(act)
        tl.store(u_ptr + row * hidden + cols, u, mask=mask)
        u = u.to(tl.float32)
    else:
        u = tl.load(x_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt(tl.sum(u * u, axis=0) / hidden + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        n = _round(u * r * w, ROUND_LIKE_EAGER, act)
        q = _round(n * _round(1.0 + scale, ROUND_LIKE_EAGER, act), ROUND_LIKE_EAGER, act)
        tl.store(y_ptr + row * hidden + cols, (q + shift).to(act), mask=mask)


def hand_fused_site(site: str, policy: str = "fp32"):
    """A callable with the keyword arguments of ``testing.make_inputs(site, ...)`` running the baseline under
    ``policy`` (``POLICIES``)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")

    def run(x=None, residual=None, gate=None, branch=None, weight=None, shift=None, scale=None, index=None,
            eps=1e-6):
        act = x if x is not None else residual
        tokens, hidden = act.shape
        u = torch.empty_like(act) if gate is not None else None
        y = torch.empty_like(act) if scale is not None else None
        table = gate if gate is not None else scale
        one_row_kernel[(tokens,)](
            act, act, branch if branch is not None else act, table, weight if weight is not None else act,
            shift if shift is not None else table, scale if scale is not None else table, index,
            u if u is not None else y, y if y is not None else u,
            hidden, eps, act.stride(0), table.stride(0),
            HAS_GATE=gate is not None, HAS_NORM=scale is not None, ROUND_LIKE_EAGER=policy == "bf16",
            BLOCK=triton.next_power_of_2(hidden), num_warps=8, enable_fp_fusion=policy == "fp32")
        return (u, y) if u is not None and y is not None else (y if u is None else u)

    return run
