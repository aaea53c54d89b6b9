"""Options of the h3_fused backend and pass.

``dtype_policy``: ``"auto"`` (default), ``"bf16"`` or ``"fp32"`` (see ``h3_fused.kernels.policy``).
Every other key is an Inductor config option, passed through unchanged. Under the ``bf16`` policy the
backend also turns on Inductor's ``emulate_precision_casts`` (eager rounding for the parts of the
graph that are not modulation sites) unless the caller set it.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3_fused.kernels.policy import POLICIES

OWN_KEYS = ("dtype_policy",)


@dataclass(frozen=True)
class FusionOptions:
    dtype_policy: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype_policy, str) or self.dtype_policy not in POLICIES:
            raise ValueError(f"dtype_policy must be one of {POLICIES}, got {self.dtype_policy!r}")

    @classmethod
    def split(cls, options: dict | None) -> tuple[FusionOptions, dict]:
        """``(our options, Inductor options)`` from ``torch.compile(..., options=...)``."""
        options = dict(options or {})
        unknown_own = [k for k in options if k.startswith("h3_fused") or k in ("policy",)]
        if unknown_own:
            raise ValueError(f"unknown h3_fused option(s) {unknown_own}; known: {list(OWN_KEYS)}")
        ours = {k: options.pop(k) for k in OWN_KEYS if k in options}
        return cls(**ours), options
