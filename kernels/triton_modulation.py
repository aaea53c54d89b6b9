"""One parameterised Triton kernel for the three modulation sites, and its launcher.

Per row ``t`` (``i = index[t]``, all arithmetic in fp32, ``R`` = round to the activation dtype):

    site B/C:  g = gate[i] * branch            (R if ROUND_GATE; a non-contractible multiply)
               u = R(residual + g)             -> stored (B, C)
    site A:    u = x
    site A/B:  r = rsqrt(sum(u*u) * (1/H) + eps)
               n = u * r                       (R if ROUND_NORM_BEFORE_WEIGHT, then * w if HAS_WEIGHT)
               n = R(n) if ROUND_NORM
               p = 1 + scale[i]                (R if ROUND_AFFINE)
               q = n * p                       (R if ROUND_AFFINE; non-contractible unless FUSE_AFFINE)
               y = R(q + shift[i])             -> stored (A, B)

A tile is ``BLOCK_T`` whole rows held in registers, ``next_power_of_2(H)`` wide; a program finishes
``TILES_PER_PROGRAM`` tiles and issues the next tile's streamed loads (index and activations) before it
finishes the current one (``launch_config`` says which sizes and why).

Multiplies feeding an add are never contracted into an FMA (which would remove the fp32 rounding
eager performs), except ``n * p + shift`` under the ``fp32`` policy (``FUSE_AFFINE``). Under the
interpreter (``PORTABLE``) rounding to bf16 is done on the bits, since the interpreter truncates
conversions. An out-of-range index never reads out of bounds (it is clamped for the loads) and fails a
device-side assertion: the kernel is compiled with ``debug=True`` for direct launches, and Inductor
compiles it with assertions on (``assert_indirect_indexing``, its default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .contract import ModulationArgs, Rounding

MAX_BLOCK_H = 32768


@triton.jit
def _rounded(v, dtype: tl.constexpr, PORTABLE: tl.constexpr):
    """``v`` (fp32) rounded to nearest even in ``dtype``, as fp32."""
    if PORTABLE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype).to(tl.float32)


@triton.jit
def _mul_rn(a, b, zero):
    """``a * b`` rounded once in fp32 and never contracted into an FMA with a following add.

    The product passes through an integer XOR with ``zero``, a per-row value derived from the loaded
    index (0 for every valid row; Inductor would fold a scalar 0 argument into a constant), which
    leaves its bits unchanged but stops LLVM and ptxas from fusing it into an add.
    """
    return ((a * b).to(tl.int32, bitcast=True) ^ zero).to(tl.float32, bitcast=True)


@triton.jit
def _rsqrt(v, PORTABLE: tl.constexpr):
    """CUDA's ``rsqrtf`` (what eager ``torch.rsqrt`` calls); the interpreter has no libdevice."""
    if PORTABLE:
        return tl.rsqrt(v)
    return libdevice.rsqrt(v)


@triton.jit
def _columns(rows, row_ok, BLOCK_H: tl.constexpr, HIDDEN: tl.constexpr):
    """Column indices of a row block and the load/store mask (a column test only where it pads ``H``)."""
    cols = tl.arange(0, BLOCK_H)
    mask = row_ok[:, None] & (cols < HIDDEN)[None, :] if BLOCK_H > HIDDEN else row_ok[:, None]
    return cols, mask


@triton.jit
def _load_tile(
    x_ptr, res_ptr, branch_ptr, idx_ptr, tile, n_rows, num_table_rows, stride_x, stride_res, stride_branch,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr,
    STREAM_HINTS: tl.constexpr,
):
    """Issue the loads of one tile's streamed operands: its index and its activations (``x``, or
    ``residual`` and ``branch``), which need no index. Returns ``(rows, row_ok, idx, bad, zero, a, b)``:
    ``idx`` clamped into ``[0, K)``, ``bad`` the rows whose index was not, ``zero`` 0 on every valid row
    (see ``_mul_rn``), ``a``/``b`` the raw activations (``b`` is ``a`` for site A)."""
    rows = tile.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    idx = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    bad = row_ok & ((idx < 0) | (idx >= num_table_rows))
    zero = (idx < 0).to(tl.int32)[:, None]
    idx = tl.where(bad, 0, idx)  # every table load reads in bounds, whatever the index
    cols, mask = _columns(rows, row_ok, BLOCK_H, HIDDEN)
    policy: tl.constexpr = "evict_first" if STREAM_HINTS else ""
    if HAS_GATE:
        a = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=policy)
        b = tl.load(branch_ptr + rows[:, None] * stride_branch + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=policy)
    else:
        a = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy=policy)
        b = a
    return rows, row_ok, idx, bad, zero, a, b


@triton.jit
def _table_rows(ptr, idx, stride, mask, cols, STREAM_HINTS: tl.constexpr):
    """Rows ``idx`` of a ``[K, H]`` table as fp32 (kept in L2 under ``STREAM_HINTS``: every tile reads them)."""
    policy: tl.constexpr = "evict_last" if STREAM_HINTS else ""
    return tl.load(ptr + idx[:, None] * stride + cols[None, :], mask=mask, other=0.0,
                   eviction_policy=policy).to(tl.float32)


@triton.jit
def _finish_tile(
    rows, row_ok, idx, bad, zero, a, b, gate_ptr, w_ptr, shift_ptr, scale_ptr, u_ptr, y_ptr, eps,
    stride_gate, stride_shift, stride_scale,
    BLOCK_H: tl.constexpr, HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, ROUND_GATE: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_NORM_BEFORE_WEIGHT: tl.constexpr, ROUND_AFFINE: tl.constexpr, FUSE_AFFINE: tl.constexpr,
    PORTABLE: tl.constexpr, TABLES_EARLY: tl.constexpr, STREAM_HINTS: tl.constexpr,
):
    """Everything after ``_load_tile``: the table loads, the math of the module docstring, the stores."""
    act: tl.constexpr = u_ptr.dtype.element_ty
    store_policy: tl.constexpr = "evict_first" if STREAM_HINTS else ""
    cols, mask = _columns(rows, row_ok, BLOCK_H, HIDDEN)
    if HAS_NORM and TABLES_EARLY:
        scale = _table_rows(scale_ptr, idx, stride_scale, mask, cols, STREAM_HINTS)
        shift = _table_rows(shift_ptr, idx, stride_shift, mask, cols, STREAM_HINTS)
    if HAS_GATE:
        gate = _table_rows(gate_ptr, idx, stride_gate, mask, cols, STREAM_HINTS)
        g = _mul_rn(gate, b.to(tl.float32), zero)
        if ROUND_GATE:
            g = _rounded(g, act, PORTABLE)
        u = _rounded(a.to(tl.float32) + g, act, PORTABLE)
        tl.store(u_ptr + rows[:, None] * HIDDEN + cols[None, :], u.to(act), mask=mask, eviction_policy=store_policy)
    else:
        u = a.to(tl.float32)
    # after the activation loads: a load may not move above the assertion's call, which would otherwise
    # hold the tile's loads until the index arrives (measured: 5-6% of site A at T >= 15,808)
    tl.device_assert(~bad, "h3_fused: index out of range [0, K)")
    if HAS_NORM:
        # fp32 constants and scalars (Inductor may pass eps as a constexpr float, which computes in fp64)
        mean_square = tl.sum(u * u, axis=1) * tl.cast(1.0 / HIDDEN, tl.float32)
        n = u * _rsqrt(mean_square + tl.cast(eps, tl.float32), PORTABLE)[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=cols < HIDDEN, other=0.0).to(tl.float32)
            if ROUND_NORM_BEFORE_WEIGHT:
                n = _rounded(n, act, PORTABLE)
            n = n * w[None, :]
        if ROUND_NORM:
            n = _rounded(n, act, PORTABLE)
        if not TABLES_EARLY:
            scale = _table_rows(scale_ptr, idx, stride_scale, mask, cols, STREAM_HINTS)
            shift = _table_rows(shift_ptr, idx, stride_shift, mask, cols, STREAM_HINTS)
        p = 1.0 + scale
        if ROUND_AFFINE:
            p = _rounded(p, act, PORTABLE)
        if FUSE_AFFINE:
            y = n * p + shift
        else:
            q = _mul_rn(n, p, zero)
            if ROUND_AFFINE:
                q = _rounded(q, act, PORTABLE)
            y = q + shift
        tl.store(y_ptr + rows[:, None] * HIDDEN + cols[None, :], _rounded(y, act, PORTABLE).to(act), mask=mask,
                 eviction_policy=store_policy)


@triton.jit(debug=True)
def modulation_kernel(
    x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, u_ptr, y_ptr,
    n_rows, num_table_rows, eps,
    stride_x, stride_res, stride_branch, stride_gate, stride_shift, stride_scale,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROUND_GATE: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_NORM_BEFORE_WEIGHT: tl.constexpr,
    ROUND_AFFINE: tl.constexpr, FUSE_AFFINE: tl.constexpr, PORTABLE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, TILES_PER_PROGRAM: tl.constexpr,
    TABLES_EARLY: tl.constexpr, STREAM_HINTS: tl.constexpr,
):
    """Program ``p`` of ``G`` handles tiles ``p, p + G, ...`` (``TILES_PER_PROGRAM`` of them), issuing the
    loads of the next tile before it finishes the current one."""
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    rows, row_ok, idx, bad, zero, a, b = _load_tile(
        x_ptr, res_ptr, branch_ptr, idx_ptr, pid, n_rows, num_table_rows, stride_x, stride_res, stride_branch,
        BLOCK_T, BLOCK_H, HIDDEN, HAS_GATE, STREAM_HINTS)
    for k in tl.static_range(TILES_PER_PROGRAM):
        if k + 1 < TILES_PER_PROGRAM:
            next_tile = _load_tile(
                x_ptr, res_ptr, branch_ptr, idx_ptr, pid + (k + 1) * n_programs, n_rows, num_table_rows,
                stride_x, stride_res, stride_branch, BLOCK_T, BLOCK_H, HIDDEN, HAS_GATE, STREAM_HINTS)
        _finish_tile(rows, row_ok, idx, bad, zero, a, b, gate_ptr, w_ptr, shift_ptr, scale_ptr, u_ptr, y_ptr, eps,
                     stride_gate, stride_shift, stride_scale, BLOCK_H, HIDDEN, HAS_GATE, HAS_NORM, HAS_WEIGHT,
                     ROUND_GATE, ROUND_NORM, ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE, FUSE_AFFINE, PORTABLE,
                     TABLES_EARLY, STREAM_HINTS)
        if k + 1 < TILES_PER_PROGRAM:
            rows, row_ok, idx, bad, zero, a, b = next_tile


@dataclass(frozen=True)
class LaunchConfig:
    """How ``modulation_kernel`` is launched: ``BLOCK_T`` rows of ``BLOCK_H >= H`` columns per tile,
    ``tiles_per_program`` tiles per program (the next one's loads issued before the current one is
    finished), table rows loaded before the norm's reduction (``tables_early``) or after it, cache
    hints (``stream_hints``: activations evict-first, tables evict-last)."""

    block_t: int
    block_h: int
    num_warps: int
    tiles_per_program: int = 1
    tables_early: bool = False
    stream_hints: bool = False


def launch_config(hidden: int, has_norm: bool) -> LaunchConfig:
    """Whole rows in registers, at least 2K elements per tile.

    Measured on the H200 at H = 5,376 (``benchmarks/bench_ops.py --sweep``, docs/BENCHMARKS.md): one row
    per tile; 64 elements per thread (4 warps) for the norm sites, 32 (8 warps) for site C. Splitting
    the row into unmasked power-of-two pieces, two rows per tile, and 16 warps were all slower.
    """
    block_h = triton.next_power_of_2(int(hidden))  # a constexpr: H is specialised, never symbolic
    if block_h > MAX_BLOCK_H:
        raise ValueError(f"H={hidden} exceeds the kernel's limit of {MAX_BLOCK_H}")
    block_t = max(1, 2048 // block_h)
    per_thread = 64 if has_norm else 32
    num_warps = max(1, min(16, block_t * block_h // (32 * per_thread)))
    return LaunchConfig(block_t, block_h, num_warps)


def specialisation(hidden: int, has_gate: bool, has_norm: bool, has_weight: bool, rounding: Rounding,
                   config: LaunchConfig, portable: bool) -> dict:
    """The kernel's constexpr arguments for one site, rounding and launch configuration."""
    return dict(
        HIDDEN=hidden, HAS_GATE=has_gate, HAS_NORM=has_norm, HAS_WEIGHT=has_weight,
        ROUND_GATE=rounding.gate_product, ROUND_NORM=rounding.norm_output,
        ROUND_NORM_BEFORE_WEIGHT=rounding.norm_before_weight, ROUND_AFFINE=rounding.affine,
        FUSE_AFFINE=rounding.fuse_affine, PORTABLE=portable, BLOCK_T=config.block_t, BLOCK_H=config.block_h,
        TILES_PER_PROGRAM=config.tiles_per_program, TABLES_EARLY=config.tables_early,
        STREAM_HINTS=config.stream_hints,
    )


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_modulation(a: ModulationArgs, u: torch.Tensor | None, y: torch.Tensor | None, wrap):
    """Run ``modulation_kernel`` for ``a`` into ``u``/``y`` (``wrap`` = ``torch.library.wrap_triton``).

    Arguments a site does not use are passed as an alias of one it does; the kernel never reads them.
    """
    config = launch_config(a.hidden, a.scale is not None)
    rows_alias = a.x if a.x is not None else a.residual
    table_alias = a.gate if a.gate is not None else a.scale

    def rows_or_alias(t):
        return rows_alias if t is None else t

    def table_or_alias(t):
        return table_alias if t is None else t

    x, res, branch = rows_or_alias(a.x), rows_or_alias(a.residual), rows_or_alias(a.branch)
    gate, shift, scale = table_or_alias(a.gate), table_or_alias(a.shift), table_or_alias(a.scale)
    tiles = triton.cdiv(a.rows, config.block_t)
    return wrap(modulation_kernel)[(triton.cdiv(tiles, config.tiles_per_program),)](
        x, res, branch, gate, table_or_alias(a.weight), shift, scale, a.index,
        y if u is None else u, u if y is None else y,
        a.rows, a.num_table_rows, a.eps,
        x.stride(0), res.stride(0), branch.stride(0), gate.stride(0), shift.stride(0), scale.stride(0),
        **specialisation(a.hidden, a.gate is not None, a.scale is not None, a.weight is not None, a.rounding,
                         config, interpreting()),
        num_warps=config.num_warps,
    )
