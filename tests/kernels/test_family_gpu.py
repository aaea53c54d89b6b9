"""The DiT family's site forms on CUDA: modulation rows given without an index (per sample, per token, one for
all, chosen per token between two, per token summed with a table: the rows with biases), a LayerNorm or an RMSNorm in each public spelling, the norm of the fp32 upcast
with fp32 rows, against eager's spelling of each site (``h3_fused.kernels.testing.family_eager_site``),
``torch.equal``: the norms' statistics in the order of eager's RMSNorm, mean and LayerNorm CUDA kernels. The ops
called directly, and the eager sites compiled with the backend (one fused op each)."""

import dataclasses

import pytest
import torch
from h3_fused.kernels.testing import (
    FAMILY_FORMS,
    TABLE_PLUS_ROWS,
    FamilyForm,
    family_eager_site,
    family_fused_site,
    family_inputs,
)
from torch._dynamo.utils import counters

pytestmark = pytest.mark.gpu

# Wan 2.2 TI2V's rows (an fp32 table plus the bf16 projection upcast) and LTX-Video's per-token ones (both bf16)
FORWARD_FORMS = FAMILY_FORMS + (FamilyForm("layer", TABLE_PLUS_ROWS, True), FamilyForm("diffusers_rms", TABLE_PLUS_ROWS))


@pytest.mark.parametrize("hidden", [3072, 5120])
@pytest.mark.parametrize("form", FORWARD_FORMS, ids=str)
def test_every_site_of_each_form_is_eagers(hidden, form):
    for site in ("A", "B", "C"):
        inputs = family_inputs(site, form, 2, 2048, hidden, seed=hidden)
        got = family_fused_site(site, form, "bf16")(**inputs)
        expected = family_eager_site(site, form)(**inputs)
        for g, e in zip(*((got, expected) if site == "B" else ((got,), (expected,)))):
            assert torch.equal(g, e), (site, (g != e).float().mean().item())


@pytest.mark.parametrize("form", [dataclasses.replace(f, modulations=2) for f in FAMILY_FORMS if f.source != "chosen"],
                         ids=str)
def test_a_norm_modulated_twice_is_eagers_for_each_modulation(form):
    """SD3.5's width (H = 2,432): both modulations of the one norm, stored by one launch, each eager's bits."""
    for site in ("A", "B"):
        inputs = family_inputs(site, form, 2, 2048, 2432, seed=5)
        got, expected = family_fused_site(site, form, "bf16")(**inputs), family_eager_site(site, form)(**inputs)
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e), (site, (g != e).float().mean().item())


FUSED = {  # what a site compiles to: site B one op, or two where the rows come after the residual's first use
    "A": [{"norm_modulate"}], "B": [{"gate_norm_modulate"}, {"norm_modulate", "gate_residual"}], "C": [{"gate_residual"}]}


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.parametrize("form", FORWARD_FORMS, ids=str)
def test_every_site_of_each_form_compiled_with_the_backend_is_eagers(form):
    for site in "ABC":
        counters.clear()
        torch._dynamo.reset()
        inputs = family_inputs(site, form, 2, 2048, 3072, seed=1)
        eager = family_eager_site(site, form)
        got = torch.compile(eager, backend="h3_fused", options={"dtype_policy": "bf16"})(**inputs)
        fused = {op for op in ("norm_modulate", "gate_norm_modulate", "gate_residual") if counters["h3_fused"][op]}
        assert fused in FUSED[site] and not counters["h3_fused"]["refused"], (site, fused)
        expected = eager(**inputs)
        for g, e in zip(*((got, expected) if site == "B" else ((got,), (expected,)))):
            assert torch.equal(g, e), (site, (g != e).float().mean().item())
