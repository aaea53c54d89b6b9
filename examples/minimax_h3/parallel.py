"""Ulysses sequence parallelism: rows split across ranks, attention by all-to-all over heads."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .model import H3Model, TokenLayout


@dataclass
class UlyssesGroup:
    """Trades a rank's rows of every head for every rank's rows of its share of the heads."""

    group: dist.ProcessGroup | None = None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def _exchange(self, chunks: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(chunks)
        dist.all_to_all_single(out, chunks, group=self.group)
        return out

    def rows_to_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """``[T/P, 3, heads, D]`` -> ``[T, 3, heads/P, D]``."""
        rows, three, heads, dim = qkv.shape
        p = self.world
        if heads % p:
            raise ValueError(f"{heads} heads cannot be split over {p} ranks")
        send = qkv.view(rows, three, p, heads // p, dim).permute(2, 0, 1, 3, 4).contiguous()
        return self._exchange(send).reshape(p * rows, three, heads // p, dim)

    def heads_to_rows(self, out: torch.Tensor) -> torch.Tensor:
        """``[T, heads/P, D]`` -> ``[T/P, heads, D]``."""
        total, local_heads, dim = out.shape
        p = self.world
        recv = self._exchange(out.reshape(p, total // p, local_heads, dim).contiguous())
        return recv.permute(1, 0, 2, 3).reshape(total // p, p * local_heads, dim)


def enable_ulysses(model: H3Model, group: dist.ProcessGroup | None = None) -> H3Model:
    sp = UlyssesGroup(group)
    for block in (*model.refiner_blocks, *model.blocks):
        block.attn.sequence_parallel = sp
    return model


def shard_rows(latents: torch.Tensor, layout: TokenLayout, rank: int, world: int):
    """This rank's contiguous share of the rows; positions and segment bounds stay global."""
    total = latents.shape[0]
    if total % world:
        raise ValueError(f"{total} tokens cannot be split evenly over {world} ranks")
    rows = slice(rank * total // world, (rank + 1) * total // world)
    return latents[rows], replace(layout, index=layout.index[rows], timestep_index=layout.timestep_index[rows])


def gather_rows(local: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=0)
