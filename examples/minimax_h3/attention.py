"""Self-attention of an H3 block: fused QKV, q/k RMSNorm, 3-D RoPE, SDPA over packed segments.

Under Ulysses sequence parallelism (``parallel.py``) each rank projects its own rows, an all-to-all
trades rows for heads, attention runs over the whole sequence for the local heads, and a second
all-to-all trades them back.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import H3Config


def rope_frequencies(positions: torch.Tensor, cfg: H3Config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[T, rope_dims // 2]`` for integer (frame, height, width) positions ``[T, 3]``."""
    per_axis = cfg.rope_dims // 3
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, per_axis, 2, dtype=torch.float32,
                                                 device=positions.device) / per_axis))
    angles = torch.cat([positions[:, a : a + 1].float() * inv for a in range(3)], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """Rotate the first ``rope_dims`` of the head dim of ``x [T, heads, D]`` (interleaved pairs)."""
    rot, rest = x[..., :rope_dims].float(), x[..., rope_dims:]
    even, odd = rot[..., 0::2], rot[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def packed_sdpa(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """SDPA per segment of packed ``[T, heads, D]`` tensors; ``cu_seqlens`` = segment starts + [T]."""
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seg = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*seg).squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def masked_sdpa(q, k, v, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """One SDPA over all tokens with a block-diagonal mask: the same attention as ``packed_sdpa``
    without host-side segment bounds, so it compiles without a graph break."""
    pos = torch.arange(q.shape[0], device=q.device)
    segment = torch.searchsorted(cu_seqlens.to(q.device), pos, right=True)
    mask = segment[:, None] == segment[None, :]
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).squeeze(0).transpose(0, 1)


class Attention(nn.Module):
    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, device=device)
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.inner_dim, bias=True, **kw)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps, **kw)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.eps, **kw)
        self.out = nn.Linear(cfg.inner_dim, cfg.hidden_size, bias=True, **kw)
        self.sequence_parallel = None  # set by parallel.enable_ulysses

    def forward(self, x, positions, cu_seqlens):
        if self.cfg.inline_attention:
            return self._attend(x, positions, cu_seqlens)
        return _attend_island(self, x, positions, cu_seqlens)

    def _attend(self, x, positions, cu_seqlens):
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        heads, dim = self.cfg.num_heads, self.cfg.head_dim
        qkv = self.qkv(x).view(x.shape[0], 3, heads, dim)
        sp = self.sequence_parallel
        if sp is not None:
            qkv = sp.rows_to_heads(qkv)
        q, k, v = qkv.unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_frequencies(positions, self.cfg)
        q = apply_rope(q, cos, sin, self.cfg.rope_dims)
        k = apply_rope(k, cos, sin, self.cfg.rope_dims)
        o = (masked_sdpa if self.cfg.inline_attention else packed_sdpa)(q, k, v, cu_seqlens)
        if sp is not None:
            o = sp.heads_to_rows(o)
        return self.out(o.reshape(o.shape[0], -1)).view(*lead, -1)


@torch.compiler.disable
def _attend_island(module: Attention, x, positions, cu_seqlens):
    """Upstream keeps attention out of the compiled graph; this is that island."""
    return module._attend(x, positions, cu_seqlens)
