"""Edge-size launches of every kernel configuration, for ``compute-sanitizer`` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from sites import fused_site, make_inputs  # noqa: E402

for hidden in (64, 101, 200, 5376):
    for tokens in (1, 3, 257):
        for site in ("A", "B", "C"):
            for policy in ("bf16", "fp32"):
                inputs = make_inputs(site, tokens, hidden, table_rows=3, seed=tokens)
                inputs["index"][-1] = 2  # the last row reads the last table row
                fused_site(site, policy)(**inputs)
torch.cuda.synchronize()
print("sanitize: all launches done")
