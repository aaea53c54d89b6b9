"""``benchmarks/bench_host.py`` on the CPU: the ways it times there, and the results file it writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_host.py"


@pytest.mark.slow
def test_the_cpu_host_times_cover_every_site_and_way_against_the_reference_alone(tmp_path):
    out = tmp_path / "host_cpu.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "4", "--calls", "3",
                          "--rounds", "2", "--profile-lines", "3", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())
    assert all(r["device"].startswith("CPU") for r in results)
    assert {(r["site"], r["way"]) for r in results} == {
        (site, way) for site in "ABC" for way in ("public_op", "dispatched_op", "check_args", "reference")}
    assert all(r["us_per_call"] > 0 and r["tokens"] == 4 for r in results)
    refused = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--profile", "in_graph"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--profile: on cpu the ways are" in refused.stderr
