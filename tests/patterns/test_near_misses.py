"""The matchers on small graphs: each site alone fuses, near-misses stay untouched, refusals say why."""

import operator

import pytest
import torch
import torch.nn.functional as F
from helpers import as_tuple, assert_bf16_policy, bf16, fused_count, inputs, site_a, sites_fused
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
    "LayerNorm with a bias": lambda x, b, w, shift, scale, gate, idx, idx2: (
        F.layer_norm(x, (H,), w, shift[0], 1e-5) * (1 + scale[idx]) + shift[idx]),
    "rows per token not from a group of modulation rows": lambda x, b, w, shift, scale, gate, idx, idx2: (
        F.rms_norm(x, (H,), w, 1e-5) * (1 + b) + shift[idx]),
    "modulation per head": lambda x, b, w, shift, scale, gate, idx, idx2: (  # [B, heads, T, D], rows per head
        lambda n: n * (1 + scale[:4, :16].view(1, 4, 1, 16)) + shift[:4, :16].view(1, 4, 1, 16))(
            F.rms_norm(x.view(1, 16, 4, H // 4).transpose(1, 2), (H // 4,), None, 1e-5)),
    "addcmul affine": lambda x, b, w, shift, scale, gate, idx, idx2: (
        torch.addcmul(shift[idx], F.rms_norm(x, (H,), w, 1e-5), 1 + scale[idx])),
    "addcmul gated residual": lambda x, b, w, shift, scale, gate, idx, idx2: torch.addcmul(x, gate[idx], b),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_misses_do_not_fuse(name):
    assert fused_count(NEAR_MISSES[name]) == 0


@pytest.mark.parametrize("name, reason, hint", [
    ("different index per gather", "its tables are gathered with different index tensors", None),
    ("LayerNorm with a bias", "the norm adds a bias: not fused", None),
    ("rows per token not from a group of modulation rows", "gives a row per token that is not one of a group", None),
    ("modulation per head", "per sample and token of [B, T, H] activations only (not per head)", None),
    ("addcmul affine", "`torch.addcmul(shift, n, 1 + scale)` (the product not rounded before the add)", None),
    ("addcmul gated residual", "`torch.addcmul(residual, gate, branch)`", None),
])
def test_refusals_say_where_what_and_why_in_the_models_terms(name, reason, hint, h3_fused_log):
    """A refusal names what the candidate looked like, the model's source line (here, this file's), the reason
    in plain words, and a hint where one helps."""
    fused_count(NEAR_MISSES[name])
    messages = [r.getMessage() for r in h3_fused_log if "not fused" in r.getMessage()]
    assert messages and counters["h3_fused"]["refused"] >= 1
    line = next((m for m in messages if reason in m), messages)
    assert reason in line and "test_near_misses.py:" in line and "(site" in line, line
    assert (f"hint: {hint}" in line) if hint else "hint:" not in line, line


def test_fused_sites_are_logged_at_the_models_source_line_and_counted_apart_from_the_norms(h3_fused_log):
    """A fused site's log line gives the model's source line of each output, as a refusal does; the pass's
    summary counts the sites and the norms it keeps as eager computes them apart."""
    def site_a_and_a_norm(**t):
        return site_a(**t), F.rms_norm(t["b"], (H,), t["w"], 1e-5)

    torch.compile(site_a_and_a_norm, backend="h3_fused", options={"dtype_policy": "bf16"})(**inputs())
    messages = [r.getMessage() for r in h3_fused_log]
    fused = [m for m in messages if m.startswith("h3_fused: fused site A")]
    assert len(fused) == 1 and "helpers.py:" in fused[0] and "scale.index_select(0, idx)" in fused[0], fused
    assert any("1 site(s) fused, 1 norm(s) outside them as eager computes them" in m for m in messages), messages
    assert (counters["h3_fused"]["norm_modulate"], counters["h3_fused"]["eager_rms_norm"]) == (1, 1)


SHARED_LAYOUT = {  # activations [B, T, H], one index [T]: every sample of the batch has the same layout
    "A": lambda x, b, w, shift, scale, gate, idx: F.rms_norm(x, (H,), w, 1e-5) * (1 + scale[idx]) + shift[idx],
    "C": lambda x, b, w, shift, scale, gate, idx: x + gate[idx] * b,
    "B": lambda x, b, w, shift, scale, gate, idx: (
        lambda u: (u, F.rms_norm(u, (H,), w, 1e-5) * (1 + scale[idx]) + shift[idx]))(x + gate[idx] * b),
}


@pytest.mark.parametrize("index_shape", [(16,), (1, 16), (2, 1)], ids=["T", "1xT", "Bx1"])
@pytest.mark.parametrize("site", list(SHARED_LAYOUT))
def test_gathered_rows_broadcast_over_a_batch_fuse(site, index_shape):
    """As diffusers' H3 model with a batch of two (classifier-free guidance): one layout's rows broadcast over
    the batch dim (or one row per sample over its tokens); the fused op takes the index expanded to every row."""
    t = inputs()
    x, b = torch.stack([t["x"], t["x"].flip(0)]), torch.stack([t["b"], -t["b"]])
    idx = t["idx"][:2].view(index_shape) if index_shape == (2, 1) else t["idx"].view(index_shape)
    args = (x, b, t["w"], t["shift"], t["scale"], t["gate"], idx)
    fn = SHARED_LAYOUT[site]
    got = torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(*args)
    assert sites_fused() == 1
    for g, e in zip(as_tuple(got), as_tuple(fn(*args))):
        assert_bf16_policy(g, e)


def test_gate_then_norm_fuses_as_one_site():
    def fn(x, b, w, shift, scale, gate, idx, idx2):
        u = (x + gate[idx] * b).to(bf16)
        return u, site_a(u, b, w, shift, scale, gate, idx, idx2)

    assert fused_count(fn) == 1
    assert counters["h3_fused"]["gate_norm_modulate"] == 1




def twice_gathered(x, b, w, shift, scale, gate, idx, idx2):
    """One norm modulated twice by tables gathered by one index (as SD3.5 modulates by rows per sample)."""
    n = F.rms_norm(x, (H,), w, 1e-5)
    return n * (1 + scale[idx]) + shift[idx], n * (1 + gate[idx]) + b[:6][idx]


def test_a_norm_modulated_twice_by_tables_gathered_by_one_index_is_one_site():
    assert fused_count(twice_gathered) == 1
    assert counters["h3_fused"]["norm_modulate"] == 1


def test_a_norm_modulated_by_tables_gathered_by_two_indices_is_refused_with_the_reason(h3_fused_log):
    """The second modulation's index is another: the op takes one for all copies."""
    def fn(x, b, w, shift, scale, gate, idx, idx2):
        n = F.rms_norm(x, (H,), w, 1e-5)
        return n * (1 + scale[idx]) + shift[idx], n * (1 + gate[idx2]) + b[:6][idx2]

    assert fused_count(fn) == 0
    assert any("gathered by different indices" in r.getMessage() for r in h3_fused_log)


def test_the_fused_rms_norm_of_a_graph_traced_before_autograd_is_a_norm():
    """On CUDA, ``nn.RMSNorm`` traced before autograd (training graphs) is one ``aten._fused_rms_norm`` node; built
    here by hand, with fake CUDA tensors, site A around it is found with its weight and eps."""
    from h3_fused.patterns import SiteKind, find_sites
    from torch._subclasses.fake_tensor import FakeTensorMode

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    with FakeTensorMode():
        values = dict(x=torch.empty(16, H, dtype=bf16, device="cuda"), w=torch.empty(H, dtype=bf16, device="cuda"),
                      table=torch.empty(6, 2 * H, dtype=bf16, device="cuda"),
                      idx=torch.zeros(16, dtype=torch.long, device="cuda"))

        def node(target, *args):
            n = graph.call_function(target, args)
            n.meta["val"] = target(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args))
            return n

        inputs = {}
        for name, v in values.items():
            inputs[name] = graph.placeholder(name)
            inputs[name].meta["val"] = v
        normed = node(operator.getitem, node(aten._fused_rms_norm.default, inputs["x"], [H], inputs["w"], 1e-5), 0)
        shift = node(aten.slice.Tensor, inputs["table"], 1, 0, H)
        scale = node(aten.slice.Tensor, inputs["table"], 1, H, 2 * H)
        p = node(aten.add.Tensor, node(aten.index_select.default, scale, 0, inputs["idx"]), 1.0)
        y = node(aten.add.Tensor, node(aten.mul.Tensor, normed, p), node(aten.index_select.default, shift, 0, inputs["idx"]))
    graph.output(y)
    (site,) = find_sites(graph, refuse=lambda node, why: pytest.fail(f"refused: {why}"))
    assert site.kind is SiteKind.NORM_MODULATE and site.eps == pytest.approx(1e-5)
    assert site.inputs["x"] is inputs["x"] and site.inputs["weight"] is inputs["w"]


def test_an_rms_norm_without_weight_whose_mean_is_written_out_takes_the_reductions_order():
    """diffusers' ``RMSNorm`` without weight (LTX-Video's) writes ``x.float().pow(2).mean(-1)`` out: on CUDA torch's
    generic reduction computes that mean, so the site is the native spelling (``SumOrder.MEAN`` on CUDA; one rounding
    either way), not ``F.rms_norm``'s fused kernel."""
    from h3_fused.kernels.contract import SumOrder, rounding_for
    from h3_fused.patterns import find_sites

    def site_a(x, emb):
        shift, scale = emb.chunk(2, -1)
        n = (x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return n * (1 + scale[:, None]) + shift[:, None]

    found = []
    with torch._inductor.config.patch(post_grad_custom_pre_pass=lambda graph: found.extend(find_sites(graph, refuse=lambda n, why: None))):
        torch.compile(site_a, backend="inductor")(torch.randn(2, 40, H).to(bf16), torch.randn(2, 2 * H).to(bf16))
    (site,) = found
    assert site.norm == "rms" and site.norm_rounds_before_weight
    rounding = rounding_for("bf16", bf16, None, bf16, norm_rounds_before_weight=site.norm_rounds_before_weight,
                            upcast_tables=False)
    assert rounding.norm_sum_order is SumOrder.MEAN


def chosen_rows(rows: torch.Tensor, choice: torch.Tensor) -> torch.Tensor:
    """Rows chosen per token between the two halves of ``rows`` (``[2B, H]``), as Qwen-Image's ``zero_cond_t``."""
    samples = rows.shape[0] // 2
    return torch.where(choice, rows[:samples, None], rows[samples:, None])


def chosen_site(choice_of_scale, choice_of_shift):
    def site(x, emb, index):
        shift, scale = emb.chunk(2, -1)
        n = F.layer_norm(x, (H,), eps=1e-6)
        return n * (1 + chosen_rows(scale, choice_of_scale(index))) + chosen_rows(shift, choice_of_shift(index))
    return site


PER_TOKEN = lambda index: index[..., None] == 0  # noqa: E731


@pytest.mark.parametrize("choice", [PER_TOKEN, lambda index: index[:, :1, None] == 0], ids=["per token", "per sample"])
def test_rows_chosen_between_two_fuse(choice):
    """Rows chosen per token by ``torch.where`` between two rows per sample, gathered from the two; a choice per
    sample makes rows per sample, taken as they are: one fused site, computing eager's output."""
    x, emb = torch.randn(2, 12, H).to(bf16), torch.randn(4, 2 * H).to(bf16)
    index = (torch.arange(12) >= 5).int().expand(2, 12).contiguous()
    site = chosen_site(choice, choice)  # the condition written once per row group, as Qwen-Image writes it
    got = torch.compile(site, backend="h3_fused", options={"dtype_policy": "bf16"})(x, emb, index)
    assert sites_fused() == 1 and counters["h3_fused"]["refused"] == 0
    assert_bf16_policy(got, site(x, emb, index))


def test_rows_chosen_by_another_condition_are_refused_with_the_reason(h3_fused_log):
    x, emb = torch.randn(2, 12, H).to(bf16), torch.randn(4, 2 * H).to(bf16)
    index = (torch.arange(12) >= 5).int().expand(2, 12).contiguous()
    torch.compile(chosen_site(PER_TOKEN, lambda index: index[..., None] == 1), backend="h3_fused",
                  options={"dtype_policy": "bf16"})(x, emb, index)
    assert sites_fused() == 0 and counters["h3_fused"]["refused"] == 1
    assert any("its rows are chosen per token by different conditions" in r.getMessage() for r in h3_fused_log)


SUMS_WITH_A_TABLE = {  # name: (the rows' sum from a [B, T, 3, H] bf16 projection and a table, taken with biases)
    "fp32 table + the projection upcast (Wan 2.2 TI2V)": (
        lambda table, temb: table.float().view(1, 1, 3, H) + temb.float(), True),
    "bf16 table + the projection (LTX-Video)": (lambda table, temb: table.view(1, 1, 3, H) + temb, True),
    "a table per sample (its rows vary by sample)": (lambda table, temb: table.float()[:2].view(2, 1, 1, H) + temb, False),
    "both upcast (the sum fp32, their promotion bf16)": (
        lambda table, temb: table.float().view(1, 1, 3, H) + temb.float(), False),
}


@pytest.mark.parametrize("name", list(SUMS_WITH_A_TABLE))
def test_rows_per_token_summed_with_a_table_are_read_with_biases_only_where_the_op_adds_as_the_graph(name, monkeypatch):
    """Rows per token chunked from ``table + temb``: the op reads ``temb``'s rows with the table's as biases where the
    table is one row per chunk for every token and the sum's dtype is the two's promoted (the op adds in it); else
    the site fuses the graph's sums as given rows. Either way one site, computing eager's output."""
    import h3_fused.patterns.replacements as replacements

    views = []
    replace = replacements.replacement_fn
    monkeypatch.setattr(replacements, "replacement_fn",
                        lambda site, policy: views.append(dict(site.row_views)) or replace(site, policy))
    total, biased = SUMS_WITH_A_TABLE[name]
    table_dtype = torch.bfloat16 if "bf16 table" in name or "both" in name else torch.float32

    def site(x, table, temb):
        shift, scale, _ = (r.squeeze(2) for r in total(table, temb).chunk(3, dim=2))
        return (F.layer_norm(x, (H,), eps=1e-6) * (1 + scale) + shift).to(x.dtype)

    g = torch.Generator().manual_seed(0)
    x, temb = torch.randn(2, 12, H, generator=g).to(bf16), torch.randn(2, 12, 3, H, generator=g).to(bf16)
    table = torch.randn(3, H, generator=g).to(table_dtype)
    got = torch.compile(site, backend="h3_fused", options={"dtype_policy": "bf16"})(x, table, temb)
    assert sites_fused() == 1 and counters["h3_fused"]["refused"] == 0
    assert views == [{"shift": (2, 0, 1, 0), "scale": (2, 1, 1, H)} if biased else {}], views
    assert_bf16_policy(got, site(x, table, temb))
