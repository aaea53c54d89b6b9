"""examples/diffusers_h3.py runs as the README says, and says what it promises."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "diffusers_h3.py"


@pytest.mark.parametrize("mode", [[], ["--regional"]], ids=["whole", "regional"])
def test_the_diffusers_example_samples_with_the_sites_fused_and_bf16_equal_to_eager(mode):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "2", *mode], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    fused = re.search(r"fused (\{.*\})", out.stdout).group(1)
    assert "'gate_norm_modulate'" in fused and "refused" not in fused, out.stdout
    assert re.findall(r"(video|audio): 100\.000% bit-identical", out.stdout) == ["video", "audio"], out.stdout
