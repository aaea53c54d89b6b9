"""Fused AdaLN modulation kernels of h3_fused: Triton on CUDA, pure torch elsewhere.

``norm_modulate`` (site A), ``gate_norm_modulate`` (site B) and ``gate_residual`` (site C) are registered as
``torch.ops.h3_fused.*`` (``ops.py``) with their autograd formulas (``autograd.py``) and backward
(``backward.py``), and these functions call them (in eager, their bodies directly: ``direct_call.py``);
``contract.py`` states where they round, ``policy.py`` the policies. ``eager_rms_norm``
(``torch.ops.h3_fused.eager_rms_norm``) is an RMSNorm with eager's bits (the forward kernel as a plain norm where
it reproduces eager's order, else eager's own ops), ``eager_rms_norm_rstd`` its statistics alone, and
``eager_layer_norm`` a LayerNorm by eager's own op, for the norms outside the sites (``eager_norm.py``).
"""

if __name__ != "h3_fused.kernels":  # the repository root is on sys.path, and its kernels/ folder was found first
    raise ImportError(
        f"{__file__} is h3_fused's kernels folder (h3_fused.kernels), imported here as the top-level package "
        f"{__name__!r}: the repository root is on sys.path (a REPL, `python -c` or `python -m` started there), where "
        "this folder hides the kernel-hub package `kernels` that transformers, peft and diffusers import. Start "
        "Python in another directory, or with `python -P` (PYTHONSAFEPATH=1), and import h3_fused.")

from . import autograd  # noqa: E402, F401  (registers the forward ops' autograd formulas)
from .backward import modulation_backward  # noqa: E402
from .contract import Rounding, SumOrder, rounding_for  # noqa: E402
from .eager_norm import eager_layer_norm, eager_rms_norm, eager_rms_norm_rstd  # noqa: E402
from .ops import gate_norm_modulate, gate_residual, norm_modulate  # noqa: E402
from .policy import POLICIES, resolve_policy  # noqa: E402

__all__ = ["POLICIES", "Rounding", "SumOrder", "eager_layer_norm", "eager_rms_norm", "eager_rms_norm_rstd",
           "gate_norm_modulate", "gate_residual",
           "modulation_backward", "norm_modulate", "resolve_policy", "rounding_for"]
