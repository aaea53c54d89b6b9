"""The ``h3_fused`` torch.compile backend: Inductor with ``H3FusionPass`` as its post-grad pass.

    torch.compile(model, backend="h3_fused", options={"dtype_policy": "bf16"})

``options`` other than ``dtype_policy`` and ``mode=`` behave as they do for Inductor. A post-grad
custom pass the user already set (one, or on torch 2.13 on a list of them) is chained after ours, never dropped.
"""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
from h3_fused.kernels.policy import resolve_policy
from torch._inductor import list_mode_options
from torch._inductor.compile_fx import compile_fx

from .graph_pass import H3FusionPass
from .options import FusionOptions


def _user_post_pass_setting(inductor_options: dict):
    """The post-grad pass setting the user made (in ``options`` or the global config)."""
    return inductor_options.pop("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)


def graph_device(example_inputs) -> torch.device:
    """The device the graph computes on: that of its first tensor input on an accelerator, else CPU."""
    devices = [t.device for t in example_inputs if isinstance(t, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def make_config_patches(options: dict | None = None, mode: str | None = None,
                        device: torch.device = torch.device("cpu")) -> dict:
    """Inductor config patches for one compile: mode options, the caller's options, and our pass."""
    fusion, inductor_options = FusionOptions.split(options)
    patches = dict(list_mode_options(mode)) if mode else {}
    if resolve_policy(fusion.dtype_policy, device) == "bf16":
        patches["emulate_precision_casts"] = True
    chained = _user_post_pass_setting(inductor_options)
    patches.update(inductor_options)
    patches["post_grad_custom_post_pass"] = H3FusionPass(fusion, chained)
    return patches


def h3_fused_backend(gm: torch.fx.GraphModule, example_inputs, *, options: dict | None = None,
                     mode: str | None = None):
    """Compile ``gm`` with Inductor and the h3_fused pass (the ``"h3_fused"`` backend)."""
    patches = make_config_patches(options, mode, graph_device(example_inputs))
    return compile_fx(gm, example_inputs, config_patches=patches)
