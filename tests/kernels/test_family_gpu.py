"""The DiT family's site forms on CUDA: modulation rows given without an index (per sample, per token, one for
all), a LayerNorm or an RMSNorm in each public spelling, the norm of the fp32 upcast with fp32 rows, against
eager's spelling of each site (``h3_fused.kernels.testing.family_eager_site``), ``torch.equal``: the norms'
statistics in the order of eager's RMSNorm, mean and LayerNorm CUDA kernels."""

import pytest
import torch
from h3_fused.kernels.testing import FAMILY_SOURCES, FamilyForm, family_eager_site, family_fused_site, family_inputs

pytestmark = pytest.mark.gpu
FORMS = [FamilyForm("layer", source, in_fp32) for source in FAMILY_SOURCES for in_fp32 in (False, True)] + [
    FamilyForm(norm, source) for norm in ("rms", "diffusers_rms") for source in FAMILY_SOURCES]


@pytest.mark.parametrize("hidden", [3072, 5120])
@pytest.mark.parametrize("form", FORMS, ids=lambda f: f"{f.norm}-{f.source}{'-fp32' if f.in_fp32 else ''}")
def test_every_site_of_each_form_is_eagers(hidden, form):
    for site in ("A", "B", "C"):
        inputs = family_inputs(site, form, 2, 2048, hidden, seed=hidden)
        got = family_fused_site(site, form, "bf16")(**inputs)
        expected = family_eager_site(site, form)(**inputs)
        for g, e in zip(*((got, expected) if site == "B" else ((got,), (expected,)))):
            assert torch.equal(g, e), (site, (g != e).float().mean().item())
