"""``benchmarks/exactness.py`` on the CPU (tiny dims): the rows it writes, one per case, in the issue's schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "exactness.py"
KEYS = {"client", "kind", "hidden", "tokens", "blocks", "mode", "variant", "policy", "outputs_equal", "mismatch"}


@pytest.mark.slow
def test_exactness_writes_a_row_per_case_a_trajectory_row_and_a_block_row_per_variant(tmp_path):
    out = tmp_path / "exactness.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--clients", "stand-in", "--modes", "whole",
                          "--steps", "2", "--locate-depth", "1", "--out", str(out)],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    forward = [r for r in rows if r["kind"] == "forward"]
    assert {(r["mode"], r["variant"]) for r in forward} == {
        ("whole", variant) for variant in ("h3_fused_bf16", "inductor_epc")}
    for row in rows:
        assert set(row) >= KEYS
        assert row["outputs_equal"] == (row["mismatch"] == 0) and 0 <= row["mismatch"] <= 1
    trajectories = [r for r in rows if r["kind"] == "trajectory"]
    assert len(trajectories) == 2 and all(len(r["mismatch_per_step"]) == 2 for r in trajectories)
    modules = [(r["variant"], r["module"]) for r in rows if r["kind"] == "module"]
    assert {("h3_fused_bf16", "blocks.0"), ("inductor_epc", "blocks.0")} <= set(modules)


def test_locate_descends_only_into_modules_whose_compiled_outputs_differ():
    """A stand-in "compiler" that changes one norm's output: the rows name the block, the attention holding the
    norm and the norm as differing, the attention's projection and the feed-forward as equal, and nothing
    below a module that matches."""
    import torch
    from exactness import first_calls, locate

    torch.manual_seed(0)
    block = torch.nn.ModuleDict(dict(attn=torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)),
                                     ff=torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())))
    block.forward = lambda x: block["ff"](block["attn"](x))
    changed = block["attn"][1]

    def compile_module(module):
        def run(*args, **kwargs):
            hooks = [changed.register_forward_hook(lambda m, a, out: out + 1)] if changed in set(module.modules()) else []
            try:
                return module(*args, **kwargs)
            finally:
                for hook in hooks:
                    hook.remove()
        return run

    x = torch.randn(4, 8)
    calls = first_calls(block, lambda m: m(x), block)
    rows = {row["module"]: row["outputs_equal"] for row in locate(block, "block", calls, compile_module, depth=3)}
    assert rows == {"block": False, "block.attn": False, "block.attn.0": True, "block.attn.1": False,
                    "block.ff": True}
