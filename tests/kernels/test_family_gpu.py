"""The DiT family's site forms on CUDA: modulation rows given without an index, LayerNorm, the norm in fp32, against
eager's spelling of each site, ``torch.equal``: the norms' statistics in the order of eager's RMSNorm and LayerNorm
CUDA kernels."""

import pytest
import torch
import torch.nn.functional as F
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate

pytestmark = pytest.mark.gpu
bf16 = torch.bfloat16


def rows(source: str, batch: int, tokens: int, hidden: int, dtype, g):
    """``(shift, scale, gate)`` as a model hands them out: chunks of one projection per sample (``[B, 1, H]`` or
    ``[B, H][:, None]``), per token (``[B, T, H]``), or one for all (``[H]``)."""
    if source == "per_token":
        return (0.3 * torch.randn(batch, tokens, 6 * hidden, generator=g, device="cuda")).to(dtype).chunk(6, -1)[:3]
    if source == "one_for_all":
        return (0.3 * torch.randn(6 * hidden, generator=g, device="cuda")).to(dtype).chunk(6, -1)[:3]
    per_sample = (0.3 * torch.randn(batch, 6 * hidden, generator=g, device="cuda")).to(dtype).chunk(6, -1)[:3]
    return tuple(r[:, None] for r in per_sample)


def eager_site(x, branch, weight, shift, scale, gate, norm, in_fp32, eps=1e-6):
    """Site B as the family writes it: ``u = res + gate * branch`` (fp32 with one cast where ``in_fp32``), then
    the norm and ``* (1 + scale) + shift`` (on ``u.float()`` with fp32 rows where ``in_fp32``)."""
    u = (x.float() + branch * gate).type_as(x) if in_fp32 else x + gate * branch
    base = u.float() if in_fp32 else u
    n = F.layer_norm(base, (base.shape[-1],), weight, None, eps) if norm == "layer" else \
        F.rms_norm(base, (base.shape[-1],), weight, eps)
    return u, (n * (1 + scale) + shift).type_as(x)


@pytest.mark.parametrize("hidden", [3072, 5120])
@pytest.mark.parametrize("source", ["per_sample", "per_token", "one_for_all"])
@pytest.mark.parametrize("norm, in_fp32", [("layer", False), ("layer", True), ("rms", False)])
def test_given_rows_match_eagers_site(hidden, source, norm, in_fp32):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    batch, tokens = 2, 2048
    x, branch = (torch.randn(batch, tokens, hidden, generator=g, device="cuda").to(bf16) for _ in range(2))
    shift, scale, gate = rows(source, batch, tokens, hidden, torch.float32 if in_fp32 else bf16, g)
    kw = dict(eps=1e-6, policy="bf16", norm=norm, norm_in_fp32=in_fp32)
    u, y = gate_norm_modulate(x, gate, branch, None, shift, scale, None, **kw)
    ref_u, ref_y = eager_site(x, branch, None, shift, scale, gate, norm, in_fp32)
    assert torch.equal(u, ref_u)
    assert torch.equal(gate_residual(x, gate, branch, None, policy="bf16"), ref_u)
    assert torch.equal(y, ref_y), (y != ref_y).float().mean().item()
    y_a = norm_modulate(x, None, shift, scale, None, **kw)
    assert torch.equal(y_a, eager_site(x, torch.zeros_like(x), None, shift, scale, gate, norm, in_fp32)[1])
