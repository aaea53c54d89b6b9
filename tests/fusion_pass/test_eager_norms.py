"""Under ``bf16`` the pass puts ``h3_fused::eager_rms_norm`` (eager's own kernels) where a graph has an RMSNorm
outside the sites: per-head q/k norms, plain norms, the native spelling; and ``h3_fused::eager_layer_norm`` where it
has a LayerNorm (with weight and bias, of an fp32 upcast, without affine); never inside a site, never under
``fp32`` or with ``eager_norms=False``, never where the norm's intermediate values are used elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_bf16_policy, bf16, eager_norms_in, fused_sites_in, sites_fused
from torch import nn
from torch._dynamo.utils import counters

pytestmark = pytest.mark.usefixtures("fresh_compile")
H, HEADS, D = 64, 4, 16


class Block(nn.Module):
    """Site A before an attention-like projection with per-head q/k norms (``nn.RMSNorm`` over ``D`` of
    ``[B, T, heads, D]``), then a plain ``nn.RMSNorm`` and a native two-rounding RMSNorm outside any site."""

    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(H, eps=1e-6, dtype=bf16)
        self.qk = nn.Linear(H, 2 * H, bias=False, dtype=bf16)
        self.q_norm, self.k_norm = (nn.RMSNorm(D, eps=1e-5, dtype=bf16) for _ in range(2))
        self.norm_out = nn.RMSNorm(H, eps=1e-6, dtype=bf16)

    def forward(self, x, shift, scale, index):
        y = self.norm1(x) * (1 + scale[index]) + shift[index]
        q, k = self.qk(y).unflatten(-1, (2, HEADS, D)).unbind(-3)
        h = (self.q_norm(q) * self.k_norm(k)).flatten(-2) + x
        h32 = h.float()
        native = (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf16) * self.norm_out.weight
        return self.norm_out(h) + native


def block_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    block = Block()
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.ndim == 1 else 0.2) + (p.ndim == 1))
    x = torch.randn(2, 50, H, generator=g).to(bf16)
    tables = torch.randn(3, 2 * H, generator=g).to(bf16).chunk(2, -1)
    return block, (x, *tables, torch.randint(0, 3, (2, 50), generator=g))


def compile_and_run(options, extra_pass=None):
    block, args = block_inputs()
    if extra_pass is not None:
        options = dict(options, post_grad_custom_post_pass=extra_pass)
    with torch.no_grad():
        return block(*args), torch.compile(block, backend="h3_fused", options=options)(*args)


def test_bf16_computes_every_norm_outside_the_sites_with_eagers_kernels():
    seen = []
    expected, got = compile_and_run({"dtype_policy": "bf16"},
                                    lambda graph: seen.append((fused_sites_in(graph), eager_norms_in(graph))))
    assert seen == [(1, 4)], "one site A; the q and k norms, the plain norm and the native one"
    assert counters["h3_fused"]["eager_rms_norm"] == 4 and sites_fused() == 1
    assert_bf16_policy(got, expected)


def test_where_elementwise_ops_read_them_the_norms_keep_only_their_statistics_in_an_op(monkeypatch):
    """Each of the block's RMSNorms is read by a product or a sum: on CUDA (here the CPU, let in) each becomes
    ``eager_rms_norm_rstd`` and the products of its spelling, which Inductor fuses with the reader: eager's bits."""
    from h3_fused.patterns import norms

    monkeypatch.setattr(norms, "STATISTICS_ALONE_ON", ("cuda", "cpu"))
    seen = []
    ops = torch.ops.h3_fused  # traced on the CPU: the ops' eager-kernels forms
    expected, got = compile_and_run({"dtype_policy": "bf16"}, lambda graph: seen.append(
        (fused_sites_in(graph), sum(n.target is ops.eager_kernels_rms_norm_rstd.default for n in graph.nodes),
         sum(n.target is ops.eager_kernels_rms_norm.default for n in graph.nodes))))
    assert seen == [(1, 4, 0)] and counters["h3_fused"]["eager_rms_norm"] == 4
    assert_bf16_policy(got, expected)


@pytest.mark.parametrize("options", [{"dtype_policy": "fp32"}, {"dtype_policy": "bf16", "eager_norms": False}],
                         ids=["fp32", "eager_norms_off"])
def test_norms_stay_inductors_under_fp32_or_when_turned_off(options):
    seen = []
    compile_and_run(options, lambda graph: seen.append((fused_sites_in(graph), eager_norms_in(graph))))
    assert seen == [(1, 0)] and counters["h3_fused"]["eager_rms_norm"] == 0


def test_a_norm_whose_inverse_rms_is_used_elsewhere_is_left_and_logged(h3_fused_log):
    """The inverse RMS also returned: replacing the norm would leave it computed twice, in two orders."""

    def fn(x, w):
        x32 = x.float()
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (x32 * r).to(bf16) * w, r

    x, w = torch.randn(8, H).to(bf16), torch.randn(H).to(bf16)
    with torch.no_grad():
        got = torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(x, w)
    assert counters["h3_fused"]["eager_rms_norm"] == 0 and counters["h3_fused"]["refused"] == 1
    assert any("a norm kept as eager computes it" in r.getMessage() and "also used elsewhere" in r.getMessage()
               for r in h3_fused_log)
    for g, e in zip(got, fn(x, w)):  # Inductor's norm: its own order
        torch.testing.assert_close(g, e)


class LayerNorms(nn.Module):
    """LayerNorms outside any site, as the DiT family has them: ``nn.LayerNorm`` with weight and bias (a token
    refiner's), diffusers' ``FP32LayerNorm`` (``F.layer_norm`` of ``x.float()`` with fp32 weight and bias, cast
    back: Wan's cross-attention norm), and one without affine after a residual add."""

    def __init__(self):
        super().__init__()
        self.refiner = nn.LayerNorm(H, eps=1e-6, dtype=bf16)
        self.cross = nn.LayerNorm(H, eps=1e-6)  # fp32 parameters

    def forward(self, x, context):
        h = self.refiner(x)
        h = F.layer_norm(h.float(), (H,), self.cross.weight, self.cross.bias, 1e-6).to(bf16) + context
        return F.layer_norm(h + x, (H,), eps=1e-5)


def test_layer_norms_outside_the_sites_are_computed_by_eagers_layer_norm():
    seen = []
    module = LayerNorms()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (p is module.refiner.weight or p is module.cross.weight))
        x, context = (torch.randn(2, 40, H, generator=g).to(bf16) for _ in range(2))
        with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: seen.append(
                (eager_norms_in(graph), sum(n.target is torch.ops.aten.var_mean.correction for n in graph.nodes)))):
            got = torch.compile(module, backend="h3_fused", options={"dtype_policy": "bf16"})(x, context)
        expected = module(x, context)
    assert seen == [(3, 0)] and counters["h3_fused"]["eager_layer_norm"] == 3
    assert_bf16_policy(got, expected)


def test_layer_norms_stay_inductors_under_fp32():
    seen = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: seen.append(eager_norms_in(graph))):
        torch.compile(lambda x: F.layer_norm(x, (H,)), backend="h3_fused",
                      options={"dtype_policy": "fp32"})(torch.randn(8, H).to(bf16))
    assert seen == [0] and counters["h3_fused"]["eager_layer_norm"] == 0
