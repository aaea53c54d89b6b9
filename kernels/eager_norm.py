"""``h3_fused::eager_rms_norm``: an RMSNorm computed by eager's own kernels, which Inductor calls as they are.

Inductor compiles a norm's fp32 sum of squares in its own order, which on CUDA differs from the order of the
kernel eager runs: the sum, and so the norm's output, differs from eager's in the last place of single elements
(of the order of one in 10^5), and one such flip reaches every output of a model a few blocks later. Under the
``bf16`` policy the pass therefore puts this op where a graph has an RMSNorm that is not part of a modulation site
(the attention's per-head q/k norms, a token refiner's norms): Inductor cannot look inside a custom op, so the
norm is eager's, bit for bit, on every device and torch version, at the price of the fusion Inductor would have
made of it with its neighbours (the normalized rows are written and read once more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.library.custom_op("h3_fused::eager_rms_norm", mutates_args=())
def eager_rms_norm(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool) -> Tensor:
    """RMSNorm of ``x`` over its last dim, ``r = rsqrt(mean(x32^2) + eps)`` (``x32`` = ``x`` in fp32), computed by
    the eager operations of the spelling the graph had, the output contiguous and of ``x``'s dtype:

    - ``rounds_before_weight`` false: ``R(x32 * r * w32)``, one rounding, as ``nn.RMSNorm`` and ``F.rms_norm``
      compute it: ``F.rms_norm`` (on CUDA torch's fused RMSNorm kernel);
    - true: ``R(R(x32 * r) * w)``, the native spelling: ``x.float().pow(2).mean(-1, keepdim=True)`` (torch's
      generic reduction), ``rsqrt``, the product cast to ``x``'s dtype, then the weight multiplied in that dtype.
    """
    if not rounds_before_weight:
        out = F.rms_norm(x, (x.shape[-1],), weight, eps)
    else:
        x32 = x.float()
        out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        if weight is not None:
            out = out * weight.to(x.dtype)
    return out.contiguous()


@eager_rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float, rounds_before_weight: bool) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
