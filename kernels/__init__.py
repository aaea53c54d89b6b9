"""Fused AdaLN modulation kernels of h3_fused: Triton on CUDA, pure torch elsewhere.

``norm_modulate`` (site A), ``gate_norm_modulate`` (site B) and ``gate_residual`` (site C) are registered as
``torch.ops.h3_fused.*`` (``ops.py``) with their autograd formulas (``autograd.py``) and backward
(``backward.py``), and these functions call them (in eager, their bodies directly: ``direct_call.py``);
``contract.py`` states where they round, ``policy.py`` the policies. ``eager_rms_norm``
(``torch.ops.h3_fused.eager_rms_norm``) is an RMSNorm with eager's bits (the forward kernel as a plain norm where
it reproduces eager's order, else eager's own ops), for the norms outside the sites (``eager_norm.py``).
"""

from . import autograd  # noqa: F401  (registers the forward ops' autograd formulas)
from .backward import modulation_backward
from .contract import Rounding, SumOrder, rounding_for
from .eager_norm import eager_rms_norm
from .ops import gate_norm_modulate, gate_residual, norm_modulate
from .policy import POLICIES, resolve_policy

__all__ = ["POLICIES", "Rounding", "SumOrder", "eager_rms_norm", "gate_norm_modulate", "gate_residual",
           "modulation_backward", "norm_modulate", "resolve_policy", "rounding_for"]
