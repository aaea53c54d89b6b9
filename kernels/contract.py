"""The rounding contract: where a fused site rounds to the activation dtype, forward and backward.

Written once, here, and mapped one for one onto the kernels' constexprs (``forward_kernel`` and
``backward_kernel``: ``ROUND_*`` and ``FUSE_MULTIPLY_ADD``) and onto the pure-torch reference
(``reference.py``). ``R_A(v)`` is ``v`` rounded to nearest even in the activation dtype ``A``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class SumOrder(enum.IntEnum):
    """The order in which a norm adds its fp32 squares (the forward kernel's ``NORM_SUM_ORDER``, by value).

    OWN: the kernel's own order (any order is within ``fp32``).
    FUSED_RMS_NORM: the order of torch's fused RMSNorm CUDA kernel, which ``nn.RMSNorm`` and ``F.rms_norm`` run.
    MEAN: the order of torch's generic reduction, which the native RMSNorm's ``x.pow(2).mean(-1)`` runs.
    FUSED_LAYER_NORM: the order and arithmetic of torch's LayerNorm CUDA kernel (its vectorized path), which
    ``nn.LayerNorm`` and ``F.layer_norm`` run: Welford's online mean and sum of squared deviations per thread,
    then Welford's combines (``forward_kernel._welford_step``, ``_eager_welford_total``).
    """

    OWN = 0
    FUSED_RMS_NORM = 1
    MEAN = 2
    FUSED_LAYER_NORM = 3


# from this H torch's generic reduction reads a row in 4-element vectors (``setReduceConfig``), below it element by
# element: the lanes' sums of ``SumOrder.MEAN`` take the one layout or the other
MEAN_VECTORS_MIN_H = 128


@dataclass(frozen=True)
class Rounding:
    """Where the fused computation rounds to the activation dtype ``A`` (``R_A``), besides the stored
    residual ``u = R_A(res + gate*branch)`` and the output ``y = R_A(...)``, which always round.

    gate_product: ``g = R_A(gate[idx] * branch)`` before the residual add (bf16/fp16 gate tables).
    norm_output: ``n = R_A(norm(u))`` (the norm returns the activation dtype; not where the graph normalizes the
    activations upcast to fp32 and keeps the norm's output in fp32).
    norm_before_weight: ``n = R_A(R_A(u * r) * w)`` (the native RMSNorm) instead of ``R_A(u * r * w)``.
    affine: ``p = R_A(1 + scale[idx])``, ``q = R_A(n * p)`` (bf16/fp16 modulation tables).
    fused_multiply_add: ``res + gate[idx] * branch`` and ``n * p + shift[idx]`` may each be one fused
    multiply-add, without the fp32 rounding of the product (``fp32`` only). With the gate table in the
    activation dtype (bf16/fp16) the stored residual is the exact sum rounded once to it
    (``reference.sum_rounded_once``); with an fp32 gate table, the sum rounded to fp32 and then to ``A``.
    The affine is an fp32 FMA, as the upstream fp32 kernels compile it.
    row_sum: modulation rows given with an ``[H]`` row added to each (``rows + bias``, Wan's and LTX-Video's
    ``scale_shift_table + temb`` per token) are the fp32 sum of the two rounded to their dtype ``S``, as the graph's
    add rounds it, where ``S`` (both operands') is bf16 or fp16; else the fp32 sum, unrounded (its dtype's, where
    ``S`` is fp32; ``fp32``: no rounding). The rows' dtype in the fields above is ``S``.
    norm_sum_order: the eager CUDA kernel whose order of the norm's fp32 sum of squares, and whose mean, the
    forward kernel reproduces, so that ``r`` is eager's bit for bit: ``SumOrder.FUSED_RMS_NORM`` for
    ``nn.RMSNorm`` and ``F.rms_norm`` (one rounding, ``norm_before_weight`` false); ``SumOrder.MEAN`` for the
    native RMSNorm; ``SumOrder.FUSED_LAYER_NORM`` for a LayerNorm (its mean and variance); ``SumOrder.OWN``: the
    kernel's own order. Reproduced where eager takes the path measured
    (``launch.norm_sum_order`` says where: ``H`` a multiple of 4, rows aligned to 4 elements, which the launch
    does not check of a view; for ``MEAN`` at least 16 rows).

    The backward rounds the activation gradients where eager's autograd of the same graph rounds them,
    which the same fields decide (``dy``, ``du`` are the incoming gradients of ``y`` and ``u``, ``xhat = u*r``):

    - ``norm_output``: the gradient reaching the norm's output is ``dn = R_A(dy * p)`` (else fp32: the norm's
      output and the affine are fp32 in the graph).
    - ``input_gradient``: the norm's input gradient ``du_n = R_A(r * (dxhat - xhat * mean(dxhat * xhat)))``
      (a LayerNorm's: ``R_A(r * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)))``, ``xhat = (u - mean) * r``)
      and at site B the residual's gradient ``du_t = R_A(du + du_n)`` (two gradients of one ``A`` tensor, summed
      in ``A`` as autograd sums them): the norm's input is ``A`` (or its fp32 upcast, whose backward rounds to
      ``A``). Otherwise (``fp32`` policy, fp32 activations) all of it stays fp32 up to the outputs.
    - ``norm_before_weight``: ``dxhat = R_A(dn * w)`` (the native RMSNorm's bf16 multiply by the weight),
      else ``dxhat = dn * w`` in fp32.
    - Every output rounds once to its tensor's dtype: ``dx``/``dresidual`` = ``du_t``,
      ``dbranch = R_A(du_t * gate[idx])``.
    - Table and weight gradients are sums over all rows of fp32 products (``dshift = sum(dy)``,
      ``dscale = sum(dy * n)``, ``dgate = sum(du_t * branch)``, ``dw = sum(dn * xhat)``, or ``* R_A(xhat)``
      with ``norm_before_weight``), accumulated in fp32 in a fixed order and rounded once to the
      parameter's dtype, under both policies (eager sums gathered rows' gradients in the parameter's dtype, by
      atomics on CUDA). Where that dtype is fp32 the sum is Kahan-compensated (the reference sums in fp64): its
      error then stays near the one rounding however many rows it sums.

    The backward recomputes ``r`` and sums ``mean(dxhat * xhat)`` in its own order (``norm_sum_order`` is the
    forward's): where that order differs from eager's, ``du_n`` may differ in the last place of ``A``.
    """

    gate_product: bool
    norm_output: bool
    norm_before_weight: bool
    affine: bool
    fused_multiply_add: bool = False
    norm_sum_order: SumOrder = SumOrder.OWN
    input_gradient: bool = False
    row_sum: bool = False


LOW_PRECISION = (torch.bfloat16, torch.float16)


def rounding_for(policy: str, activation: torch.dtype, gate_table: torch.dtype | None,
                 mod_table: torch.dtype | None, *, norm_rounds_before_weight: bool,
                 upcast_tables: bool, norm_in_fp32: bool = False, layer_norm: bool = False,
                 row_sum: torch.dtype | None = None) -> Rounding:
    """The rounding points of the eager graph under ``bf16``; only the stored ones under ``fp32``.
    ``norm_in_fp32``: the graph normalizes the activations upcast to fp32 and keeps the norm's output (and so
    the affine) in fp32; ``layer_norm``: its norm is a LayerNorm; ``row_sum``: the dtype of the sum of given rows
    and a row added to them (None without; ``gate_table`` and ``mod_table`` are then that dtype)."""
    if policy == "fp32":
        return Rounding(False, False, False, False, fused_multiply_add=True)
    sum_order = SumOrder.FUSED_LAYER_NORM if layer_norm else SumOrder.MEAN if norm_rounds_before_weight else SumOrder.FUSED_RMS_NORM
    rounds_row_sum = row_sum in LOW_PRECISION
    if activation in (torch.float32, torch.float64):  # nothing to round to but the rows' sum
        return Rounding(False, False, False, False, norm_sum_order=sum_order, row_sum=rounds_row_sum)

    def low(table):
        return table is not None and table == activation and not upcast_tables

    return Rounding(gate_product=low(gate_table), norm_output=not norm_in_fp32,
                    norm_before_weight=norm_rounds_before_weight, affine=low(mod_table) and not norm_in_fp32,
                    norm_sum_order=sum_order, input_gradient=True, row_sum=rounds_row_sum)


def compensated(gradient_of: torch.Tensor | None) -> bool:
    """Whether the sum over rows of the gradient of ``gradient_of`` (a table or the weight) is compensated (the
    kernel's Kahan sum, the reference's fp64 one): where it is rounded to fp32, which would not hide an fp32 sum's
    own error."""
    return gradient_of is not None and gradient_of.dtype == torch.float32
