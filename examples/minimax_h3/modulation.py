"""The model's own modulation helpers and norms, written as the public H3 code writes them."""

from __future__ import annotations

import torch
from torch import nn

from .config import MODALITY_AUDIO, MODALITY_PAD, MODALITY_VIDEO, ROWS_PER_TIMESTEP, Spellings


def _gather(table: torch.Tensor, idx: torch.Tensor, spell: Spellings) -> torch.Tensor:
    if spell.upcast_tables:
        table = table.float()
    if spell.gather == "index_select":
        if idx.dim() != 1:
            return table.index_select(0, idx.reshape(-1)).view(*idx.shape, table.shape[-1])
        return table.index_select(0, idx)
    return table[idx]


def modulate_scale_shift(x, shift, scale, idx, *, dtype, spell: Spellings = Spellings()):
    """``(x * (1 + scale[idx]) + shift[idx]).to(dtype)``."""
    idx = idx.to(device=x.device, dtype=torch.long)
    scale_rows = _gather(scale, idx, spell)
    one_plus = 1.0 + scale_rows if spell.one_plus_first else scale_rows + 1
    out = x * one_plus + _gather(shift, idx, spell)
    return out.to(dtype) if spell.trailing_to else out


def modulate_gate(x, gate, other, idx, *, dtype, spell: Spellings = Spellings()):
    """``(x + gate[idx] * other).to(dtype)``."""
    idx = idx.to(device=x.device, dtype=torch.long)
    gate_rows = _gather(gate, idx, spell)
    gated = gate_rows * other if spell.gate_first else other * gate_rows
    out = x + gated
    return out.to(dtype) if spell.trailing_to else out


class NativeRMSNorm(nn.Module):
    """vLLM-style RMSNorm: fp32 statistics, cast back, then the weight: ``R(R(x32 * r) * w)``."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        x = x.to(orig_dtype)
        return x * self.weight


def make_rms_norm(hidden_size: int, eps: float, dtype, spell: Spellings, device=None) -> nn.Module:
    if spell.norm == "native":
        return NativeRMSNorm(hidden_size, eps, dtype=dtype, device=device)
    return nn.RMSNorm(hidden_size, eps=eps, dtype=dtype, device=device)


def build_table_index(timesteps: torch.Tensor, modality: torch.Tensor, dtype=torch.int64):
    """Per-token AdaLN table row: ``inverse_timestep_index * 3 + modality.clamp(min=0)``.

    ``timesteps`` (float ``[...]``) and ``modality`` (int ``[...]``; -1 pad, 0 video, 1 text, 2 audio)
    have the token shape. Returns ``(unique_timesteps [M], index [...] of dtype)``; padding uses the
    video row of its timestep.
    """
    if timesteps.shape != modality.shape:
        raise ValueError(f"timesteps {tuple(timesteps.shape)} and modality {tuple(modality.shape)} differ")
    if modality.numel() and (modality.min() < MODALITY_PAD or modality.max() > MODALITY_AUDIO):
        raise ValueError("modality tags must be -1 (pad), 0 (video), 1 (text) or 2 (audio)")
    unique, inverse = torch.unique(timesteps, return_inverse=True)
    row = inverse * ROWS_PER_TIMESTEP + modality.clamp(min=MODALITY_VIDEO)
    return unique, row.to(dtype)
