"""``benchmarks/sites.py``'s side-by-side launches: calls that share one set of outputs, and the check that
they leave the same values in them (under the Triton interpreter, on small CPU tensors)."""

from __future__ import annotations

import os

from helpers import run_interpreted

SHARED_OUTPUTS = r"""
import sys
import torch
sys.path.insert(0, BENCHMARKS)
from sites import calls_agree, kernel_launch, make_inputs

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
print("shared outputs OK")
""".replace("BENCHMARKS", repr(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")))


def test_calls_timed_side_by_side_share_outputs_and_agree_only_on_equal_values():
    assert "shared outputs OK" in run_interpreted(SHARED_OUTPUTS)


HAND_FUSED = r"""
import sys
import torch
sys.path.insert(0, BENCHMARKS)
from hand_fused import hand_fused_site
from sites import eager_site, make_inputs

for site in "ABC":
    inputs = make_inputs(site, 7, 96, device="cpu")
    expected = eager_site(site)(**inputs)
    for policy in ("fp32", "bf16"):
        got = hand_fused_site(site, policy)(**inputs)
        for g, e in zip(*((got, expected) if site == "B" else ((got,), (expected,)))):
            # within two bf16 places of eager (the interpreter truncates its conversions to bf16)
            torch.testing.assert_close(g.float(), e.float(), rtol=2 ** -6, atol=2 ** -6 * e.abs().max().item())
try:
    hand_fused_site("A", "auto")
except ValueError as e:
    assert "policy" in str(e)
else:
    raise AssertionError("an unknown policy must be refused")
print("hand fused OK")
""".replace("BENCHMARKS", repr(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")))


def test_the_hand_fused_baseline_computes_each_site_under_both_policies_and_refuses_others():
    assert "hand fused OK" in run_interpreted(HAND_FUSED)
