"""The dtype-boundary policies and how ``"auto"`` resolves on a device.

``bf16``  every rounding the unfused (eager) graph performs happens at the same point, with no FMA
          contraction across a rounding point, and on CUDA the norm's fp32 sum in the order of the eager
          kernel the spelling runs, where reproduced (``contract.Rounding.norm_sum_order``): bit-identical
          to eager there, elsewhere up to the order of that sum.
``fp32``  the gated residual is rounded where the graph stores it (the exact ``res + gate*branch``
          rounded once); everything after it stays fp32 and the output is rounded once.
``auto``  ``bf16`` on CUDA devices of compute capability 9.x (H100/H200), where the public H3 accuracy
          CI needed eager numerics; ``fp32`` on other CUDA devices (precedent: B300); ``bf16`` on the
          CPU and any other device, where eager-exactness is the only precedent we have.
"""

from __future__ import annotations

import torch

POLICIES = ("auto", "bf16", "fp32")


def check_policy(policy: object) -> str:
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def resolve_policy(policy: str, device: torch.device | str) -> str:
    """``"bf16"`` or ``"fp32"`` for ``policy`` on ``device`` (see the module docstring)."""
    check_policy(policy)
    if policy != "auto":
        return policy
    device = torch.device(device)
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return "bf16" if major == 9 else "fp32"
    return "bf16"
