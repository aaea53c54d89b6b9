"""Regional static compile: every instance of a repeated block class shares one compiled forward."""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from .backend import h3_fused_backend


def find_repeated_block_classes(model: nn.Module) -> list[type]:
    """Classes of modules that appear more than once inside ``nn.ModuleList``s of ``model``."""
    seen = Counter(type(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst)
    return [cls for cls, n in seen.items() if n > 1]


def compile_repeated_blocks(model: nn.Module, block_classes: list[type] | None = None, *,
                            dynamic: bool = False, dynamic_token_dim: int | None = None,
                            options: dict | None = None, mode: str | None = None) -> nn.Module:
    """Compile each repeated block of ``model`` on its own with the h3_fused backend, in place.

    One ``torch.compile``d forward per block class serves every instance (parameters are graph
    inputs). ``dynamic=False`` by default; ``dynamic_token_dim=d`` marks dim ``d`` of every tensor
    argument with that many dims or more as dynamic instead (the token count), so one graph serves
    every T. Returns ``model``.
    """
    classes = block_classes if block_classes is not None else find_repeated_block_classes(model)
    if not classes:
        raise ValueError("no repeated block classes found in the model; pass block_classes=")
    compiled = {}
    for cls in classes:
        compiled[cls] = torch.compile(cls.forward, backend=functools.partial(h3_fused_backend, options=options,
                                                                             mode=mode),
                                      dynamic=None if dynamic_token_dim is not None else dynamic)
    for module in model.modules():
        forward = compiled.get(type(module))
        if forward is not None:
            module.forward = functools.partial(_call_compiled, forward, module, dynamic_token_dim)
    return model


def _call_compiled(forward, module, token_dim, *args, **kwargs):
    if token_dim is not None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.dim() > token_dim and a.shape[token_dim] > 1:
                torch._dynamo.maybe_mark_dynamic(a, token_dim)
    return forward(module, *args, **kwargs)
