"""Every forward-kernel build at the edge sizes, against the pure-torch reference on the GPU.

``.ci/gpu`` also runs this file under ``compute-sanitizer`` (memcheck and racecheck): each site and policy at
H in {1, 31, 64, 101, 200, 5376} and T in {1, 3, 257}, with the configuration ``launch_config`` picks for
its few rows, for ``FEW_ROWS`` rows and for many rows (so the 8- and 4-warp builds of sites A and B, with
their table chunks preloaded and not, are all run), and each once more warming the coming table rows one row
ahead (the shipped distance never reaches past these sizes), where site B also runs with an fp32 gate table
and bf16 shift and scale (the warming reads the gate row with a load of its own); and the plain RMSNorm
(``eager_rms_norm``'s kernel) and its statistics alone (``eager_rms_norm_rstd``'s) at the same sizes.
"""

import dataclasses
import itertools

import pytest
import torch
from h3_fused.kernels.arguments import check_args
from h3_fused.kernels.launch import FEW_ROWS, launch_config, launch_modulation, norm_sum_order
from h3_fused.kernels.reference import reference_modulation
from h3_fused.kernels.testing import kernel_launch, make_inputs

pytestmark = pytest.mark.gpu
SITES_HAVE = {"A": (False, True), "B": (True, True), "C": (True, False)}  # (gate, norm)


@pytest.mark.parametrize("rows_for", [None, FEW_ROWS, "own"], ids=["many_rows", "few_rows", "own_rows"])
@pytest.mark.parametrize("warm_next_row", [False, True])
@pytest.mark.parametrize("hidden", [1, 31, 64, 101, 200, 5376])
def test_every_build_at_the_edge_sizes_matches_the_reference(rows_for, warm_next_row, hidden):
    for tokens, site, policy in itertools.product((1, 3, 257), "ABC", ("bf16", "fp32")):
        gate_dtypes = (None, torch.float32) if warm_next_row and site == "B" else (None,)
        for gate_dtype in gate_dtypes:
            inputs = make_inputs(site, tokens, hidden, table_rows=3, seed=tokens)
            inputs["index"][-1] = 2  # the last row reads the last table row
            if gate_dtype is not None:
                inputs["gate"] = inputs["gate"].to(gate_dtype)
            a = check_args(**inputs, policy=policy, has_norm=site != "C")
            config = launch_config(hidden, *SITES_HAVE[site], tokens if rows_for == "own" else rows_for,
                                   norm_sum_order(a.rounding, hidden, site != "C", tokens))
            if warm_next_row:
                config = dataclasses.replace(config, warm_rows_ahead=1)
            launch = kernel_launch(site, inputs, policy, config=config)
            launch()
            expected = reference_modulation(a)
            u, y = launch.outputs
            if u is not None:
                assert torch.equal(u, expected[0]), (site, policy, tokens)
            if y is not None:  # the norm's fp32 sum has the kernel's order: a rare last-place flip
                assert (y != expected[1]).float().mean() <= 1e-3 + 1 / y.numel(), (site, policy, tokens)
                torch.testing.assert_close(y, expected[1], rtol=2 ** -7, atol=2 ** -7 * expected[1].abs().max().item())


@pytest.mark.parametrize("hidden", [1, 31, 64, 101, 200, 5376])
def test_the_plain_rms_norm_at_the_edge_sizes_matches_eagers_ops(hidden):
    """Site A without tables, index or affine (``eager_rms_norm``'s kernel), with and without a weight, one
    rounding and the native two, into an output poisoned with NaN: every element written, eager's value but for
    the sum's order where the kernel does not reproduce it."""
    for tokens, weighted, native in itertools.product((1, 3, 257), (True, False), (False, True)):
        g = torch.Generator(device="cuda").manual_seed(tokens)
        x = torch.randn(tokens, hidden, generator=g, device="cuda").to(torch.bfloat16)
        weight = torch.randn(hidden, generator=g, device="cuda").to(torch.bfloat16) if weighted else None
        a = check_args(x=x, weight=weight, eps=1e-5, policy="bf16", norm_rounds_before_weight=native, has_norm=True)
        y = torch.full_like(x, float("nan"))
        launch_modulation(a, None, y, lambda kernel: kernel)
        expected = torch.ops.h3_fused.eager_kernels_rms_norm(x, weight, 1e-5, native)
        assert not y.isnan().any(), (tokens, weighted, native)
        assert (y != expected).float().mean() <= 1e-3 + 1 / y.numel(), (tokens, weighted, native)
        torch.testing.assert_close(y, expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())
        if not weighted:  # the statistics alone: one fp32 r a row, nothing written beyond them
            a = check_args(x=x, eps=1e-5, policy="bf16", norm_rounds_before_weight=native, has_norm=True,
                           stores_rstd=True)
            r = torch.full((tokens + 1, 1), float("nan"), device="cuda")
            launch_modulation(a, None, r[:tokens], lambda kernel: kernel)
            assert not r[:tokens].isnan().any() and r[tokens].isnan(), (tokens, native)
            torch.testing.assert_close(r[:tokens], torch.ops.h3_fused.eager_kernels_rms_norm_rstd(x, 1e-5, native),
                                       rtol=1e-6, atol=0)
