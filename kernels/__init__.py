"""Fused AdaLN modulation kernels of h3_fused: Triton on CUDA, pure torch elsewhere.

``norm_modulate`` (site A), ``gate_norm_modulate`` (site B) and ``gate_residual`` (site C) are
registered as ``torch.ops.h3_fused.*``, and these functions call them (in eager, their bodies directly:
``direct_call.py``); see ``ops.py`` for the math and ``policy.py`` for policies.
"""

from .contract import Rounding, rounding_for
from .ops import gate_norm_modulate, gate_residual, norm_modulate
from .policy import POLICIES, resolve_policy

__all__ = ["POLICIES", "Rounding", "gate_norm_modulate", "gate_residual", "norm_modulate", "resolve_policy",
           "rounding_for"]
