"""One launch of each site's fused kernel and of the hand-fused baseline (T = 15,808 by default), for ``ncu``.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k 'regex:modulation_kernel|one_row_kernel' python benchmarks/ncu_sites.py [--tokens T] [--sites A B C] \
        [--index uniform runs] [--policies bf16 fp32]

``--index``: the index layouts to launch, one after the other (``testing.make_inputs``); ``--policies``: the
fused kernel under each policy, one after the other (default ``bf16``), then the baseline once.
"""

import argparse

import torch
from h3_fused.kernels.testing import INDEX_LAYOUTS, SITES, fused_site, make_inputs
from hand_fused import hand_fused_site

parser = argparse.ArgumentParser()
parser.add_argument("--tokens", type=int, default=15808)
parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
parser.add_argument("--index", nargs="+", default=["uniform"], choices=INDEX_LAYOUTS)
parser.add_argument("--policies", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
args = parser.parse_args()
for site in args.sites:
    for layout in args.index:
        inputs = make_inputs(site, args.tokens, index_layout=layout)
        for policy in args.policies:
            fused_site(site, policy)(**inputs)
        hand_fused_site(site)(**inputs)
torch.cuda.synchronize()
print("profile: all launches done")
