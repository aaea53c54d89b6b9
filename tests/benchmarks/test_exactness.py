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
def test_exactness_writes_a_row_per_case_and_a_trajectory_row_per_variant(tmp_path):
    out = tmp_path / "exactness.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--clients", "stand-in", "--modes", "regional", "whole",
                          "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    forward = [r for r in rows if r["kind"] == "forward"]
    assert {(r["mode"], r["variant"]) for r in forward} == {
        (mode, variant) for mode in ("regional", "whole") for variant in ("h3_fused_bf16", "inductor_epc")}
    for row in rows:
        assert set(row) >= KEYS
        assert row["outputs_equal"] == (row["mismatch"] == 0) and 0 <= row["mismatch"] <= 1
    trajectories = [r for r in rows if r["kind"] == "trajectory"]
    assert len(trajectories) == 2 and all(len(r["mismatch_per_step"]) == 2 for r in trajectories)
