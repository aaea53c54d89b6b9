"""The hand-fused baseline: the one-row design of the public hand-fused H3 kernels, for comparison.

What users run today when they edit the model by hand: one program per row, the whole row in one
``next_power_of_2(H)`` block (34% of lanes masked at H = 5,376), 8 warps, every operand loaded up front,
fp32 arithmetic with a single rounding at each store (so it drifts from eager like the ``fp32``
policy), no index check. Per row ``t``, ``i = index[t]``:

    u = R(residual + gate[i] * branch)                                 (sites B, C; stored)
    y = R(u * rsqrt(mean(u^2) + eps) * w * (1 + scale[i]) + shift[i])  (sites A, B; stored)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def one_row_kernel(x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, u_ptr, y_ptr,
                   hidden, eps, stride_act, stride_table,
                   HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    i = tl.load(idx_ptr + row)
    if HAS_GATE:
        res = tl.load(res_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
        branch = tl.load(branch_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(gate_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        u = (res + gate * branch).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + row * hidden + cols, u, mask=mask)
        u = u.to(tl.float32)
    else:
        u = tl.load(x_ptr + row * stride_act + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + i * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(u * u, axis=0) / hidden + eps)
        y = u * r * w * (1.0 + scale) + shift
        tl.store(y_ptr + row * hidden + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def hand_fused_site(site: str):
    """A callable with the keyword arguments of ``sites.make_inputs(site, ...)`` running the baseline."""

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
            HAS_GATE=gate is not None, HAS_NORM=scale is not None, BLOCK=triton.next_power_of_2(hidden),
            num_warps=8)
        return (u, y) if u is not None and y is not None else (y if u is None else u)

    return run
