"""The backward kernels' logic on CPU tensors under Triton's interpreter, against the pure-torch reference
(``TRITON_INTERPRET=1 pytest -m interpreted``).

Under the interpreter the launch uses ``INTERPRETED_PROGRAMS`` programs, so that every program runs through
several rows and, with the uniform index, the sorted index's runs end inside programs: every partial-sum
slot and the fixed-order reduction are exercised. The kernel and the reference agree bit for bit but where
the order of an fp32 row sum enters (a rare last-place flip of an activation gradient).
"""

import dataclasses

import pytest
import torch
from h3_fused.kernels.backward import SavedSite, rows_of
from h3_fused.kernels.launch_backward import BackwardConfig, Needs, backward_specialisation, launch_backward
from h3_fused.kernels.reference import reference_backward
from h3_fused.kernels.testing import FamilyForm, family_backward_inputs, site_tensors

pytestmark = pytest.mark.interpreted
bf16 = torch.bfloat16
SITES = {"A": ("u", "weight", "shift", "scale", "dy"), "B": ("u", "branch", "gate", "weight", "shift", "scale", "dy", "du"),
         "C": ("branch", "gate", "du")}


def saved(site, tokens, hidden, table_rows, seed=0, runs=False, weighted=True):
    """What a site's backward receives: the forward's saved values and the incoming gradients."""
    every = site_tensors(tokens, hidden, table_rows, seed=seed, index_layout="runs" if runs else "uniform")
    every["u"] = every.pop("x")
    every["dy"], every["du"] = (site_tensors(tokens, hidden, table_rows, seed=seed + n)["x"] for n in (1, 2))
    kept = {k: (v if k in SITES[site] else None) for k, v in every.items()}
    if not weighted:
        kept["weight"] = None
    return dict(kept, index=every["index"])


def both(t, policy, native, needs, config=None):
    saved = SavedSite(t["u"], t["branch"], t["gate"], t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5,
                      policy=policy, norm_rounds_before_weight=native, upcast_tables=False)
    a = saved.forward_args(t["du"])
    rows = tuple(rows_of(t[name], a, name) for name in ("u", "dy", "du"))
    return launch_backward(a, *rows, needs, lambda kernel: kernel, config), reference_backward(a, *rows, needs)


def assert_same(got, ref):
    """Activation gradients: at most 1% last-place flips (where the order of an fp32 row sum enters); bf16 table and
    weight gradients: the same bits (fp32 sums rounded once to bf16); fp32 ones: within a few of fp32's last places
    (the fp32 normalized row, whose row statistics each sums in its own order; Kahan's sum against the reference's
    fp64 one)."""
    assert set(got) == set(ref)
    for name in ref:
        flips = (got[name] != ref[name]).float().mean().item()
        single = ref[name].dtype == torch.float32 and name not in ("lead", "branch")
        assert flips <= (1e-2 if name in ("lead", "branch") else 1 if single else 0), (name, flips)
        near = 2 ** -20 * ref[name].abs().max().item() if single else 0  # where the normalized row is near 0
        torch.testing.assert_close(got[name], ref[name], atol=near, rtol=2 ** -20 if single else 2 ** -7)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("tokens, hidden, table_rows", [(1, 64, 3), (13, 101, 4), (40, 200, 6), (37, 2, 2)])
@pytest.mark.parametrize("policy, native", [("bf16", False), ("bf16", True), ("fp32", False)])
def test_every_gradient_matches_the_reference(site, tokens, hidden, table_rows, policy, native):
    t = saved(site, tokens, hidden, table_rows)
    assert_same(*both(t, policy, native, Needs()))


@pytest.mark.parametrize("site", ["A", "B"])
@pytest.mark.parametrize("index_runs", [False, True])
def test_rows_in_chunks_many_programs_and_runs_of_the_index(site, index_runs):
    """Rows in 32-column chunks (H = 101: four, the last 5 wide): one row per program without the prefetch, eight
    with it; the index in runs (as in the model) or drawn per row."""
    t = saved(site, 21, 101, 5, seed=3, runs=index_runs)
    for rows_per_program, prefetch in ((1, False), (8, True)):
        config = BackwardConfig(32, 1, rows_per_program, -(-21 // rows_per_program), prefetch)
        assert_same(*both(t, "bf16", False, Needs(), config))


@pytest.mark.parametrize("site, asked, weighted", [("B", (), True), ("B", ("lead", "branch"), True), ("A", (), False)],
                         ids=["B", "B_activations_only", "A_without_weight"])
def test_held_tables_and_early_streams_give_the_same_bits(site, asked, weighted):
    """``hoist_tables`` (the table rows' and weight's chunks held in registers: once a table row where rows are
    sorted, at each row's start where not, as when only activation gradients are asked) and ``early_streams``
    (the residual gradient and the branch loaded at the row's start) change where values are loaded, not what
    is computed: every gradient bit for bit as the build without them, in chunks of 32 columns of H = 101, on
    several programs (on the GPU the compiler may contract another multiply-add in either build)."""
    t = saved(site, 24, 101, 5, seed=8, weighted=weighted)
    needs = Needs(**{name: not asked or name in asked for name in ("lead", "branch", "gate", "weight", "shift", "scale")})
    plain = BackwardConfig(32, 1, 8, 3)
    expected = both(t, "bf16", False, needs, plain)[0]
    for hoist, early in ((False, True), (True, True)):  # the builds shipped at B, and at A and C
        got = both(t, "bf16", False, needs, dataclasses.replace(plain, hoist_tables=hoist, early_streams=early))[0]
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("asked", [("lead",), ("lead", "branch"), ("shift", "scale"), ("gate",), ("weight",)])
def test_only_what_is_asked_is_computed(site, asked):
    t = saved(site, 20, 64, 3, seed=5)
    needs = Needs(**{name: name in asked for name in ("lead", "branch", "gate", "weight", "shift", "scale")})
    got, ref = both(t, "bf16", False, needs)
    assert_same(got, ref)
    assert set(got) <= set(asked)


@pytest.mark.parametrize("site", ["A", "B"])
def test_one_column(site):
    """H = 1: the norm's input gradient is a difference of nearly equal terms (``xhat`` is +-1), so the two sum
    orders differ in more than the last place; both stay next to zero."""
    got, ref = both(saved(site, 37, 1, 2), "bf16", False, Needs())
    for name in ref:
        torch.testing.assert_close(got[name].float(), ref[name].float(), rtol=2 ** -7,
                                   atol=1e-3 * ref[name].float().abs().max().item())


def test_without_a_weight():
    t = saved("B", 20, 64, 3, seed=6, weighted=False)
    assert_same(*both(t, "bf16", False, Needs()))


def test_the_same_bits_on_every_run():
    t = saved("B", 40, 200, 6, seed=7)
    first, second = both(t, "bf16", False, Needs())[0], both(t, "bf16", False, Needs())[0]
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("bad, needs", [(-1, Needs()), (4, Needs()),
                                        (4, Needs(gate=False, weight=False, shift=False, scale=False))],
                         ids=["negative", "past_the_last_row", "past_the_last_row_activations_only"])
def test_an_index_out_of_range_fails_the_kernels_assertion(bad, needs):
    """The kernel launched without the host's check (as on CUDA): a row whose index is outside ``[0, K)`` fails the
    device assertion, also where the rows are visited in sorted order, where no table row's loop reaches it:
    its key sorts first or last, the first program's first row or the last program's last row, whose table
    rows every program reads (``first_k``, ``last_k``)."""
    t = saved("B", 13, 64, 4)
    t["index"][5] = bad
    with pytest.raises(Exception, match="index out of range"):
        both(t, "bf16", False, needs)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("form, shared_rows", [
    (FamilyForm("layer", "per_sample"), False), (FamilyForm("layer", "per_token", True), False),
    (FamilyForm("layer", "one_for_all"), False), (FamilyForm("rms", "chosen"), False),
    (FamilyForm("diffusers_rms", "per_sample"), False), (FamilyForm("layer", "per_token"), True)],
    ids=["layer-per_sample", "layer-per_token-fp32", "layer-one_for_all", "rms-chosen", "diffusers_rms-per_sample",
         "layer-shared_per_token"])
def test_family_forms_match_the_reference(site, form, shared_rows):
    """Rows given per sample, per token, one for all (an index in the rows' own order: no sort; per token, each
    table row's gradient one row's, stored as it is computed) or shared by the samples (sorted); a LayerNorm (its mean and the mean of ``dxhat`` besides an RMSNorm's sums); the norm of the
    fp32 upcast with fp32 rows (the input gradient rounded, the norm's output gradient not; the table sums
    compensated); in 32-column chunks of H = 101 on several programs."""
    saved, a, rows = family_backward_inputs(site, form, 2, 23, 101, device="cpu", shared_rows=shared_rows)
    assert saved.ordered_index == (not shared_rows)
    config = BackwardConfig(32, 1, 8, 6)
    per_token = form.source in ("per_token", "chosen") and not shared_rows  # one table row a row: stored, not summed
    spec = backward_specialisation(a, Needs(), config, saved.ordered_index)
    assert spec.ROW_PER_KEY is per_token
    got = launch_backward(a, *rows, Needs(), lambda kernel: kernel, config, ordered_index=saved.ordered_index)
    assert_same(got, reference_backward(a, *rows, Needs()))


@pytest.mark.parametrize("site, index, norm, policy", [("A", "uniform", "layer", "bf16"), ("B", "runs", "rms", "bf16"),
                                                        ("B", "one_row_each", "layer", "bf16"),
                                                        ("B", "uniform", "layer", "fp32")])
def test_copies_of_shift_and_scale_match_the_reference(site, index, norm, policy):
    """Three copies of ``shift`` and ``scale`` (a norm modulated three times; SD3.5's twice), ``dy`` ``[3, R, H]``:
    the norm's gradient summed over the copies and each copy's table gradients its own, by the three table
    gradient paths: the rows sorted by table row (``uniform``), in their own order (``runs``, the rows per sample
    of a model) and one table row each (``one_row_each``, rows per token: stored as computed), in 32-column
    chunks of H = 40 on several programs; each row's streams prefetched during the previous row, and not."""
    rows, hidden, copies = 13, 40, 3
    t = saved(site, rows, hidden, 5, seed=4, runs=index == "runs")
    g = torch.Generator().manual_seed(9)
    table_rows = rows if index == "one_row_each" else 5
    if index == "one_row_each":
        t["index"] = torch.arange(rows)
        t["gate"] = t["gate"][:1].expand(rows, hidden) if site == "B" else None
    t["shift"], t["scale"] = (0.3 * torch.randn(copies, table_rows, hidden, generator=g).to(bf16) for _ in range(2))
    t["dy"] = torch.randn(copies, rows, hidden, generator=g).to(bf16)
    saved_site = SavedSite(t["u"], t["branch"], t["gate"], None, t["shift"], t["scale"], t["index"], eps=1e-5,
                           policy=policy, norm_rounds_before_weight=False, upcast_tables=False, norm=norm)
    a = saved_site.forward_args(t["du"])
    assert a.modulations == copies and a.num_table_rows == table_rows
    u, dy, du = (rows_of(t[name], a, name) for name in ("u", "dy", "du"))
    ordered = index != "uniform"
    ref = reference_backward(a, u, dy, du, Needs())
    for config in (BackwardConfig(32, 1, 5, -(-rows // 5)), BackwardConfig(32, 1, 5, -(-rows // 5), prefetch=False)):
        got = launch_backward(a, u, dy, du, Needs(), lambda kernel: kernel, config, ordered_index=ordered)
        assert got["shift"].shape == (copies * table_rows, hidden)
        assert_same(got, ref)
