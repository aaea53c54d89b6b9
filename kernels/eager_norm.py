"""Norms with eager's bits, whose sums Inductor cannot reorder: ``h3_fused::eager_rms_norm`` and
``h3_fused::eager_layer_norm``.

Inductor compiles a norm's fp32 sums in its own order, which on CUDA differs from the order of the kernel eager
runs: the sums, and so the norm's output, differ from eager's in the last place of single elements (of the order
of one in 10^5), and one such flip reaches every output of a model a few blocks later. Under the ``bf16`` policy
the pass therefore puts these ops where a graph has a norm that is not part of a modulation site (the attention's
per-head q/k norms, a token refiner's norms, a cross-attention's LayerNorm with its bias).

``eager_rms_norm`` computes the RMSNorm one of two ways, both eager's bits:

- on CUDA, where the forward kernel reproduces the order of the eager kernel the spelling runs
  (``launch.norm_sum_order``), the forward kernel as a plain RMSNorm (site A without tables): the op is a
  ``triton_op``, so Inductor inlines the kernel into its code, one pass over the rows;
- elsewhere (the CPU; a width or a weight dtype whose eager path is not reproduced)
  ``h3_fused::eager_kernels_rms_norm``, a custom op whose body is the spelling's eager operations, which Inductor
  calls as they are.

``eager_rms_norm_rstd`` is an RMSNorm's statistics alone, ``r = rsqrt(mean(x32^2) + eps)`` per row, eager's bits
(the forward kernel storing ``r`` where it reproduces eager's order, else eager's own ops): the pass applies them
in the graph (``R(x32 * r * w32)``, or ``R(R(x32 * r) * w)``: products, which Inductor computes as eager does), so
that Inductor fuses the normalization into what reads it (the rotary embedding) as it would the norm.

``eager_layer_norm`` is ``F.layer_norm`` itself, called as it is (its bias is one more term than the forward
kernel's norm has).

Where a whole norm is one op the price is the fusion Inductor would have made of the norm with its neighbours
(RoPE, for q and k; the residual add before a LayerNorm): the normalized rows are written and read once more. With
its statistics alone the price is one more read of the norm's input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._prims_common import compute_elementwise_output_logical_to_physical_perm
from torch.library import triton_op

from .arguments import ModulationArgs, check_args
from .contract import SumOrder
from .launch import launch_modulation, norm_sum_order
from .runtime import launch_context

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.custom_op("h3_fused::eager_kernels_rms_norm", mutates_args=())
def eager_kernels_rms_norm(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool) -> Tensor:
    """``eager_rms_norm`` computed by the eager operations of the spelling the graph had, the output contiguous:

    - ``rounds_before_weight`` false: ``F.rms_norm`` (on CUDA torch's fused RMSNorm kernel);
    - true, the native spelling: ``x.float().pow(2).mean(-1, keepdim=True)`` (torch's generic reduction),
      ``rsqrt``, the product cast to ``x``'s dtype, then the weight multiplied in that dtype.
    """
    if not rounds_before_weight:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if weight is not None:
            out = out * weight.to(x.dtype)
    return out.contiguous()


@eager_kernels_rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("h3_fused::eager_layer_norm", mutates_args=())
def eager_layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """``F.layer_norm(x, [H], weight, bias, eps)`` over the last dim, as eager computes it (on CUDA torch's
    LayerNorm kernel), the output contiguous: ``R((x - mean) * rsqrt(var + eps) * w + b)``, the biased variance."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).contiguous()


@eager_layer_norm.register_fake
def _(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def kernel_args(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool,
                stores_rstd: bool = False) -> ModulationArgs | None:
    """The plain-RMSNorm arguments of the forward kernel where it computes this norm in eager's order (on CUDA,
    the weight absent or of ``x``'s dtype, rows and a width ``launch.norm_sum_order`` reproduces), else None;
    ``stores_rstd``: its statistics alone."""
    if (x.device.type != "cuda" or x.dtype not in KERNEL_DTYPES or x.dim() < 1 or x.numel() == 0
            or (weight is not None and (weight.dtype != x.dtype or weight.device != x.device))):
        return None
    a = check_args(x=x, weight=weight, eps=eps, policy="bf16", norm_rounds_before_weight=rounds_before_weight,
                   has_norm=True, stores_rstd=stores_rstd)
    return a if norm_sum_order(a.rounding, a.hidden, True, a.static_rows) is not SumOrder.OWN else None


def memory_order(x: Tensor) -> list[int] | None:
    """The permutation of ``x``'s dims into the order of its memory where ``x`` is dense but not contiguous, that
    permutation makes it contiguous and keeps its last dim last (a head's rows transposed, ``[B, heads, T, D]``
    from ``[B, T, heads, D]``, as SD3's attention norms them), and its strides are static; else None."""
    if x.is_contiguous() or not all(isinstance(n, int) for n in (*x.shape, *x.stride())):
        return None
    order = compute_elementwise_output_logical_to_physical_perm(x)[0]
    return order if order[-1] == x.dim() - 1 and x.permute(order).is_contiguous() else None


def _launched_in_memory_order(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool,
                              stores_rstd: bool) -> Tensor | None:
    """The forward kernel's plain RMSNorm of ``x`` (``stores_rstd``: its fp32 ``r``, ``[..., 1]``), the rows of a
    dense ``x`` read in the order of its memory and the output laid out as ``x``; None where ``kernel_args`` says
    the kernel does not reproduce eager's order."""
    order = memory_order(x)
    rows = x if order is None else x.permute(order)
    a = kernel_args(rows, weight, eps, rounds_before_weight, stores_rstd=stores_rstd)
    if a is None:
        return None
    out = (torch.empty((*rows.shape[:-1], 1), dtype=torch.float32, device=a.device) if stores_rstd
           else torch.empty(a.out_shape, dtype=a.dtype, device=a.device))
    with launch_context(a.device, (x, weight, eps, rounds_before_weight)) as wrap:
        launch_modulation(a, None, out, wrap)
    return out if order is None else out.permute(sorted(range(x.dim()), key=order.__getitem__))


@triton_op("h3_fused::eager_rms_norm", mutates_args=())
def eager_rms_norm(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool) -> Tensor:
    """RMSNorm of ``x`` over its last dim, ``r = rsqrt(mean(x32^2) + eps)`` (``x32`` = ``x`` in fp32), bit for bit
    as the eager spelling the graph had computes it, of ``x``'s dtype: ``rounds_before_weight`` false:
    ``R(x32 * r * w32)``, one rounding (``nn.RMSNorm``, ``F.rms_norm``); true: ``R(R(x32 * r) * w)``, the native
    spelling. The forward kernel where ``kernel_args`` says it reproduces eager's order, else
    ``eager_kernels_rms_norm`` (its output contiguous). The kernel reads a dense ``x``'s rows in the order of its
    memory and lays the output out as ``x`` (as the eager spelling's is), so a transposed ``x`` is not copied;
    any other layout is read from a contiguous copy into a contiguous output."""
    y = _launched_in_memory_order(x, weight, eps, rounds_before_weight, stores_rstd=False)
    return eager_kernels_rms_norm(x, weight, eps, rounds_before_weight) if y is None else y


@torch.library.custom_op("h3_fused::eager_kernels_rms_norm_rstd", mutates_args=())
def eager_kernels_rms_norm_rstd(x: Tensor, eps: float, rounds_before_weight: bool) -> Tensor:
    """``eager_rms_norm_rstd`` computed by the eager operations of the spelling the graph had, ``[..., 1]``:

    - ``rounds_before_weight`` false: the ``rstd`` of ``aten._fused_rms_norm`` (on CUDA torch's fused RMSNorm kernel,
      which ``F.rms_norm`` runs);
    - true, the native spelling: ``rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)``.
    """
    if not rounds_before_weight:
        return torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], None, eps)[1].reshape(*x.shape[:-1], 1)
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


@eager_kernels_rms_norm_rstd.register_fake
def _(x: Tensor, eps: float, rounds_before_weight: bool) -> Tensor:
    return torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)


@triton_op("h3_fused::eager_rms_norm_rstd", mutates_args=())
def eager_rms_norm_rstd(x: Tensor, eps: float, rounds_before_weight: bool) -> Tensor:
    """The statistics of ``eager_rms_norm(x, weight, eps, rounds_before_weight)``: ``r = rsqrt(mean(x32^2) + eps)``
    per row of ``x`` (``x32`` = ``x`` in fp32), fp32, ``[..., 1]``, bit for bit as the eager spelling computes it
    (the weight takes no part). The forward kernel storing ``r`` where ``kernel_args`` says it reproduces eager's
    order (a dense ``x``'s rows read in the order of its memory, ``r`` laid out as ``x``'s rows), else
    ``eager_kernels_rms_norm_rstd``."""
    r = _launched_in_memory_order(x, None, eps, rounds_before_weight, stores_rstd=True)
    return eager_kernels_rms_norm_rstd(x, eps, rounds_before_weight) if r is None else r
