"""Flow-matching Euler sampling: ``x <- x + (sigma_next - sigma) * v(x, layout(sigma))``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .model import TokenLayout


def euler_sample(model: Callable[[torch.Tensor, TokenLayout], torch.Tensor], noise: torch.Tensor,
                 layout_at: Callable[[float], TokenLayout], *, steps: int,
                 on_step: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Integrate the flow from sigma=1 (noise) to sigma=0 in ``steps`` equal Euler steps.

    ``layout_at(sigma)`` gives the token layout at that noise level (its per-token timesteps decide the
    AdaLN rows). ``on_step(i, x)`` sees the fp32 latent after step ``i``.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    x = noise.float()
    for i in range(steps):
        v = model(x, layout_at(sigmas[i]))
        x = x + (sigmas[i + 1] - sigmas[i]) * v.float()
        if on_step is not None:
            on_step(i, x)
    return x
