"""Options of the h3_fused backend and pass.

``dtype_policy``: ``"auto"`` (default), ``"bf16"`` or ``"fp32"`` (see ``h3_fused.kernels.policy``).
``eager_norms``: under ``bf16``, compute every RMSNorm and LayerNorm outside the sites as eager does
(``h3_fused::eager_rms_norm``, ``h3_fused::eager_layer_norm``), so that its output is eager's bit for bit
(default True; False leaves such norms to Inductor, which fuses them with their neighbours in its own order).
Every other key is an Inductor config option, passed through unchanged; any other key is refused where the
options are read, with the nearest known key. Under the ``bf16`` policy the
backend also turns on Inductor's settings for eager's numerics in the parts of the graph that are not
modulation sites (``emulate_precision_casts``, ``eager_numerics.division_rounding`` and
``eager_numerics.disable_ftz``: ``backend.EAGER_NUMERICS``) unless the caller set them.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import torch._inductor.config as inductor_config
from h3_fused.kernels.policy import POLICIES

OWN_KEYS = ("dtype_policy", "eager_norms")


@dataclass(frozen=True)
class FusionOptions:
    dtype_policy: str = "auto"
    eager_norms: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.dtype_policy, str) or self.dtype_policy not in POLICIES:
            raise ValueError(f"dtype_policy must be one of {POLICIES}, got {self.dtype_policy!r}")
        if not isinstance(self.eager_norms, bool):
            raise ValueError(f"eager_norms must be True or False, got {self.eager_norms!r}")

    @classmethod
    def split(cls, options: dict | None) -> tuple[FusionOptions, dict]:
        """``(our options, Inductor options)`` from ``torch.compile(..., options=...)``; a key that is neither
        ours nor Inductor's raises ``ValueError`` naming it, with the nearest known key."""
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict, got {type(options).__name__}")
        options = dict(options or {})
        inductor_keys = inductor_config.get_config_copy().keys()
        for key in options:
            if key not in OWN_KEYS and key not in inductor_keys:
                near = difflib.get_close_matches(key, [*OWN_KEYS, *inductor_keys], n=1)
                raise ValueError(f"unknown option {key!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + f": h3_fused takes {', '.join(OWN_KEYS)} and the options of torch._inductor.config")
        ours = {k: options.pop(k) for k in OWN_KEYS if k in options}
        return cls(**ours), options
