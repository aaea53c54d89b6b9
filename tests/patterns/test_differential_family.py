"""Differential property test of the matcher's DiT-family parameters: random sites written as diffusers' DiTs
write them, compiled with h3_fused and run against eager.

Drawn: the site (A; B, a gated residual then the modulated norm; C), the norm (``F.rms_norm``, diffusers'
``RMSNorm`` with its bf16 input times an fp32 ``rsqrt``, ``F.layer_norm``; with or without weight; of the
activations or, with fp32 rows, of their fp32 upcast with the affine and the residual in fp32 and one cast after,
as Wan writes it), the rows (one per sample as ``[B, 1, H]`` chunks or ``[B, H][:, None]``, with ``1 +`` before or
after the view; one per token as chunks of a ``[B, T, 6H]`` projection, or of its sum with a ``[6, H]`` table, as Wan
2.2 TI2V (fp32, of the projection upcast) and LTX-Video (in the rows' dtype) write theirs; one for all), their dtype, how many times
the norm's output is modulated (once, or twice by rows of the same form, as SD3.5's ``SD35AdaLayerNormZeroX``: one
site whose op stores both), the activations' dtype, the batch, the tokens, the width, the policy, and a near-miss (no ``1 +``, ``2 +``, a LayerNorm with a bias,
rows per token that are no group's). Every example: the sites fused are the true ones, and the output obeys the
policy (``bf16`` with every site fused: Inductor's bits with ``emulate_precision_casts``, which compiles the sites'
eager operations on the CPU; always within a few ulps of eager). ``H3_FUZZ_EXAMPLES`` and ``H3_FUZZ_SEED`` set a
run, as for ``test_differential.py``.
"""

import os
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_sites_fuse_within_policy
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from tqdm import tqdm

EXAMPLES = int(os.environ.get("H3_FUZZ_EXAMPLES", "8"))
SEED = int(os.environ.get("H3_FUZZ_SEED", "20261207"))
f32 = torch.float32


@dataclass(frozen=True)
class Case:
    site: str
    norm: str  # "rms", "rms_diffusers", "layer"
    weight: bool
    in_fp32: bool  # the norm of x.float(), affine and residual in fp32, one cast after (needs fp32 rows)
    rows: str  # "per_sample", "per_sample_view", "one_plus_then_view", "per_token", "per_token_table", "one_for_all"
    rows_fp32: bool
    modulations: int  # 2: the norm's output modulated twice
    dtype: torch.dtype
    batch: int
    tokens: int
    hidden: int
    policy: str
    near_miss: str
    seed: int


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    rows_fp32 = dtype == f32 or draw(st.booleans())
    site = draw(st.sampled_from(["A", "B", "C"]))
    return Case(site, draw(st.sampled_from(["rms", "rms_diffusers", "layer"])), draw(st.booleans()),
                rows_fp32 and dtype != f32 and draw(st.booleans()),
                draw(st.sampled_from(["per_sample", "per_sample_view", "one_plus_then_view", "per_token",
                                      "per_token_table", "one_for_all"])),
                rows_fp32, draw(st.integers(1, 2)), dtype, draw(st.integers(1, 2)), draw(st.integers(1, 24)), 8 * draw(st.integers(1, 24)),
                draw(st.sampled_from(["bf16", "fp32", "auto"])),
                draw(st.sampled_from(["none", "none", "no_one_plus", "two_plus", "layer_bias", "rows_not_a_group"]))
                if site != "C" else "none", draw(st.integers(0, 2**16)))


def build(case: Case):
    """The function under test, its inputs, and how many sites fuse in it."""
    g = torch.Generator().manual_seed(case.seed)
    B, T, H = case.batch, case.tokens, case.hidden
    rows_dtype = f32 if case.rows_fp32 else case.dtype
    x, branch = (torch.randn(B, T, H, generator=g).to(case.dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(case.dtype) if case.weight else None
    bias = (0.1 * torch.randn(H, generator=g)).to(case.dtype)
    shared = (0.3 * torch.randn(6, H, generator=g)).to(rows_dtype)  # per_token_table's table
    if case.rows == "per_token":
        table = (0.3 * torch.randn(B, T, 6 * H, generator=g)).to(rows_dtype)
    elif case.rows == "per_token_table":  # a projection in the activations' dtype, summed in the rows'
        table = (0.3 * torch.randn(B, T, 6, H, generator=g)).to(case.dtype if case.rows_fp32 else rows_dtype)
    elif case.rows == "one_for_all":
        table = (0.3 * torch.randn(6 * H, generator=g)).to(rows_dtype)
    else:
        table = (0.3 * torch.randn(B, 6 * H, generator=g)).to(rows_dtype)
    other = (0.3 * torch.randn(B, T, H, generator=g)).to(rows_dtype)  # not one of a group
    miss = "none" if case.near_miss == "layer_bias" and case.norm != "layer" else case.near_miss

    def rows(t, shared):
        """shift, scale, gate, and the second modulation's shift and scale."""
        if case.rows == "per_token_table":  # Wan 2.2 TI2V's `(table.unsqueeze(0) + temb.float()).chunk(6, dim=2)`
            summed = shared.unsqueeze(0).unsqueeze(0) + (t.float() if case.rows_fp32 else t)
            return tuple(r.squeeze(2) for r in summed.chunk(6, dim=2)[:5])
        shift, scale, gate, shift2, scale2 = t.chunk(6, -1)[:5]
        if case.rows == "per_sample":
            return shift.unsqueeze(1), scale.unsqueeze(1), gate.unsqueeze(1), shift2.unsqueeze(1), scale2.unsqueeze(1)
        if case.rows == "one_plus_then_view":  # the scale viewed after its `1 +`
            return shift.unsqueeze(1), scale, gate.unsqueeze(1), shift2.unsqueeze(1), scale2
        if case.rows == "per_sample_view":
            return shift[:, None], scale[:, None], gate[:, None], shift2[:, None], scale2[:, None]
        return shift, scale, gate, shift2, scale2

    def one_plus(scale):
        if case.rows == "one_plus_then_view":
            return ((2 if miss == "two_plus" else 1) + scale)[:, None, :]
        return (2 + scale) if miss == "two_plus" else 1 + scale

    def norm(h):
        if case.norm == "layer":
            return F.layer_norm(h, (H,), weight.to(h.dtype) if weight is not None else None,
                                bias.to(h.dtype) if miss == "layer_bias" else None, 1e-6)
        if case.norm == "rms_diffusers":  # x * rsqrt(mean(x.float()^2)): an fp32 product of the input
            n = h * torch.rsqrt(h.to(f32).pow(2).mean(-1, keepdim=True) + 1e-6)
            return n * weight.to(n.dtype) if weight is not None else n.to(h.dtype)
        return F.rms_norm(h, (H,), weight.to(h.dtype) if weight is not None else None, 1e-6)

    def modulate(h, *pairs):
        """The norm of ``h`` modulated by each (shift, scale) of ``pairs``."""
        n = norm(h.float() if case.in_fp32 else h)

        def affine(shift, scale):
            if miss == "no_one_plus":
                return (n * (scale[:, None, :] if case.rows == "one_plus_then_view" else scale) + shift).to(h.dtype)
            if miss == "rows_not_a_group":
                return (n * (1 + other) + shift).to(h.dtype)
            return (n * one_plus(scale) + shift).to(h.dtype)

        return tuple(affine(shift, scale) for shift, scale in pairs)

    def fn(x, branch, table, shared):
        shift, scale, gate, shift2, scale2 = rows(table, shared)
        pairs = [(shift, scale), (shift2, scale2)][:case.modulations]
        if case.site == "A":
            return modulate(x, *pairs)
        u = (x.float() + branch * gate).type_as(x) if case.in_fp32 else (x + gate * branch).to(x.dtype)
        return (u,) if case.site == "C" else (u, *modulate(u, *pairs))

    # the norm part fuses where it is a site: no near-miss, and a norm of the fp32 upcast only with fp32 rows
    # (which ``in_fp32`` always has); diffusers' RMSNorm with a weight rounds before it, as the native spelling
    norm_site = miss == "none" or (miss == "rows_not_a_group" and T == 1)  # one token: rows per sample
    expected = {"A": int(norm_site), "B": 1, "C": 1}[case.site]
    return fn, (x, branch, table, shared), expected, (norm_site or case.site == "C")


PROGRESS = tqdm(total=EXAMPLES, desc="family differential examples", file=sys.__stderr__, leave=False, disable=None)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@seed(SEED)
@given(case=cases())
def test_the_familys_sites_fuse_and_keep_the_policy(case):
    PROGRESS.update()
    assert_sites_fuse_within_policy(case, *build(case))
