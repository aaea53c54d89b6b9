"""The forward kernel: one parameterised Triton kernel for the three modulation sites (device code only;
``launch.py`` chooses its configuration and launches it).

Per row ``t`` (``i = index[t]``, arithmetic in fp32 unless said below, ``R`` = round to the activation dtype):

    rows:      gate[i], scale[i], shift[i]: gathered rows (GATHERED) or given ones; ROW_BIAS: given rows plus
               an [H] row shared by all, summed in fp32 (R_S to their shared dtype S if ROUND_ROW_SUM)
    site B/C:  g = gate[i] * branch            (R if ROUND_GATE)
               u = R(residual + g)             -> stored (B, C; one FMA with the product if FUSE_MULTIPLY_ADD)
    site A:    u = x
    site A/B:  r = rsqrt(sum(u*u) * (1/H) + eps)  (the sum and the mean in the order and form of eager's kernel
                                               where NORM_SUM_ORDER says: ``_eager_norm_mean``)
               n = u * r                       (R if ROUND_NORM_BEFORE_WEIGHT, then * w if HAS_WEIGHT)
      or, LAYER_NORM:
               r = rsqrt(var(u) + eps), n = (u - mean(u)) * r   (the biased variance; mean and variance by
                                               Welford's updates in the order of eager's kernel where
                                               NORM_SUM_ORDER says: ``_eager_welford_total``)
               n = R(n) if ROUND_NORM
               p = 1 + scale[i]                (R if ROUND_AFFINE)
               q = n * p                       (R if ROUND_AFFINE; fused with the add if FUSE_MULTIPLY_ADD)
               y = R(q + shift[i])             -> stored (A, B)
               (COPIES > 1: y for each copy j of shift and scale, stored at rows j * R on: M modulations of
               the one norm)
    plain RMSNorm (A without HAS_AFFINE: no tables, no index):
               y = R(n)                        -> stored
      or, STORE_RSTD (its statistics alone):
               r                               -> stored (fp32, one per row, at y)

The ``ROUND_*``, ``FUSE_MULTIPLY_ADD`` and ``NORM_SUM_ORDER`` constexprs are ``contract.Rounding``'s fields,
one for one (``NORM_SUM_ORDER``: a ``contract.SumOrder``, compared here with ``OWN_ORDER``,
``FUSED_RMS_NORM_ORDER``, ``MEAN_ORDER`` and ``FUSED_LAYER_NORM_ORDER``); ``launch.ForwardSpecialisation`` declares them all.

Each program holds ``BLOCK_T`` whole rows in registers, read in chunks of ``CHUNK`` columns; the chunks
of ``u`` stay in registers (in the activation dtype) from the sum of squares to the modulation. Each
chunk's weight, ``scale[i]`` and ``shift[i]`` are loaded just before their use, or, under
``PRELOAD_TABLE_CHUNKS``, one chunk early (the first chunk's before the reduction, the next chunk's before
each ``y`` store); the order changes no result. Two ways of bringing table rows into L2 before the rows
that need them ask for them, neither of which changes a result:

- ``WARM_ROWS_AHEAD``: after its stores, every few programs read the table rows of the row that many rows
  on (``_touch_coming_table_rows``); where the index comes in runs, as in the model, the programs that
  start a new run find its table rows in L2 instead of waiting on DRAM.
- ``WARM_TABLES_FIRST``: the kernel's first programs hold no rows; they read every table row and the
  weight (``_touch_table_rows``), ahead of the activations the programs of rows request after them.

An out-of-range index never reads out of bounds (it is clamped for the loads) and fails a device-side
assertion: the kernel is compiled with ``debug=True`` for direct launches, and Inductor compiles it
with assertions on (``assert_indirect_indexing``, its default). docs/DESIGN.md gives the reason for each
choice and what it measured.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .contract import MEAN_VECTORS_MIN_H, SumOrder
from .device_math import mul_rn, rounded, rounded_product, rsqrt, sum_rounded_once, widened

OWN_ORDER = tl.constexpr(SumOrder.OWN.value)
FUSED_RMS_NORM_ORDER = tl.constexpr(SumOrder.FUSED_RMS_NORM.value)
MEAN_ORDER = tl.constexpr(SumOrder.MEAN.value)
MEAN_VECTORS_FROM_H = tl.constexpr(MEAN_VECTORS_MIN_H)
FUSED_LAYER_NORM_ORDER = tl.constexpr(SumOrder.FUSED_LAYER_NORM.value)
EAGER_THREADS = tl.constexpr(128)  # the threads of a row in torch's fused RMSNorm and LayerNorm CUDA kernels


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
                             BLOCK_T: tl.constexpr, WARM_ROWS_AHEAD: tl.constexpr, WARMING_LANES: tl.constexpr):
    """Warms L2 with the table rows the kernel will read ``WARM_ROWS_AHEAD`` rows on. Every ``GROUP``-th program
    (``program``, counting the programs of rows, int64; ``GROUP = WARMING_LANES // 16``, at least 1) reads
    ``k = index[its first row + WARM_ROWS_AHEAD]`` and then, one lane
    each, one element of every 32-byte sector of ``GROUP`` consecutive lines, from line ``program_id mod
    lines-per-row`` on, of ``shift[k]``, ``scale[k]`` and (site B) ``gate[k]``: between them the
    programs cover whole rows. ``shift`` and ``scale`` share a dtype; ``gate``, whose dtype may differ,
    has a load of its own.
    Where the index comes in runs, the programs ``WARM_ROWS_AHEAD`` rows before a run's start bring its new table
    rows from DRAM; elsewhere the sectors are already in L2. The loads are ``volatile`` (their results
    are unused, and the compiler keeps them) and plain, which Inductor's analysis of the kernel
    understands, unlike inline assembly such as ``prefetch``. An index out of range, or past the last
    row, reads nothing. Changes no result."""
    GROUP: tl.constexpr = WARMING_LANES // 16 if WARMING_LANES >= 16 else 1
    if program % GROUP == 0:
        lane = tl.arange(0, WARMING_LANES).to(tl.int64)
        coming_row = program * BLOCK_T + WARM_ROWS_AHEAD + 0 * lane  # every lane reads it: one request per warp
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
    x_ptr, res_ptr, branch_ptr, gate_ptr, gate_bias_ptr, u_ptr, rows, q, i, zero, start: tl.constexpr, lanes, mask,
    stride_x, stride_res, stride_branch, stride_gate, stride_gate_token,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, ROUND_GATE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr,
    GATHERED: tl.constexpr, ROW_BIAS: tl.constexpr, ROUND_ROW_SUM: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """One chunk of ``u`` in the activation dtype: the gated residual (sites B, C; stored by the caller), or
    the loaded ``x``. The gate's row is ``_table_chunk``'s ``(q, i)``; where the rows are given (not
    ``GATHERED``), the zero that keeps the product from an FMA is the gate's own NaN test, element by element.

    The activations are read once, so they bypass L1 (``.cg``), leaving it to the table rows that every
    program on the SM reads again (docs/DESIGN.md, "Cache hints")."""
    if HAS_GATE:
        act: tl.constexpr = u_ptr.dtype.element_ty
        res = tl.load(res_ptr + rows[:, None] * stride_res + start + lanes[None, :], mask=mask, other=0.0,
                      cache_modifier=".cg")
        branch = tl.load(branch_ptr + rows[:, None] * stride_branch + start + lanes[None, :], mask=mask, other=0.0,
                         cache_modifier=".cg")
        gate = _table_chunk(gate_ptr, gate_bias_ptr, q, i, start, lanes, mask, stride_gate, stride_gate_token, HIDDEN,
                            GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
        if not GATHERED:
            zero = (gate != gate).to(tl.int32)
        if FUSE_MULTIPLY_ADD and gate.dtype == act:
            u = sum_rounded_once(gate, branch, res, INTERPRETED)
        elif FUSE_MULTIPLY_ADD:  # explicit, whatever Triton's default for contracting multiply-adds
            u = tl.fma(gate.to(tl.float32), branch.to(tl.float32), res.to(tl.float32))
        elif ROUND_GATE:
            u = res.to(tl.float32) + rounded_product(gate.to(tl.float32), branch.to(tl.float32), zero, act, INTERPRETED)
        else:
            u = res.to(tl.float32) + mul_rn(gate.to(tl.float32), branch.to(tl.float32), zero)
        u = rounded(u, act, INTERPRETED).to(act)
    else:
        u = tl.load(x_ptr + rows[:, None] * stride_x + start + lanes[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg")
    return u


@triton.jit
def _shared_row_chunk(row_ptr, start: tl.constexpr, lanes, HIDDEN: tl.constexpr):
    """A chunk of an ``[H]`` row every row reads (the norm's weight, a bias of the modulation rows) as a
    ``[1, CHUNK]`` row, in the layout of the activations (a 1-D load would be converted through shared memory,
    with barriers, in every chunk)."""
    return tl.load(row_ptr + start + lanes[None, :], mask=(lanes < HIDDEN - start)[None, :], other=0.0)


@triton.jit
def _table_chunk(table_ptr, bias_ptr, q, i, start: tl.constexpr, lanes, mask, stride, stride_token,
                 HIDDEN: tl.constexpr, GATHERED: tl.constexpr, ROW_BIAS: tl.constexpr, ROUND_ROW_SUM: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Chunk ``start`` of each row's modulation row: row ``q`` (the index's entry) of a ``[K, H]`` table where
    ``GATHERED``, else token ``i`` of sample ``q`` of ``[B, T, H]`` rows (``stride``, ``stride_token``: their
    strides, either maybe 0). ``ROW_BIAS``: plus the ``[H]`` row at ``bias_ptr``, added in fp32 (exact operands)
    and, ``ROUND_ROW_SUM``, rounded to the rows' dtype (which the bias then shares), as the graph's sum is;
    else returned in fp32."""
    row = q[:, None] * stride if GATHERED else q[:, None] * stride + i[:, None] * stride_token
    rows = tl.load(table_ptr + row + start + lanes[None, :], mask=mask, other=0.0)
    if ROW_BIAS:
        total = widened(rows) + widened(_shared_row_chunk(bias_ptr, start, lanes, HIDDEN))
        rows = rounded(total, rows.dtype, INTERPRETED).to(rows.dtype) if ROUND_ROW_SUM else total
    return rows


@triton.jit
def _tables_chunk(w_ptr, shift_ptr, scale_ptr, shift_bias_ptr, scale_bias_ptr, q, i, c: tl.constexpr, row_ok,
                  stride_shift, stride_scale, stride_shift_token, stride_scale_token, HIDDEN: tl.constexpr,
                  CHUNK: tl.constexpr, HAS_WEIGHT: tl.constexpr, GATHERED: tl.constexpr, ROW_BIAS: tl.constexpr,
                  ROUND_ROW_SUM: tl.constexpr, INTERPRETED: tl.constexpr):
    """Chunk ``c`` of the weight (0.0 without one), ``scale[i]`` and ``shift[i]``, for ``PRELOAD_TABLE_CHUNKS``."""
    lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
    w = _shared_row_chunk(w_ptr, c * CHUNK, lanes, HIDDEN) if HAS_WEIGHT else 0.0
    return (w, _table_chunk(scale_ptr, scale_bias_ptr, q, i, c * CHUNK, lanes, mask, stride_scale, stride_scale_token,
                            HIDDEN, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED),
            _table_chunk(shift_ptr, shift_bias_ptr, q, i, c * CHUNK, lanes, mask, stride_shift, stride_shift_token,
                         HIDDEN, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED))


@triton.jit
def _modulated(
    u, mean, r, w_ptr, shift_ptr, scale_ptr, shift_bias_ptr, scale_bias_ptr, y_ptr, q, i, zero, start: tl.constexpr,
    lanes, mask, stride_shift, stride_scale, stride_shift_token, stride_scale_token, tables,
    HIDDEN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_AFFINE: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_NORM_BEFORE_WEIGHT: tl.constexpr, ROUND_AFFINE: tl.constexpr, FUSE_MULTIPLY_ADD: tl.constexpr,
    LAYER_NORM: tl.constexpr, GATHERED: tl.constexpr, ROW_BIAS: tl.constexpr, ROUND_ROW_SUM: tl.constexpr,
    INTERPRETED: tl.constexpr, PRELOAD_TABLE_CHUNKS: tl.constexpr,
):
    """One chunk of ``y = R(R(norm(u)) * R(1 + scale[i]) + shift[i])`` (roundings as the flags say), or without
    ``HAS_AFFINE`` of ``y = R(norm(u))``, returned in the activation dtype for the caller to store; the norm is
    ``u * r``, or ``(u - mean) * r`` under ``LAYER_NORM``. The weight, scale and shift chunks are ``tables``
    (loaded by the caller) under ``PRELOAD_TABLE_CHUNKS``, else loaded here, each just before its first use."""
    act: tl.constexpr = y_ptr.dtype.element_ty
    n = (u - mean[:, None]) * r[:, None] if LAYER_NORM else u * r[:, None]
    if HAS_WEIGHT:
        w = tables[0] if PRELOAD_TABLE_CHUNKS else _shared_row_chunk(w_ptr, start, lanes, HIDDEN)
        if ROUND_NORM_BEFORE_WEIGHT:
            n = rounded(n, act, INTERPRETED)
        n = n * widened(w)
    if ROUND_NORM:
        n = rounded(n, act, INTERPRETED)
    if HAS_AFFINE:  # an else, not an early return: Triton builds what follows a return in a static if
        scale = tables[1] if PRELOAD_TABLE_CHUNKS else _table_chunk(
            scale_ptr, scale_bias_ptr, q, i, start, lanes, mask, stride_scale, stride_scale_token, HIDDEN, GATHERED,
            ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
        shift = tables[2] if PRELOAD_TABLE_CHUNKS else _table_chunk(
            shift_ptr, shift_bias_ptr, q, i, start, lanes, mask, stride_shift, stride_shift_token, HIDDEN, GATHERED,
            ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
        if not GATHERED:  # the given rows: the zero from the scale row itself, element by element (``_new_residual``)
            zero = (scale != scale).to(tl.int32)
        if ROUND_AFFINE:  # a plain conversion: LLVM narrows the rounded affine to packed bf16 arithmetic
            scale, shift = scale.to(tl.float32), shift.to(tl.float32)
            p = rounded(1.0 + scale, act, INTERPRETED)
        else:
            scale, shift = widened(scale), widened(shift)
            p = 1.0 + scale
        if FUSE_MULTIPLY_ADD:
            y = tl.fma(n, p, shift)
        elif ROUND_AFFINE:
            y = rounded_product(n, p, zero, act, INTERPRETED) + shift
        else:
            y = mul_rn(n, p, zero) + shift
    else:
        y = n
    return rounded(y, act, INTERPRETED).to(act)


@triton.jit
def _add_squares_as_fused_rms_norm(partial, u):
    """``partial`` plus the squares of chunk ``u`` (``[BLOCK_T, CHUNK]`` fp32, ``CHUNK`` a multiple of 4 and at
    most 512), in the order of torch's fused RMSNorm CUDA kernel (``_fused_rms_norm``: the vectorized layer-norm
    kernel with ``rms_norm``). That kernel gives a row 128 threads; thread ``t`` reads the 4-element vectors
    ``t, t + 128, ...`` of the row and adds each vector's squares, in order, to its own fp32 sum by FMA.
    ``partial`` (``[BLOCK_T, CHUNK // 4]``) holds those sums, one per thread, after the chunks before this one:
    with ``CHUNK = 512`` a chunk is one vector of each thread (a shorter row fits one chunk; the threads
    beyond it add nothing)."""
    BT: tl.constexpr = u.shape[0]
    THREADS: tl.constexpr = u.shape[1] // 4
    even, odd = tl.split(tl.reshape(u, [BT, THREADS, 2, 2]))  # each thread's elements 0, 2 and 1, 3
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    partial = tl.fma(v0, v0, partial)
    partial = tl.fma(v1, v1, partial)
    partial = tl.fma(v2, v2, partial)
    return tl.fma(v3, v3, partial)


@triton.jit
def _add_squares_as_mean(partial, u, zero):
    """``partial`` plus the squares of chunk ``u`` (``[BLOCK_T, CHUNK]`` fp32, ``CHUNK`` 4 times a power of 2 up
    to 128) as the native RMSNorm's ``x.pow(2).mean(-1)`` adds them on CUDA from 16 rows on: ``pow`` rounds each
    square to fp32 (``mul_rn``: never an FMA with the add), and torch's generic reduction gives a row one warp
    whose lanes each keep 4 sums. From ``H`` = 128 on it reads the row in 4-element vectors, lane ``l`` the
    vectors ``l, l + 32, ...``, adding element ``i`` of each to its sum ``i``; a shorter row it reads element by
    element, lane ``l`` of ``L`` taking elements ``l + L*i`` into sum ``i`` (``_lane_sums`` puts them in the
    vectors' layout). ``partial`` holds the squares added chunk by chunk, in the chunk's layout."""
    return partial + mul_rn(u, u, zero)


@triton.jit
def _lane_sums(partial, HIDDEN: tl.constexpr):
    """The 4 sums of each lane of torch's generic reduction from the squares ``partial`` (``[BLOCK_T, CHUNK]``),
    as ``[BLOCK_T, CHUNK // 4, 4]``: from ``H`` = ``MEAN_VECTORS_MIN_H`` on the chunk's columns ``4l .. 4l + 3``
    (lane ``l``'s vectors); below it (the reduction does not vectorize a shorter row, ``setReduceConfig``), one
    chunk of ``4L`` columns read element-strided, whose column ``l + L*i`` is lane ``l``'s sum ``i``."""
    BT: tl.constexpr = partial.shape[0]
    LANES: tl.constexpr = partial.shape[1] // 4
    if HIDDEN >= MEAN_VECTORS_FROM_H:
        sums = tl.reshape(partial, [BT, LANES, 4])
    else:
        sums = tl.permute(tl.reshape(partial, [BT, 4, LANES]), (0, 2, 1))
    return sums


@triton.jit
def _eager_order_total(partial):
    """The row sums of the per-thread sums ``partial`` (``[BLOCK_T, THREADS]``, ``THREADS`` a power of 2 up to
    128) in the order both eager kernels finish theirs: within each warp of 32 threads a shuffle-down tree
    (thread ``l`` adds thread ``l + 16``, then ``l + 8``, ... ``l + 1``; a row of fewer lanes starts at half
    of them), then, in torch's fused RMSNorm kernel, across its 4 warps a tree in shared memory (warp ``w``
    adds warp ``w + 2``, then warp 0 adds warp 1). Each step adds two values, so the adds are eager's;
    threads the row does not reach hold 0, and adding 0 changes nothing, so a row of fewer threads takes the
    same tree over the threads it has."""
    BT: tl.constexpr = partial.shape[0]
    THREADS: tl.constexpr = partial.shape[1]
    WARPS: tl.constexpr = (THREADS + 31) // 32
    LANES: tl.constexpr = THREADS // WARPS
    sums = tl.reshape(partial, [BT, WARPS, LANES])
    for step in tl.static_range(5):
        if (LANES >> (step + 1)) > 0:
            sums = tl.sum(tl.reshape(sums, [BT, WARPS, 2, LANES >> (step + 1)]), 2)
    sums = tl.reshape(sums, [BT, WARPS])
    for step in tl.static_range(2):
        if (WARPS >> (step + 1)) > 0:
            sums = tl.sum(tl.reshape(sums, [BT, 2, WARPS >> (step + 1)]), 1)
    return tl.reshape(sums, [BT])


@triton.jit
def _eager_norm_mean(partial, n_rows, program, zero, HIDDEN: tl.constexpr, NORM_SUM_ORDER: tl.constexpr):
    """``mean(u*u)`` per row from the partial sums of ``_add_squares_as_fused_rms_norm`` (``FUSED_RMS_NORM_ORDER``:
    the sum divided by ``H``, as torch's fused RMSNorm kernel divides it) or ``_add_squares_as_mean``
    (``MEAN_ORDER``: each lane's 4 sums added ``((s0 + s1) + s2) + s3``, then the lanes' tree, times the factor
    torch's mean takes, ``float(rows) / float(rows * H)``, each count rounded to fp32 as eager's host code
    rounds it)."""
    if NORM_SUM_ORDER == FUSED_RMS_NORM_ORDER:  # an else, not an early return (Triton builds what follows it)
        mean = tl.math.div_rn(_eager_order_total(partial), tl.cast(HIDDEN, tl.float32))
    else:
        BT: tl.constexpr = partial.shape[0]
        LANES: tl.constexpr = partial.shape[1] // 4
        even, odd = tl.split(tl.reshape(_lane_sums(partial, HIDDEN), [BT, LANES, 2, 2]))  # each lane's 0, 2; 1, 3
        s0, s2 = tl.split(even)
        s1, s3 = tl.split(odd)
        rows = n_rows + 0 * program  # int64, also where ``n_rows`` is a constant
        factor = tl.math.div_rn(rows.to(tl.float32), (rows * HIDDEN).to(tl.float32))
        # rounded as the mean kernel stores it (``mul_rn``: a plain product fuses with the caller's ``+ eps``)
        mean = tl.reshape(mul_rn(_eager_order_total(((s0 + s1) + s2) + s3)[:, None], factor, zero), [BT])
    return mean


@triton.jit
def _welford_step(mean, spread, v, k: tl.constexpr, active, PARTIAL: tl.constexpr):
    """Welford's online update of torch's LayerNorm CUDA kernel for each thread's ``k``-th value ``v``:
    ``delta = v - mean``, ``mean' = fma(delta, 1/k, mean)``, ``spread' = fma(delta, v - mean', spread)``, with
    ``1/k`` rounded once (nvcc divides without fast math) and the two multiply-adds contracted, as nvcc
    compiles the kernel's ``mean + delta * (1/k)`` and ``sigma2 + delta * (v - mean')``. ``PARTIAL``: only
    the ``active`` threads update (the chunk that crosses ``H``)."""
    coef = tl.math.div_rn(tl.full([1, 1], 1.0, tl.float32), tl.full([1, 1], k, tl.float32))
    delta = v - mean
    new_mean = tl.fma(delta, coef, mean)
    new_spread = tl.fma(delta, v - new_mean, spread)
    if PARTIAL:
        new_mean, new_spread = tl.where(active, new_mean, mean), tl.where(active, new_spread, spread)
    return new_mean, new_spread


@triton.jit
def _add_as_fused_layer_norm(mean, spread, u, c: tl.constexpr, HIDDEN: tl.constexpr):
    """Each thread's running mean and sum of squared deviations (``[BLOCK_T, 128]``) after chunk ``c`` of ``u``
    (``[BLOCK_T, 512]`` fp32), in the order of torch's LayerNorm CUDA kernel (the vectorized path, ``H`` a
    multiple of 4): 128 threads a row, thread ``t`` reading the 4-element vectors ``t, t + 128, ...``, one
    Welford update per element, in order. A chunk is one vector of each thread; in the chunk that crosses
    ``H`` the threads beyond it take no update."""
    BT: tl.constexpr = u.shape[0]
    THREADS: tl.constexpr = u.shape[1] // 4
    PARTIAL: tl.constexpr = (c + 1) * 4 * THREADS > HIDDEN
    active = (tl.arange(0, THREADS) < (HIDDEN - c * 4 * THREADS) // 4)[None, :]
    even, odd = tl.split(tl.reshape(u, [BT, THREADS, 2, 2]))  # each thread's elements 0, 2 and 1, 3
    v0, v2 = tl.split(even)
    v1, v3 = tl.split(odd)
    mean, spread = _welford_step(mean, spread, v0, 4 * c + 1, active, PARTIAL)
    mean, spread = _welford_step(mean, spread, v1, 4 * c + 2, active, PARTIAL)
    mean, spread = _welford_step(mean, spread, v2, 4 * c + 3, active, PARTIAL)
    return _welford_step(mean, spread, v3, 4 * c + 4, active, PARTIAL)


@triton.jit
def _welford_combine(mean_b, spread_b, n_b, mean_a, spread_a, n_a):
    """torch's LayerNorm CUDA kernel's ``cuWelfordCombine(b, a)`` (``b`` the thread's own statistics, ``a`` the
    ones it receives): ``delta = mean_b - mean_a``, ``n = n_a + n_b``, ``c = 1/n`` (rounded once),
    ``mean = fma(n_a * c, mean_a, (n_b * c) * mean_b)``, ``spread = fma(delta * delta * n_a, n_b * c,
    spread_a + spread_b)``; all 0 where ``n`` is."""
    n = n_a + n_b
    coef = tl.math.div_rn(tl.full([1], 1.0, tl.float32), tl.maximum(n, 1.0))
    share_a, share_b = n_a * coef, n_b * coef
    delta = mean_b - mean_a
    mean = tl.fma(share_a, mean_a, share_b * mean_b)
    spread = tl.fma(delta * delta * n_a, share_b, spread_a + spread_b)
    return tl.where(n > 0, mean, 0.0), tl.where(n > 0, spread, 0.0), n


@triton.jit
def _welford_halves(mean, spread, n, shape: tl.constexpr, order: tl.constexpr):
    """Each thread of the first half of axis ``-2`` of ``shape`` (the views' shape, that axis of 2) combined
    with its partner in the second half (``_welford_combine``), the axis removed."""
    mean_b, mean_a = tl.split(tl.permute(tl.reshape(mean, shape), order))
    spread_b, spread_a = tl.split(tl.permute(tl.reshape(spread, shape), order))
    n_b, n_a = tl.split(tl.permute(tl.reshape(n, shape), order))
    return _welford_combine(mean_b, spread_b, n_b, mean_a, spread_a, n_a)


@triton.jit
def _eager_welford_total(mean, spread, HIDDEN: tl.constexpr):
    """A row's mean and (biased) variance from its 128 threads' Welford statistics (``_add_as_fused_layer_norm``),
    in the order of torch's LayerNorm CUDA kernel: within each of its 4 warps a shuffle-down tree of
    ``_welford_combine`` (thread ``l`` with thread ``l + 16``, then ``l + 8``, ... ``l + 1``), then across the
    warps in shared memory (warp ``w`` with warp ``w + 2``, then warp 0 with warp 1); the variance the sum of
    squared deviations divided by ``H`` (rounded once). A thread's count is 4 per vector it read; a thread
    that read none joins the tree with count 0, as in eager (a combine with it is not always exact)."""
    BT: tl.constexpr = mean.shape[0]
    WARPS: tl.constexpr = EAGER_THREADS // 32
    VECTORS: tl.constexpr = HIDDEN // 4
    t = tl.arange(0, EAGER_THREADS)
    count = tl.where(t < VECTORS, (VECTORS - t + EAGER_THREADS - 1) // EAGER_THREADS, 0) * 4
    n = tl.broadcast_to(count.to(tl.float32)[None, :], [BT, EAGER_THREADS])
    for step in tl.static_range(5):
        mean, spread, n = _welford_halves(mean, spread, n, [BT, WARPS, 2, 16 >> step], [0, 1, 3, 2])
    mean, spread, n = tl.reshape(mean, [BT, WARPS]), tl.reshape(spread, [BT, WARPS]), tl.reshape(n, [BT, WARPS])
    for step in tl.static_range(2):
        mean, spread, n = _welford_halves(mean, spread, n, [BT, 2, 2 >> step], [0, 2, 1])
    mean, spread = tl.reshape(mean, [BT]), tl.reshape(spread, [BT])
    return mean, tl.math.div_rn(spread, tl.full([1], HIDDEN, tl.float32))


@triton.jit
def _touch_table_rows(program, w_ptr, shift_ptr, scale_ptr, gate_ptr, num_table_rows, stride_shift, stride_scale,
                      stride_gate, HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
                      HAS_WEIGHT: tl.constexpr, WARMING_LANES: tl.constexpr):
    """Warming program ``program`` (int64) of the kernel's first ones (``WARM_TABLES_FIRST``): one element of each
    of ``WARMING_LANES`` consecutive 32-byte sectors, one per lane, of every table row the site reads, taken in
    order (the rows of ``shift`` and ``scale``, of ``gate``, then the weight), read with ``volatile`` loads
    whose results are unused. Between them the warming programs cover every row, so that the rows arrive
    in L2 ahead of the activations the programs of rows request after them, instead of behind them.
    Changes no result."""
    sector = program * WARMING_LANES + tl.arange(0, WARMING_LANES).to(tl.int64)
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


@triton.jit(debug=True)
def modulation_kernel(
    x_ptr, res_ptr, branch_ptr, gate_ptr, w_ptr, shift_ptr, scale_ptr, idx_ptr, gate_bias_ptr, shift_bias_ptr,
    scale_bias_ptr, u_ptr, y_ptr,
    n_rows, num_table_rows, tokens, eps,
    stride_x, stride_res, stride_branch, stride_gate, stride_shift, stride_scale,
    stride_gate_token, stride_shift_token, stride_scale_token,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_AFFINE: tl.constexpr, COPIES: tl.constexpr, GATHERED: tl.constexpr, ROW_BIAS: tl.constexpr,
    LAYER_NORM: tl.constexpr, ROUND_GATE: tl.constexpr, ROUND_NORM: tl.constexpr,
    ROUND_NORM_BEFORE_WEIGHT: tl.constexpr, ROUND_AFFINE: tl.constexpr, ROUND_ROW_SUM: tl.constexpr,
    FUSE_MULTIPLY_ADD: tl.constexpr, NORM_SUM_ORDER: tl.constexpr, INTERPRETED: tl.constexpr,
    STORE_RSTD: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr, PRELOAD_TABLE_CHUNKS: tl.constexpr,
    WARM_ROWS_AHEAD: tl.constexpr, WARM_TABLES_FIRST: tl.constexpr, WARMING_LANES: tl.constexpr,
):
    """The forward of one site (the module docstring); the constexprs are ``launch.ForwardSpecialisation``'s."""
    program = tl.program_id(0).to(tl.int64)  # int64 throughout: no int32 overflow checks under debug=True
    warming: tl.constexpr = 0
    if WARM_TABLES_FIRST:  # the programs beyond the rows' come first (``launch.warming_program_count``)
        rows_programs = (n_rows + 0 * program + BLOCK_T - 1) // BLOCK_T  # ``n_rows`` may be a constant: no ``.to``
        warming = tl.num_programs(0).to(tl.int64) - rows_programs
    if WARM_TABLES_FIRST and program < warming:
        _touch_table_rows(program, w_ptr, shift_ptr, scale_ptr, gate_ptr, num_table_rows, stride_shift,
                          stride_scale, stride_gate, HIDDEN, HAS_GATE, HAS_NORM, HAS_WEIGHT, WARMING_LANES)
    else:
        rows_program = program - warming  # counting the programs of rows
        rows = rows_program * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < n_rows
        HAS_TABLES: tl.constexpr = HAS_GATE or HAS_AFFINE
        if HAS_TABLES and GATHERED:  # q: the table row; i: unused
            idx = tl.load(idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
            bad = row_ok & ((idx < 0) | (idx >= num_table_rows))
            zero = (idx < 0).to(tl.int32)[:, None]  # 0 wherever the result is defined (see ``device_math.mul_rn``)
            q = tl.where(bad, 0, idx)  # every load reads in bounds, whatever the index
            i = q
        else:  # given rows (q: the sample, i: its token) or a plain norm (no rows): the zero from a loaded value, 1
            # only on a row whose norm's outputs are NaN anyway (the products of given rows take their own)
            first = tl.load((x_ptr if HAS_NORM and not HAS_GATE else res_ptr) + rows * (
                stride_x if HAS_NORM and not HAS_GATE else stride_res), mask=row_ok, other=0.0)
            zero = (first != first).to(tl.int32)[:, None]
            q = rows // tokens
            i = rows - q * tokens

        kept = ()  # the row's chunks of u, in the activation dtype (exact: u is rounded to it or loaded in it)
        PER_THREAD: tl.constexpr = NORM_SUM_ORDER != OWN_ORDER and NORM_SUM_ORDER != MEAN_ORDER  # one sum a thread
        partial = tl.zeros([BLOCK_T, CHUNK // 4 if PER_THREAD else CHUNK], tl.float32)
        spread = tl.zeros([BLOCK_T, CHUNK // 4 if PER_THREAD else CHUNK], tl.float32)  # Welford's, per thread
        for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
            lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
            u = _new_residual(x_ptr, res_ptr, branch_ptr, gate_ptr, gate_bias_ptr, u_ptr, rows, q, i, zero, c * CHUNK,
                              lanes, mask, stride_x, stride_res, stride_branch, stride_gate, stride_gate_token, HIDDEN,
                              HAS_GATE, ROUND_GATE, FUSE_MULTIPLY_ADD, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
            if HAS_NORM:
                wide = widened(u)
                if LAYER_NORM and NORM_SUM_ORDER == FUSED_LAYER_NORM_ORDER:  # running means, and spreads
                    partial, spread = _add_as_fused_layer_norm(partial, spread, wide, c, HIDDEN)
                elif LAYER_NORM:  # the sum of the values, for the mean
                    partial += wide
                elif NORM_SUM_ORDER == FUSED_RMS_NORM_ORDER:
                    partial = _add_squares_as_fused_rms_norm(partial, wide)
                elif NORM_SUM_ORDER == MEAN_ORDER:
                    partial = _add_squares_as_mean(partial, wide, zero)
                else:  # an explicit FMA: the same build whatever Triton's default for contracting them
                    partial = tl.fma(wide, wide, partial)
            kept = kept + (u,)
        tables = (0.0, 0.0, 0.0)
        if HAS_NORM and PRELOAD_TABLE_CHUNKS and HAS_GATE:  # site B: arriving while the row is reduced (after the check: slower)
            tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, shift_bias_ptr, scale_bias_ptr, q, i, 0, row_ok,
                                   stride_shift, stride_scale, stride_shift_token, stride_scale_token, HIDDEN, CHUNK,
                                   HAS_WEIGHT, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
        if HAS_GATE:  # after every chunk's loads: a store may alias them, so no load could move above it
            for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
                lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
                tl.store(u_ptr + rows[:, None] * HIDDEN + c * CHUNK + lanes[None, :], kept[c], mask=mask)
        # after the activation loads: a load may not move above the assertion's call, which would otherwise
        # hold the row's loads until the index arrives (docs/DESIGN.md, "The index assertion's place")
        if HAS_TABLES and GATHERED:
            tl.device_assert(~bad, "h3_fused: index out of range [0, K)")
        if HAS_NORM and PRELOAD_TABLE_CHUNKS and not HAS_GATE:  # site A: after the assertion, so that ptxas does not
            # compute their addresses, which wait for the index, before issuing the activation loads
            tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, shift_bias_ptr, scale_bias_ptr, q, i, 0, row_ok,
                                   stride_shift, stride_scale, stride_shift_token, stride_scale_token, HIDDEN, CHUNK,
                                   HAS_WEIGHT, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
        if HAS_NORM:
            # fp32 constants and scalars (Inductor may pass eps as a constexpr float, which computes in fp64)
            inverse_h = tl.cast(1.0 / HIDDEN, tl.float32)
            mean = 0.0
            if LAYER_NORM and NORM_SUM_ORDER == FUSED_LAYER_NORM_ORDER:
                mean, variance = _eager_welford_total(partial, spread, HIDDEN)
                shifted = variance + tl.cast(eps, tl.float32)
            elif LAYER_NORM:  # the mean, then the variance about it from the row kept in registers, in the kernel's order
                mean = tl.sum(partial, axis=1) * inverse_h
                deviations = tl.zeros([BLOCK_T, CHUNK], tl.float32)
                for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
                    lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
                    deviation = tl.where(mask, widened(kept[c]) - mean[:, None], 0.0)
                    deviations = tl.fma(deviation, deviation, deviations)
                shifted = tl.fma(tl.sum(deviations, axis=1), inverse_h, tl.cast(eps, tl.float32))
            elif NORM_SUM_ORDER != OWN_ORDER:
                shifted = _eager_norm_mean(partial, n_rows, rows_program, zero, HIDDEN, NORM_SUM_ORDER) + \
                    tl.cast(eps, tl.float32)
            else:
                shifted = tl.fma(tl.sum(partial, axis=1), inverse_h, tl.cast(eps, tl.float32))
            r = rsqrt(shifted, INTERPRETED)
            if STORE_RSTD:  # the statistics alone: the caller applies them (chunks below: none)
                tl.store(y_ptr + rows, r, mask=row_ok)
            chunks: tl.constexpr = 0 if STORE_RSTD else triton.cdiv(HIDDEN, CHUNK)
            # with copies, copy ``j``'s rows are table rows ``j * K`` on, or given rows' samples ``j * B`` on
            samples = 0
            if COPIES > 1:
                samples = num_table_rows + 0 * program if GATHERED else (n_rows + 0 * program) // tokens
            for c in tl.static_range(chunks):
                lanes, mask = _chunk(c, row_ok, CHUNK, HIDDEN)
                current = tables
                if PRELOAD_TABLE_CHUNKS and c + 1 < chunks:  # the next chunk's, before this chunk's store (which may alias them)
                    tables = _tables_chunk(w_ptr, shift_ptr, scale_ptr, shift_bias_ptr, scale_bias_ptr, q, i, c + 1,
                                           row_ok, stride_shift, stride_scale, stride_shift_token, stride_scale_token,
                                           HIDDEN, CHUNK, HAS_WEIGHT, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED)
                for copy in tl.static_range(COPIES):  # each modulation of the one norm (the preloaded: copy 0's)
                    y = _modulated(widened(kept[c]), mean, r, w_ptr, shift_ptr, scale_ptr, shift_bias_ptr,
                                   scale_bias_ptr, y_ptr,
                                   q + copy * samples if copy > 0 else q, i, zero, c * CHUNK, lanes, mask,
                                   stride_shift, stride_scale, stride_shift_token, stride_scale_token, current,
                                   HIDDEN, HAS_WEIGHT, HAS_AFFINE, ROUND_NORM, ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE,
                                   FUSE_MULTIPLY_ADD, LAYER_NORM, GATHERED, ROW_BIAS, ROUND_ROW_SUM, INTERPRETED,
                                   PRELOAD_TABLE_CHUNKS and copy == 0)
                    out_rows = rows + copy * (n_rows + 0 * program) if copy > 0 else rows
                    tl.store(y_ptr + out_rows[:, None] * HIDDEN + c * CHUNK + lanes[None, :], y, mask=mask)
        if WARM_ROWS_AHEAD > 0 and HAS_AFFINE and GATHERED:  # last: no register of the row is live any more
            _touch_coming_table_rows(rows_program, idx_ptr, shift_ptr, scale_ptr, gate_ptr, n_rows, num_table_rows,
                                     stride_shift, stride_scale, stride_gate, HIDDEN, HAS_GATE, BLOCK_T, WARM_ROWS_AHEAD, WARMING_LANES)
