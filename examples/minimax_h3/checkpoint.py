"""Weights in safetensors files, with the upstream key names (``blocks.{i}.norm1.weight``, ...)."""

from __future__ import annotations

import os

import torch
from torch import nn


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: lists every missing, unexpected or mis-shaped key."""


def save_checkpoint(model: nn.Module, path: str | os.PathLike) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}, str(path))


def load_checkpoint(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> nn.Module:
    """Copy the tensors of ``path`` into ``model`` (cast to each parameter's dtype and device)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    misshaped = [f"{k}: checkpoint {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
                 for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if misshaped:
        problems.append(f"mis-shaped keys: {'; '.join(misshaped)}")
    if unexpected and strict:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError(f"checkpoint {os.fspath(path)!r} does not fit the model: " + " | ".join(problems))
    with torch.no_grad():
        for key, value in expected.items():
            value.copy_(tensors[key].to(value.dtype))
    return model
