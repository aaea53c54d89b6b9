"""One parameterised Triton kernel for the three modulation sites, and its launcher.

Per row ``t`` (``i = index[t]``, arithmetic in fp32 unless said below, ``R`` = round to the activation dtype):

    site B/C:  g = gate[i] * branch            (R if ROUND_GATE)
               u = R(residual + g)             -> stored (B, C; one FMA with the product if FUSE_MULTIPLY_ADD)
    site A:    u = x
    site A/B:  r = rsqrt(sum(u*u) * (1/H) + eps)
               n = u * r                       (R if ROUND_NORM_BEFORE_WEIGHT, then * w if HAS_WEIGHT)
               n = R(n) if ROUND_NORM
               p = 1 + scale[i]                (R if ROUND_AFFINE)
               q = n * p                       (R if ROUND_AFFINE; fused with the add if FUSE_MULTIPLY_ADD)
               y = R(q + shift[i])             -> stored (A, B)

Each program holds ``BLOCK_T`` whole rows in registers, read in chunks of ``CHUNK`` columns; the chunks
of ``u`` stay in registers (in the activation dtype) from the sum of squares to the modulation. Each
chunk's weight, ``scale[i]`` and ``shift[i]`` are loaded just before their use, or ahead
(``TABLES_AHEAD``: the first chunk's before the reduction, the next chunk's before each ``y`` store);
the order changes no result (``launch_config`` says why these sizes and orders). After its stores, every
few programs warm L2 with the table rows of the row ``AHEAD`` rows on (``_touch_coming_table_rows``):
where the index comes in runs, as in the model, the programs that start a new run find its table rows
in L2 instead of waiting on DRAM. Under ``WARM_TABLES`` the kernel's first programs hold no rows: they
bring every table row into L2 (``_touch_table_rows``), ahead of the activations the programs of rows
request after them.

Multiplies feeding an add are never contracted into an FMA (which would remove the fp32 rounding
eager performs), except under the ``fp32`` policy (``FUSE_MULTIPLY_ADD``), where ``q + shift`` is one
fp32 FMA, as the upstream fp32 kernels compile it, and ``residual + g`` one FMA in the activation dtype
where the gate table has it (``fma.rn.bf16x2``: the exact sum rounded once, which is what ``u = R(residual +
gate[i] * branch)`` means, without converting the operands to fp32 and the sum back; through fp32 it
would be rounded twice, which differs where the product is a tie of bf16 and the residual lies below
fp32's last place of it; ``_sum_rounded_once``), else one fp32 FMA. Under the interpreter
(``PORTABLE``) rounding to bf16 is done on the bits, since the interpreter truncates conversions.

An out-of-range index never reads out of bounds (it is clamped for the loads) and fails a device-side
assertion: the kernel is compiled with ``debug=True`` for direct launches, and Inductor compiles it
with assertions on (``assert_indirect_indexing``, its default).
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
FEWEST_ROWS = 1024  # up to this many rows site A runs on 8 warps (``launch_config``)
FEW_ROWS = 6144  # up to this many rows site B runs on 8 warps
SITE_A_NARROW_H = 2048  # up to this H site A loads its table rows ahead only up to SITE_A_FEW_ROWS rows
SITE_A_FEW_ROWS = 16384
MIN_WARPS = 4  # the fewest warps a program runs on (``launch_config``)
WARM_TABLES_MAX_BYTES = 4 << 20  # tables larger than this are not warmed as the kernel starts (``warming_programs``)


@triton.jit
def _rounded(v, dtype: tl.constexpr, PORTABLE: tl.constexpr):
    """``v`` (fp32) rounded to nearest even in ``dtype``, as fp32."""
    if PORTABLE and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(v != v, v, bits.to(tl.float32, bitcast=True))
    return v.to(dtype).to(tl.float32)


@triton.jit
def _widened(v):
    """``v`` as fp32 (exact), a bf16 ``v`` through its bits (its 16 bits are the fp32 value's high half).

    A plain conversion of the high bf16 of a packed pair is two instructions (PRMT, then a shift), the bits
    one (an AND, or a shift for the low one): site A's sm_90 build for 3,072 rows runs 680 -> 640
    instructions per thread under ``bf16`` and 824 -> 728 under ``fp32`` (``benchmarks/sass_counts.py
    --dump``, Triton 3.6), with the same registers. Where LLVM narrows rounded fp32 arithmetic on bf16
    values to packed bf16 arithmetic (``R(1 + scale)``), the conversion stays plain: the bits would hide it."""
    if v.dtype == tl.bfloat16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return v.to(tl.float32)


@triton.jit
def _mul_rn(a, b, zero):
    """``a * b`` rounded once in fp32 and never contracted into an FMA with a following add, even where
    the product is then rounded to bf16: LLVM narrows ``R(a*b)`` and ``R(c + R(a*b))`` of bf16 values
    to bf16 arithmetic and would contract the pair into one ``fma.rn.bf16x2``, dropping the rounding.

    The product passes through an integer XOR with ``zero``, a per-row value derived from the loaded
    index (0 for every valid row; Inductor would fold a scalar 0 argument into a constant), which
    leaves its bits unchanged but stops LLVM and ptxas from fusing it into an add.
    """
    return ((a * b).to(tl.int32, bitcast=True) ^ zero).to(tl.float32, bitcast=True)


@triton.jit
def _rounded_product(a, b, zero, dtype: tl.constexpr, PORTABLE: tl.constexpr):
    """``R(a * b)`` (``a``, ``b`` fp32), as fp32, never contracted into an FMA with a following add.

    Where ``a`` and ``b`` are bf16 values LLVM computes this as one packed bf16 multiply (exact: the
    fp32 product of two bf16 values needs no rounding, so one rounding to bf16 is eager's), and the
    XOR of the rounded bits with ``zero`` (see ``_mul_rn``) keeps it from fusing with the next add.
    """
    if PORTABLE:
        return _rounded(a * b, dtype, PORTABLE)
    bits = (a * b).to(dtype).to(tl.int16, bitcast=True) ^ zero.to(tl.int16)
    return bits.to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _sum_rounded_once(gate, branch, res, PORTABLE: tl.constexpr):
    """``res + gate * branch`` of operands in the activation dtype, as fp32 values whose rounding to that
    dtype (``_rounded``) is the exact sum's one rounding. Compiled: one FMA in the dtype
    (``fma.rn.bf16x2``), already rounded. Interpreted (``PORTABLE``: no bf16 arithmetic there): the fp32
    sum and its exact error (TwoSum; the product of two bf16/fp16 values is exact in fp32 within its
    range) rounded to odd, toward zero with the last bit set where inexact, which leaves the one rounding
    that follows to decide as the exact sum would."""
    if not PORTABLE:
        return tl.fma(gate, branch, res).to(tl.float32)
    p = gate.to(tl.float32) * branch.to(tl.float32)
    r = res.to(tl.float32)
    s = r + p
    t = s - r
    e = (r - (s - t)) + (p - t)
    inexact = (e != 0) & (e == e)  # e is NaN where the sum is not finite: left as it is
    beyond = inexact & ((e < 0) == (s > 0))  # s lies past the exact sum, away from zero
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(beyond, bits - 1, bits) | inexact.to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rsqrt(v, PORTABLE: tl.constexpr):
    """CUDA's ``rsqrtf`` (what eager ``torch.rsqrt`` calls); the interpreter has no libdevice."""
    if PORTABLE:
        return tl.rsqrt(v)
    return libdevice.rsqrt(v)


@triton.jit
def _touch_sectors(row_ptrs, line, quarter, selected, valid, HIDDEN: tl.constexpr):
    """One element of quarter ``quarter`` (a 32-byte sector) of 128-byte line ``line`` (taken modulo the
    row's lines) of each table row ``row_ptrs`` points to, where ``selected`` and ``valid``: a
    ``volatile`` load whose result is unused. The line's width in elements follows the table's dtype."""
    per_line: tl.constexpr = 1024 // row_ptrs.dtype.element_ty.primitive_bitwidth
    lines_per_row: tl.constexpr = (HIDDEN + per_line - 1) // per_line
    col = (line % lines_per_row) * per_line + quarter * (per_line // 4)
    tl.load(row_ptrs + col, mask=selected & (col < HIDDEN) & valid, volatile=True)


@triton.jit
def _touch_coming_table_rows(program, idx_ptr, shift_ptr, scale_ptr, gate_ptr, n_rows, num_table_rows,
                             stride_shift, stride_scale, stride_gate, HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr,
                             BLOCK_T: tl.constexpr, AHEAD: tl.constexpr, LANES: tl.constexpr):
    """Warms L2 with the table rows the kernel will read ``AHEAD`` rows on. Every ``GROUP``-th program
    (``program``, counting the programs of rows, int64; ``GROUP = LANES // 16``, at least 1) reads
    ``k = index[its first row + AHEAD]`` and then, one lane
    each, one element of every 32-byte sector of ``GROUP`` consecutive lines, from line ``program_id mod
    lines-per-row`` on, of ``shift[k]``, ``scale[k]`` and (site B) ``gate[k]``: between them the
    programs cover whole rows. ``shift`` and ``scale`` share a dtype; ``gate``, whose dtype may differ,
    has a load of its own.
    Where the index comes in runs, the programs ``AHEAD`` rows before a run's start bring its new table
    rows from DRAM; elsewhere the sectors are already in L2. The loads are ``volatile`` (their results
    are unused, and the compiler keeps them) and plain, which Inductor's analysis of the kernel
    understands, unlike inline assembly such as ``prefetch``. An index out of range, or past the last
    row, reads nothing. Changes no result."""
    GROUP: tl.constexpr = LANES // 16 if LANES >= 16 else 1
    if program % GROUP == 0:
        lane = tl.arange(0, LANES).to(tl.int64)
        coming_row = program * BLOCK_T + AHEAD + 0 * lane  # every lane reads it: one request per warp
        k = tl.load(idx_ptr + coming_row, mask=coming_row < n_rows, other=-1)
        valid = (k >= 0) & (k < num_table_rows)
        k = tl.where(valid, k, 0)
        which = lane // (4 * GROUP)
        line = program + (lane // 4) % GROUP
        modulation = tl.where(which == 0, shift_ptr + k * stride_shift, scale_ptr + k * stride_scale)
        _touch_sectors(modulation, line, lane % 4, which < 2, valid, HIDDEN)
        if HAS_GATE:
            _touch_sectors(gate_ptr + k * stride_gate, line, lane % 4, which == 2, valid, HIDDEN)


@triton.jit
def _chunk(c: tl.constexpr, row_ok, CHUNK: tl.constexpr, HIDDEN: tl.constexpr):
    """The lanes of chunk ``c`` (its columns are ``c * CHUNK + lanes``) and the load/store mask (a column
    test only in the chunk that crosses ``H``).

    Column offsets are added to pointers, never to int32 tensors: with ``debug=True`` (which keeps the
    index assertion) Triton checks every int32 add for overflow, each with an assertion and a barrier.
    """
    lanes = tl.arange(0, CHUNK)
    mask = row_ok[:, None] & (lanes < HIDDEN - c * CHUNK)[None, :] if (c + 1) * CHUNK > HIDDEN else row_ok[:, None]
    return lanes, mask


@triton.jit
def _new_residual(
    x_ptr, res_ptr, branch_ptr, gate_ptr, u_ptr, rows, idx, zero, start: tl.constexpr, lanes, mask,
    stride_x, stride_res, stride_branch, stride_gate,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, ROUND_GATE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr,
    PORTABLE: tl.constexpr,
):
    """One chunk of ``u`` in the activation dtype: the gated residual (sites B, C; stored by the caller), or
    the loaded ``x``.

    The activations are read once, so they bypass L1 (``.cg``), leaving it to the table rows that every
    program on the SM reads again (measured: site A 0.6-0.9% faster, B and C unchanged)."""
    if HAS_GATE:
        act: tl.constexpr = u_ptr.dtype.element_ty
        res = tl.load(res_ptr + rows[:, None] * stride_res + start + lanes[None, :], mask=mask, other=0.0,
                      cache_modifier=".cg")
        branch = tl.load(branch_ptr + rows[:, None] * stride_branch + start + lanes[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg")
        gate = tl.load(gate_ptr + idx[:, None] * stride_gate + start + lanes[None, :], mask=mask, other=0.0)
        if FUSE_MULTIPLY_ADD and gate.dtype == act:
            u = _sum_rounded_once(gate, branch, res, PORTABLE)
        elif FUSE_MULTIPLY_ADD:  # explicit, whatever Triton's default for contracting multiply-adds
            u = tl.fma(gate.to(tl.float32), branch.to(tl.float32), res.to(tl.float32))
        elif ROUND_GATE:
            u = res.to(tl.float32) + _rounded_product(gate.to(tl.float32), branch.to(tl.float32), zero, act, PORTABLE)
        else:
            u = res.to(tl.float32) + _mul_rn(gate.to(tl.float32), branch.to(tl.float32), zero)
        u = _rounded(u, act, PORTABLE).to(act)
    else:
        u = tl.load(x_ptr + rows[:, None] * stride_x + start + lanes[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg")
    return u


@triton.jit
def _weight_chunk(w_ptr, start: tl.constexpr, lanes, HIDDEN: tl.constexpr):
    """The weight's chunk as a ``[1, CHUNK]`` row, in the layout of the activations (a 1-D load would be
    converted through shared memory, with barriers, in every chunk)."""
    return tl.load(w_ptr + start + lanes[None, :], mask=(lanes < HIDDEN - start)[None, :], other=0.0)


@triton.jit
def _table_chunk(table_ptr, idx, start: tl.constexpr, lanes, mask, stride):
    """Chunk ``start`` of row ``idx`` of a ``[K, H]`` table."""
    return tl.load(table_ptr + idx[:, None] * stride + start + lanes[None, :], mask=mask, other=0.0)


@triton.jit
def _tables_chunk(w_ptr, shift_ptr, scale_ptr, idx, c: tl.constexpr, row_ok, stride_shift, stride_scale,
                  HIDDEN: tl.constexpr, CHUNK: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """Chunk ``c`` of the weight (0.0 without one), ``scale[i]`` and ``shift[i]``, for ``TABLES_AHEAD``."""
    lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
    w = _weight_chunk(w_ptr, c * CHUNK, lanes, HIDDEN) if HAS_WEIGHT else 0.0
    return (w, _table_chunk(scale_ptr, idx, c * CHUNK, lanes, mask, stride_scale),
            _table_chunk(shift_ptr, idx, c * CHUNK, lanes, mask, stride_shift))


@triton.jit
def _modulated(
    u, r, w_ptr, shift_ptr, scale_ptr, y_ptr, idx, zero, start: tl.constexpr, lanes, mask,
    stride_shift, stride_scale, tables,
    HIDDEN: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_NORM_BEFORE_WEIGHT: tl.constexpr, ROUND_AFFINE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr,
    PORTABLE: tl.constexpr, TABLES_AHEAD: tl.constexpr,
):
    """One chunk of ``y = R(R(norm(u)) * R(1 + scale[i]) + shift[i])`` (roundings as the flags say), returned
    in the activation dtype for the caller to store. The weight, scale and shift chunks are ``tables``
    (loaded by the caller) under ``TABLES_AHEAD``, else loaded here, each just before its first use."""
    act: tl.constexpr = y_ptr.dtype.element_ty
    n = u * r[:, None]
    if HAS_WEIGHT:
        w = tables[0] if TABLES_AHEAD else _weight_chunk(w_ptr, start, lanes, HIDDEN)
        if ROUND_NORM_BEFORE_WEIGHT:
            n = _rounded(n, act, PORTABLE)
        n = n * _widened(w)
    if ROUND_NORM:
        n = _rounded(n, act, PORTABLE)
    scale = tables[1] if TABLES_AHEAD else _table_chunk(scale_ptr, idx, start, lanes, mask, stride_scale)
    shift = tables[2] if TABLES_AHEAD else _table_chunk(shift_ptr, idx, start, lanes, mask, stride_shift)
    if ROUND_AFFINE:  # a plain conversion: LLVM narrows the rounded affine to packed bf16 arithmetic
        scale, shift = scale.to(tl.float32), shift.to(tl.float32)
        p = _rounded(1.0 + scale, act, PORTABLE)
    else:
        scale, shift = _widened(scale), _widened(shift)
        p = 1.0 + scale
    if FUSE_MULTIPLY_ADD:
        y = tl.fma(n, p, shift)
    elif ROUND_AFFINE:
        y = _rounded_product(n, p, zero, act, PORTABLE) + shift
    else:
        y = _mul_rn(n, p, zero) + shift
    return _rounded(y, act, PORTABLE).to(act)


@triton.jit
def _touch_table_rows(program, w_ptr, shift_ptr, scale_ptr, gate_ptr, num_table_rows, stride_shift, stride_scale,
                      stride_gate, HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
                      HAS_WEIGHT: tl.constexpr, LANES: tl.constexpr):
    """Warming program ``program`` (int64) of the kernel's first ones (``WARM_TABLES``): one element of each
    of ``LANES`` consecutive 32-byte sectors, one per lane, of every table row the site reads, taken in
    order (the rows of ``shift`` and ``scale``, of ``gate``, then the weight), read with ``volatile`` loads
    whose results are unused. Between them the warming programs cover every row, so that the rows arrive
    in L2 ahead of the activations the programs of rows request after them, instead of behind them.
    Changes no result."""
    sector = program * LANES + tl.arange(0, LANES).to(tl.int64)
    table_rows = num_table_rows + 0 * program  # int64, also where Triton or Inductor made the count a constant
    rest = sector
    if HAS_NORM:  # shift and scale share a dtype
        per_sector: tl.constexpr = 256 // shift_ptr.dtype.element_ty.primitive_bitwidth
        row_sectors: tl.constexpr = (HIDDEN + per_sector - 1) // per_sector
        row = rest // row_sectors
        table = tl.where(row < table_rows, shift_ptr + row * stride_shift, scale_ptr + (row - table_rows) * stride_scale)
        tl.load(table + (rest % row_sectors) * per_sector, mask=row < 2 * table_rows, volatile=True)
        rest -= 2 * table_rows * row_sectors
    if HAS_GATE:
        gate_per_sector: tl.constexpr = 256 // gate_ptr.dtype.element_ty.primitive_bitwidth
        gate_row_sectors: tl.constexpr = (HIDDEN + gate_per_sector - 1) // gate_per_sector
        row = rest // gate_row_sectors
        tl.load(gate_ptr + row * stride_gate + (rest % gate_row_sectors) * gate_per_sector,
                mask=(rest >= 0) & (row < table_rows), volatile=True)
        rest -= table_rows * gate_row_sectors
    if HAS_WEIGHT:
        w_per_sector: tl.constexpr = 256 // w_ptr.dtype.element_ty.primitive_bitwidth
        tl.load(w_ptr + rest * w_per_sector, mask=(rest >= 0) & (rest * w_per_sector < HIDDEN), volatile=True)


def ceil_div(a, b):
    """``ceil(a / b)`` of non-negative integers, symbolic ones too. On the host, in place of ``triton.cdiv``,
    a ``constexpr_function`` whose wrapper costs about 1.5 us a call (Triton 3.6-3.9), several per launch."""
    return (a + b - 1) // b


def warming_programs(a: ModulationArgs, lanes: int) -> int:
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


@triton.jit
def _modulate_rows(
    program, x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, u_ptr, y_ptr,
    n_rows, num_table_rows, eps,
    stride_x, stride_res, stride_branch, stride_gate, stride_shift, stride_scale,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROUND_GATE: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_NORM_BEFORE_WEIGHT: tl.constexpr,
    ROUND_AFFINE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr, PORTABLE: tl.constexpr, BLOCK_T: tl.constexpr,
    CHUNK: tl.constexpr, TABLES_AHEAD: tl.constexpr, AHEAD: tl.constexpr, LANES: tl.constexpr,
):
    """The rows of program ``program`` (int64), counting the programs of rows."""
    rows = program * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    idx = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    bad = row_ok & ((idx < 0) | (idx >= num_table_rows))
    zero = (idx < 0).to(tl.int32)[:, None]  # 0 wherever the result is defined (see _mul_rn)
    idx = tl.where(bad, 0, idx)  # every load reads in bounds, whatever the index

    kept = ()  # the row's chunks of u, in the activation dtype (exact: u is rounded to it or loaded in it)
    squares = tl.zeros([BLOCK_T, CHUNK], tl.float32)
    for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
        lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
        u = _new_residual(x_ptr, res_ptr, branch_ptr, gate_ptr, u_ptr, rows, idx, zero, c * CHUNK, lanes, mask,
                          stride_x, stride_res, stride_branch, stride_gate, HIDDEN, HAS_GATE, ROUND_GATE,
                          FUSE_MULTIPLY_ADD, PORTABLE)
        if HAS_NORM:
            wide = _widened(u)
            squares += wide * wide
        kept = kept + (u,)
    tables = (0.0, 0.0, 0.0)
    if HAS_NORM and TABLES_AHEAD and HAS_GATE:  # site B: arriving while the row is reduced (after the check: slower)
        tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, idx, 0, row_ok, stride_shift, stride_scale, HIDDEN,
                               CHUNK, HAS_WEIGHT)
    if HAS_GATE:  # after every chunk's loads: a store may alias them, so no load could move above it
        for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
            lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
            tl.store(u_ptr + rows[:, None] * HIDDEN + c * CHUNK + lanes[None, :], kept[c], mask=mask)
    # after the activation loads: a load may not move above the assertion's call, which would otherwise
    # hold the row's loads until the index arrives (measured: 5-6% of site A at T >= 15,808)
    tl.device_assert(~bad, "h3_fused: index out of range [0, K)")
    if HAS_NORM and TABLES_AHEAD and not HAS_GATE:  # site A: after the assertion, so that ptxas does not
        # compute their addresses, which wait for the index, before issuing the activation loads
        tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, idx, 0, row_ok, stride_shift, stride_scale, HIDDEN,
                               CHUNK, HAS_WEIGHT)
    if HAS_NORM:
        # fp32 constants and scalars (Inductor may pass eps as a constexpr float, which computes in fp64)
        mean_square = tl.sum(squares, axis=1) * tl.cast(1.0 / HIDDEN, tl.float32)
        r = _rsqrt(mean_square + tl.cast(eps, tl.float32), PORTABLE)
        chunks: tl.constexpr = triton.cdiv(HIDDEN, CHUNK)
        for c in tl.static_range(chunks):
            lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
            current = tables
            if TABLES_AHEAD and c + 1 < chunks:  # the next chunk's, before this chunk's store (which may alias them)
                tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, idx, c + 1, row_ok, stride_shift, stride_scale,
                                       HIDDEN, CHUNK, HAS_WEIGHT)
            y = _modulated(_widened(kept[c]), r, w_ptr, shift_ptr, scale_ptr, y_ptr, idx, zero, c * CHUNK, lanes,
                           mask, stride_shift, stride_scale, current, HIDDEN, HAS_WEIGHT, ROUND_NORM,
                           ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE, FUSE_MULTIPLY_ADD, PORTABLE, TABLES_AHEAD)
            tl.store(y_ptr + rows[:, None] * HIDDEN + c * CHUNK + lanes[None, :], y, mask=mask)
    if AHEAD > 0 and HAS_NORM:  # last: no register of the row is live any more
        _touch_coming_table_rows(program, idx_ptr, shift_ptr, scale_ptr, gate_ptr, n_rows, num_table_rows,
                                 stride_shift, stride_scale, stride_gate, HIDDEN, HAS_GATE, BLOCK_T, AHEAD, LANES)


@triton.jit(debug=True)
def modulation_kernel(
    x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, u_ptr, y_ptr,
    n_rows, num_table_rows, eps,
    stride_x, stride_res, stride_branch, stride_gate, stride_shift, stride_scale,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    ROUND_GATE: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_NORM_BEFORE_WEIGHT: tl.constexpr,
    ROUND_AFFINE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr, PORTABLE: tl.constexpr, BLOCK_T: tl.constexpr,
    CHUNK: tl.constexpr, TABLES_AHEAD: tl.constexpr, AHEAD: tl.constexpr, WARM_TABLES: tl.constexpr,
    LANES: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)  # int64 throughout: no int32 overflow checks under debug=True
    warming: tl.constexpr = 0
    if WARM_TABLES:  # the programs beyond the rows' come first (``warming_programs``)
        rows_programs = (n_rows + 0 * program + BLOCK_T - 1) // BLOCK_T  # ``n_rows`` may be a constant: no ``.to``
        warming = tl.num_programs(0).to(tl.int64) - rows_programs
    if WARM_TABLES and program < warming:
        _touch_table_rows(program, w_ptr, shift_ptr, scale_ptr, gate_ptr, num_table_rows, stride_shift,
                          stride_scale, stride_gate, HIDDEN, HAS_GATE, HAS_NORM, HAS_WEIGHT, LANES)
    else:
        _modulate_rows(program - warming, x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr,
                       u_ptr, y_ptr, n_rows, num_table_rows, eps, stride_x, stride_res, stride_branch, stride_gate,
                       stride_shift, stride_scale, HIDDEN, HAS_GATE, HAS_NORM, HAS_WEIGHT, ROUND_GATE, ROUND_NORM,
                       ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE, FUSE_MULTIPLY_ADD, PORTABLE, BLOCK_T, CHUNK,
                       TABLES_AHEAD, AHEAD, LANES)


@dataclass(frozen=True)
class LaunchConfig:
    """``BLOCK_T`` rows per program, each read in chunks of ``CHUNK`` columns, on ``num_warps`` warps;
    ``tables_ahead``: the norm's table rows loaded ahead of their use (``launch_config``);
    ``prefetch_ahead``: how many rows ahead the kernel warms L2 with the table rows it will read (0: it
    does not; ``_touch_coming_table_rows``); ``warm_tables``: warming programs ahead of the programs of rows
    bring every table row into L2 as the kernel starts (``_touch_table_rows``, ``warming_programs``)."""

    block_t: int
    chunk: int
    num_warps: int
    tables_ahead: bool = False
    prefetch_ahead: int = 1024
    warm_tables: bool = False

    @property
    def lanes(self) -> int:
        """The lanes of the warming loads (``LANES``), ``block_t * chunk // 8``: one per eight elements of a
        chunk of the program's rows, which is one per thread (each holds 8 columns of a chunk) at every H
        but 1."""
        return self.block_t * self.chunk // 8


def launch_config(hidden: int, has_gate: bool, has_norm: bool, rows: int | None) -> LaunchConfig:
    """Whole rows in registers, read in chunks of one 16-byte vector per thread (8 bf16), so that only the
    last chunk pads ``H``; one row per program (rows shorter than the program's lanes share it).

    - Warps: 8 for site C, for site B up to ``FEW_ROWS`` rows and for site A up to ``FEWEST_ROWS`` rows;
      4 beyond (more programs resident per SM); never fewer than ``MIN_WARPS`` = 4, which only changes
      H of 4,096 and less.
    - ``tables_ahead``: the norm's table rows (weight, ``scale[i]``, ``shift[i]``) loaded ahead of their
      use (the first chunk's before the reduction, each next chunk's before the current chunk's store;
      more registers, fewer programs per SM) by site B always; by site A from H = 2,049 on always, and up
      to ``SITE_A_NARROW_H`` = 2,048 for up to ``SITE_A_FEW_ROWS`` rows, each just before its use beyond.
    - ``prefetch_ahead``: the table rows of the row 1,024 rows on warmed in L2 (``_touch_coming_table_rows``).
    - ``warm_tables``: for site A, warming programs ahead of the programs of rows bring every table row
      into L2 as the kernel starts (``_touch_table_rows``).

    ``rows`` is the row count, or None where it is symbolic (a graph compiled for dynamic shapes): the
    many-rows choice, without a guard on the count.

    Every bound was chosen side by side on the H200 at H = 5,376 (``SITE_A_NARROW_H`` at H = 2,048 to
    16,384), with the outputs unchanged (docs/BENCHMARKS.md): the warp counts in runs 13 and 21 ("Launch
    configurations measured", "Small T"; with warming programs in run 113, "What the gap is made of"); B's table rows ahead in run 30, and beyond ``FEW_ROWS`` on 4 warps in run 45; A on 4 warps with
    its table rows ahead from 1,025 rows in run 41, and beyond 16,384 rows in runs 87-89, with one set
    of output buffers for both ("The table rows ahead at every row count"): from H = 4,096 on 0.6-4.5%
    faster with the model's index in runs and between 3.9% faster and 0.8% slower with the uniform one,
    at H = 2,048 1.2-4.1% slower, so that there ``SITE_A_FEW_ROWS`` stays, which runs 44-71 had placed
    between 15,808 and 20,000 rows; the warming distance in run 38; ``MIN_WARPS`` in runs
    59-61 ("The launch rule below H = 5,376"); ``warm_tables`` in runs 93-95 ("Warming the tables as the
    kernel starts": site A side by side 0.4-6.9% faster at T = 3,072 and 15,808, H = 2,048-16,384, and
    0.1-0.2% at 63,232; B within 0.5% either way; C 1-2% slower). Measured there and slower: 1, 2 and 16 warps, the row
    as one padded block, two rows per program, programs looping over rows, every table row loaded with
    the activations, the table rows prefetched or touched first or warmed into L1, capped registers,
    cache hints, and persistent programs pipelined through shared memory.
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
    tables_ahead = has_norm and (has_gate or hidden > SITE_A_NARROW_H or at_most(SITE_A_FEW_ROWS))
    return LaunchConfig(block_t, chunk, num_warps, tables_ahead, warm_tables=has_norm and not has_gate)


def specialisation(hidden: int, has_gate: bool, has_norm: bool, has_weight: bool, rounding: Rounding,
                   config: LaunchConfig, portable: bool) -> dict:
    """The kernel's constexpr arguments for one site, rounding and launch configuration."""
    return dict(
        HIDDEN=hidden, HAS_GATE=has_gate, HAS_NORM=has_norm, HAS_WEIGHT=has_weight,
        ROUND_GATE=rounding.gate_product, ROUND_NORM=rounding.norm_output,
        ROUND_NORM_BEFORE_WEIGHT=rounding.norm_before_weight, ROUND_AFFINE=rounding.affine,
        FUSE_MULTIPLY_ADD=rounding.fused_multiply_add, PORTABLE=portable, BLOCK_T=config.block_t, CHUNK=config.chunk,
        TABLES_AHEAD=config.tables_ahead and has_norm,  # no tables without a norm: one build of site C
        AHEAD=config.prefetch_ahead, WARM_TABLES=config.warm_tables, LANES=config.lanes,
    )


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_modulation(a: ModulationArgs, u: torch.Tensor | None, y: torch.Tensor | None, wrap):
    """Run ``modulation_kernel`` for ``a`` into ``u``/``y`` (``wrap`` = ``torch.library.wrap_triton``).

    Arguments a site does not use are passed as an alias of one it does; the kernel never reads them.
    """
    config = launch_config(a.hidden, a.gate is not None, a.scale is not None,
                           a.rows if isinstance(a.rows, int) else None)
    rows_alias = a.x if a.x is not None else a.residual
    table_alias = a.gate if a.gate is not None else a.scale

    def rows_or_alias(t):
        return rows_alias if t is None else t

    def table_or_alias(t):
        return table_alias if t is None else t

    x, res, branch = rows_or_alias(a.x), rows_or_alias(a.residual), rows_or_alias(a.branch)
    gate, shift, scale = table_or_alias(a.gate), table_or_alias(a.shift), table_or_alias(a.scale)
    warming = warming_programs(a, config.lanes) if config.warm_tables else 0
    return wrap(modulation_kernel)[(ceil_div(a.rows, config.block_t) + warming,)](
        x, res, branch, gate, table_or_alias(a.weight), shift, scale, a.index,
        y if u is None else u, u if y is None else y,
        a.rows, a.num_table_rows, a.eps,
        x.stride(0), res.stride(0), branch.stride(0), gate.stride(0), shift.stride(0), scale.stride(0),
        **specialisation(a.hidden, a.gate is not None, a.scale is not None, a.weight is not None, a.rounding,
                         config, interpreting()),
        num_warps=config.num_warps,
    )
