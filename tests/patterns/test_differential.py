"""Differential property test of the pass: random sites in the public spellings, and near-misses,
compiled with h3_fused and run against eager.

For every example: the number of replacements in ``counters["h3_fused"]`` equals the number of true
sites (near-misses never fuse), and the output obeys the policy (``bf16``, every site fused: bit-identical
to Inductor with ``emulate_precision_casts``, which compiles the sites' eager operations on the CPU; always
within a few bf16 ulps of eager). ``H3_FUZZ_EXAMPLES`` (default 8) and
``H3_FUZZ_SEED`` set the size and seed of a run (docs/RELIABILITY.md records a long one).
"""

import os
import sys
from dataclasses import dataclass

import pytest
import torch
from helpers import assert_sites_fuse_within_policy
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from minimax_h3 import Spellings, modulate_gate, modulate_scale_shift
from minimax_h3.modulation import make_rms_norm
from tqdm import tqdm

EXAMPLES = int(os.environ.get("H3_FUZZ_EXAMPLES", "8"))
SEED = int(os.environ.get("H3_FUZZ_SEED", "20261202"))
NEAR_MISSES = ("none", "other_index", "no_one_plus", "two_plus", "norm_dim0", "interior_used")


@dataclass(frozen=True)
class Case:
    site: str  # "A", "B" (C then A on its output) or "C"
    spell: Spellings
    weight: bool
    hidden: int
    tokens: int
    rows: int
    dtype: torch.dtype
    policy: str
    dynamic: bool
    near_miss: str
    seed: int


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
    spell = Spellings(
        norm=draw(st.sampled_from(["torch", "native"])),
        gather=draw(st.sampled_from(["index_select", "getitem"])),
        one_plus_first=draw(st.booleans()), gate_first=draw(st.booleans()),
        trailing_to=True, upcast_tables=draw(st.booleans()),
        fp32_tables=draw(st.booleans()) if dtype != torch.float32 else False,
        index_dtype=draw(st.sampled_from([torch.int64, torch.int32])), batched=draw(st.booleans()),
    )
    site = draw(st.sampled_from(["A", "B", "C"]))
    near_miss = draw(st.sampled_from(NEAR_MISSES if site != "C" else ("none", "interior_used")))
    return Case(site, spell, draw(st.booleans()), 8 * draw(st.integers(1, 24)), 2 * draw(st.integers(1, 24)),
                draw(st.integers(1, 12)), dtype, draw(st.sampled_from(["bf16", "fp32", "auto"])),
                draw(st.booleans()), near_miss, draw(st.integers(0, 2**16)))


def build(case: Case):
    """The function under test and its inputs; ``expected_sites`` fused ops should replace."""
    g = torch.Generator().manual_seed(case.seed)
    table_dtype = torch.float32 if case.spell.fp32_tables else case.dtype
    lead = (2, case.tokens // 2) if case.spell.batched else (case.tokens,)
    tables = (0.3 * torch.randn(case.rows, 6 * case.hidden, generator=g)).to(table_dtype).chunk(6, -1)
    x = torch.randn(*lead, case.hidden, generator=g).to(case.dtype)
    branch = torch.randn(*lead, case.hidden, generator=g).to(case.dtype)
    index = torch.randint(0, case.rows, lead, generator=g).to(case.spell.index_dtype)
    other = torch.randint(0, case.rows, lead, generator=g).to(case.spell.index_dtype)
    norm = make_rms_norm(case.hidden, 1e-5, case.dtype, case.spell)
    if not case.weight:
        norm = torch.nn.RMSNorm(case.hidden, eps=1e-5, elementwise_affine=False, dtype=case.dtype) \
            if case.spell.norm == "torch" else norm
    with torch.no_grad():
        if case.weight:
            norm.weight.copy_(1 + 0.1 * torch.randn(case.hidden, generator=g))
        elif case.spell.norm == "native":
            norm.weight.fill_(1.0)
    spell, miss = case.spell, case.near_miss

    def modulate(h, idx):
        shift, scale = tables[0], tables[1]
        if miss == "other_index":
            shift_rows = shift[other.long()].float() if spell.upcast_tables else shift[other.long()]
            return (h * (1 + (scale.float() if spell.upcast_tables else scale)[idx.long()]) + shift_rows).to(h.dtype)
        if miss == "no_one_plus":
            return (h * scale[idx.long()] + shift[idx.long()]).to(h.dtype)
        if miss == "two_plus":
            return (h * (2 + scale[idx.long()]) + shift[idx.long()]).to(h.dtype)
        return modulate_scale_shift(h, shift, scale, idx, dtype=h.dtype, spell=spell)

    def normed(h):
        if miss == "norm_dim0":
            h32 = h.float()
            return (h32 * torch.rsqrt(h32.pow(2).mean(0, keepdim=True) + 1e-5)).to(h.dtype)
        return norm(h)

    def gate(res, idx):
        return modulate_gate(res, tables[2], branch, idx, dtype=res.dtype, spell=spell)

    def fn(x, index):
        if case.site == "C":
            u = gate(x, index)
            return (u, (u * 2) if miss == "interior_used" else u)
        if case.site == "B":
            x = gate(x, index)
        n = normed(x)
        y = modulate(n, index)
        extra = n.float().abs().sum() if miss == "interior_used" else y
        return (x, y, extra)

    if miss == "interior_used" and case.site == "C":
        def fn(x, index):  # noqa: F811  the gate product also escapes
            prod = tables[2][index.long()] * branch
            return ((x + prod).to(x.dtype), prod)
    # A near-miss in the norm/modulation part of B leaves its gated residual a true site C. Under
    # dynamic=True, Dynamo turns the native norm's float attribute eps into a graph input: the pass
    # cannot prove its value and refuses that norm (documented limitation), as for a near-miss.
    norm_site_ok = miss == "none" and not (case.dynamic and spell.norm == "native")
    expected = 1 if norm_site_ok or case.site == "B" else 0
    if case.site == "C":
        expected = 1 if miss == "none" else 0
    return fn, (x, index), expected, norm_site_ok or case.site == "C" and miss == "none"


PROGRESS = tqdm(total=EXAMPLES, desc="differential examples", file=sys.__stderr__, leave=False, disable=None)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@seed(SEED)
@given(case=cases())
def test_pass_never_changes_what_the_model_computes_beyond_its_policy(case):
    PROGRESS.update()  # on the terminal's stderr, past pytest's capture: the test runs for minutes
    assert_sites_fuse_within_policy(case, *build(case), dynamic=case.dynamic)
