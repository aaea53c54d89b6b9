"""One launch of each site's ``bf16`` kernel and of the hand-fused baseline at T = 15,808, for ``ncu``.

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k 'regex:modulation_kernel|one_row_kernel' python benchmarks/profile_sites.py
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from hand_fused import hand_fused_site  # noqa: E402
from sites import SITES, fused_site, make_inputs  # noqa: E402

for site in SITES:
    inputs = make_inputs(site, 15808)
    fused_site(site, "bf16")(**inputs)
    hand_fused_site(site)(**inputs)
torch.cuda.synchronize()
print("profile: all launches done")
