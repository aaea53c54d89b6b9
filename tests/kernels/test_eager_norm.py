"""``h3_fused::eager_rms_norm``: eager's own RMSNorm, bit for bit, as an op Inductor cannot look into."""

import pytest
import torch
import torch.nn.functional as F
from h3_fused.kernels import eager_rms_norm

bf16 = torch.bfloat16


def native(x, weight, eps):
    x32 = x.float()
    out = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if weight is None else out * weight


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("rounds_before_weight", [False, True], ids=["nn.RMSNorm", "native"])
def test_the_op_is_the_eager_spelling_bit_for_bit(rounds_before_weight, weighted):
    """Per-head rows ``[B, T, heads, D]`` read from a wider projection (a strided view, as q in a fused qkv), the
    output contiguous."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 37, 3, 4, 16, generator=g).to(bf16)
    x = qkv[:, :, 0]
    weight = (1 + 0.1 * torch.randn(16, generator=g)).to(bf16) if weighted else None
    expected = native(x, weight, 1e-6) if rounds_before_weight else F.rms_norm(x, (16,), weight, 1e-6)
    got = eager_rms_norm(x, weight, 1e-6, rounds_before_weight)
    assert got.is_contiguous() and got.dtype == x.dtype and torch.equal(got, expected)


@pytest.mark.parametrize("rounds_before_weight", [False, True], ids=["nn.RMSNorm", "native"])
def test_opcheck(rounds_before_weight):
    x = torch.randn(5, 3, 32).to(bf16)
    weight = torch.randn(32).to(bf16)
    for w in (weight, None):
        torch.library.opcheck(torch.ops.h3_fused.eager_rms_norm.default, (x, w, 1e-5, rounds_before_weight),
                              test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
