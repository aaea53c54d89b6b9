"""diffusers' DiT family, unmodified, tiny configs on the CPU (``examples/dit_family.py``): every modulation site
fuses, whole-model and by repeated blocks, nothing is refused, and the output is what eager computes.

The counts per op follow from each model's blocks (tiny configs: ``dit_family.MODELS``). Whole model: a block's
gated residual merges with the next block's first modulated norm where nothing sits between them (Flux, HunyuanVideo
and SD3's double-stream blocks, Wan's last residual and ``norm_out``); Wan and LTX-Video keep an ungated
cross-attention between a gated residual and the next norm, so there the residual is a site of its own (C).
By blocks: one compiled graph per block class (and per signature), whose sites are counted once.
"""

import pytest
from dit_family import MODELS, compare
from helpers import inductor_matches_eager_on_cpu

WHOLE = {  # site A, site B, site C
    "flux": (4, 2, 3),  # double block: 2 A, 2 B, 2 C; single block: A, C; norm_out: A
    "wan": (3, 2, 2),  # 2 blocks x (A norm1, C, A norm3, C); C + the next A -> B (block 1's norm1, norm_out)
    "wan_ti2v": (3, 2, 2),  # the same, the rows per token
    "hunyuan_video": (4, 2, 5),  # as Flux, plus the token refiner's 2 gate-only residuals
    "qwen_image": (7, 1, 5),  # 2 blocks x 2 streams; the residual is used before the next rows are computed
    "ltx_video": (4, 1, 3),  # 2 blocks x (A, C, [cross-attention], A, C); the last C + norm_out's A -> B
    "sd3": (2, 6, 0),  # 2 joint blocks (the last, context_pre_only, modulates the context once)
}
REGIONAL = {
    "flux": (3, 2, 3),
    "wan": (2, 0, 2),
    "wan_ti2v": (2, 0, 2),
    "hunyuan_video": (4, 1, 6),
    "qwen_image": (4, 0, 4),
    "ltx_video": (2, 0, 2),
    "sd3": (4, 3, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["whole", "regional"])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_site_fuses_and_bf16_computes_what_eager_computes(name, mode):
    r = compare(name, "cpu", real=False, policy="bf16", regional=mode == "regional")
    expected = (WHOLE if mode == "whole" else REGIONAL)[name]
    assert tuple(r["sites"].values()) == expected, r
    assert r["refused"] == 0, r["reasons"]
    if inductor_matches_eager_on_cpu():
        assert r["equal"], r
    else:
        assert r["max_diff"] <= 0.05, r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan"])
def test_the_fp32_policy_fuses_the_same_sites_within_its_bound(name):
    r = compare(name, "cpu", real=False, policy="fp32", regional=False)
    assert tuple(r["sites"].values()) == WHOLE[name] and r["refused"] == 0
    assert r["max_diff"] <= 0.05, r

