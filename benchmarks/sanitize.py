"""Edge-size launches of every kernel configuration, for ``compute-sanitizer`` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python benchmarks/sanitize.py

Each launch runs six times: with the configuration ``launch_config`` picks for its few rows, for
``FEW_ROWS`` rows, and for many rows (or a symbolic count), so that the 8-warp and 4-warp builds of
sites A and B, and site A's builds that load its table rows ahead and that load them just before their
use, are all checked at the edge sizes; and each once more warming the coming table rows one row ahead
(``prefetch_ahead``; the shipped 1,024 rows ahead never reach past these sizes), so that those reads
are checked too, up to the last row; there site B also runs with its gate table in fp32 and its other
tables in bf16 (the warming reads the gate row with a load of its own, lines of its own width).
"""

import dataclasses
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from h3_fused.kernels.triton_modulation import FEW_ROWS  # noqa: E402
from h3_fused.kernels.triton_modulation import launch_config as shipped  # noqa: E402
from sites import fused_site, launch_config_answering, make_inputs  # noqa: E402


def picked_for(count):
    """The configuration ``launch_config`` picks for ``count`` rows (None: many rows, or a symbolic count),
    whatever the launch's own row count."""
    return lambda hidden, has_gate, has_norm, rows: shipped(hidden, has_gate, has_norm, count)


def warming_next_row(choose):
    """``choose``'s configuration, warming the table rows of the next row."""
    return lambda hidden, has_gate, has_norm, rows: dataclasses.replace(choose(hidden, has_gate, has_norm, rows),
                                                                    prefetch_ahead=1)


for base in (shipped, picked_for(FEW_ROWS), picked_for(None)):
    for choose, gate_dtypes in ((base, (None,)), (warming_next_row(base), (None, torch.float32))):
        with launch_config_answering(choose):
            for hidden, tokens, site, policy in itertools.product((1, 31, 64, 101, 200, 5376), (1, 3, 257), "ABC",
                                                                  ("bf16", "fp32")):
                for gate_dtype in gate_dtypes if site == "B" else (None,):
                    inputs = make_inputs(site, tokens, hidden, table_rows=3, seed=tokens)
                    inputs["index"][-1] = 2  # the last row reads the last table row
                    if gate_dtype is not None:
                        inputs["gate"] = inputs["gate"].to(gate_dtype)
                    fused_site(site, policy)(**inputs)
torch.cuda.synchronize()
print("sanitize: all launches done")
