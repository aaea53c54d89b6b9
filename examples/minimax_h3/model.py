"""The H3 DiT stand-in: unfused, spelled like the public model, with random or loaded weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import MODALITY_AUDIO, MODALITY_PAD, MODALITY_TEXT, MODALITY_VIDEO, H3Config
from .layers import AdaLNProj, FinalLayer, H3Block, TimeEmbedder
from .modulation import build_table_index


@dataclass
class TokenLayout:
    """Per-token bookkeeping of one forward, built once outside the model's compiled region.

    timesteps: the M distinct timesteps (fp32 ``[M]``). index: AdaLN table row per token
    (``inverse * 3 + modality``). timestep_index: the ``inverse`` itself (final-layer tables).
    positions: (frame, height, width) per token ``[T, 3]``. cu_seqlens: packed segment bounds.
    """

    timesteps: torch.Tensor
    index: torch.Tensor
    timestep_index: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor

    @classmethod
    def build(cls, timesteps, modality, positions, cu_seqlens, index_dtype=torch.int64) -> TokenLayout:
        unique, index = build_table_index(timesteps, modality, dtype=index_dtype)
        _, inverse = torch.unique(timesteps, return_inverse=True)
        return cls(unique, index, inverse.to(index_dtype), positions, cu_seqlens)


class H3Model(nn.Module):
    def __init__(self, cfg: H3Config, device=None):
        super().__init__()
        self.cfg = cfg
        kw = dict(dtype=cfg.dtype, device=device)
        self.patch_embed = nn.Linear(cfg.in_channels, cfg.hidden_size, **kw)
        self.time_embed = TimeEmbedder(cfg, device)
        self.adaln_proj = AdaLNProj(cfg, device)
        self.refiner_blocks = nn.ModuleList(H3Block(cfg, device) for _ in range(cfg.num_refiner_blocks))
        self.blocks = nn.ModuleList(H3Block(cfg, device) for _ in range(cfg.num_blocks))
        self.final_layer = FinalLayer(cfg, device)

    def forward(self, latents: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """``latents [T, C]`` (or ``[B, S, C]``) -> predicted velocity, fp32, same shape."""
        x = self.patch_embed(latents.to(self.cfg.dtype))
        t_emb = self.time_embed(layout.timesteps)
        tables = self.adaln_proj(t_emb)
        for block in (*self.refiner_blocks, *self.blocks):
            x = block(x, tables, layout.index, layout.positions, layout.cu_seqlens)
        return self.final_layer(x, t_emb, layout.timestep_index)


def init_weights(model: H3Model, seed: int = 0, std: float = 0.02) -> H3Model:
    """Deterministic random weights: N(0, std) matrices, small biases, norm weights near 1."""
    device = next(model.parameters()).device
    if device.type == "meta":
        return model
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                values = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, device=device)
            elif name.endswith("bias"):
                values = 0.01 * torch.randn(p.shape, generator=gen, device=device)
            else:
                values = std * torch.randn(p.shape, generator=gen, device=device)
            p.copy_(values.to(p.dtype))
    return model


def example_inputs(cfg: H3Config, tokens: int, *, segments: int = 2, seed: int = 0, device="cpu",
                   batch: int | None = None):
    """Random latents and a mixed-modality layout: video at timestep t, text clean (t=0), a pad tail.

    With ``batch`` (or ``cfg.spellings.batched``), activations and per-token tensors are ``[B, S, ...]``
    with ``S = tokens // B`` and each batch row is one attention segment.
    """
    gen = torch.Generator().manual_seed(seed)
    batched = cfg.spellings.batched
    if batched:
        batch = batch or 2
        seq = tokens // batch
        tokens = batch * seq
    bounds = torch.linspace(0, tokens, (batch if batched else segments) + 1).round().long()
    modality = torch.full((tokens,), MODALITY_VIDEO, dtype=torch.long)
    timesteps = torch.empty(tokens)
    for s, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        n = hi - lo
        text = max(1, n // 4)
        modality[lo : lo + text] = MODALITY_TEXT
        modality[hi - max(1, n // 16) : hi] = MODALITY_PAD if s % 2 == 0 else MODALITY_AUDIO
        timesteps[lo:hi] = 0.25 + 0.5 * s / max(1, segments)
        timesteps[lo : lo + text] = 0.0
    positions = torch.randint(0, 16, (tokens, 3), generator=gen)
    latents = torch.randn(tokens, cfg.in_channels, generator=gen)
    layout = TokenLayout.build(timesteps, modality, positions, bounds, cfg.spellings.index_dtype)
    if batched:
        latents = latents.view(batch, seq, -1)
        layout.index = layout.index.view(batch, seq)
        layout.timestep_index = layout.timestep_index.view(batch, seq)
    layout = TokenLayout(*(t.to(device) if t is not layout.cu_seqlens else t for t in vars(layout).values()))
    return latents.to(device), layout
