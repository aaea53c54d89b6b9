"""The backward of the fused ops: ``h3_fused::modulation_backward`` and its pure-torch reference.

``modulation_backward`` is a ``torch.library.triton_op`` like the forward ops, so that under ``torch.compile``
Inductor inlines its kernels (``backward_kernel.py``) into the compiled backward graph; on the CPU (and for
fp64) it calls ``h3_fused::reference_modulation_backward``, a custom op whose body is the pure-torch reference
(``reference.reference_backward``), which a compiled graph calls as it is. Both take what a forward op saved
(``SavedSite``'s fields), the incoming gradients of the site's outputs and which gradients autograd asks for
(``autograd.py`` registers the formulas that call them). The backward has no backward: double backward
(``create_graph=True``) through a fused site raises ``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

import torch
from torch.library import custom_op

from .arguments import ModulationArgs, as_rows, check_args, check_index_on_host
from .launch_backward import Needs, launch_backward
from .ops import PublicOp
from .reference import reference_backward
from .runtime import launch_context, triton_allowed

Tensor = torch.Tensor
GRADIENTS = ("lead", "branch", "gate", "weight", "shift", "scale")  # the order of the backward ops' outputs


@dataclass(frozen=True)
class SavedSite:
    """What a forward op saves for its backward, and the flags it was called with: ``u``, the rows it normalized
    (``x`` at site A, the stored residual at site B; None at site C), the branch and the gate table (B, C), the
    weight, shift and scale tables (A, B), the index. Never a normalized or modulated row, nor the per-row
    ``rsqrt``, which the backward recomputes from the rows it reads anyway. The backward ops take the tensors
    (``tensors``), ``dy`` and ``du``, then the flags (``flags``) and ``needs``."""

    u: Tensor | None
    branch: Tensor | None
    gate: Tensor | None
    weight: Tensor | None
    shift: Tensor | None
    scale: Tensor | None
    index: Tensor | None  # None where the rows were given (per sample, per token, one for all): ``gathered``
    eps: float
    policy: str
    norm_rounds_before_weight: bool
    upcast_tables: bool
    norm: str = "rms"
    norm_in_fp32: bool = False
    ordered_index: bool = False  # the index is nondecreasing (``gathered``'s, of given rows)

    TENSORS = 7  # the fields before the flags, which ``save_for_backward`` keeps

    @classmethod
    def of(cls, tensors, flags: dict) -> SavedSite:
        """From the saved tensors (``TENSORS`` of them, in order) and the flags."""
        return cls(*tensors, **flags)

    def values(self) -> tuple:
        """The fields in order (``dataclasses.astuple`` would copy the tensors)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def tensors(self) -> tuple:
        return self.values()[:self.TENSORS]

    def flags(self) -> dict:
        return dict(eps=self.eps, policy=self.policy, norm_rounds_before_weight=self.norm_rounds_before_weight,
                    upcast_tables=self.upcast_tables, norm=self.norm, norm_in_fp32=self.norm_in_fp32,
                    ordered_index=self.ordered_index)

    def tables(self) -> dict[str, Tensor]:
        return {name: t for name in ("gate", "shift", "scale") if (t := getattr(self, name)) is not None}

    def gathered(self, shape: torch.Size) -> SavedSite:
        """The site with rows given as rows that broadcast to the activations of ``shape`` restated as tables
        ``[K, H]`` (``K`` rows: the given rows' count) gathered by an index, one table row per activation row;
        the index is nondecreasing (``ordered_index``) where the rows vary only along a run of leading dims
        (per sample, per token, one for all). The tables must broadcast alike (``rows_without_fused_backward`` says
        where not); ``shift`` and ``scale`` with a leading dim of ``M`` copies become ``[M, K, H]`` tables. Their
        gradients come back ``[K, H]`` (``[M, K, H]``): viewed as the rows' shape they are theirs."""
        tables = self.tables()
        rank, first = len(shape), next(iter(tables.values()))
        rows, lead = row_dims(one_copy(first, rank), rank), tuple(shape[:-1])
        keys = math.prod(rows)
        index_dtype = torch.int32 if keys <= torch.iinfo(torch.int32).max else torch.int64
        index = torch.arange(keys, dtype=index_dtype, device=first.device).view(rows).expand(lead)
        ordered = any(rows == (*lead[:j], *(1,) * (len(lead) - j)) for j in range(len(lead) + 1))
        flat = {name: t.reshape(*t.shape[:1] * (t.dim() > rank), keys, shape[-1]) for name, t in tables.items()}
        return dataclasses.replace(self, **flat, index=index, ordered_index=ordered)

    def forward_args(self, du: Tensor | None) -> ModulationArgs:
        """The forward's checked arguments (site C has no ``u``: ``du``, the residual's gradient, stands for the
        residual, whose shape, dtype and device it has)."""
        flags = dict(policy=self.policy, upcast_tables=self.upcast_tables)
        if self.scale is None:
            return check_args(residual=du, gate=self.gate, branch=self.branch, index=self.index, **flags,
                              has_norm=False)
        norm = dict(weight=self.weight, shift=self.shift, scale=self.scale, index=self.index, eps=self.eps,
                    norm_rounds_before_weight=self.norm_rounds_before_weight, norm=self.norm,
                    norm_in_fp32=self.norm_in_fp32, **flags)
        if self.gate is None:
            return check_args(x=self.u, **norm, has_norm=True)
        return check_args(residual=self.u, gate=self.gate, branch=self.branch, **norm, has_norm=True)


def row_dims(rows: Tensor, rank: int) -> tuple[int, ...]:
    """The leading dims of modulation rows that broadcast to activations of ``rank`` dims, padded to ``rank - 1``."""
    return (1,) * (rank - rows.dim()) + tuple(rows.shape[:-1])


def one_copy(rows: Tensor, rank: int) -> Tensor:
    """Modulation rows for activations of ``rank`` dims without their leading dim of copies, where they have one."""
    return rows[0] if rows.dim() > rank else rows


def rows_without_fused_backward(tables: dict[str, Tensor | None], rank: int) -> str | None:
    """What of given modulation rows the fused backward does not take, or None: rows that broadcast differently
    (``SavedSite.gathered`` takes one index for all; a leading dim of copies aside)."""
    shapes = {name: row_dims(one_copy(t, rank), rank) for name, t in tables.items() if t is not None}
    if len(set(shapes.values())) > 1:
        return "modulation rows of different shapes (" + ", ".join(
            f"{name} {list(dims)}" for name, dims in shapes.items()) + ")"
    return None


def rows_of(t: Tensor | None, a: ModulationArgs, name: str) -> Tensor | None:
    """``t`` (one of the site's activations or their gradients; ``dy`` has ``y``'s shape, of ``M`` modulations
    where the site has copies) as ``[R, H]`` (``[M * R, H]``) rows in the activation dtype."""
    if t is None:
        return None
    shape, of = (a.y_shape, "y") if name == "dy" else (a.out_shape, "the activations")
    if t.shape != shape:
        raise ValueError(f"{name} must have the shape of {of} {tuple(shape)}, got {tuple(t.shape)}")
    return as_rows(name, t.to(a.dtype), a.hidden)


def _outputs(saved: SavedSite, a: ModulationArgs, grads: dict) -> tuple[Tensor, ...]:
    """The ops' six outputs: each gradient in its input's shape, an empty tensor where none was asked for."""
    shapes = dict(lead=a.out_shape, branch=a.out_shape) | {name: t.shape for name, t in saved.tables().items()}
    return tuple(grads[name].view(shapes.get(name, grads[name].shape)) if name in grads
                 else a.index.new_empty(0, dtype=a.dtype) for name in GRADIENTS)


@custom_op("h3_fused::reference_modulation_backward", mutates_args=())
def reference_modulation_backward(
    u: Tensor | None, branch: Tensor | None, gate: Tensor | None, weight: Tensor | None, shift: Tensor | None,
    scale: Tensor | None, index: Tensor, dy: Tensor | None, du: Tensor | None, eps: float, policy: str,
    norm_rounds_before_weight: bool, upcast_tables: bool, norm: str, norm_in_fp32: bool, ordered_index: bool,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``modulation_backward`` by the pure-torch reference (``reference.reference_backward``)."""
    saved = SavedSite(u, branch, gate, weight, shift, scale, index, eps, policy, norm_rounds_before_weight,
                      upcast_tables, norm, norm_in_fp32, ordered_index)
    a = saved.forward_args(du)
    check_index_on_host(a.index, a.num_table_rows)
    grads = reference_backward(a, rows_of(u, a, "u"), rows_of(dy, a, "dy"), rows_of(du, a, "du"), Needs(*needs))
    return _outputs(saved, a, grads)


@reference_modulation_backward.register_fake
def _(u, branch, gate, weight, shift, scale, index, dy, du, eps, policy, norm_rounds_before_weight, upcast_tables,
      norm, norm_in_fp32, ordered_index, needs):
    lead = u if u is not None else du
    wanted = dict(zip(GRADIENTS, needs))
    like = dict(lead=lead, branch=lead, gate=gate, weight=weight, shift=shift, scale=scale)
    return tuple(torch.empty(like[name].shape, dtype=like[name].dtype, device=lead.device)
                 if wanted[name] and like[name] is not None and (name != "branch" or gate is not None)
                 else index.new_empty(0, dtype=lead.dtype) for name in GRADIENTS)


def _backward_body(
    u: Tensor | None, branch: Tensor | None, gate: Tensor | None, weight: Tensor | None, shift: Tensor | None,
    scale: Tensor | None, index: Tensor, dy: Tensor | None, du: Tensor | None, *, eps: float, policy: str,
    norm_rounds_before_weight: bool, upcast_tables: bool, norm: str = "rms", norm_in_fp32: bool = False,
    ordered_index: bool = False, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients ``needs`` asks for (in ``GRADIENTS`` order) of the site whose ``SavedSite`` these fields
    are; ``dy``, ``du``: the gradients of the site's outputs ``y`` and ``u``. A gradient not asked for is an
    empty tensor."""
    saved = SavedSite(u, branch, gate, weight, shift, scale, index, eps, policy, norm_rounds_before_weight,
                      upcast_tables, norm, norm_in_fp32, ordered_index)
    a = saved.forward_args(du)
    if a.rows == 0 or a.hidden == 0 or not triton_allowed(a.device, a.dtype):
        return torch.ops.h3_fused.reference_modulation_backward(*saved.tensors(), dy, du, **saved.flags(),
                                                                needs=needs)
    if a.device.type == "cpu":  # the Triton interpreter: validate indices on the host
        check_index_on_host(a.index, a.num_table_rows)
    with launch_context(a.device, (*saved.values(), dy, du, needs)) as wrap:
        grads = launch_backward(a, rows_of(u, a, "u"), rows_of(dy, a, "dy"), rows_of(du, a, "du"), Needs(*needs),
                                wrap, ordered_index=ordered_index)
    return _outputs(saved, a, grads)


modulation_backward = PublicOp("modulation_backward", _backward_body)
