"""Regional static compile: every instance of a repeated block class shares one compiled forward."""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from .backend import h3_fused_backend
from .options import FusionOptions


def find_repeated_block_classes(model: nn.Module) -> list[type]:
    """The classes of modules that appear two or more times inside ``nn.ModuleList``s of ``model`` (a model's
    stack of transformer blocks): each is compiled once and the compiled forward serves every instance."""
    seen = Counter(type(m) for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst)
    return [cls for cls, n in seen.items() if n > 1]


def _backend(options: dict | None, mode: str | None):
    """The h3_fused backend with these options, under a name that says so in Dynamo's messages."""

    def h3_fused(gm, example_inputs):
        return h3_fused_backend(gm, example_inputs, options=options, mode=mode)

    return h3_fused


def compile_repeated_blocks(model: nn.Module, block_classes: list[type] | None = None, *,
                            dynamic: bool = False, dynamic_token_dim: int | None = None,
                            options: dict | None = None, mode: str | None = None) -> nn.Module:
    """Compile each repeated block class of ``model`` once with the h3_fused backend, in place.

    A block class is repeated when two or more of its instances sit in ``nn.ModuleList``s of ``model``
    (``find_repeated_block_classes``), or it is named in ``block_classes``. One ``torch.compile``d forward per
    class serves every instance (parameters are graph inputs). ``dynamic=False`` by default;
    ``dynamic_token_dim=d`` marks dim ``d`` of every tensor argument with more than ``d`` dims as dynamic
    instead (the token count), so one graph serves every T. ``options`` are checked here (``FusionOptions``).
    Returns ``model``.
    """
    FusionOptions.split(options)  # an unknown or misspelled option fails here, not at the first call
    if dynamic_token_dim is not None and (not isinstance(dynamic_token_dim, int) or dynamic_token_dim < 0):
        raise ValueError(f"dynamic_token_dim must be a non-negative int, got {dynamic_token_dim!r}")
    classes = block_classes if block_classes is not None else find_repeated_block_classes(model)
    if not classes:
        raise ValueError("no repeated block classes in the model (a class with two or more instances in an "
                         "nn.ModuleList); pass block_classes=")
    present = {type(m) for m in model.modules()}
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"block_classes must hold nn.Module subclasses, got {cls!r}")
        if cls not in present:
            raise ValueError(f"block class {cls.__name__} has no instance in the model")
    compiled = {cls: torch.compile(cls.forward, backend=_backend(options, mode),
                                   dynamic=None if dynamic_token_dim is not None else dynamic)
                for cls in classes}
    for module in model.modules():
        forward = compiled.get(type(module))
        if forward is not None:
            module.forward = functools.partial(_call_compiled, forward, module, dynamic_token_dim)
    return model


def _call_compiled(forward, module, token_dim, *args, **kwargs):
    if token_dim is not None:
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim() > token_dim]
        if not tensors:
            raise ValueError(f"dynamic_token_dim={token_dim}: no tensor argument of {type(module).__name__} has "
                             f"a dim {token_dim}")
        for a in tensors:
            if a.shape[token_dim] > 1:
                torch._dynamo.maybe_mark_dynamic(a, token_dim)
    return forward(module, *args, **kwargs)
