"""Configuration of the MiniMax-H3 stand-in: the real numbers, a tiny CPU preset, spelling switches."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

MODALITY_PAD = -1
MODALITY_VIDEO = 0
MODALITY_TEXT = 1
MODALITY_AUDIO = 2
ROWS_PER_TIMESTEP = 3  # one AdaLN table row per (timestep, modality)


@dataclass(frozen=True)
class Spellings:
    """How the model's authors wrote the modulation path (spec section 2); all compute the same math.

    norm: "torch" is ``nn.RMSNorm`` (rounds once, ``R(x32 * r * w32)``); "native" is the vLLM-style
        hand-written RMSNorm (``R(R(x32 * r) * w)``).
    gather: "index_select" or "getitem" (``table[idx]``).
    one_plus_first: ``1.0 + scale`` when True, ``scale + 1`` when False.
    gate_first: ``gate * other`` when True, ``other * gate`` when False.
    trailing_to: end each helper with ``.to(dtype)``.
    upcast_tables: ``table.float().index_select(...)`` (the affine becomes one fp32 expression).
    fp32_tables: the AdaLN projection produces fp32 tables (type promotion makes the affine fp32).
    index_dtype: dtype of the per-token index (``torch.int64`` or ``torch.int32``); the helpers call
        ``idx.to(device=x.device, dtype=torch.long)``.
    batched: activations ``[B, S, H]`` instead of packed ``[T, H]``.
    """

    norm: str = "torch"
    gather: str = "index_select"
    one_plus_first: bool = True
    gate_first: bool = True
    trailing_to: bool = True
    upcast_tables: bool = False
    fp32_tables: bool = False
    index_dtype: torch.dtype = torch.int64
    batched: bool = False

    def __post_init__(self) -> None:
        if self.norm not in ("torch", "native"):
            raise ValueError(f"Spellings.norm must be 'torch' or 'native', got {self.norm!r}")
        if self.gather not in ("index_select", "getitem"):
            raise ValueError(f"Spellings.gather must be 'index_select' or 'getitem', got {self.gather!r}")
        if self.index_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Spellings.index_dtype must be torch.int32 or torch.int64, got {self.index_dtype}")


@dataclass(frozen=True)
class H3Config:
    """Architecture of the H3 DiT. Defaults are the real model (spec section 1)."""

    hidden_size: int = 5376
    num_heads: int = 56
    head_dim: int = 128
    ffn_dim: int = 14336
    num_blocks: int = 50
    num_refiner_blocks: int = 2
    in_channels: int = 64
    time_freq_dim: int = 256
    time_hidden_dim: int = 5376
    time_embed_dim: int = 2688
    rope_dims: int = 96
    rope_theta: float = 10000.0
    eps: float = 1e-5
    dtype: torch.dtype = torch.bfloat16
    inline_attention: bool = False  # True: attention inside the compiled graph (masked SDPA, no break)
    spellings: Spellings = field(default_factory=Spellings)

    def __post_init__(self) -> None:
        if self.rope_dims > self.head_dim or self.rope_dims % 6:
            raise ValueError("rope_dims must be a multiple of 6 (three axes, cos/sin pairs) and <= head_dim")

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def real(cls, **overrides) -> H3Config:
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides) -> H3Config:
        """A CPU-sized preset with the same structure (H=256, 4 heads x 64)."""
        base = cls(
            hidden_size=256,
            num_heads=4,
            head_dim=64,
            ffn_dim=512,
            num_blocks=2,
            num_refiner_blocks=1,
            in_channels=16,
            time_freq_dim=64,
            time_hidden_dim=256,
            time_embed_dim=128,
            rope_dims=48,
        )
        return replace(base, **overrides)
