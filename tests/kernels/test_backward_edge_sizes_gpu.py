"""Every backward-kernel build at the edge sizes, against the pure-torch reference on the GPU.

``.ci/gpu`` also runs this file under ``compute-sanitizer`` (memcheck and racecheck): each site and policy at
H in {1, 31, 64, 101, 200, 5376} and T in {1, 3, 257}, all gradients and the activations' alone, with the
shipped launch configuration, one row per program, without the prefetch of the next row, and with the table
rows held in registers and the streams loaded early each the other way round from the shipped build
(``BackwardConfig.hoist_tables``, ``early_streams``); and the DiT family's forms, a norm modulated twice among them.
"""

import dataclasses
import itertools

import pytest
import torch
from h3_fused.kernels.launch_backward import Needs, backward_config, launch_backward
from h3_fused.kernels.reference import reference_backward
from h3_fused.kernels.testing import FamilyForm, backward_inputs, family_backward_inputs

pytestmark = pytest.mark.gpu
ONLY_ACTIVATIONS = Needs(gate=False, weight=False, shift=False, scale=False)


def saved(site, tokens, hidden, policy):
    a, rows = backward_inputs(site, tokens, hidden, table_rows=3, seed=tokens, policy=policy)
    a.index[-1] = 2  # the last row reads the last table row
    return a, rows


@pytest.mark.parametrize("variant", ["shipped", "one_row_per_program", "no_prefetch", "tables_and_streams_toggled"])
@pytest.mark.parametrize("hidden", [1, 31, 64, 101, 200, 5376])
def test_every_backward_build_at_the_edge_sizes_matches_the_reference(variant, hidden):
    for tokens, site, policy, needs in itertools.product((1, 3, 257), "ABC", ("bf16", "fp32"),
                                                         (Needs(), ONLY_ACTIVATIONS)):
        a, rows = saved(site, tokens, hidden, policy)
        config = backward_config(hidden, tokens, a.device, site != "C", site != "A")
        if variant == "one_row_per_program":
            config = dataclasses.replace(config, rows_per_program=1, programs=tokens)
        elif variant == "no_prefetch":
            config = dataclasses.replace(config, prefetch=False)
        elif variant == "tables_and_streams_toggled":  # the build each site does not ship
            config = dataclasses.replace(config, hoist_tables=not config.hoist_tables,
                                         early_streams=not config.early_streams)
        got = launch_backward(a, *rows, needs, lambda kernel: kernel, config)
        expected = reference_backward(a, *rows, needs)
        assert got.keys() == expected.keys()
        for name in expected:
            # the row sums' fp32 order is the kernel's: an activation gradient may differ from the reference's in
            # its last place (rarely), an fp32 sum near zero in its last places
            largest = expected[name].float().abs().max().item()
            if got[name].dtype != torch.float32 and hidden > 1:  # a few places of a few elements
                assert (got[name] != expected[name]).float().mean() <= 1e-3 + 1 / got[name].numel()
                tolerance = 2 ** -6 * largest
            else:
                tolerance = (1e-3 if hidden == 1 else 1e-5) * largest
            torch.testing.assert_close(got[name], expected[name], rtol=2 ** -7, atol=tolerance,
                                       msg=lambda m, name=name: f"{site} {policy} T={tokens} {name}: {m}")


FAMILY = [(FamilyForm("layer", "per_sample"), False), (FamilyForm("layer", "per_token", True), False),
          (FamilyForm("rms", "one_for_all"), False), (FamilyForm("layer", "per_token"), True),
          (FamilyForm("layer", "per_sample", modulations=2), False), (FamilyForm("rms", "per_token", modulations=2), False)]


@pytest.mark.parametrize("hidden", [1, 31, 101, 5120])
@pytest.mark.parametrize("form, shared_rows", FAMILY,
                         ids=["layer-per_sample", "layer-per_token-fp32", "rms-one_for_all", "layer-shared_per_token",
                              "layer-per_sample-x2", "rms-per_token-x2"])
def test_the_family_forms_at_the_edge_sizes_match_the_reference(form, shared_rows, hidden):
    """The DiT family's forms (``family_backward_inputs``): a LayerNorm, rows per sample, per token (fp32, their
    sums compensated), one for all (an index in the rows' own order) or shared by the samples (sorted), a norm
    modulated twice (copies of the rows per sample, sorted, or per token, stored per row), two samples of T in
    {1, 3, 257} tokens, all gradients and the activations' alone, the shipped configuration."""
    for tokens, site, needs in itertools.product((1, 3, 257), "ABC", (Needs(), ONLY_ACTIVATIONS)):
        saved, a, rows = family_backward_inputs(site, form, 2, tokens, hidden, seed=tokens, shared_rows=shared_rows)
        got = launch_backward(a, *rows, needs, lambda kernel: kernel, ordered_index=saved.ordered_index)
        expected = reference_backward(a, *rows, needs)
        assert got.keys() == expected.keys()
        for name in expected:
            # as above: the row sums' fp32 order is the kernel's, so an activation gradient may differ in its last
            # place, and with it (rows per token: one product each) a few elements of a row gradient
            largest = expected[name].float().abs().max().item()
            if hidden == 1:  # a LayerNorm of one column is 0: its input gradient is fp32's error times rsqrt(eps)
                torch.testing.assert_close(got[name], expected[name], rtol=2 ** -7, atol=1e-3 * max(largest, 1.0))
                continue
            tight = (2 ** -6 if got[name].dtype != torch.float32 else 1e-5) * largest
            close = torch.isclose(got[name], expected[name], rtol=2 ** -7, atol=tight)
            assert (~close).float().mean() <= 1e-3 + 1 / got[name].numel(), f"{site} T={tokens} {name}"
            torch.testing.assert_close(got[name], expected[name], rtol=2 ** -7, atol=2 ** -4 * largest,
                                       msg=lambda m, name=name: f"{site} T={tokens} {name}: {m}")
