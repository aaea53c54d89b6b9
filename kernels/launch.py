"""Host side of the forward kernel: its launch configuration, its constexpr specialisation, the launch.

Every rule here was chosen side by side on the H200 at H = 5,376 (and at H = 2,048-16,384 where a rule
depends on H), with the outputs unchanged; docs/DESIGN.md has one section per rule (what it does, why,
what it measured) and the configurations measured and rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arguments import ModulationArgs
from .contract import MEAN_VECTORS_MIN_H, Rounding, SumOrder
from .forward_kernel import modulation_kernel
from .launch_plan import KernelLaunch, row_stride, specialisation
from .runtime import ceil_div, interpreting

MAX_BLOCK_H = 32768
FEWEST_ROWS = 1024  # up to this many rows site A runs on 8 warps
FEW_ROWS = 6144  # up to this many rows site B runs on 8 warps
SITE_A_NARROW_H = 2048  # up to this H site A preloads its table chunks only up to SITE_A_FEW_ROWS rows
SITE_A_FEW_ROWS = 16384
MIN_WARPS = 4  # the fewest warps a program runs on (but in the mean's order, MEAN_ORDER_WARPS)
MEAN_ORDER_WARPS = 2  # a program's warps where the squares add in the mean's order: one row on 64 threads
MEAN_ORDER_MIN_ROWS = 16  # from this many rows torch's mean gives a row one warp (the order reproduced)
MEAN_ORDER_MIN_H = 16  # the narrowest row whose mean's order was measured
# torch's reduction gives a row one warp while each lane sums fewer than 256 of its values (``div_up(H, 32) < 256``,
# ``setReduceConfig`` in ATen's Reduce.cuh); a wider row it splits over 16 warps, an order not reproduced
MEAN_ORDER_MAX_H = 8160
WARM_ROWS_AHEAD = 1024  # each program warms L2 with the table rows of the row this many rows on
WARM_TABLES_MAX_BYTES = 4 << 20  # tables larger than this are not warmed as the kernel starts


@dataclass(frozen=True)
class LaunchConfig:
    """How the forward kernel runs: ``block_t`` rows per program, each read in chunks of ``chunk`` columns, on
    ``num_warps`` warps; the kernel's knobs of the same names in capitals:

    - ``preload_table_chunks``: the norm's weight, ``scale[i]`` and ``shift[i]`` chunks loaded one chunk early;
    - ``warm_rows_ahead``: each program warms L2 with the table rows of the row this many rows on (0: none);
    - ``warm_tables_first``: warming programs ahead of the programs of rows bring every table row and the
      weight into L2 as the kernel starts (``warming_program_count`` of them).
    """

    block_t: int
    chunk: int
    num_warps: int
    preload_table_chunks: bool = False
    warm_rows_ahead: int = WARM_ROWS_AHEAD
    warm_tables_first: bool = False

    @property
    def warming_lanes(self) -> int:
        """The lanes of the warming loads (``WARMING_LANES``), ``block_t * chunk // 8``: one per eight elements
        of a chunk of the program's rows, which is one per thread (each holds 8 columns of a chunk) at every
        H but 1."""
        return self.block_t * self.chunk // 8


def norm_sum_order(rounding: Rounding, hidden: int, has_norm: bool, rows: int | None) -> SumOrder:
    """The kernel's ``NORM_SUM_ORDER``: the rounding contract's ``norm_sum_order`` where the eager kernel takes the
    path reproduced (``H`` a multiple of 4: vectorized; for ``MEAN`` also ``MEAN_ORDER_MIN_ROWS`` rows or more,
    or a symbolic count, and ``H`` from ``MEAN_ORDER_MIN_H`` to ``MEAN_ORDER_MAX_H``), else ``OWN``."""
    order = rounding.norm_sum_order if has_norm and hidden % 4 == 0 else SumOrder.OWN
    few_rows = rows is not None and rows < MEAN_ORDER_MIN_ROWS
    if order is SumOrder.MEAN and (few_rows or not MEAN_ORDER_MIN_H <= hidden <= MEAN_ORDER_MAX_H):
        order = SumOrder.OWN
    return order


def sum_order_chunk(hidden: int, sum_order: SumOrder) -> int | None:
    """The chunk width the order ``sum_order`` needs (None: any): one 4-element vector per eager thread, 128
    threads for the fused RMSNorm (512 columns, or the padded row), for the mean one warp's lanes, as many as
    the row's vectors allow (``4 * min(32, last power of 2 <= H / 4)``; a row the reduction reads element by
    element, below ``MEAN_VECTORS_MIN_H``, as many as its elements allow, 4 sums each: one chunk of
    ``4 * min(32, last power of 2 <= H)``, wider than the row); for the LayerNorm 512 columns whatever
    ``H``, since its tree is over all of eager's 128 threads (a combine with a thread that read nothing is not
    always exact, unlike adding 0)."""
    if sum_order is SumOrder.FUSED_LAYER_NORM:
        return 512
    if sum_order is SumOrder.FUSED_RMS_NORM:
        return min(1 << (int(hidden) - 1).bit_length(), 512)
    if sum_order is SumOrder.MEAN:
        lanes_reach = int(hidden) // 4 if hidden >= MEAN_VECTORS_MIN_H else int(hidden)
        return 4 * min(32, 1 << (lanes_reach.bit_length() - 1))
    return None


def launch_config(hidden: int, has_gate: bool, has_norm: bool, rows: int | None,
                  sum_order: SumOrder = SumOrder.OWN, has_affine: bool = True, gathered: bool = True) -> LaunchConfig:
    """Whole rows in registers, read in chunks of one 16-byte vector per thread (8 bf16), so that only the
    last chunk pads ``H``; one row per program (rows shorter than the program's lanes share it).

    Where the norm's squares add in an eager kernel's order (``sum_order``, see ``norm_sum_order``), 4 warps and
    chunks of ``sum_order_chunk`` columns: one 4-element vector a thread, the vector eager's thread of the same
    number reads, so that the order costs no exchange between threads. For the mean's order one row a program
    on ``MEAN_ORDER_WARPS`` warps, in chunks of one vector per lane of eager's warp (128 columns: 2 a thread);
    the lanes' sums meet in the final tree, whose adds are eager's whichever thread holds them. A row shorter
    than ``MEAN_VECTORS_MIN_H`` is one chunk: the rows per program as the other orders take them. (One warp a
    row, eager's lane a thread, holds 4 times the registers; 4 warps a row hold half the columns a thread but
    gain less: docs/DESIGN.md.)

    - Warps: 8 for site C, for site B up to ``FEW_ROWS`` rows and for site A up to ``FEWEST_ROWS`` rows;
      4 beyond, where more programs resident per SM win; never fewer than ``MIN_WARPS`` (the mean's order: above).
    - ``preload_table_chunks``: site B always; site A from H = 2,049 on, and up to ``SITE_A_NARROW_H`` for up
      to ``SITE_A_FEW_ROWS`` rows (beyond, the extra registers cost more than the early loads gain).
    - ``warm_rows_ahead``: ``WARM_ROWS_AHEAD`` rows for sites A and B.
    - ``warm_tables_first``: site A (B gains nothing from it, C loses), in every sum order.

    Both warmings read table rows by the index: where the rows are given instead (``gathered`` false: one per
    sample, few, or one per token, streamed like the activations) neither runs.

    A plain RMSNorm (``has_norm`` without ``has_affine``) reads no tables: it runs as site A with nothing
    preloaded or warmed (the kernel warms table rows ahead only for a site with an affine).

    ``rows`` is the row count, or None where it is symbolic (a graph compiled for dynamic shapes): the
    many-rows choice, without a guard on the count.
    """
    padded = 1 << (int(hidden) - 1).bit_length()  # the next power of 2; H is a constexpr, never symbolic
    if padded > MAX_BLOCK_H:
        raise ValueError(f"H={hidden} exceeds the kernel's limit of {MAX_BLOCK_H}")
    block_t = max(1, 2048 // padded)

    def at_most(bound: int) -> bool:  # a symbolic count takes the many-rows choice
        return rows is not None and rows <= bound

    more_warps = not has_norm or at_most(FEW_ROWS if has_gate else FEWEST_ROWS)
    per_thread = 32 if more_warps else 64
    num_warps = max(MIN_WARPS, min(16, block_t * padded // (32 * per_thread)))
    chunk = min(padded, max(1, 32 * num_warps * 8 // block_t))  # the quotient is 0 at H = 1
    if sum_order is not SumOrder.OWN:
        num_warps, chunk = MIN_WARPS, sum_order_chunk(hidden, sum_order)
        block_t = min(block_t, max(1, 2048 // chunk))  # a chunk wider than the row (the LayerNorm's) holds fewer rows
        if sum_order is SumOrder.MEAN and hidden >= MEAN_VECTORS_MIN_H:
            block_t, num_warps = 1, MEAN_ORDER_WARPS
    tables = has_norm and has_affine
    preload = tables and (has_gate or hidden > SITE_A_NARROW_H or at_most(SITE_A_FEW_ROWS))
    warm_first = tables and not has_gate and gathered
    return LaunchConfig(block_t, chunk, num_warps, preload, warm_rows_ahead=WARM_ROWS_AHEAD if gathered else 0,
                        warm_tables_first=warm_first)


def warming_program_count(a: ModulationArgs, lanes: int) -> int:
    """How many warming programs (``_touch_table_rows``, ``lanes`` 32-byte sectors each) cover every table
    row the site reads and the weight; none where the tables' row count is symbolic, or where the tables
    hold more than ``WARM_TABLES_MAX_BYTES`` (a bound set, not measured: the model's tables hold about
    140 KB, and warming many megabytes would hold the rows' loads back behind them)."""
    if not isinstance(a.num_table_rows, int):
        return 0
    rows = [(t, a.num_table_rows) for t in (a.shift, a.scale, a.gate) if t is not None] + [(a.weight, 1)] * (
        a.weight is not None)
    sectors = sum(count * ceil_div(a.hidden * t.element_size(), 32) for t, count in rows)
    return 0 if 32 * sectors > WARM_TABLES_MAX_BYTES else ceil_div(sectors, lanes)


@specialisation(modulation_kernel)
class ForwardSpecialisation:
    """The forward kernel's constexprs (``forward_kernel``'s module docstring gives their meaning), in its order.

    The site: ``HIDDEN`` columns, a gate (sites B, C), a norm (A, B, a plain norm), its weight, an affine
    (A, B; a plain norm has none) and how many modulations of the norm it stores, its rows gathered by the index
    or given (maybe with biases), a LayerNorm or an RMSNorm. The rounding contract (``contract.Rounding``): ``ROUND_*``,
    ``FUSE_MULTIPLY_ADD``, and ``NORM_SUM_ORDER`` (a ``contract.SumOrder``'s value, as ``norm_sum_order``
    resolves it). ``INTERPRETED``: under Triton's interpreter. ``STORE_RSTD``: a plain RMSNorm stores its rows'
    ``r`` alone. The ``LaunchConfig``: the rest."""

    HIDDEN: int
    HAS_GATE: bool
    HAS_NORM: bool
    HAS_WEIGHT: bool
    HAS_AFFINE: bool
    COPIES: int
    GATHERED: bool
    ROW_BIAS: bool
    LAYER_NORM: bool
    ROUND_GATE: bool
    ROUND_NORM: bool
    ROUND_NORM_BEFORE_WEIGHT: bool
    ROUND_AFFINE: bool
    ROUND_ROW_SUM: bool
    FUSE_MULTIPLY_ADD: bool
    NORM_SUM_ORDER: int
    INTERPRETED: bool
    STORE_RSTD: bool
    BLOCK_T: int
    CHUNK: int
    PRELOAD_TABLE_CHUNKS: bool
    WARM_ROWS_AHEAD: int
    WARM_TABLES_FIRST: bool
    WARMING_LANES: int

    @classmethod
    def of(cls, a: ModulationArgs, config: LaunchConfig, sum_order: SumOrder) -> ForwardSpecialisation:
        """The specialisation for the site ``a`` launched with ``config`` adding its squares in ``sum_order``."""
        r = a.rounding
        return cls(
            HIDDEN=a.hidden, HAS_GATE=a.gate is not None, HAS_NORM=a.has_norm, HAS_WEIGHT=a.weight is not None,
            HAS_AFFINE=a.has_affine, COPIES=a.modulations, GATHERED=a.gathered, ROW_BIAS=a.row_bias,
            LAYER_NORM=a.norm == "layer", ROUND_GATE=r.gate_product, ROUND_NORM=r.norm_output,
            ROUND_NORM_BEFORE_WEIGHT=r.norm_before_weight, ROUND_AFFINE=r.affine,
            ROUND_ROW_SUM=r.row_sum, FUSE_MULTIPLY_ADD=r.fused_multiply_add, NORM_SUM_ORDER=int(sum_order),
            INTERPRETED=interpreting(), STORE_RSTD=a.stores_rstd,
            BLOCK_T=config.block_t, CHUNK=config.chunk,
            PRELOAD_TABLE_CHUNKS=config.preload_table_chunks and a.has_norm,  # no tables without a norm: one C build
            WARM_ROWS_AHEAD=config.warm_rows_ahead, WARM_TABLES_FIRST=config.warm_tables_first,
            WARMING_LANES=config.warming_lanes,
        )


FORWARD_INPUTS = ("x", "residual", "branch", "gate", "weight", "shift", "scale", "index", "gate_bias", "shift_bias",
                  "scale_bias")  # the kernel's order


@dataclass(frozen=True)
class ForwardLaunch:
    """One launch of ``modulation_kernel`` worked out for the arguments of a ``ModulationArgs``: everything but
    the tensors, so that calls on arguments of the same layout can share it (``direct_call.py``).

    ``slots``: the ``ModulationArgs`` field each of the kernel's tensor inputs (``FORWARD_INPUTS``) reads, None
    where the site has no such input: the kernel, which never reads it, is passed a placeholder (``placeholder``),
    never another input: under Inductor an input that is a value computed in the graph is written to memory once
    for each kernel argument that takes it, so an alias in the slots of absent inputs would write it again for
    each (a modulation row per token, a residual sum). ``launch``: the rest."""

    slots: tuple[str | None, ...]
    launch: KernelLaunch

    @staticmethod
    def tensors(inputs, u: torch.Tensor | None, y: torch.Tensor | None, placeholder: torch.Tensor | None) -> tuple:
        """The kernel's tensor arguments: the inputs (one per slot; ``placeholder`` where None), then ``u`` and
        ``y`` (each an alias of the other where the site has no such output)."""
        return (*(placeholder if t is None else t for t in inputs), y if u is None else u, u if y is None else y)

    def inputs(self, a: ModulationArgs) -> tuple:
        """``a``'s tensor for each slot, None where the site has none."""
        return tuple(getattr(a, name) if name else None for name in self.slots)

    def placeholder(self, a: ModulationArgs) -> torch.Tensor | None:
        """What the kernel is passed in the slots of the inputs the site has not: no elements, ``a``'s device."""
        return torch.empty(0, dtype=a.dtype, device=a.device) if None in self.slots else None

    def __call__(self, inputs, u: torch.Tensor | None, y: torch.Tensor | None, placeholder: torch.Tensor | None,
                 wrap):
        """Launch on ``inputs`` into ``u``/``y`` (``wrap``: ``torch.library.wrap_triton``, or the identity for a
        direct launch); returns what the launch returns (the compiled kernel, launched directly)."""
        return self.launch(self.tensors(inputs, u, y, placeholder), wrap)


def plan_launch(a: ModulationArgs, config: LaunchConfig | None = None) -> ForwardLaunch:
    """The launch of ``modulation_kernel`` for ``a`` with ``config`` (default: ``launch_config``'s)."""
    rows = a.static_rows
    sum_order = norm_sum_order(a.rounding, a.hidden, a.has_norm, rows)
    if config is None:
        config = launch_config(a.hidden, a.gate is not None, a.has_norm, rows, sum_order, a.has_affine, a.gathered)
    elif sum_order is not SumOrder.OWN and config.chunk != sum_order_chunk(a.hidden, sum_order):
        raise ValueError(f"config.chunk={config.chunk}: where the norm's squares add in an eager kernel's order a "
                         f"chunk holds {sum_order_chunk(a.hidden, sum_order)} columns at H={a.hidden}")
    slots = tuple(name if getattr(a, name) is not None else None for name in FORWARD_INPUTS)
    if not a.gathered and (config.warm_rows_ahead or config.warm_tables_first):
        raise ValueError(f"config={config}: rows given without an index are not warmed (warm_rows_ahead=0, "
                         "warm_tables_first=False)")
    warming = warming_program_count(a, config.warming_lanes) if config.warm_tables_first else 0

    def token_stride(t):  # a given [B, T, H] row's token stride (0 where broadcast); a gathered table has none
        return t.stride(1) if t is not None and t.dim() == 3 else 0

    return ForwardLaunch(slots, KernelLaunch(
        modulation_kernel, grid=(ceil_div(a.rows, config.block_t) + warming,), num_warps=config.num_warps,
        scalars=(a.rows, a.num_table_rows, a.tokens, a.eps,
                 *map(row_stride, (a.x, a.residual, a.branch, a.gate, a.shift, a.scale)),
                 *map(token_stride, (a.gate, a.shift, a.scale))),
        spec=ForwardSpecialisation.of(a, config, sum_order)))


def launch_modulation(a: ModulationArgs, u: torch.Tensor | None, y: torch.Tensor | None, wrap,
                      config: LaunchConfig | None = None):
    """Run ``modulation_kernel`` for ``a`` into ``u``/``y`` (``wrap`` = ``torch.library.wrap_triton``, or the
    identity for a direct launch) with ``config`` (default: ``launch_config``'s). Returns what the launch
    returns (the compiled kernel, for a direct launch)."""
    launch = plan_launch(a, config)
    return launch(launch.inputs(a), u, y, launch.placeholder(a), wrap)
