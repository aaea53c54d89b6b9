"""Time embedding, AdaLN projection, MLP, the DiT block and the final layer of the H3 stand-in."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attention import Attention
from .config import ROWS_PER_TIMESTEP, H3Config
from .modulation import make_rms_norm, modulate_gate, modulate_scale_shift

ADALN_CHUNKS = 6


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimeEmbedder(nn.Module):
    """fp32: sinusoidal ``time_freq_dim`` -> ``time_hidden_dim`` -> ``time_embed_dim``."""

    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.freq_dim = cfg.time_freq_dim
        self.fc1 = nn.Linear(cfg.time_freq_dim, cfg.time_hidden_dim, device=device)
        self.fc2 = nn.Linear(cfg.time_hidden_dim, cfg.time_embed_dim, device=device)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(sinusoidal_embedding(t, self.freq_dim))))


class AdaLNProj(nn.Module):
    """``silu(t_emb).to(dtype) -> Linear(E, 18H) -> view(3M, 6H) -> chunk(6, -1)``.

    Returns six ``[3M, H]`` tables that are strided views (row stride 6H) of one buffer.
    """

    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.table_dtype = torch.float32 if cfg.spellings.fp32_tables else cfg.dtype
        self.hidden = cfg.hidden_size
        self.linear = nn.Linear(cfg.time_embed_dim, ROWS_PER_TIMESTEP * ADALN_CHUNKS * cfg.hidden_size,
                                dtype=self.table_dtype, device=device)

    def forward(self, t_emb: torch.Tensor):
        out = self.linear(F.silu(t_emb).to(self.table_dtype))
        return out.view(-1, ADALN_CHUNKS * self.hidden).chunk(ADALN_CHUNKS, dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        kw = dict(dtype=cfg.dtype, device=device)
        self.fc1 = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_dim, bias=True, **kw)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=True, **kw)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class H3Block(nn.Module):
    """One DiT block: three modulation sites around attention and the MLP (spec section 1)."""

    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.spell = cfg.spellings
        self.norm1 = make_rms_norm(cfg.hidden_size, cfg.eps, cfg.dtype, self.spell, device)
        self.attn = Attention(cfg, device)
        self.norm2 = make_rms_norm(cfg.hidden_size, cfg.eps, cfg.dtype, self.spell, device)
        self.mlp = SwiGLU(cfg, device)

    def forward(self, x, tables, index, positions, cu_seqlens):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = tables
        dtype, spell = x.dtype, self.spell
        res = x
        h = self.norm1(x)
        h = modulate_scale_shift(h, shift_msa, scale_msa, index, dtype=dtype, spell=spell)
        h = self.attn(h, positions, cu_seqlens)
        x = modulate_gate(res, gate_msa, h, index, dtype=dtype, spell=spell)
        res = x
        h = self.norm2(x)
        h = modulate_scale_shift(h, shift_mlp, scale_mlp, index, dtype=dtype, spell=spell)
        h = self.mlp(h)
        return modulate_gate(res, gate_mlp, h, index, dtype=dtype, spell=spell)


class FinalLayer(nn.Module):
    """``norm(x)``, modulate with ``[M, H]`` tables (row stride 2H) by timestep, project, ``.to(fp32)``."""

    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.spell = cfg.spellings
        self.hidden = cfg.hidden_size
        table_dtype = torch.float32 if cfg.spellings.fp32_tables else cfg.dtype
        self.norm = make_rms_norm(cfg.hidden_size, cfg.eps, cfg.dtype, self.spell, device)
        self.adaln = nn.Linear(cfg.time_embed_dim, 2 * cfg.hidden_size, dtype=table_dtype, device=device)
        self.proj = nn.Linear(cfg.hidden_size, cfg.in_channels, dtype=cfg.dtype, device=device)

    def forward(self, x, t_emb, timestep_index):
        shift, scale = self.adaln(F.silu(t_emb).to(self.adaln.weight.dtype)).chunk(2, dim=-1)
        h = modulate_scale_shift(self.norm(x), shift, scale, timestep_index, dtype=x.dtype, spell=self.spell)
        return self.proj(h).to(torch.float32)
