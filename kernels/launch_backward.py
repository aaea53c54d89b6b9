"""Host side of the backward kernels: which gradients to compute, the launch configuration, the launches.

One launch of ``modulation_backward_kernel`` computes the activation gradients and each program's fp32
partial sums of the table and weight gradients; one launch of ``reduce_partials_kernel`` per table or
weight gradient sums them in a fixed order (docs/DESIGN.md, "The backward"). Where table gradients are
needed, the rows are visited in the order of a stable sort of the index, so that a program's rows of a table
row are contiguous; ``seg[k]`` (``torch.searchsorted``) is where table row ``k``'s rows begin in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import ModulationArgs
from .backward_kernel import modulation_backward_kernel, reduce_partials_kernel
from .contract import compensated
from .launch_plan import KernelLaunch, row_stride, specialisation
from .runtime import ceil_div, interpreting

BACKWARD_MAX_CHUNK = 2048  # columns of a row a program holds at a time: 4 per thread on 16 warps
# Programs per SM: a program of site A or B holds two rows and three or four rows of fp32 sums in registers,
# which fill an SM's registers (a second program per SM measured slower); site C's hold one row of sums
PROGRAMS_PER_SM = {True: 1, False: 2}  # by whether the site has a norm
MIN_ROWS_PER_PROGRAM = 8  # fewer rows per program would cost more in partial sums than it gains in programs
INTERPRETED_PROGRAMS = 3  # under the interpreter: several programs, several rows each, runs ending inside one
REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class Needs:
    """Which gradients autograd asks for: of the lead input (``x``, or ``residual``), ``branch``, the ``gate``,
    ``shift`` and ``scale`` tables, and the norm ``weight``."""

    lead: bool = True
    branch: bool = True
    gate: bool = True
    weight: bool = True
    shift: bool = True
    scale: bool = True

    @property
    def tables(self) -> bool:
        return self.gate or self.shift or self.scale


@dataclass(frozen=True)
class BackwardConfig:
    """``chunk`` columns at a time on ``num_warps`` warps; ``programs`` programs of ``rows_per_program`` rows;
    ``prefetch``: each row's streamed inputs are loaded during the previous row's work; ``hoist_tables``: the
    weight's chunks loaded once a program, the ``scale`` and ``gate`` rows' once a table row where the rows
    are sorted (else at each row's start), all held in registers instead of loaded where each chunk uses
    them; ``early_streams``: the incoming residual gradient and the branch loaded at the row's start, ahead
    of its first store (which a later load cannot pass: it may alias)."""

    chunk: int
    num_warps: int
    rows_per_program: int
    programs: int
    prefetch: bool = True
    hoist_tables: bool = False
    early_streams: bool = False


def backward_config(hidden: int, rows, device: torch.device, has_norm: bool = True,
                    has_gate: bool = True) -> BackwardConfig:
    """Rows in chunks of at most ``BACKWARD_MAX_CHUNK`` columns, 4 per thread; ``PROGRAMS_PER_SM`` programs per SM,
    each with at least ``MIN_ROWS_PER_PROGRAM`` rows; each row's streamed inputs prefetched during the
    previous row's work; ``early_streams`` at every site, ``hoist_tables`` at sites A and C, not B, whose
    registers it spills (docs/DESIGN.md, "The backward"). ``rows`` may be symbolic."""
    chunk = min(1 << (int(hidden) - 1).bit_length(), BACKWARD_MAX_CHUNK)
    num_warps = max(1, min(16, chunk // 128))
    if device.type == "cuda":
        target = PROGRAMS_PER_SM[has_norm] * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = INTERPRETED_PROGRAMS
    rows_per_program = torch.sym_max(MIN_ROWS_PER_PROGRAM, ceil_div(rows, target)) if device.type == "cuda" else \
        ceil_div(rows, target)
    return BackwardConfig(chunk, num_warps, rows_per_program, ceil_div(rows, rows_per_program),
                          hoist_tables=not (has_norm and has_gate), early_streams=True)


@specialisation(modulation_backward_kernel)
class BackwardSpecialisation:
    """The backward kernel's constexprs (``backward_kernel``'s module docstring gives their meaning), in its order:
    the site (with how many modulations of its norm), the rounding contract's ``ROUND_*`` (``contract.Rounding``),
    the gradients computed (``NEED_*``), whether the rows are visited sorted by table row and whether their own
    order is sorted, the ``BackwardConfig``, ``INTERPRETED``."""

    HIDDEN: int
    HAS_GATE: bool
    HAS_NORM: bool
    HAS_WEIGHT: bool
    LAYER_NORM: bool
    COPIES: int
    ROUND_NORM: bool
    ROUND_NORM_BEFORE_WEIGHT: bool
    ROUND_AFFINE: bool
    ROUND_INPUT_GRADIENT: bool
    NEED_X: bool
    NEED_BRANCH: bool
    NEED_SHIFT: bool
    NEED_SCALE: bool
    NEED_GATE: bool
    NEED_W: bool
    SORTED: bool
    ORDERED_INDEX: bool
    ROW_PER_KEY: bool
    COMPENSATE_TABLES: bool
    COMPENSATE_W: bool
    PREFETCH: bool
    HOIST_TABLES: bool
    EARLY_STREAMS: bool
    INTERPRETED: bool
    CHUNK: int


@specialisation(reduce_partials_kernel)
class ReduceSpecialisation:
    """The partial sums' reduction's constexprs: ``BLOCK`` columns a program, ``GROUPED`` (a table's gradient,
    a row per table row) or not (the weight's), ``COMPENSATED`` (Kahan's sum)."""

    HIDDEN: int
    BLOCK: int
    GROUPED: bool
    COMPENSATED: bool
    INTERPRETED: bool


def backward_specialisation(a: ModulationArgs, needs: Needs, config: BackwardConfig,
                            ordered_index: bool = False) -> BackwardSpecialisation:
    """The backward kernel's specialisation for the site ``a`` (the forward's checked arguments), the gradients
    ``needs`` asks for (those the site has), launched with ``config``: sorted by table row where any table
    gradient is needed (``ordered_index``: the index is nondecreasing, the rows' own order is sorted), but where
    that index is the rows' own (one table row a row: its gradients stored as the rows compute them)."""
    has_gate, has_norm = a.gate is not None, a.scale is not None
    rounding = a.rounding
    need_shift, need_scale, need_gate = needs.shift and has_norm, needs.scale and has_norm, needs.gate and has_gate
    row_per_key = ordered_index and a.num_table_rows == a.rows
    return BackwardSpecialisation(
        HIDDEN=a.hidden, HAS_GATE=has_gate, HAS_NORM=has_norm, HAS_WEIGHT=a.weight is not None,
        LAYER_NORM=has_norm and a.norm == "layer", COPIES=a.modulations, ROUND_NORM=rounding.norm_output,
        ROUND_NORM_BEFORE_WEIGHT=rounding.norm_before_weight, ROUND_AFFINE=rounding.affine,
        ROUND_INPUT_GRADIENT=rounding.input_gradient, NEED_X=needs.lead, NEED_BRANCH=needs.branch and has_gate,
        NEED_SHIFT=need_shift, NEED_SCALE=need_scale, NEED_GATE=need_gate,
        NEED_W=needs.weight and a.weight is not None,
        SORTED=(need_shift or need_scale or need_gate) and not row_per_key, ORDERED_INDEX=ordered_index,
        ROW_PER_KEY=row_per_key, COMPENSATE_TABLES=any(compensated(t) for t in a.tables),
        COMPENSATE_W=compensated(a.weight),
        PREFETCH=config.prefetch, HOIST_TABLES=config.hoist_tables, EARLY_STREAMS=config.early_streams,
        INTERPRETED=interpreting(), CHUNK=config.chunk)


def _empty_like_rows(a: ModulationArgs):
    return torch.empty((a.rows, a.hidden), dtype=a.dtype, device=a.device)


def launch_backward(a: ModulationArgs, u: torch.Tensor | None, dy: torch.Tensor | None, du: torch.Tensor | None,
                    needs: Needs, wrap, config: BackwardConfig | None = None,
                    ordered_index: bool = False) -> dict[str, torch.Tensor]:
    """The gradients ``needs`` asks for, as ``reference.reference_backward`` returns them (same keys, dtypes and
    shapes; rows ``[R, H]``), computed by the Triton kernels (``wrap`` = ``torch.library.wrap_triton``, or the
    identity for a direct launch) with ``config`` (default: ``backward_config``'s). ``a``: the forward's checked
    arguments (gathered: an index); ``u``, ``dy``, ``du``: ``[R, H]`` rows with unit column stride;
    ``ordered_index``: the index is nondecreasing (no sort)."""
    has_gate, has_norm = a.gate is not None, a.scale is not None
    config = config or backward_config(a.hidden, a.rows, a.device, has_norm, has_gate)
    spec = backward_specialisation(a, needs, config, ordered_index)
    need_w = spec.NEED_W
    want = dict(shift=spec.NEED_SHIFT, scale=spec.NEED_SCALE, gate=spec.NEED_GATE)
    grads = {}
    if spec.NEED_X:
        grads["lead"] = _empty_like_rows(a)
    if spec.NEED_BRANCH:
        grads["branch"] = _empty_like_rows(a)
    # a tensor the site has not, or a gradient not asked for: a placeholder the kernel never reads or writes, never
    # another argument (under Inductor a value computed in the graph, the incoming gradients, is written once
    # for each kernel argument that takes it; ``launch.ForwardLaunch``)
    placeholder = torch.empty(0, dtype=a.dtype, device=a.device)
    bounds = torch.arange(a.num_table_rows + 1, device=a.device) if spec.SORTED else None
    if spec.SORTED and ordered_index:
        order, seg = a.index, torch.searchsorted(a.index, bounds.to(a.index.dtype))  # order: not read
    elif spec.SORTED:
        # keys made distinct (index * R + row), so that the order, and with it the order of every fp32 sum, is
        # the same whichever sort runs (eager's stable one, or one a compiler chooses)
        rows = torch.arange(a.rows, device=a.device)
        sorted_keys, order = torch.sort(a.index.long() * a.rows + rows)
        seg = torch.searchsorted(sorted_keys, bounds * a.rows)
    else:
        order = seg = placeholder  # not read

    def partials(count, wanted, dtype=torch.float32):
        return torch.empty((count, a.hidden), dtype=dtype, device=a.device) if wanted else placeholder

    # the copies of each gradient's rows (shift's and scale's one after the other)
    copies = dict(gate=1, shift=a.modulations, scale=a.modulations, weight=1)
    if spec.ROW_PER_KEY:  # the table gradients themselves, written as the rows compute them
        part = {name: partials(copies[name] * a.num_table_rows, wanted, getattr(a, name).dtype if wanted else None)
                for name, wanted in want.items()}
    else:
        part = {name: partials(copies[name] * (config.programs + a.num_table_rows), wanted)
                for name, wanted in want.items()}
    part["weight"] = partials(config.programs, need_w)

    def given(t):  # a tensor the site has, else the placeholder
        return placeholder if t is None else t

    branch, gate = (a.branch, a.gate) if has_gate else (None, None)
    scale = a.scale if has_norm else None
    tensors = (given(u), given(branch), given(gate), given(a.weight), given(scale), a.index, order, seg, given(dy),
               given(du), given(grads.get("lead")), given(grads.get("branch")), part["shift"], part["scale"],
               part["gate"], part["weight"])
    KernelLaunch(
        modulation_backward_kernel, grid=(config.programs,), num_warps=config.num_warps,
        scalars=(a.rows, a.num_table_rows, config.rows_per_program, a.eps, *map(row_stride, (u, branch, gate, scale,
                                                                                             dy, du))),
        spec=spec,
    )(tensors, wrap)
    tables = {name: getattr(a, name) for name, wanted in want.items() if wanted and not spec.ROW_PER_KEY}
    grads |= {name: part[name] for name, wanted in want.items() if wanted and spec.ROW_PER_KEY}
    if need_w:
        tables["weight"] = a.weight
    for name, table in tables.items():
        grouped_sum = name != "weight"
        out = torch.empty((table.shape[0], a.hidden) if grouped_sum else (a.hidden,), dtype=table.dtype,
                          device=a.device)
        KernelLaunch(
            reduce_partials_kernel,
            grid=(ceil_div(a.hidden, REDUCE_BLOCK), table.shape[0] // copies[name] if grouped_sum else 1,
                  copies[name]),
            num_warps=4, scalars=(config.rows_per_program, config.programs, a.hidden if grouped_sum else 0),
            spec=ReduceSpecialisation(HIDDEN=a.hidden, BLOCK=REDUCE_BLOCK, GROUPED=grouped_sum,
                                      COMPENSATED=spec.COMPENSATE_W if name == "weight" else spec.COMPENSATE_TABLES,
                                      INTERPRETED=interpreting()),
        )((part[name], out, seg), wrap)
        grads[name] = out
    return grads
