"""GPU suite for the backward of the DiT family's site forms at real sizes (``pytest -m gpu``): against the fp64
gradients of each site's math and eager's, and determinism. Rows per sample are each summed over thousands of
tokens: in fp32 in a fixed order (Kahan-compensated for fp32 rows) and rounded once, where eager reduces the
broadcast in the rows' dtype."""

import pytest
import torch
from h3_fused.kernels.testing import FamilyForm, family_eager_site, family_exact_site, family_fused_site, family_inputs
from helpers import gradients, in_fp64
from test_backward_gpu import relative_error

pytestmark = pytest.mark.gpu
FORMS = [FamilyForm("layer", "per_sample"), FamilyForm("layer", "per_sample", True), FamilyForm("layer", "per_token", True),
         FamilyForm("rms", "one_for_all"), FamilyForm("diffusers_rms", "per_sample"), FamilyForm("layer", "chosen"),
         FamilyForm("layer", "per_sample", modulations=2)]
DIFFERENTIABLE = {"A": ("x", "modulation"), "B": ("residual", "branch", "modulation"),
                  "C": ("residual", "branch", "modulation")}



@pytest.mark.parametrize("tokens", [2048, 16384])
@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("form", FORMS, ids=str)
def test_gradients_at_real_size_are_as_close_to_fp64_as_eagers(form, site, tokens):
    """Two samples of ``tokens`` at H = 3,072: every gradient within eager's error against fp64 (``bf16``)."""
    inputs = family_inputs(site, form, 2, tokens, 3072, seed=tokens)
    names = DIFFERENTIABLE[site]
    exact = gradients(family_exact_site(site, form), in_fp64(inputs), names)
    ours = gradients(family_fused_site(site, form, "bf16"), inputs, names)
    eagers = gradients(family_eager_site(site, form), inputs, names)
    for name in names:
        mine, theirs = relative_error(ours[name], exact[name]), relative_error(eagers[name], exact[name])
        print(f"{form} {site} T={tokens} {name}: ours {mine:.2e}, eager {theirs:.2e}")
        assert mine <= theirs * 1.05 + 1e-7, (name, mine, theirs)


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("form", FORMS, ids=str)
def test_gradients_are_the_same_bits_on_every_run(form, policy):
    inputs = family_inputs("B", form, 2, 8192, 3072, seed=5)
    names = DIFFERENTIABLE["B"]
    first, second = (gradients(family_fused_site("B", form, policy), inputs, names) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in names)
