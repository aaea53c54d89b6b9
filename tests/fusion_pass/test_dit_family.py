"""diffusers' DiT family, unmodified, tiny configs on the CPU (``examples/dit_family.py``): every modulation site
fuses, whole-model and by repeated blocks, nothing is refused, and the output is what eager computes.

The counts per op follow from each model's blocks (tiny configs: ``dit_family.MODELS``). Whole model: a block's
gated residual merges with the next block's first modulated norm where nothing sits between them (Flux, HunyuanVideo
and SD3's double-stream blocks, Wan's last residual and ``norm_out``); Wan and LTX-Video keep an ungated
cross-attention between a gated residual and the next norm, so there the residual is a site of its own (C).
By blocks: one compiled graph per block class (and per signature), whose sites are counted once.
"""

import warnings

import pytest
import torch
from dit_family import MODELS, compare
from h3_fused.kernels.testing import TABLE_PLUS_ROWS, FamilyForm, family_eager_site, family_inputs
from helpers import inductor_matches_eager_on_cpu, inductor_matches_eager_transcendentals_on_cpu
from torch._dynamo.utils import counters

WHOLE = {  # site A, site B, site C
    "flux": (4, 2, 3),  # double block: 2 A, 2 B, 2 C; single block: A, C; norm_out: A
    "wan": (3, 2, 2),  # 2 blocks x (A norm1, C, A norm3, C); C + the next A -> B (block 1's norm1, norm_out)
    "wan_ti2v": (3, 2, 2),  # the same, the rows per token
    "hunyuan_video": (4, 2, 5),  # as Flux, plus the token refiner's 2 gate-only residuals
    "qwen_image": (2, 6, 0),  # 2 blocks x 2 streams: each residual with the next norm (its rows' views moved up)
    "qwen_image_edit": (3, 5, 1),  # zero_cond_t: the image's rows chosen per token, norm_out's not: C and A apart
    "ltx_video": (4, 1, 3),  # 2 blocks x (A, C, [cross-attention], A, C); the last C + norm_out's A -> B
    "ltx_video_per_token": (3, 2, 2),  # the same, and block 0's last C + block 1's first A -> B (rows with biases)
    "sd3": (2, 6, 0),  # 2 joint blocks (the last, context_pre_only, modulates the context once)
    "sd3_5": (2, 6, 2),  # as SD3; each dual-attention block's norm modulated twice is one site (both outputs)
}
REGIONAL = {
    "flux": (3, 2, 3),
    "wan": (2, 0, 2),
    "wan_ti2v": (2, 0, 2),
    "hunyuan_video": (4, 1, 6),
    "qwen_image": (2, 2, 2),
    "qwen_image_edit": (2, 2, 2),
    "ltx_video": (2, 0, 2),
    "ltx_video_per_token": (2, 0, 2),
    "sd3": (4, 3, 3),
    "sd3_5": (4, 3, 5),
}


# Each model whole and by blocks under bf16, but where another model compiles the same classes the same way (CI's
# time): Qwen-Image and SD3 are Qwen-Image-Edit's and SD3.5's classes, whose configs run their modulation forms too
# (Qwen-Image-Edit's text stream has rows per sample; SD3.5's context stream the plain AdaLayerNormZero), and
# HunyuanVideo's whole graph joins its blocks and norm_out as Flux's does (its blocks by blocks here), and LTX-Video's
# blocks with rows per token run in its whole graph, and Wan's blocks run with its norms' statistics route (below)
# (every model both ways at real dims on the GPU: .ci/gpu's family stage)
LEFT_TO_OTHERS = {("qwen_image", "whole"), ("qwen_image", "regional"), ("sd3", "whole"), ("sd3", "regional"),
                  ("hunyuan_video", "whole"), ("ltx_video_per_token", "regional"), ("wan", "regional")}
BF16_CASES = [(name, mode) for name in MODELS for mode in ("whole", "regional") if (name, mode) not in LEFT_TO_OTHERS]


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", BF16_CASES, ids=[f"{n}-{m}" for n, m in BF16_CASES])
def test_every_site_fuses_and_bf16_computes_what_eager_computes(name, mode):
    r = compare(name, "cpu", real=False, policy="bf16", regional=mode == "regional")
    expected = (WHOLE if mode == "whole" else REGIONAL)[name]
    assert tuple(r["sites"].values()) == expected, r
    assert r["refused"] == 0, r["reasons"]
    # a whole graph also holds the timestep embedding's exp, sin and cos, Inductor's own code on the CPU
    if inductor_matches_eager_on_cpu() and (mode == "regional" or inductor_matches_eager_transcendentals_on_cpu()):
        assert r["equal"], r
    else:
        if mode == "whole" and inductor_matches_eager_on_cpu():
            warnings.warn("Inductor's exp, sin and cos differ from eager's on this CPU: a whole model is held to the "
                          "fp32 policy's bound", stacklevel=1)
        assert r["max_diff"] <= 0.05, r


@pytest.mark.slow
def test_the_norms_the_rotary_embedding_reads_keep_only_their_statistics_in_an_op(monkeypatch, h3_fused_log):
    """Wan by blocks, the CPU let in where the pass does this on CUDA: the self-attention's q/k norms, which the
    rotary embedding reads (through ``unflatten`` and ``unbind``), become ``eager_rms_norm_rstd`` and their products;
    the cross-attention's, which the attention reads, stay whole ``eager_rms_norm`` ops; every site fuses, none is
    refused, and the output is eager's."""
    from h3_fused.patterns import norms

    monkeypatch.setattr(norms, "STATISTICS_ALONE_ON", ("cuda", "cpu"))
    with torch._inductor.config.patch(fx_graph_cache=False):  # the patched constant is not in the pass's uuid
        r = compare("wan", "cpu", real=False, policy="bf16", regional=True)
    kept = [m.getMessage() for m in h3_fused_log if "computed as eager computes it" in m.getMessage()]
    assert sum("eager_rms_norm_rstd" in m for m in kept) == 2 and sum("(h3_fused::eager_rms_norm)" in m for m in kept) == 2
    assert tuple(r["sites"].values()) == REGIONAL["wan"] and r["refused"] == 0
    if inductor_matches_eager_on_cpu():
        assert r["equal"], r


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wan"])
def test_the_fp32_policy_fuses_the_same_sites_within_its_bound(name):
    """Wan by blocks (the norm of the fp32 upcast, fp32 rows) under ``fp32``: the sites ``bf16`` fuses."""
    r = compare(name, "cpu", real=False, policy="fp32", regional=True)
    assert tuple(r["sites"].values()) == REGIONAL[name] and r["refused"] == 0
    assert r["max_diff"] <= 0.05, r



@pytest.mark.usefixtures("fresh_compile")
# Wan's form, Wan 2.2 TI2V's and LTX-Video's rows per token summed with a table, Qwen-Image-Edit's rows chosen per
# token and SD3.5's twice-modulated norm (the benchmark's other forms: the differential family test's draws)
@pytest.mark.parametrize("form", [FamilyForm("layer", "per_sample", True), FamilyForm("layer", TABLE_PLUS_ROWS, True),
                                  FamilyForm("diffusers_rms", TABLE_PLUS_ROWS), FamilyForm("rms", "chosen"),
                                  FamilyForm("layer", "per_sample", modulations=2)], ids=str)
def test_each_site_of_the_benchmarks_forms_is_one_fused_site(form, monkeypatch):
    """The sites ``benchmarks/bench_family.py`` times (``h3_fused.kernels.testing``'s family forms, rows chunked from
    a projection as the models do), compiled with h3_fused: each is one site of its op, computing eager's output;
    rows summed with a table are read as the projection's rows with the table's as biases (the sums never
    written)."""
    import h3_fused.patterns.replacements as replacements

    views = []
    replace = replacements.replacement_fn
    monkeypatch.setattr(replacements, "replacement_fn",
                        lambda site, policy: views.append(set(site.row_views)) or replace(site, policy))
    for site, op in zip("ABC", ("norm_modulate", "gate_norm_modulate", "gate_residual")):
        counters.clear()
        torch._dynamo.reset()
        views.clear()
        inputs = family_inputs(site, form, 2, 9, 64, device="cpu")
        eager = family_eager_site(site, form)
        got = torch.compile(eager, backend="h3_fused", options={"dtype_policy": "bf16"})(**inputs)
        assert dict(counters["h3_fused"]) == {op: 1}, (site, dict(counters["h3_fused"]))
        biased = {"A": {"shift", "scale"}, "B": {"gate", "shift", "scale"}, "C": {"gate"}}[site]
        assert views == [biased if form.source == TABLE_PLUS_ROWS else set()], (site, views)
        tolerance = dict(rtol=0, atol=0) if inductor_matches_eager_on_cpu() else dict(rtol=2 ** -6, atol=2 ** -6)
        expected = eager(**inputs)
        for g, e in zip(*((got, expected) if isinstance(got, tuple) else ((got,), (expected,))), strict=True):
            torch.testing.assert_close(g.float(), e.float(), **tolerance)


@pytest.mark.usefixtures("fresh_compile")
@pytest.mark.parametrize("norm, mean_order", [("rms", False), ("diffusers_rms", True)])
def test_an_rms_norm_without_weight_takes_the_order_of_the_kernel_eager_runs(norm, mean_order, monkeypatch):
    """Without a weight ``F.rms_norm`` and diffusers' ``RMSNorm`` decompose alike; eager runs torch's fused RMSNorm
    kernel for the first, its generic mean for the second. The site takes the order of the one its nodes were
    traced from (``norm_rounds_before_weight``: the mean's order)."""
    import h3_fused.patterns.replacements as replacements

    flags = []
    replace = replacements.replacement_fn
    monkeypatch.setattr(replacements, "replacement_fn",
                        lambda site, policy: flags.append(site.norm_rounds_before_weight) or replace(site, policy))
    form = FamilyForm(norm, "per_sample")
    inputs = family_inputs("A", form, 2, 9, 64, device="cpu")
    torch.compile(family_eager_site("A", form), backend="h3_fused")(**inputs)
    assert flags == [mean_order]
