"""Bad input to the fused ops and the backend: a clear error naming the argument, or a result equal to eager.

Every case runs on the CPU (the reference path; the same argument checks run before the kernel on CUDA) and,
marked ``gpu``, on CUDA. An out-of-range index on CUDA fails a device-side assertion, which leaves the CUDA
context unusable: that case runs in a process of its own (``test_ops_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
from h3_fused.kernels import gate_norm_modulate, norm_modulate
from h3_fused.kernels.testing import eager_site, fused_site, make_inputs

bf16 = torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def inputs(device, site="B", tokens=8, hidden=64, **over):
    t = make_inputs(site, tokens, hidden, device=device)
    t.update({k: v(device) if callable(v) else v for k, v in over.items()})
    return t


REFUSED = {  # name: (site, overrides (a callable takes the device), error, message)
    "index out of range": ("A", dict(index=lambda d: torch.tensor([0, 1, 2, 6, 0, 1, 2, 3], device=d)), IndexError,
                           r"index\[3\] = 6 is not in \[0, 6\)"),
    "negative index": ("A", dict(index=lambda d: torch.tensor([-1, 1, 2, 3, 0, 1, 2, 3], device=d)), IndexError,
                       r"index\[0\] = -1 is not in \[0, 6\)"),
    "index of another shape": ("A", dict(index=lambda d: torch.zeros(7, dtype=torch.long, device=d)), ValueError,
                               r"index must have the shape of the activations without the last dim \(8,\)"),
    "float index": ("A", dict(index=lambda d: torch.zeros(8, device=d)), TypeError, "index must have dtype"),
    "branch of another shape": ("C", dict(branch=lambda d: torch.zeros(4, 64, dtype=bf16, device=d)), ValueError,
                                r"branch must have the shape of residual \(8, 64\)"),
    "branch of another dtype": ("C", dict(branch=lambda d: torch.zeros(8, 64, device=d)), TypeError,
                                "branch must have the dtype of residual"),
    "table of another width": ("A", dict(shift=lambda d: torch.zeros(6, 32, dtype=bf16, device=d)), ValueError,
                               r"shift must be a \[K, H=64\] table"),
    "tables of different rows": ("B", dict(gate=lambda d: torch.zeros(7, 64, dtype=bf16, device=d)), ValueError,
                                 r"the tables must have the same rows K, got gate 7, shift 6, scale 6"),
    "copies of the shift table alone": ("A", dict(shift=lambda d: torch.zeros(2, 6, 64, dtype=bf16, device=d)),
                                        ValueError, r"shift and scale must both have 2 dims or both one more"),
    "copies of tables of another width": ("A", dict(shift=lambda d: torch.zeros(2, 6, 32, dtype=bf16, device=d),
                                                    scale=lambda d: torch.zeros(2, 6, 32, dtype=bf16, device=d)),
                                          ValueError, r"shift must be \[M=2, K, H=64\] tables"),
    "weight of another size": ("A", dict(weight=lambda d: torch.ones(32, dtype=bf16, device=d)), ValueError,
                               r"weight must have shape \[H=64\]"),
    "weight of another low precision": ("A", dict(x=lambda d: torch.randn(8, 64, device=d).half()), TypeError,
                                        "weight must have the dtype of x"),
    "tables on the meta device": ("A", dict(scale=lambda d: torch.zeros(6, 64, dtype=bf16, device="meta")),
                                  ValueError, "scale is on meta but x is on"),
    "int activations": ("A", dict(x=lambda d: torch.zeros(8, 64, dtype=torch.int32, device=d)), TypeError,
                        "x must have dtype"),
    "negative eps": ("A", dict(eps=-1.0), ValueError, "eps must be a non-negative float"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(REFUSED))
def test_bad_input_is_refused_with_the_argument_named(name, device):
    site, over, error, message = REFUSED[name]
    if device == "cuda" and error is IndexError:
        pytest.skip("a device-side assertion: tests/kernels/test_ops_gpu.py runs it in a process of its own")
    with pytest.raises(error, match=message):
        fused_site(site, "bf16")(**inputs(device, site, **over))


def given(device, x_shape=(2, 8, 64), **rows):
    """Site B's arguments with modulation rows given without an index: ``[B, 1, H]`` rows unless ``rows`` says."""
    g = torch.Generator(device=device).manual_seed(0)
    residual, branch = (torch.randn(*x_shape, generator=g, device=device).to(bf16) for _ in range(2))
    shape = (x_shape[0], 1, x_shape[-1])
    t = {k: torch.randn(rows.get(k, shape), generator=g, device=device).to(bf16) for k in ("gate", "shift", "scale")}
    return dict(residual=residual, branch=branch, weight=None, index=None, **t)


GIVEN_REFUSED = {  # name: (rows' shapes and dtypes, error, message)
    "rows of another width": (dict(shift=(2, 1, 32)), ValueError, r"shift must be rows of H=64 that broadcast"),
    "rows of another sample count": (dict(scale=(3, 1, 64)), ValueError, r"scale must be rows of H=64"),
    "rows per token of another token count": (dict(gate=(2, 5, 64)), ValueError, r"gate must be rows of H=64"),
    "rows of two more dims than the activations": (dict(shift=(1, 1, 2, 1, 64), scale=(1, 1, 2, 1, 64)), ValueError,
                                                   r"shift must be rows of H=64"),
    "copies of shift alone": (dict(shift=(1, 2, 1, 64)), ValueError, r"shift and scale must both have"),
    "copies of different counts": (dict(shift=(2, 2, 1, 64), scale=(3, 2, 1, 64)), ValueError,
                                   r"shift and scale must both have"),
    "copies of the gate": (dict(gate=(2, 2, 1, 64)), ValueError, r"gate must be rows of H=64"),
    "a scalar row": (dict(scale=()), ValueError, r"scale must be rows of H=64"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(GIVEN_REFUSED))
def test_bad_given_rows_are_refused_with_the_argument_named(name, device):
    shapes, error, message = GIVEN_REFUSED[name]
    t = given(device, **shapes)
    with pytest.raises(error, match=message):
        gate_norm_modulate(t["residual"], t["gate"], t["branch"], None, t["shift"], t["scale"], None, policy="bf16",
                           norm="layer")


BIASES_REFUSED = {  # name: (biases by row name, with an index, error, message)
    "a bias of another width": (dict(gate=32, shift=64, scale=64), False, ValueError,
                                r"gate_bias must have shape \[H=64\], got \(32,\)"),
    "a bias for some rows only": (dict(shift=64, scale=64), False, ValueError,
                                  "every modulation row takes a bias or none: got shift_bias, scale_bias"),
    "biases with an index": (dict(gate=64, shift=64, scale=64), True, ValueError,
                             "row biases .* add to rows given without an index"),
    "an integer bias": (dict(gate=64, shift=64, scale=torch.int32), False, TypeError, "scale_bias must have dtype"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(BIASES_REFUSED))
def test_bad_row_biases_are_refused_with_the_argument_named(name, device):
    biases, gathered, error, message = BIASES_REFUSED[name]
    t = given(device, gate=(2, 8, 64), shift=(2, 8, 64), scale=(2, 8, 64))
    made = {f"{k}_bias": torch.zeros(64, dtype=v, device=device) if isinstance(v, torch.dtype) else
            torch.zeros(v, dtype=bf16, device=device) for k, v in biases.items()}
    index = None
    if gathered:
        t.update({k: t[k][0] for k in ("gate", "shift", "scale")})  # [8, 64] tables
        index = torch.zeros(2, 8, dtype=torch.long, device=device)
    with pytest.raises(error, match=message):
        gate_norm_modulate(t["residual"], t["gate"], t["branch"], None, t["shift"], t["scale"], index, policy="bf16",
                           **made)


@pytest.mark.parametrize("device", DEVICES)
def test_given_rows_of_two_dtypes_and_an_unknown_norm_are_refused(device):
    t = given(device)
    with pytest.raises(TypeError, match="shift and scale must share a dtype"):
        gate_norm_modulate(t["residual"], t["gate"], t["branch"], None, t["shift"].float(), t["scale"], None,
                           policy="bf16")
    with pytest.raises(ValueError, match=r"norm must be one of \('rms', 'layer'\), got 'group'"):
        gate_norm_modulate(t["residual"], t["gate"], t["branch"], None, t["shift"], t["scale"], None,
                           policy="bf16", norm="group")


def test_unknown_policy_is_refused():
    t = inputs("cpu", "A")
    with pytest.raises(ValueError, match=r"policy must be one of \('auto', 'bf16', 'fp32'\), got 'bf17'"):
        norm_modulate(t["x"], t["weight"], t["shift"], t["scale"], t["index"], policy="bf17")


def equal_to_eager(site, t):
    """What eager computes, under the ``bf16`` policy: bit for bit on the CPU; on CUDA the residual bit for bit and
    ``y`` up to the norm's fp32 sum order (a rare last-place flip)."""
    got, ref = fused_site(site, "bf16")(**t), eager_site(site)(**t)
    got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
    for i, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g.isnan(), r.isnan())
        g, r = torch.nan_to_num(g), torch.nan_to_num(r)
        is_y = site == "A" or (site == "B" and i == 1)
        if g.device.type == "cuda" and is_y and g.numel():
            assert (g != r).float().mean() <= 1e-5 + 1 / max(1, g.numel())
        else:
            assert torch.equal(g, r)


def with_nan_and_inf(device):
    x = make_inputs("A", 8, 64, device=device)["x"].clone()
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -float("inf")
    return x


ACCEPTED = {  # name: (site, overrides): computed as eager computes them
    "empty input (T = 0)": ("B", dict(tokens=0)),
    "one row": ("B", dict(tokens=1)),
    "NaN / +Inf / -Inf in the activations": ("A", dict(x=with_nan_and_inf)),
    "row-strided view": ("A", dict(x=lambda d: torch.randn(8, 200, device=d).to(bf16)[:, 8:72])),
    "storage-offset view": ("A", dict(x=lambda d: torch.randn(9, 64, device=d).to(bf16)[1:])),
    "T = 70,000 rows (> 65,535)": ("B", dict(tokens=70000)),
    "non-power-of-two H = 200": ("B", dict(hidden=200)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ACCEPTED))
def test_unusual_but_valid_input_computes_what_eager_computes(name, device):
    site, over = ACCEPTED[name]
    shape = {k: over.pop(k) for k in ("tokens", "hidden") if k in over}
    equal_to_eager(site, inputs(device, site, **shape, **over))


@pytest.mark.usefixtures("fresh_compile")
def test_a_site_the_pass_cannot_handle_compiles_unfused():
    """An fp64 site: no fused op exists for it, so it compiles and runs as Inductor compiles it."""
    t = make_inputs("A", 8, 64, device="cpu", dtype=torch.float64)
    fn = eager_site("A")
    torch.testing.assert_close(torch.compile(fn, backend="h3_fused")(**t), fn(**t))
