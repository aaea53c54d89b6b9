"""The fused ops' backward on the CPU (the pure-torch reference): the contract against fp64 and eager's autograd.

Eager's backward of the unfused bf16 graph rounds the activation gradients where ``contract.Rounding`` says,
so under ``bf16`` ours are bit-identical to it here; it sums the table gradients in bf16, ours in fp32, rounded
once: closer to fp64.
"""

import pytest
import torch
from h3_fused.kernels import modulation_backward
from h3_fused.kernels.testing import eager_site, fused_site, make_inputs, site_tensors
from helpers import gradients, in_fp64

bf16, f64 = torch.bfloat16, torch.float64
SITE_INPUTS = {"A": ("x", "weight", "shift", "scale", "index"),
               "B": ("residual", "gate", "branch", "weight", "shift", "scale", "index"),
               "C": ("residual", "gate", "branch", "index")}


def fused(site, policy="bf16", native=False, upcast=False):
    return fused_site(site, policy, norm_rounds_before_weight=native, upcast_tables=upcast) if site != "C" else \
        fused_site(site, policy, upcast_tables=upcast)


def eager(site, native=False, upcast=False):
    return eager_site(site, native, upcast)


def inputs(site, tokens, hidden, table_rows=6, dtype=bf16):
    return make_inputs(site, tokens, hidden, table_rows, device="cpu", dtype=dtype)


def float_grads(site):
    return set(SITE_INPUTS[site]) - {"index"}


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("native", [False, True])
def test_gradcheck_in_fp64(site, native):
    """``torch.autograd.gradcheck``: the backward's formulas against finite differences, every input."""
    t = inputs(site, 5, 8, 3, dtype=f64)
    names = SITE_INPUTS[site]
    args = tuple(t[k].requires_grad_(k != "index") for k in names)
    assert torch.autograd.gradcheck(lambda *a: fused(site, native=native)(**dict(zip(names, a)), eps=t.get("eps")),
                                    args)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("upcast", [False, True])
def test_bf16_activation_gradients_are_eagers_bit_for_bit(site, native, upcast):
    t = inputs(site, 37, 96)
    wrt = float_grads(site)
    got, ref = gradients(fused(site, "bf16", native, upcast), t, wrt), gradients(eager(site, native, upcast), t, wrt)
    for name in ("x", "residual", "branch") + (("weight",) if not native and site != "C" else ()):
        if name in wrt:
            assert torch.equal(got[name], ref[name]), name


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("native", [False, True])
def test_every_gradient_is_as_close_to_fp64_as_eagers(site, policy, native):
    """Against the fp64 gradient of the fp64 graph: each of ours within eager's mean error (the tables' and the
    native weight's well inside it: summed in fp32, rounded once)."""
    t = inputs(site, 300, 64, 6)
    wrt = float_grads(site)
    exact = gradients(eager(site, native), in_fp64(t), wrt)
    got, ref = gradients(fused(site, policy, native), t, wrt), gradients(eager(site, native), t, wrt)
    for name in wrt:
        ours, eagers = ((g[name].double() - exact[name]).abs().mean().item() for g in (got, ref))
        assert ours <= eagers * 1.01 + 1e-12, (name, ours, eagers)


@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_table_gradients_are_summed_in_fp32_and_rounded_once(site):
    """Many rows into few table rows: ``dshift``, the sum of ``dy``, is its fp64 sum rounded to bf16 (within the
    rounding's half place and fp32's error); every table gradient is closer to fp64 than eager's bf16 sum."""
    t = inputs(site, 4000, 32, 3)
    wrt = float_grads(site)
    exact = gradients(eager(site), in_fp64(t), wrt)
    got, ref = gradients(fused(site), t, wrt), gradients(eager(site), t, wrt)
    if "shift" in wrt:
        assert ((got["shift"].double() - exact["shift"]).abs() <= exact["shift"].abs() * 2 ** -8 * 1.001).all()
    for name in {"gate", "shift", "scale"} & wrt:
        assert (got[name].double() - exact[name]).abs().mean() < (ref[name].double() - exact[name]).abs().mean()


@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_gradients_are_the_same_bits_on_every_run(site):
    t = inputs(site, 500, 64)
    wrt = float_grads(site)
    first, second = gradients(fused(site), t, wrt), gradients(fused(site), t, wrt)
    assert all(torch.equal(first[k], second[k]) for k in wrt)


def test_only_the_gradients_asked_for_are_computed():
    """LoRA-like: frozen tables and weight; ``modulation_backward`` returns empty tensors for what is not asked."""
    t = inputs("B", 9, 64)
    grads = gradients(fused("B"), t, {"residual", "branch"})
    assert set(grads) == {"residual", "branch"} and all(g is not None for g in grads.values())
    t = site_tensors(tokens=9, hidden=64)
    dy = torch.randn(9, 64).to(bf16)
    out = modulation_backward(t["x"], None, None, t["weight"], t["shift"], t["scale"], t["index"], dy, None,
                              eps=1e-5, policy="bf16", norm_rounds_before_weight=False, upcast_tables=False,
                              needs=[True, False, False, False, False, True])
    assert [o.numel() > 0 for o in out] == [True, False, False, False, False, True]
    assert out[0].shape == t["x"].shape and out[5].shape == t["scale"].shape


def test_double_backward_is_refused_clearly():
    t = inputs("A", 4, 64)
    x = t["x"].clone().requires_grad_()
    y = fused("A")(**dict(t, x=x))
    (grad,) = torch.autograd.grad(y.float().sum(), x, create_graph=False)
    assert grad.shape == x.shape
    y = fused("A")(**dict(t, x=x))
    with pytest.raises(NotImplementedError, match="double backward"):
        torch.autograd.grad(y.float().sum(), x, create_graph=True)


def test_an_incoming_gradient_of_another_shape_is_refused_naming_it():
    t = site_tensors(tokens=4, hidden=64)
    with pytest.raises(ValueError, match=r"dy must have the shape of y \(4, 64\), got \(3, 64\)"):
        modulation_backward(t["x"], None, None, t["weight"], t["shift"], t["scale"], t["index"],
                            torch.zeros(3, 64, dtype=bf16), None, eps=1e-5, policy="bf16",
                            norm_rounds_before_weight=False, upcast_tables=False, needs=[True] * 6)


@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_opcheck_with_autograd(site):
    """``torch.library.opcheck``: schema, fake tensors, the autograd registration and AOT dispatch (with the
    backward) of the forward op, and the backward op itself."""
    t = site_tensors(tokens=9, hidden=64)
    t["residual"] = t["x"]
    op = {"A": torch.ops.h3_fused.norm_modulate, "B": torch.ops.h3_fused.gate_norm_modulate,
          "C": torch.ops.h3_fused.gate_residual}[site].default
    args = tuple(t[k].requires_grad_(k != "index") for k in SITE_INPUTS[site])
    kwargs = dict(policy="bf16") | (dict(eps=1e-5) if site != "C" else {})
    torch.library.opcheck(op, args, kwargs)
    dy = torch.randn(9, 64).to(bf16)
    backward_args = {"A": (t["x"], None, None, t["weight"], t["shift"], t["scale"], t["index"], dy, None),
                     "B": (t["x"], t["branch"], t["gate"], t["weight"], t["shift"], t["scale"], t["index"], dy, dy),
                     "C": (None, t["branch"], t["gate"], None, None, None, t["index"], None, dy)}[site]
    torch.library.opcheck(torch.ops.h3_fused.modulation_backward.default,
                          tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in backward_args),
                          dict(eps=1e-5, policy="bf16", norm_rounds_before_weight=False, upcast_tables=False,
                               needs=[True] * 6))
