"""The backward kernels: one parameterised Triton kernel for the gradients of the three sites, and the
fixed-order reduction of its per-program partial sums (device code only; ``launch_backward.py`` launches them).

Per row ``t`` (``i = index[t]``, fp32 unless said, ``R`` = round to the activation dtype where
``ROUND_NORM``; the forward's ``u`` is read back: ``x`` at site A, the stored residual at site B):

    r     = rsqrt(sum(u*u) / H + eps)                 xhat = u * r
            (LAYER_NORM: m = sum(u) / H, r = rsqrt(sum((u-m)^2) / H + eps), xhat = (u - m) * r)
    p     = 1 + scale[i]                              (R if ROUND_AFFINE: the forward's p)
    dn    = dy * p                                    (R if ROUND_NORM)
            (COPIES > 1, M modulations of the one norm: dn = sum over copies j of dy_j * p_j, each term and each
            partial sum R if ROUND_NORM, as eager's autograd adds the gradients of a tensor used M times)
    dxhat = dn * w                                    (R if ROUND_NORM_BEFORE_WEIGHT; dn without a weight)
    du_n  = r * (dxhat - xhat * sum(dxhat * xhat) / H)   (R if ROUND_INPUT_GRADIENT)
            (LAYER_NORM: r * (dxhat - sum(dxhat) / H - xhat * sum(dxhat * xhat) / H))
    du_t  = du + du_n (site B; R if ROUND_INPUT_GRADIENT), du_n (site A), du (site C)
    dx = du_t (site A) or dresidual = du_t (sites B, C);  dbranch = R(du_t * gate[i])    -> stored

and the sums over rows, in fp32: ``dshift[i] += dy``, ``dscale[i] += dy * n`` (``n`` the forward's normalized
row; with copies, each copy's into its own table: copy ``j``'s ``dy`` rows ``j * R`` on, its table rows ``j * K`` on),
``dgate[i] += du_t * branch``, ``dw += dn * xhat`` (``* R(xhat)`` where ``ROUND_NORM_BEFORE_WEIGHT``);
Kahan-compensated where the gradient is fp32 (``COMPENSATE_TABLES``, ``COMPENSATE_W``), whose one rounding would
not hide an fp32 sum's own error. ``contract.Rounding`` states the same contract; the ``NEED_*`` flags leave out
what autograd does not ask for.

Each program runs through ``rows_per_program`` consecutive rows, one row at a time, the row in registers in
chunks of ``CHUNK`` columns (``u`` and ``dy`` held from pass 1 to pass 2; ``PREFETCH``: the next row's streamed
inputs loaded during the row's work; ``HOIST_TABLES``: the weight's and the row's table chunks held in registers
rather than loaded where each chunk uses them; ``EARLY_STREAMS``: ``du`` and ``branch`` loaded at the row's start,
ahead of its first store), and adds each row's contribution to the table and weight gradients into fp32 registers.
Where table gradients are needed (``SORTED``), the rows are visited in the order of a stable sort of the index
(``order``; table row ``k``'s rows are sorted positions ``seg[k]`` to ``seg[k + 1] - 1``), so that a program's rows of each
table row are contiguous (``ORDERED_INDEX``: the index is nondecreasing, as for rows given per sample, per
token or one for all, so the rows' own order is sorted and ``order`` is not read): it sums them and writes the
sums to slot ``program + k`` of a partial buffer (distinct slots: programs and table rows both increase along
the sorted order). ``ROW_PER_KEY`` (rows given one per token: each table row has one row's contribution): the
table gradients are stored as each row computes them, rounded once, in place of the partial buffers (no
``SORTED``). Without ``SORTED`` a program
writes one slot, ``program``. ``reduce_partials_kernel`` then sums each table row's slots, and the weight's,
in program order and rounds once: no atomics, the same bits on every run.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .device_math import rounded, rsqrt, widened


@triton.jit
def _zeros(CHUNKS: tl.constexpr, CHUNK: tl.constexpr):
    """A tuple of ``CHUNKS`` fp32 zero chunks: one accumulator of a whole row."""
    acc = ()
    for _ in tl.static_range(CHUNKS):
        acc = acc + (tl.zeros([CHUNK], tl.float32),)
    return acc


@triton.jit
def _everywhere(flag, lanes):
    """The scalar ``flag`` as a block like ``lanes`` (the interpreter takes no scalar in a block's mask)."""
    return lanes * 0 + flag.to(tl.int32) != 0


@triton.jit
def _kahan_at(acc, c: tl.constexpr, y):
    """``acc`` (chunk sums, then their Kahan compensations) with ``y``, the value less chunk ``c``'s compensation,
    added to chunk ``c`` by Kahan's step."""
    CHUNKS: tl.constexpr = len(acc) // 2
    total = acc[c] + y
    lost = (total - acc[c]) - y
    out = ()
    for j in tl.static_range(len(acc)):
        out = out + (total,) if j == c else out + (lost,) if j == CHUNKS + c else out + (acc[j],)
    return out


@triton.jit
def _add_at(acc, c: tl.constexpr, value, COMPENSATED: tl.constexpr):
    """``acc`` with ``value`` added to its chunk ``c``. ``COMPENSATED``: ``acc`` holds the chunks' sums, then their
    Kahan compensations (``_zeros`` of twice the chunks), and the addition is Kahan's."""
    if COMPENSATED:
        out = _kahan_at(acc, c, value - acc[len(acc) // 2 + c])
    else:
        out = ()
        for j in tl.static_range(len(acc)):
            out = out + (acc[j] + value,) if j == c else out + (acc[j],)
    return out


@triton.jit
def _add_product_at(acc, c: tl.constexpr, a, b, COMPENSATED: tl.constexpr):
    """``acc`` with ``a * b`` added to its chunk ``c`` by one FMA; ``COMPENSATED`` (``_add_at``): by Kahan's step,
    the product less the compensation one FMA."""
    if COMPENSATED:
        out = _kahan_at(acc, c, tl.fma(a, b, -acc[len(acc) // 2 + c]))
    else:
        out = ()
        for j in tl.static_range(len(acc)):
            out = out + (tl.fma(a, b, acc[j]),) if j == c else out + (acc[j],)
    return out


@triton.jit
def _flush(acc, part_ptr, slot, write, lanes, copy_stride, CHUNK: tl.constexpr, HIDDEN: tl.constexpr,
           COMPENSATED: tl.constexpr, COPIES: tl.constexpr = 1):
    """Store the row accumulator ``acc`` (``COPIES`` rows, one after the other) to slot ``slot`` of a partial buffer
    (copy ``j``'s ``j * copy_stride`` elements on) where ``write`` (``COMPENSATED``: each chunk's sum less its
    compensation)."""
    written = _everywhere(write, lanes)
    SUMS: tl.constexpr = len(acc) // 2 if COMPENSATED else len(acc)
    CHUNKS: tl.constexpr = SUMS // COPIES
    for j in tl.static_range(COPIES):
        for c in tl.static_range(CHUNKS):
            cols = c * CHUNK + lanes
            total = acc[j * CHUNKS + c] - acc[SUMS + j * CHUNKS + c] if COMPENSATED else acc[j * CHUNKS + c]
            tl.store(part_ptr + j * copy_stride + slot * HIDDEN + cols, total, mask=(cols < HIDDEN) & written)


@triton.jit
def _store_row(ptr, k, cols, ok, value, HIDDEN: tl.constexpr, INTERPRETED: tl.constexpr):
    """Row ``k`` of a ``[K, H]`` gradient (columns ``cols``) where each table row has one row's contribution
    (``ROW_PER_KEY``): ``value``, rounded once to the gradient's dtype."""
    out: tl.constexpr = ptr.dtype.element_ty
    tl.store(ptr + k * HIDDEN + cols, rounded(value, out, INTERPRETED).to(out), mask=ok)


@triton.jit
def _one_plus(scale, act: tl.constexpr, ROUND_AFFINE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The forward's ``p = 1 + scale`` (``R`` where ``ROUND_AFFINE``), fp32."""
    return rounded(1.0 + scale.to(tl.float32), act, INTERPRETED) if ROUND_AFFINE else 1.0 + widened(scale)


@triton.jit
def _norm_output_gradient(dy, scale, act: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_AFFINE: tl.constexpr,
                          INTERPRETED: tl.constexpr):
    """``dn`` of one chunk, ``dy`` and ``scale`` the copies' chunks (tuples): ``dy_0 * p_0``, plus each further copy's
    ``dy_j * p_j`` (``R`` each term and each sum where ``ROUND_NORM``; else one FMA each)."""
    dn = widened(dy[0]) * _one_plus(scale[0], act, ROUND_AFFINE, INTERPRETED)
    if ROUND_NORM:
        dn = rounded(dn, act, INTERPRETED)
    for j in tl.static_range(1, len(dy)):
        p = _one_plus(scale[j], act, ROUND_AFFINE, INTERPRETED)
        if ROUND_NORM:
            dn = rounded(dn + rounded(widened(dy[j]) * p, act, INTERPRETED), act, INTERPRETED)
        else:
            dn = tl.fma(widened(dy[j]), p, dn)
    return dn


@triton.jit
def _normed_input_gradient(dy, scale, w, act: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_NORM: tl.constexpr,
                           ROUND_NORM_BEFORE_WEIGHT: tl.constexpr, ROUND_AFFINE: tl.constexpr,
                           INTERPRETED: tl.constexpr):
    """``(dn, dxhat)`` of one chunk: the gradients reaching the norm's output and its normalized row (``dy``,
    ``scale``: the copies' chunks)."""
    dn = _norm_output_gradient(dy, scale, act, ROUND_NORM, ROUND_AFFINE, INTERPRETED)
    dxhat = dn
    if HAS_WEIGHT:
        dxhat = dn * widened(w)
        if ROUND_NORM_BEFORE_WEIGHT:
            dxhat = rounded(dxhat, act, INTERPRETED)
    return dn, dxhat


@triton.jit
def _dxhat_plus(dy, scale, w, addend, act: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROUND_NORM: tl.constexpr,
                ROUND_AFFINE: tl.constexpr, INTERPRETED: tl.constexpr):
    """``dxhat + addend`` (a LayerNorm's ``dxhat``: never rounded before its weight; ``dy``, ``scale``: the copies'
    chunks), the product that makes ``dxhat`` written out as one FMA with the add, so that no compiler contracts it
    otherwise (unrounded and without a weight, each copy's product is an FMA into the sum)."""
    if HAS_WEIGHT:
        total = tl.fma(_norm_output_gradient(dy, scale, act, ROUND_NORM, ROUND_AFFINE, INTERPRETED), widened(w),
                       addend)
    elif ROUND_NORM:
        total = _norm_output_gradient(dy, scale, act, ROUND_NORM, ROUND_AFFINE, INTERPRETED) + addend
    else:
        total = addend
        for j in tl.static_range(len(dy)):
            total = tl.fma(widened(dy[j]), _one_plus(scale[j], act, ROUND_AFFINE, INTERPRETED), total)
    return total


@triton.jit
def _input_gradients(dy, u32, r, minus_mean_product, minus_mean_dxhat, du, scale, w, act: tl.constexpr,
                     HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     LAYER_NORM: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_NORM_BEFORE_WEIGHT: tl.constexpr,
                     ROUND_AFFINE: tl.constexpr, ROUND_INPUT_GRADIENT: tl.constexpr, INTERPRETED: tl.constexpr):
    """``(du_t, dn, normed, n)`` of a block of a row's columns (``dy``, ``scale``: the copies' chunks; or of several
    rows', ``r``,
    ``minus_mean_product = -mean(dxhat * xhat)`` and a LayerNorm's ``minus_mean_dxhat = -mean(dxhat)`` broadcast
    to it; ``u32`` the row less its mean for a LayerNorm): the gradient reaching the site's residual, the gradient
    reaching the norm's output, the normalized row (``R(xhat)`` where the norm rounds before the weight) and the
    norm's output. Without a norm ``du_t`` is the incoming ``du`` (fp32) and the others are it too (unused)."""
    if HAS_NORM:
        xhat = u32 * r
        dn, dxhat = _normed_input_gradient(dy, scale, w, act, HAS_WEIGHT, ROUND_NORM, ROUND_NORM_BEFORE_WEIGHT,
                                           ROUND_AFFINE, INTERPRETED)
        if LAYER_NORM:  # dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)
            centred = tl.fma(xhat, minus_mean_product, _dxhat_plus(dy, scale, w, minus_mean_dxhat, act, HAS_WEIGHT,
                                                                    ROUND_NORM, ROUND_AFFINE, INTERPRETED))
        else:  # dxhat - xhat * mean(dxhat * xhat), one rounding
            centred = tl.fma(xhat, minus_mean_product, dxhat)
        if ROUND_INPUT_GRADIENT:
            du_n = rounded(r * centred, act, INTERPRETED)
            du_t = rounded(du + du_n, act, INTERPRETED) if HAS_GATE else du_n
        else:
            du_t = tl.fma(r, centred, du) if HAS_GATE else r * centred
        normed = xhat
        if ROUND_NORM_BEFORE_WEIGHT:
            normed = rounded(normed, act, INTERPRETED)
        n = normed * widened(w) if HAS_WEIGHT else normed
        if ROUND_NORM:
            n = rounded(n, act, INTERPRETED)
    else:
        du_t, dn, normed, n = du, du, du, du
    return du_t, dn, normed, n


@triton.jit
def _row(s, valid, order_ptr, idx_ptr, num_table_rows, SORTED: tl.constexpr, ORDERED_INDEX: tl.constexpr):
    """``(t, k)``: the row at position ``s`` of the visiting order and its table row (clamped: every load reads
    in bounds, whatever the index; an index out of range fails the assertion)."""
    s = tl.where(valid, s, 0)
    t = tl.load(order_ptr + s).to(tl.int64) if SORTED and not ORDERED_INDEX else s
    k = tl.load(idx_ptr + t).to(tl.int64)
    tl.device_assert(~valid | ((k >= 0) & (k < num_table_rows)), "h3_fused: index out of range [0, K)")
    return t, tl.minimum(tl.maximum(k, 0), num_table_rows - 1)


@triton.jit
def _chunks(ptr, t, stride, valid, lanes, WANTED: tl.constexpr, CHUNK: tl.constexpr, HIDDEN: tl.constexpr,
            STREAMED: tl.constexpr = True):
    """Row ``t`` of a ``[R, H]`` tensor (or ``[K, H]`` table) as a tuple of chunks (an empty tuple where not
    ``WANTED``); a ``STREAMED`` row is read once, so it bypasses L1."""
    out = ()
    if WANTED:
        for c in tl.static_range(triton.cdiv(HIDDEN, CHUNK)):
            cols = c * CHUNK + lanes
            mask = (cols < HIDDEN) & _everywhere(valid, lanes)
            if STREAMED:
                out = out + (tl.load(ptr + t * stride + cols, mask=mask, other=0.0, cache_modifier=".cg"),)
            else:
                out = out + (tl.load(ptr + t * stride + cols, mask=mask, other=0.0),)
    return out


@triton.jit
def _chunk_of(held, c: tl.constexpr, ptr, t, stride, cols, ok, HELD: tl.constexpr, STREAMED: tl.constexpr = False):
    """Chunk ``c`` (columns ``cols``) of row ``t``: from the chunks ``held`` where ``HELD``, else loaded."""
    if HELD:
        chunk = held[c]
    elif STREAMED:
        chunk = tl.load(ptr + t * stride + cols, mask=ok, other=0.0, cache_modifier=".cg")
    else:
        chunk = tl.load(ptr + t * stride + cols, mask=ok, other=0.0)
    return chunk


@triton.jit
def _copies_chunks(ptr, t, copy_rows, stride, valid, lanes, WANTED: tl.constexpr, COPIES: tl.constexpr,
                   CHUNK: tl.constexpr, HIDDEN: tl.constexpr, STREAMED: tl.constexpr = True):
    """``_chunks`` of row ``t`` of each of ``COPIES`` copies (copy ``j``'s row: ``t + j * copy_rows``), one tuple, copy
    ``j``'s chunks from ``j * CHUNKS`` on."""
    out = ()
    for j in tl.static_range(COPIES):
        out = out + _chunks(ptr, t + j * copy_rows, stride, valid, lanes, WANTED, CHUNK, HIDDEN, STREAMED)
    return out


@triton.jit
def _copies_chunk_of(held, c: tl.constexpr, ptr, t, copy_rows, stride, cols, ok, HELD: tl.constexpr,
                     COPIES: tl.constexpr, CHUNKS: tl.constexpr):
    """Chunk ``c`` of row ``t`` of each of ``COPIES`` copies (``_copies_chunks``' layout where ``HELD``), a tuple."""
    out = ()
    for j in tl.static_range(COPIES):
        out = out + (_chunk_of(held, j * CHUNKS + c, ptr, t + j * copy_rows, stride, cols, ok, HELD),)
    return out


@triton.jit(debug=True)
def modulation_backward_kernel(
    u_ptr, branch_ptr, gate_ptr, w_ptr, scale_ptr, idx_ptr, order_ptr, seg_ptr, dy_ptr, du_ptr, dx_ptr, dbranch_ptr,
    part_shift_ptr, part_scale_ptr, part_gate_ptr, part_w_ptr,
    n_rows, num_table_rows, rows_per_program, eps,
    stride_u, stride_branch, stride_gate, stride_scale, stride_dy, stride_du,
    HIDDEN: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    LAYER_NORM: tl.constexpr, COPIES: tl.constexpr, ROUND_NORM: tl.constexpr, ROUND_NORM_BEFORE_WEIGHT: tl.constexpr,
    ROUND_AFFINE: tl.constexpr, ROUND_INPUT_GRADIENT: tl.constexpr,
    NEED_X: tl.constexpr, NEED_BRANCH: tl.constexpr, NEED_SHIFT: tl.constexpr, NEED_SCALE: tl.constexpr,
    NEED_GATE: tl.constexpr, NEED_W: tl.constexpr, SORTED: tl.constexpr, ORDERED_INDEX: tl.constexpr,
    ROW_PER_KEY: tl.constexpr,
    COMPENSATE_TABLES: tl.constexpr, COMPENSATE_W: tl.constexpr, PREFETCH: tl.constexpr,
    HOIST_TABLES: tl.constexpr, EARLY_STREAMS: tl.constexpr, INTERPRETED: tl.constexpr, CHUNK: tl.constexpr,
):
    act: tl.constexpr = dx_ptr.dtype.element_ty
    CHUNKS: tl.constexpr = triton.cdiv(HIDDEN, CHUNK)
    GROUPED: tl.constexpr = SORTED  # table gradients summed by table row (not ROW_PER_KEY's, stored per row)
    program = tl.program_id(0).to(tl.int64)  # int64 throughout: no int32 overflow checks under debug=True
    begin = program * rows_per_program
    end = tl.minimum(begin + rows_per_program, n_rows)
    lanes = tl.arange(0, CHUNK)
    TABLE_SUMS: tl.constexpr = CHUNKS * (2 if COMPENSATE_TABLES else 1)  # an accumulator's chunks
    COPY_SUMS: tl.constexpr = TABLE_SUMS * COPIES  # shift's and scale's: a row of sums for each copy
    # a partial buffer's slots of one copy of shift and scale; table rows of one copy
    copy_stride = (tl.num_programs(0).to(tl.int64) + num_table_rows) * HIDDEN
    acc_shift, acc_scale = _zeros(COPY_SUMS, CHUNK), _zeros(COPY_SUMS, CHUNK)
    acc_gate, acc_w = _zeros(TABLE_SUMS, CHUNK), _zeros(CHUNKS * (2 if COMPENSATE_W else 1), CHUNK)
    t_next, k_next = _row(begin, begin < end, order_ptr, idx_ptr, num_table_rows, SORTED, ORDERED_INDEX)
    ws = _chunks(w_ptr, 0, 0, begin < end, lanes, HAS_WEIGHT and HOIST_TABLES, CHUNK, HIDDEN, False)
    if PREFETCH:  # the row's streamed inputs arrive during the previous row's work
        dy_next = _copies_chunks(dy_ptr, t_next, n_rows, stride_dy, begin < end, lanes, HAS_NORM, COPIES, CHUNK, HIDDEN)
        u_next = _chunks(u_ptr, t_next, stride_u, begin < end, lanes, HAS_NORM, CHUNK, HIDDEN)
    if GROUPED:  # the table rows of the program's first and last rows, in sorted order
        first_k = k_next
        last_k = _row(end - 1, begin < end, order_ptr, idx_ptr, num_table_rows, SORTED, ORDERED_INDEX)[1]
    else:
        first_k = 0
        last_k = 0
    held: tl.constexpr = HOIST_TABLES and SORTED
    for table_row in range(first_k, last_k + 1):  # the program's rows of each table row, then their slot
        lo, hi = begin, end
        if GROUPED:
            lo = tl.maximum(begin, tl.load(seg_ptr + table_row))
            hi = tl.minimum(end, tl.load(seg_ptr + table_row + 1))
        # sorted, every row of the segment reads table row ``table_row``: its chunks once for them all
        segment_scales = _copies_chunks(scale_ptr, table_row, num_table_rows, stride_scale, hi > lo, lanes,
                                        HAS_NORM and held, COPIES, CHUNK, HIDDEN, False)
        segment_gates = _chunks(gate_ptr, table_row, stride_gate, hi > lo, lanes, NEED_BRANCH and held, CHUNK,
                                HIDDEN, False)
        for s in range(lo, hi):
            t, k = t_next, k_next
            if PREFETCH:
                dys, us = dy_next, u_next
                t_next, k_next = _row(s + 1, s + 1 < end, order_ptr, idx_ptr, num_table_rows, SORTED, ORDERED_INDEX)
                dy_next = _copies_chunks(dy_ptr, t_next, n_rows, stride_dy, s + 1 < end, lanes, HAS_NORM, COPIES,
                                         CHUNK, HIDDEN)
                u_next = _chunks(u_ptr, t_next, stride_u, s + 1 < end, lanes, HAS_NORM, CHUNK, HIDDEN)
            else:
                dys = _copies_chunks(dy_ptr, t, n_rows, stride_dy, s < end, lanes, HAS_NORM, COPIES, CHUNK, HIDDEN)
                us = _chunks(u_ptr, t, stride_u, s < end, lanes, HAS_NORM, CHUNK, HIDDEN)
                t_next, k_next = _row(s + 1, s + 1 < end, order_ptr, idx_ptr, num_table_rows, SORTED, ORDERED_INDEX)
            if HOIST_TABLES and not SORTED:  # rows in index order: each row's own table row, at its start
                scales = _copies_chunks(scale_ptr, k, num_table_rows, stride_scale, s < end, lanes, HAS_NORM, COPIES,
                                        CHUNK, HIDDEN, False)
                gates = _chunks(gate_ptr, k, stride_gate, s < end, lanes, NEED_BRANCH, CHUNK, HIDDEN, False)
            else:
                scales, gates = segment_scales, segment_gates
            # the streams pass 2 reads, loaded before the row's first store (which they cannot pass: it may alias)
            dus = _chunks(du_ptr, t, stride_du, s < end, lanes, HAS_GATE and EARLY_STREAMS, CHUNK, HIDDEN)
            branches = _chunks(branch_ptr, t, stride_branch, s < end, lanes, NEED_GATE and EARLY_STREAMS, CHUNK,
                               HIDDEN)
            r, minus_mean_product, minus_mean_dxhat, mean = 0.0, 0.0, 0.0, 0.0
            if HAS_NORM:  # pass 1: the row's sum of squares and sum(dxhat * u) (a LayerNorm's: about its mean)
                if LAYER_NORM:
                    sums = tl.zeros([CHUNK], tl.float32)
                    for c in tl.static_range(CHUNKS):
                        sums += widened(us[c])
                    # the means as FMAs with +0 (the same values): a product would contract into the adds that
                    # take them
                    mean = tl.fma(tl.sum(sums, axis=0), tl.cast(1.0 / HIDDEN, tl.float32), 0.0)
                squares = tl.zeros([CHUNK], tl.float32)
                products = tl.zeros([CHUNK], tl.float32)
                dxhats = tl.zeros([CHUNK], tl.float32)
                for c in tl.static_range(CHUNKS):
                    cols = c * CHUNK + lanes
                    ok = cols < HIDDEN
                    scale = _copies_chunk_of(scales, c, scale_ptr, k, num_table_rows, stride_scale, cols, ok,
                                             HOIST_TABLES, COPIES, CHUNKS)
                    w = _chunk_of(ws, c, w_ptr, 0, 0, cols, ok, HOIST_TABLES) if HAS_WEIGHT else 0.0
                    u32 = widened(us[c])
                    dy = _copies_chunk_of(dys, c, dy_ptr, t, n_rows, stride_dy, cols, ok, True, COPIES, CHUNKS)
                    if LAYER_NORM:
                        u32 = tl.where(ok, u32 - mean, 0.0)
                    squares = tl.fma(u32, u32, squares)
                    _, dxhat = _normed_input_gradient(dy, scale, w, act, HAS_WEIGHT, ROUND_NORM,
                                                      ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE, INTERPRETED)
                    products = tl.fma(dxhat, u32, products)
                    if LAYER_NORM:
                        dxhats = _dxhat_plus(dy, scale, w, dxhats, act, HAS_WEIGHT, ROUND_NORM, ROUND_AFFINE,
                                             INTERPRETED)
                r = rsqrt(tl.fma(tl.sum(squares, axis=0), tl.cast(1.0 / HIDDEN, tl.float32), tl.cast(eps, tl.float32)),
                          INTERPRETED)
                # -mean(dxhat * xhat): the sign in the constant, the same bits as negating the mean
                minus_mean_product = tl.sum(products, axis=0) * r * tl.cast(-1.0 / HIDDEN, tl.float32)
                if LAYER_NORM:
                    minus_mean_dxhat = tl.fma(tl.sum(dxhats, axis=0), tl.cast(-1.0 / HIDDEN, tl.float32), 0.0)
            for c in tl.static_range(CHUNKS):  # pass 2: the row's gradients
                cols = c * CHUNK + lanes
                ok = cols < HIDDEN
                du = _chunk_of(dus, c, du_ptr, t, stride_du, cols, ok, EARLY_STREAMS, True).to(tl.float32) \
                    if HAS_GATE else 0.0
                dy, u32, scale, w = (0.0,), 0.0, (0.0,), 0.0
                if HAS_NORM:
                    dy = _copies_chunk_of(dys, c, dy_ptr, t, n_rows, stride_dy, cols, ok, True, COPIES, CHUNKS)
                    u32 = widened(us[c])
                    if LAYER_NORM:
                        u32 = u32 - mean
                    scale = _copies_chunk_of(scales, c, scale_ptr, k, num_table_rows, stride_scale, cols, ok,
                                             HOIST_TABLES, COPIES, CHUNKS)
                    w = _chunk_of(ws, c, w_ptr, 0, 0, cols, ok, HOIST_TABLES) if HAS_WEIGHT else 0.0
                du_t, dn, normed, n = _input_gradients(dy, u32, r, minus_mean_product, minus_mean_dxhat, du, scale, w,
                                                       act, HAS_GATE, HAS_NORM, HAS_WEIGHT, LAYER_NORM, ROUND_NORM,
                                                       ROUND_NORM_BEFORE_WEIGHT, ROUND_AFFINE, ROUND_INPUT_GRADIENT,
                                                       INTERPRETED)
                if NEED_W:
                    acc_w = _add_product_at(acc_w, c, dn, normed, COMPENSATE_W)
                for j in tl.static_range(COPIES):  # each copy's table gradients: its rows of sums, or its table rows
                    if NEED_SHIFT and ROW_PER_KEY:
                        _store_row(part_shift_ptr, k + j * num_table_rows, cols, ok, widened(dy[j]), HIDDEN,
                                   INTERPRETED)
                    elif NEED_SHIFT:
                        acc_shift = _add_at(acc_shift, j * CHUNKS + c, widened(dy[j]), COMPENSATE_TABLES)
                    if NEED_SCALE and ROW_PER_KEY:
                        _store_row(part_scale_ptr, k + j * num_table_rows, cols, ok, widened(dy[j]) * n, HIDDEN,
                                   INTERPRETED)
                    elif NEED_SCALE:
                        acc_scale = _add_product_at(acc_scale, j * CHUNKS + c, widened(dy[j]), n, COMPENSATE_TABLES)
                if NEED_X:
                    tl.store(dx_ptr + t * HIDDEN + cols, rounded(du_t, act, INTERPRETED).to(act), mask=ok)
                if NEED_BRANCH:
                    gate = _chunk_of(gates, c, gate_ptr, k, stride_gate, cols, ok, HOIST_TABLES)
                    tl.store(dbranch_ptr + t * HIDDEN + cols, rounded(du_t * widened(gate), act, INTERPRETED).to(act),
                             mask=ok)
                if NEED_GATE:
                    branch = _chunk_of(branches, c, branch_ptr, t, stride_branch, cols, ok, EARLY_STREAMS, True)
                    if ROW_PER_KEY:
                        _store_row(part_gate_ptr, k, cols, ok, du_t * widened(branch), HIDDEN, INTERPRETED)
                    else:
                        acc_gate = _add_product_at(acc_gate, c, du_t, widened(branch), COMPENSATE_TABLES)
        if GROUPED:
            slot = program + table_row
            if NEED_SHIFT:
                _flush(acc_shift, part_shift_ptr, slot, hi > lo, lanes, copy_stride, CHUNK, HIDDEN, COMPENSATE_TABLES,
                       COPIES)
            if NEED_SCALE:
                _flush(acc_scale, part_scale_ptr, slot, hi > lo, lanes, copy_stride, CHUNK, HIDDEN, COMPENSATE_TABLES,
                       COPIES)
            if NEED_GATE:
                _flush(acc_gate, part_gate_ptr, slot, hi > lo, lanes, 0, CHUNK, HIDDEN, COMPENSATE_TABLES)
            acc_shift, acc_scale = _zeros(COPY_SUMS, CHUNK), _zeros(COPY_SUMS, CHUNK)
            acc_gate = _zeros(TABLE_SUMS, CHUNK)
    if NEED_W:
        _flush(acc_w, part_w_ptr, program, end > begin, lanes, 0, CHUNK, HIDDEN, COMPENSATE_W)


@triton.jit
def reduce_partials_kernel(part_ptr, out_ptr, seg_ptr, rows_per_program, n_programs, stride_out,
                           HIDDEN: tl.constexpr, BLOCK: tl.constexpr, GROUPED: tl.constexpr,
                           COMPENSATED: tl.constexpr, INTERPRETED: tl.constexpr):
    """Row ``k`` (``program_id(1)``) of a gradient: the sum of its partial slots, in program order (``COMPENSATED``:
    Kahan's sum), rounded once to ``out_ptr``'s dtype. ``GROUPED`` (table gradients): the slots ``p + k`` of the
    programs ``p`` whose rows include sorted positions ``seg[k]`` to ``seg[k + 1] - 1``, the rows of table row
    ``k``; else (the weight) slots ``0 .. n_programs - 1``. Copy ``j`` (``program_id(2)``) of ``shift`` and
    ``scale``: its slots ``j * (n_programs + K)`` on, its row ``j * K + k`` (``K`` table rows)."""
    k = tl.program_id(1).to(tl.int64)
    copy = tl.program_id(2).to(tl.int64)
    table_rows = tl.num_programs(1).to(tl.int64)
    part_ptr += copy * (n_programs + table_rows) * HIDDEN
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    if GROUPED:
        lo = tl.load(seg_ptr + k).to(tl.int64)
        hi = tl.load(seg_ptr + k + 1).to(tl.int64)
        first = lo // rows_per_program
        stop = tl.where(hi > lo, (hi - 1) // rows_per_program + 1, first)
        offset = k
    else:
        first = 0
        stop = n_programs + 0 * k
        offset = 0
    total = tl.zeros([BLOCK], tl.float32)
    lost = tl.zeros([BLOCK], tl.float32)
    for p in range(first, stop):
        partial = tl.load(part_ptr + (p + offset) * HIDDEN + cols, mask=ok, other=0.0)
        if COMPENSATED:
            y = partial - lost
            added = total + y
            lost = (added - total) - y
            total = added
        else:
            total += partial
    if COMPENSATED:
        total = total - lost
    out: tl.constexpr = out_ptr.dtype.element_ty
    tl.store(out_ptr + (copy * table_rows + k) * stride_out + cols, rounded(total, out, INTERPRETED).to(out), mask=ok)
