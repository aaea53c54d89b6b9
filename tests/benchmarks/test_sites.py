"""``benchmarks/sites.py``'s side-by-side launches and the hand-fused baseline, on small CPU tensors under
Triton's interpreter (``TRITON_INTERPRET=1 pytest -m interpreted``)."""

from __future__ import annotations

import pytest
import torch
from hand_fused import hand_fused_site
from sites import calls_agree, eager_site, kernel_launch, make_inputs

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
