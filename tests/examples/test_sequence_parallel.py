"""Ulysses sequence parallelism on 2 gloo ranks reproduces the single-process forward, eager and compiled."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "examples" / "sequence_parallel.py"


@pytest.mark.slow
def test_the_sequence_parallel_script_fuses_on_every_rank_and_matches_one_process(tmp_path):
    """examples/sequence_parallel.py as .ci/gpu runs it on two GPUs (there under both policies), here under
    torchrun on 2 gloo ranks under ``bf16`` (each run costs two fresh processes' compiles): each rank fuses the
    three sites of the block graph; the gathered output equals one process's, eager and compiled, bit for bit."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                          "--policy", "bf16", "--out", str(tmp_path / "sp.json")],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    results = json.loads((tmp_path / "sp.json").read_text())
    assert results["backend"] == "gloo" and results["ranks"] == 2
    for fused in results["fused_per_rank"]:
        assert fused == {"norm_modulate": 1, "gate_norm_modulate": 1, "gate_residual": 1}
    assert results["eager"]["equal"]
    assert results["compiled"]["ok"]  # under bf16: bit for bit
