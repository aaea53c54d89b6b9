"""Edge-size launches of every kernel configuration, for ``compute-sanitizer`` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py

Each launch runs twice: with the configuration ``launch_config`` picks for its few rows, and with the
one it picks for many rows (or a symbolic count), so that site A's 8-warp and 4-warp builds are both
checked at the edge sizes.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h3_fused.kernels import triton_modulation as tm  # noqa: E402
from sites import fused_site, make_inputs  # noqa: E402

choose = tm.launch_config
for as_if_many_rows in (False, True):
    tm.launch_config = (lambda hidden, has_gate, rows: choose(hidden, has_gate, None)) if as_if_many_rows else choose
    for hidden in (64, 101, 200, 5376):
        for tokens in (1, 3, 257):
            for site in ("A", "B", "C"):
                for policy in ("bf16", "fp32"):
                    inputs = make_inputs(site, tokens, hidden, table_rows=3, seed=tokens)
                    inputs["index"][-1] = 2  # the last row reads the last table row
                    fused_site(site, policy)(**inputs)
torch.cuda.synchronize()
print("sanitize: all launches done")
