"""``benchmarks/harness.py``'s side-by-side launches and the hand-fused baseline, on small CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1 pytest -m interpreted``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from h3_fused.kernels.testing import eager_site, kernel_launch, make_inputs
from hand_fused import hand_fused_site
from harness import calls_agree

pytestmark = pytest.mark.interpreted


def test_calls_timed_side_by_side_share_outputs_and_agree_only_on_equal_values():
    inputs = make_inputs("B", 7, 64, device="cpu")
    first = kernel_launch("B", inputs, "bf16")
    same = kernel_launch("B", inputs, "bf16", outputs=first.outputs)
    assert all(a is b for a, b in zip(first.outputs, same.outputs)), "a call given outputs allocates none"
    assert calls_agree([first, same], first.outputs)
    assert not torch.isnan(first.outputs[1]).any(), "the last call's values are left in the outputs"
    other_rows = kernel_launch("B", dict(inputs, index=(inputs["index"] + 1) % 6), "bf16", outputs=first.outputs)
    assert not calls_agree([first, other_rows], first.outputs), "other table rows, other outputs"
    assert not calls_agree([first, lambda: None], first.outputs), "a call that writes nothing does not agree"
    only_u = kernel_launch("C", dict(residual=inputs["residual"], gate=inputs["gate"], branch=inputs["branch"],
                                     index=inputs["index"]), "bf16")
    assert only_u.outputs[1] is None and calls_agree([only_u, only_u], only_u.outputs)


@pytest.mark.parametrize("site", ["A", "B", "C"])
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_the_hand_fused_baseline_computes_each_site_under_both_policies(site, policy):
    inputs = make_inputs(site, 7, 96, device="cpu")
    expected = eager_site(site)(**inputs)
    got = hand_fused_site(site, policy)(**inputs)
    for g, e in zip(*((got, expected) if site == "B" else ((got,), (expected,)))):
        # within two bf16 places of eager (the interpreter truncates its conversions to bf16)
        torch.testing.assert_close(g.float(), e.float(), rtol=2 ** -6, atol=2 ** -6 * e.abs().max().item())


def test_the_hand_fused_baseline_refuses_other_policies():
    with pytest.raises(ValueError, match="policy"):
        hand_fused_site("A", "auto")


@pytest.mark.parametrize("native", [False, True], ids=["nn_rms_norm", "native"])
def test_a_free_sum_order_launch_keeps_the_policy_but_adds_the_squares_in_the_kernels_order(native, monkeypatch):
    from h3_fused.kernels import launch as launch_module
    from h3_fused.kernels.contract import SumOrder

    launched = []
    real_launch = launch_module.launch_modulation
    monkeypatch.setattr(launch_module, "launch_modulation",
                        lambda a, *rest: launched.append(a) or real_launch(a, *rest))
    inputs = dict(make_inputs("A", 20, 128, device="cpu"), norm_rounds_before_weight=native)
    eager_order, free_order = (kernel_launch("A", inputs, "bf16", free_sum_order=free) for free in (False, True))
    eager_order(), free_order()
    assert [a.rounding.norm_sum_order for a in launched] == [SumOrder.MEAN if native else SumOrder.FUSED_RMS_NORM,
                                                             SumOrder.OWN]
    assert dataclasses.replace(launched[1].rounding, norm_sum_order=launched[0].rounding.norm_sum_order) == \
        launched[0].rounding, "the policy's other roundings are kept"
    # the same values but for the last place the sum's order moves
    torch.testing.assert_close(free_order.outputs[1].float(), eager_order.outputs[1].float(), rtol=2 ** -7, atol=0)
