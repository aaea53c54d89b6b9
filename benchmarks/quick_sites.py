"""Quick timing of the bare ``bf16`` fused op per site and T (device time under CUDA graphs after an L2
flush, share of the copy bandwidth measured in the same run). For a first look after a kernel change;
``bench_ops.py`` is the side-by-side benchmark.

    python benchmarks/quick_sites.py
"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, TOKENS, copy_bandwidth, graph_ms  # noqa: E402
from sites import SITES, fused_site, make_inputs, minimal_bytes  # noqa: E402

roof = copy_bandwidth()
for site in SITES:
    for tokens in TOKENS:
        inputs, fn = make_inputs(site, tokens, HIDDEN), fused_site(site, "bf16")
        ms = graph_ms(lambda fn=fn, inputs=inputs: fn(**inputs))
        share = minimal_bytes(site, tokens, HIDDEN) / ms / 1e6 / roof
        print(f"{site} {tokens} {ms * 1e3:.1f} us {100 * share:.1f}%", flush=True)
