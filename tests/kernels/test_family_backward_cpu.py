"""The backward of the DiT family's site forms on the CPU (the pure-torch reference behind the fused ops): rows
given per sample, per token, one for all or chosen per token between two; a LayerNorm or an RMSNorm in each
public spelling; the norm of the fp32 upcast with fp32 rows; one norm modulated twice. Against finite differences in fp64, against eager's
autograd of the model's spelling (``family_eager_site``) and against fp64.

A per-sample row's gradient is a sum over its sample's tokens: ours is summed in fp32 in a fixed order and
rounded once (``SavedSite.gathered`` restates the given rows as tables gathered by an index, which the backward
of gathered rows sums so), eager's in the rows' dtype by autograd's broadcast reduction.
"""

import pytest
import torch
from h3_fused.kernels.testing import (
    FAMILY_FORMS,
    FamilyForm,
    family_eager_site,
    family_exact_site,
    family_fused_site,
    family_inputs,
)
from helpers import gradients, in_fp64

ACTIVATIONS = {"A": ("x",), "B": ("residual", "branch"), "C": ("residual", "branch")}
# a norm modulated twice (SD3.5's): sites A and B, as they have the norm
TWICE = (FamilyForm("layer", "per_sample", modulations=2), FamilyForm("rms", "per_token", modulations=2))
SITE_FORMS = [(site, form) for site in "ABC" for form in FAMILY_FORMS] + [(site, f) for site in "AB" for f in TWICE]


def site_forms(keep=lambda form: True):
    return pytest.mark.parametrize("site, form", [(s, f) for s, f in SITE_FORMS if keep(f)],
                                   ids=[f"{s}-{f}" for s, f in SITE_FORMS if keep(f)])



def inputs(site, form, batch=2, tokens=37, hidden=64, seed=0):
    return family_inputs(site, form, batch, tokens, hidden, device="cpu", seed=seed)


def wrt(site):
    return set(ACTIVATIONS[site]) | {"modulation"}


def exact_gradients(site, form, t, names):
    return gradients(family_exact_site(site, form), in_fp64(t), names)


@site_forms()
def test_gradcheck_in_fp64(site, form):
    """``torch.autograd.gradcheck`` of the fused op in fp64 (nothing rounds): every differentiable input,
    the rows as the model chunks them from its projection."""
    t = in_fp64(inputs(site, form, 2, 3, 8))
    names = sorted(wrt(site))
    fused = family_fused_site(site, form, "bf16")

    def fn(*tensors):
        return fused(**(t | dict(zip(names, tensors))))

    assert torch.autograd.gradcheck(fn, tuple(t[k].requires_grad_() for k in names))


@site_forms()
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_every_gradient_is_as_close_to_fp64_as_eagers(site, policy, form):
    """Against the fp64 gradient of the model's spelling in fp64: each of ours within eager's mean error."""
    t = inputs(site, form)
    exact = exact_gradients(site, form, t, wrt(site))
    got = gradients(family_fused_site(site, form, policy), t, wrt(site))
    ref = gradients(family_eager_site(site, form), t, wrt(site))
    for name in wrt(site):
        ours, eagers = ((g[name].double() - exact[name]).abs().mean().item() for g in (got, ref))
        assert ours <= eagers * 1.01 + 1e-12, (name, ours, eagers)


@site_forms(lambda form: form.norm == "rms")
def test_bf16_activation_gradients_of_rms_norms_are_eagers_but_where_a_row_sum_enters(site, form):
    """Eager's CPU autograd of ``F.rms_norm`` rounds where the reference does: the activation gradients are its
    bits but for rare last-place flips where the order of a row's fp32 sums enters (``contract.Rounding``); of a
    norm modulated twice too, whose output's two gradients eager adds in bf16.
    (A LayerNorm's native CPU backward, and diffusers' ``RMSNorm``, whose eager backward rounds the gradients of
    its two uses of ``x`` apart and adds them in bf16, are held to eager's error against fp64, above.)"""
    t = inputs(site, form)
    got = gradients(family_fused_site(site, form, "bf16"), t, wrt(site))
    ref = gradients(family_eager_site(site, form), t, wrt(site))
    for name in ACTIVATIONS[site]:
        assert (got[name] != ref[name]).float().mean() <= 1e-3, name
        torch.testing.assert_close(got[name], ref[name], atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("form", [FamilyForm("layer", "per_sample"), FamilyForm("layer", "per_sample", True),
                                  FamilyForm("rms", "one_for_all")], ids=str)
@pytest.mark.parametrize("tokens", [256, 4000])
def test_row_gradients_summed_over_thousands_of_tokens_are_rounded_once(site, form, tokens):
    """Hundreds to thousands of tokens into one row per sample (or one for all): the shift rows' gradient, the sum
    of ``dy``, is within half a place of its dtype of the fp64 sum at every size; the rows' gradients are as
    close to the fp64 ones as eager's (eager's CPU sum over a broadcast dim is fp32 too, rounded once: the two
    differ where one rounds a tie the other way, hence the margin)."""
    t = inputs(site, form, batch=2, tokens=tokens, hidden=128)
    exact = exact_gradients(site, form, t, {"modulation"})["modulation"]
    got = gradients(family_fused_site(site, form, "bf16"), t, {"modulation"})["modulation"].double()
    ref = gradients(family_eager_site(site, form), t, {"modulation"})["modulation"].double()
    if site != "C":
        shift, exact_shift = got.chunk(6, -1)[0], exact.chunk(6, -1)[0]
        half_place = torch.finfo(t["modulation"].dtype).eps / 2
        assert ((shift - exact_shift).abs() <= exact_shift.abs() * half_place * 1.001).all()
    used = exact != 0  # the chunks the site reads
    assert (got - exact)[used].abs().mean() <= (ref - exact)[used].abs().mean() * 1.05


@pytest.mark.parametrize("form", [FamilyForm("layer", "per_sample"), FamilyForm("rms", "chosen")], ids=str)
def test_gradients_are_the_same_bits_on_every_run(form):
    t = inputs("B", form, tokens=300)
    first, second = (gradients(family_fused_site("B", form, "bf16"), t, wrt("B")) for _ in range(2))
    assert all(torch.equal(first[k], second[k]) for k in wrt("B"))


def test_rows_of_different_shapes_are_refused_by_the_backward_naming_them():
    """A gate per sample beside shift and scale per token: the backward takes one index for all three."""
    t = inputs("B", FamilyForm("layer", "per_token"), tokens=5)
    shift, scale, gate = (r.detach().requires_grad_() for r in t["modulation"].chunk(6, -1)[:3])
    gate = gate[:, :1]
    u, y = torch.ops.h3_fused.gate_norm_modulate(t["residual"], gate, t["branch"], None, shift, scale, None,
                                                 eps=1e-6, policy="bf16", norm="layer")
    with pytest.raises(NotImplementedError, match=r"different shapes \(gate \[2, 1\], shift \[2, 5\]"):
        y.float().sum().backward()
