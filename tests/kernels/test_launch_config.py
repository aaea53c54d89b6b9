"""The forward kernel's launch rules (``h3_fused.kernels.launch``): warps, chunks, preloading, warming."""

import math

import pytest
import torch
from h3_fused.kernels.testing import site_tensors as make
from hypothesis import given, settings
from hypothesis import strategies as st

bf16, f32 = torch.bfloat16, torch.float32


def test_launch_config_gives_the_normed_sites_more_warps_only_for_few_known_rows():
    """Site A runs on 8 warps up to ``FEWEST_ROWS`` rows, site B up to ``FEW_ROWS``, and both on 4
    beyond, or where the count is symbolic (``None``: chosen without a guard on it); site C always on 8."""
    from h3_fused.kernels.launch import FEW_ROWS, FEWEST_ROWS, launch_config

    counts = (1, FEWEST_ROWS, FEWEST_ROWS + 1, FEW_ROWS, FEW_ROWS + 1, None)
    wide, narrow = (1, 2048, 8), (1, 1024, 4)
    site_a = [launch_config(5376, False, True, rows) for rows in counts]
    assert [(c.block_t, c.chunk, c.num_warps) for c in site_a] == [wide] * 2 + [narrow] * 4
    site_b = [launch_config(5376, True, True, rows) for rows in counts]
    assert [(c.block_t, c.chunk, c.num_warps) for c in site_b] == [wide] * 4 + [narrow] * 2
    site_c = [launch_config(5376, True, False, rows) for rows in counts]
    assert {(c.block_t, c.chunk, c.num_warps) for c in site_c} == {wide}


@settings(max_examples=300, deadline=None)
@given(hidden=st.integers(1, 16384), site=st.sampled_from([(False, True), (True, True), (True, False)]),
       rows=st.none() | st.integers(1, 100_000))
def test_launch_config_never_runs_on_fewer_than_min_warps(hidden, site, rows):
    """At every H, site and row count a program has ``MIN_WARPS`` to 16 warps, each thread holding 8
    elements of every chunk (16 at H = 1, whose 2,048 rows per program are one column each), in chunks no
    wider than the row padded to a power of two; one row per program where that padding is 2,048 or more.
    The warming loads (``warming_lanes``) have one lane per thread (two at H = 1)."""
    from h3_fused.kernels.launch import MIN_WARPS, launch_config

    c = launch_config(hidden, *site, rows)
    assert MIN_WARPS == 4 <= c.num_warps <= 16
    assert c.block_t * c.chunk == 32 * c.num_warps * (16 if hidden == 1 else 8)
    assert c.warming_lanes == 32 * c.num_warps * (2 if hidden == 1 else 1)
    assert c.chunk <= 1 << (hidden - 1).bit_length()
    assert (c.block_t == 1) == (hidden > 1024)


@settings(max_examples=200, deadline=None)
@given(hidden=st.integers(1, 8192).map(lambda h: 4 * h), site=st.sampled_from([(False, True), (True, True)]),
       rows=st.none() | st.integers(1, 100_000))
def test_eager_sum_orders_take_chunks_of_one_vector_per_eager_thread(hidden, site, rows):
    """Where the norm's squares add in the fused RMSNorm's order, chunks of 512 columns (its 128 threads x 4) on
    4 warps, or the whole padded row where it is shorter, the rows per program as without it; in the mean's
    order, chunks of one vector per lane of a warp (at most 32 lanes), one row a program on 2 warps, but for a
    row eager reads element by element (H < 128): one chunk of 4 elements per lane, the rows per program as the
    other orders take them; site A's tables warmed as the kernel starts in every order."""
    from h3_fused.kernels.contract import SumOrder
    from h3_fused.kernels.launch import MEAN_ORDER_WARPS, MIN_WARPS, launch_config

    fused, other = launch_config(hidden, *site, rows, SumOrder.FUSED_RMS_NORM), launch_config(hidden, *site, rows)
    assert (fused.chunk, fused.num_warps, fused.block_t) == (min(512, 1 << (hidden - 1).bit_length()), MIN_WARPS,
                                                             other.block_t)
    mean = launch_config(hidden, *site, rows, SumOrder.MEAN)
    if hidden >= 128:
        assert (mean.chunk, mean.num_warps, mean.block_t, mean.warm_tables_first) == (
            128, MEAN_ORDER_WARPS, 1, other.warm_tables_first)
    else:  # read element by element by eager: one chunk of 4 sums for each of min(32, last power of 2 <= H) lanes
        lanes = min(32, 1 << (hidden.bit_length() - 1))
        assert (mean.chunk, mean.num_warps, mean.block_t, mean.warm_tables_first) == (
            4 * lanes, MIN_WARPS, min(other.block_t, 2048 // (4 * lanes)), other.warm_tables_first)


@pytest.mark.parametrize("policy, native, hidden, rows, order", [
    ("bf16", False, 5376, 3, 1), ("bf16", False, 128, None, 1), ("bf16", False, 101, 4096, 0),
    ("bf16", True, 5376, 4096, 2), ("bf16", True, 5376, None, 2), ("bf16", True, 5376, 15, 0),
    ("bf16", True, 64, 4096, 2), ("bf16", True, 16, 4096, 2), ("bf16", True, 12, 4096, 0), ("bf16", True, 8160, 4096, 2), ("bf16", True, 8192, 4096, 0),
    ("bf16", True, 16384, 4096, 0), ("fp32", False, 5376, 4096, 0),
    ("fp32", True, 5376, 4096, 0)])
def test_the_norm_sums_in_the_order_of_the_eager_kernel_the_spelling_runs(policy, native, hidden, rows, order):
    """``NORM_SUM_ORDER`` under ``bf16``: 1 (torch's fused RMSNorm) for ``nn.RMSNorm`` / ``F.rms_norm`` and 2
    (torch's mean) for the native RMSNorm, where eager takes the path reproduced (H a multiple of 4; for the
    mean 16 rows or more, or a symbolic count, and H from 16 to 8,160); else 0, the kernel's own; never under
    ``fp32`` nor for site C (no norm)."""
    from h3_fused.kernels.arguments import check_args
    from h3_fused.kernels.launch import ForwardSpecialisation, LaunchConfig, norm_sum_order

    t = make(tokens=4, hidden=hidden)
    for site, has_norm in (("A", True), ("C", False)):
        kwargs = dict(x=t["x"], shift=t["shift"], scale=t["scale"], index=t["index"], weight=t["weight"],
                      norm_rounds_before_weight=native) if has_norm else dict(
            residual=t["x"], branch=t["branch"], gate=t["gate"], index=t["index"])
        a = check_args(**kwargs, policy=policy, has_norm=has_norm)
        spec = ForwardSpecialisation.of(a, LaunchConfig(1, 512, 4), norm_sum_order(a.rounding, hidden, has_norm, rows))
        assert (order if has_norm else 0) == spec.NORM_SUM_ORDER, site


def test_a_chunk_other_than_the_eager_order_needs_is_refused():
    from h3_fused.kernels.arguments import check_args
    from h3_fused.kernels.launch import LaunchConfig, launch_modulation

    t = make(tokens=4, hidden=1024)
    a = check_args(x=t["x"], weight=t["weight"], shift=t["shift"], scale=t["scale"], index=t["index"],
                   policy="bf16", has_norm=True)
    with pytest.raises(ValueError, match="config.chunk=1024: .* holds 512 columns"):
        launch_modulation(a, None, torch.empty_like(t["x"]), lambda kernel: kernel, LaunchConfig(1, 1024, 4))


@pytest.mark.parametrize("hidden", [2048, 2049, 5376])
def test_launch_config_preloads_table_chunks_for_site_b_and_site_a_but_many_narrow_rows(hidden):
    """Site B always preloads its table chunks; site A too, except at H up to ``SITE_A_NARROW_H`` beyond
    ``SITE_A_FEW_ROWS`` rows or where the count is symbolic; site C has no table rows of a norm; every
    build warms the coming table rows 1,024 rows ahead, and site A's also every table row as it starts."""
    from h3_fused.kernels.launch import FEWEST_ROWS, SITE_A_FEW_ROWS, SITE_A_NARROW_H, launch_config

    counts = (1, FEWEST_ROWS, FEWEST_ROWS + 1, SITE_A_FEW_ROWS, SITE_A_FEW_ROWS + 1, None)
    ahead = {(gated, normed): [launch_config(hidden, gated, normed, rows).preload_table_chunks for rows in counts]
             for gated, normed in ((False, True), (True, True), (True, False))}
    site_a = [True] * 4 + [hidden > SITE_A_NARROW_H] * 2
    assert ahead == {(False, True): site_a, (True, True): [True] * 6, (True, False): [False] * 6}
    assert {launch_config(hidden, g, n, rows).warm_rows_ahead for g, n in ahead for rows in counts} == {1024}
    warm = {(g, n): {launch_config(hidden, g, n, rows).warm_tables_first for rows in counts} for g, n in ahead}
    assert warm == {(False, True): {True}, (True, True): {False}, (True, False): {False}}


@pytest.mark.parametrize("gate_dtype, table_dtype", [(bf16, bf16), (f32, bf16), (bf16, f32)])
def test_warming_program_count_cover_every_table_row_and_the_weight(gate_dtype, table_dtype):
    """``warming_program_count``: enough programs of ``lanes`` 32-byte sectors for every row of each table the
    site reads, in its own dtype, and the (bf16) weight; none for tables over ``WARM_TABLES_MAX_BYTES``."""
    from h3_fused.kernels.arguments import check_args
    from h3_fused.kernels.launch import WARM_TABLES_MAX_BYTES, warming_program_count

    t = make(tokens=4, hidden=5376, table_rows=6, table_dtype=table_dtype)
    gate = t["gate"].to(gate_dtype)
    row_sectors = {bf16: 5376 * 2 // 32, f32: 5376 * 4 // 32}
    a = check_args(x=t["x"], weight=t["weight"], shift=t["shift"], scale=t["scale"], index=t["index"], eps=1e-5,
                   policy="bf16", has_norm=True)
    assert warming_program_count(a, 128) == math.ceil((2 * 6 * row_sectors[table_dtype] + row_sectors[bf16]) / 128)
    b = check_args(residual=t["x"], gate=gate, branch=t["branch"], weight=t["weight"], shift=t["shift"],
                   scale=t["scale"], index=t["index"], eps=1e-5, policy="bf16", has_norm=True)
    sectors = 6 * (2 * row_sectors[table_dtype] + row_sectors[gate_dtype]) + row_sectors[bf16]
    assert warming_program_count(b, 256) == math.ceil(sectors / 256)
    c = check_args(residual=t["x"], gate=gate, branch=t["branch"], index=t["index"], policy="bf16", has_norm=False)
    assert warming_program_count(c, 256) == math.ceil(6 * row_sectors[gate_dtype] / 256)
    big = make(tokens=4, hidden=8192, table_rows=1 + WARM_TABLES_MAX_BYTES // (2 * 8192 * 2))
    a = check_args(x=big["x"], shift=big["shift"], scale=big["scale"], index=big["index"], eps=1e-5,
                   policy="bf16", has_norm=True)
    assert warming_program_count(a, 128) == 0
