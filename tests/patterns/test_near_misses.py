"""The matchers on small graphs: each site alone fuses, near-misses stay untouched, refusals say why."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import bf16, fused_count, site_a
from torch._dynamo.utils import counters

H = 64
pytestmark = pytest.mark.usefixtures("fresh_compile")


def test_site_a_alone_fuses():
    assert fused_count(site_a) == 1


NEAR_MISSES = {
    "different index per gather": lambda x, b, w, shift, scale, gate, idx, idx2: (
        F.rms_norm(x, (H,), w, 1e-5) * (1 + scale[idx]) + shift[idx2]),
    "norm over another dim": lambda x, b, w, shift, scale, gate, idx, idx2: (
        (x.float() * torch.rsqrt(x.float().pow(2).mean(0, keepdim=True) + 1e-5)).to(bf16) * (1 + scale[idx])
        + shift[idx]),
    "missing 1 +": lambda x, b, w, shift, scale, gate, idx, idx2: (
        F.rms_norm(x, (H,), w, 1e-5) * scale[idx] + shift[idx]),
    "2 + scale": lambda x, b, w, shift, scale, gate, idx, idx2: (
        F.rms_norm(x, (H,), w, 1e-5) * (2 + scale[idx]) + shift[idx]),
    "gate table of another width": lambda x, b, w, shift, scale, gate, idx, idx2: (
        x + torch.cat([gate, gate], -1)[idx][:, :H] * b),
    "gather along dim 1": lambda x, b, w, shift, scale, gate, idx, idx2: (
        x + gate.t().index_select(1, idx).t() * b),
    "interior value used elsewhere": lambda x, b, w, shift, scale, gate, idx, idx2: (
        lambda n: (n * (1 + scale[idx]) + shift[idx], n.sum()))(F.rms_norm(x, (H,), w, 1e-5)),
    "gated residual product used elsewhere": lambda x, b, w, shift, scale, gate, idx, idx2: (
        lambda g: (x + g, g * 2))(gate[idx] * b),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_do_not_fuse(name):
    assert fused_count(NEAR_MISSES[name]) == 0


def test_refusals_are_logged_with_the_reason():
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("h3_fused")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        fused_count(NEAR_MISSES["different index per gather"])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert any("different index tensors" in r.getMessage() for r in records)
    assert counters["h3_fused"]["refused"] >= 1


def test_gate_then_norm_fuses_as_one_site():
    def fn(x, b, w, shift, scale, gate, idx, idx2):
        u = (x + gate[idx] * b).to(bf16)
        return u, site_a(u, b, w, shift, scale, gate, idx, idx2)

    assert fused_count(fn) == 1
    assert counters["h3_fused"]["gate_norm_modulate"] == 1


