"""``KeepEagerRoundings``: under ``bf16``, a value cast to a narrower float dtype and straight back, and a
reciprocal, keep eager's rounding on every supported torch (torch 2.11 and 2.12's Inductor drops the narrow cast,
torch 2.11's divides approximately in a reciprocal; the pass restates each in a form Inductor rounds as eager)."""

import h3_fused
import h3_fused.backend as backend
import h3_fused.eager_roundings as eager_roundings
import pytest
import torch
from h3_fused.eager_roundings import (
    KeepEagerRoundings,
    divide_reciprocals,
    restate_narrowing_casts,
    rewrites_needed,
)
from helpers import inductor_matches_eager_on_cpu
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.pattern_matcher import CallFunction, KeywordArg
from torch.fx.experimental.proxy_tensor import make_fx

bf16 = torch.bfloat16


def round_trips(x):
    """A round trip through bf16 (a block's ``.type_as`` output read by the next module's ``.float()``), a cast
    to bf16 used as bf16 and widened, and a widening alone."""
    rounded = (x * 3).to(bf16).float() * 1.7
    narrow = x.to(bf16)
    return rounded, narrow + 1, narrow.float(), x.double()


CAST = torch.ops.prims.convert_element_type.default
# the pattern of torch 2.11 and 2.12's ``joint_graph.pointless_convert``, which drops the inner cast it matches
POINTLESS_CONVERT = CallFunction(CAST, CallFunction(CAST, KeywordArg("arg"), KeywordArg("dtype1")), KeywordArg("dtype2"))


def test_only_a_narrowing_cast_whose_one_user_widens_it_back_is_restated_out_of_the_patterns_reach():
    gm = make_fx(round_trips, decomposition_table=select_decomp_table(), tracing_mode="fake")(torch.randn(4, 8))
    # the round trip (a cast to bf16 with other users, as ``narrow``, is one the pattern cannot drop)
    matched = [n for n in gm.graph.find_nodes(op="call_function", target=CAST) if POINTLESS_CONVERT.match(n)]
    assert len(matched) == 1 and matched[0].args[0].args[1] == bf16
    restate_narrowing_casts(gm.graph)
    gm.graph.lint()
    gm.recompile()
    restated = [n for n in gm.graph.find_nodes(op="call_function", target=CAST) if n.kwargs]
    assert [(n.kwargs["dtype"], len(n.users)) for n in restated] == [(bf16, 1)]
    assert not [n for n in gm.graph.find_nodes(op="call_function", target=CAST) if POINTLESS_CONVERT.match(n)]
    x = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(gm(x), round_trips(x), strict=True))


class UserJointPass(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return b"user"


ALL_REWRITES = (restate_narrowing_casts, divide_reciprocals)


@pytest.fixture(params=[True, False], ids=["with_the_pass", "without_the_pass"])
def drops(request, monkeypatch):
    """Whether the backend takes Inductor for one that drops eager's roundings (so sets the pass with every
    rewrite), whatever this torch's Inductor does (``rewrites_needed``)."""
    needed = (lambda: ALL_REWRITES) if request.param else (lambda: ())
    monkeypatch.setattr(backend, "rewrites_needed", needed)
    monkeypatch.setattr(eager_roundings, "rewrites_needed", needed)
    return request.param


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_the_backend_installs_it_under_bf16_where_inductor_drops_roundings_chaining_the_users(policy, drops):
    user = UserJointPass()
    patches = h3_fused.make_config_patches({"dtype_policy": policy, "joint_custom_pre_pass": user})
    if policy == "bf16" and drops:
        ours = patches["joint_custom_pre_pass"]
        assert isinstance(ours, KeepEagerRoundings) and ours.rewrites == ALL_REWRITES
        assert ours.chained == (user,) and ours.uuid()
    else:
        assert patches["joint_custom_pre_pass"] is user


def test_the_rewrites_this_torch_needs_are_known():
    version = torch.torch_version.TorchVersion(torch.__version__)
    assert rewrites_needed() == tuple(r for r, older in ((restate_narrowing_casts, version < "2.13"),
                                                         (divide_reciprocals, version < "2.12")) if older)


def reciprocals(x):
    """Rotary frequencies as LTX-Video and HunyuanVideo write them (``1 / theta ** e``, ``e`` in [0, 1) for ``x`` up
    to 640), reciprocals of fp32, bf16 and fp64 values."""
    return 1.0 / (10000.0 ** (x / 640)), torch.reciprocal(x * 3 + 1), 1.0 / x.to(bf16), 1.0 / x.double()


def test_a_reciprocal_is_restated_as_an_fp32_division_but_in_fp64():
    gm = make_fx(reciprocals, decomposition_table=select_decomp_table(), tracing_mode="fake")(torch.rand(4, 8) + 1)
    found = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.reciprocal.default)
    assert [n.meta["val"].dtype for n in found] == [torch.float32, torch.float32, bf16, torch.float64]
    divide_reciprocals(gm.graph)
    gm.graph.lint()
    gm.recompile()
    left = gm.graph.find_nodes(op="call_function", target=torch.ops.aten.reciprocal.default)
    divisions = [d for d in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.div.Tensor)
                 if isinstance(d.args[0], torch.fx.Node) and d.args[0].target is torch.ops.aten.full.default]
    assert [n.meta["val"].dtype for n in left] == [torch.float64] and len(divisions) == 3
    assert all(d.args[0].meta["val"].dtype == torch.float32 and d.args[1].meta["val"].dtype == torch.float32
               and d.args[0].args == ([], 1.0) for d in divisions)
    narrow = [u for d in divisions for u in d.users if u.target is CAST]
    assert [(u.kwargs["dtype"], u.meta["val"].dtype) for u in narrow] == [(bf16, bf16)]
    x = torch.rand(4, 8) + 1
    assert all(torch.equal(a, b) for a, b in zip(gm(x), reciprocals(x), strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_round_trip_through_bf16_keeps_eagers_rounding_with_the_pass(device, drops, fresh_compile):
    """With the pass: eager's bits on every torch. Without it: eager's bits where this torch's Inductor keeps the
    cast, and not where it drops it (as torch 2.11 on an H100 showed: the pass is what keeps the rounding). On the
    CPU neither where the C++ backend computes bf16 values in fp32 between casts (torch 2.11, 2.12)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 256, generator=g, device=device)
    expected = round_trips(x)
    got = torch.compile(round_trips, backend="h3_fused", options={"dtype_policy": "bf16"})(x)
    equal = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert equal == (codegen_keeps_bf16_roundings(device) and (drops or restate_narrowing_casts not in rewrites_needed()))


def codegen_keeps_bf16_roundings(device: str) -> bool:
    """Whether Inductor's code for ``device`` rounds a bf16 value where the graph casts it (on CUDA always; on the
    CPU where ``emulate_precision_casts`` reaches the C++ backend)."""
    return device != "cpu" or inductor_matches_eager_on_cpu()


def test_the_rewrites_leave_no_round_trip_for_pointless_convert_to_drop():
    """Every rewrite applied, in the order the pass applies them: no cast to a narrower dtype cast straight back
    in the positional form torch 2.11's ``pointless_convert`` drops (``1 / t.to(bf16)``'s division reads
    ``t.to(bf16)`` widened: the rounding of ``t`` must stay), and the result widened again keeps its rounding."""
    def narrow_reciprocals(x):
        return (1.0 / x.to(bf16)).float() * 3, torch.reciprocal(x.to(bf16)) + 1

    gm = make_fx(narrow_reciprocals, decomposition_table=select_decomp_table(), tracing_mode="fake")(torch.rand(4, 8))
    KeepEagerRoundings(rewrites=ALL_REWRITES)(gm.graph)
    gm.graph.lint()
    gm.recompile()
    assert not gm.graph.find_nodes(op="call_function", target=torch.ops.aten.reciprocal.default)
    assert not [n for n in gm.graph.find_nodes(op="call_function", target=CAST) if POINTLESS_CONVERT.match(n)
                and n.args[0].args[1] in (bf16, torch.float16)]
    x = torch.rand(4, 8) + 0.5
    assert all(torch.equal(a, b) for a, b in zip(gm(x), narrow_reciprocals(x), strict=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_reciprocals_keep_eagers_rounding_with_the_pass(device, drops, fresh_compile):
    """With the pass: eager's bits on every torch whose code keeps bf16 roundings. Without it: not where this
    torch's Inductor divides approximately in a reciprocal on CUDA (torch 2.11 on an H100: one element in eight a
    last place apart)."""
    x = torch.arange(1, 4097, device=device, dtype=torch.float32) / 7
    expected = reciprocals(x)
    got = torch.compile(reciprocals, backend="h3_fused", options={"dtype_policy": "bf16"})(x)
    equal = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    approximate = device == "cuda" and divide_reciprocals in rewrites_needed()
    assert equal == (codegen_keeps_bf16_roundings(device) and (drops or not approximate))


def rotary_frequencies(x):
    """LTX-Video's: ``theta ** linspace(log_theta(1), log_theta(theta), d)``, scaled by positions."""
    return x[:, None] * 10000.0 ** torch.linspace(0.0, 1.0, 341, device=x.device, dtype=torch.float32)


class RecordedGraph(CustomGraphPass):
    """A user's post-grad pass that keeps the targets of the graph it is given."""

    def __init__(self):
        self.targets = []

    def __call__(self, graph):
        self.targets = [n.target for n in graph.nodes if n.op == "call_function"]

    def uuid(self):
        return None  # no cache: the pass must see the graph


EAGER_LINSPACE = torch.ops.h3_fused.eager_linspace.default


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_linspace_is_eagers_kernel_under_bf16_only(policy, fresh_compile):
    """Inductor's decomposition of ``linspace`` rounds its multiply-adds apart, where eager's CUDA kernel fuses
    them: under ``bf16`` the backend calls eager's ``torch.linspace`` (an op Inductor does not decompose)."""
    recorded = RecordedGraph()
    x = torch.arange(64, dtype=torch.float32)
    got = torch.compile(rotary_frequencies, backend="h3_fused",
                        options={"dtype_policy": policy, "post_grad_custom_post_pass": recorded})(x)
    kept = EAGER_LINSPACE in recorded.targets
    assert kept == (policy == "bf16") and recorded.targets
    if policy == "bf16":
        assert torch.equal(got, rotary_frequencies(x))


@pytest.mark.gpu
def test_linspace_compiled_under_bf16_is_eagers_bits(fresh_compile):
    x = torch.arange(4096, device="cuda", dtype=torch.float32) / 64
    got = torch.compile(rotary_frequencies, backend="h3_fused", options={"dtype_policy": "bf16"})(x)
    assert torch.equal(got, rotary_frequencies(x))


def test_only_linspace_and_logspace_of_numbers_become_eagers_op():
    """Dynamo's graph of calls with numbers (positional or by keyword, ``logspace`` with its base) and of one with a
    tensor for its start, which is left to Inductor."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def spaced(x, start):
        return (torch.linspace(0.0, 1.0, 5, dtype=torch.float32) + x, torch.logspace(0, 2, steps=5, base=3.0) + x,
                torch.linspace(start, 1.0, 5) + x)

    x, start = torch.zeros(5), torch.tensor(0.5)
    torch._dynamo.reset()
    torch.compile(spaced, backend=capture)(x, start)
    (gm,) = graphs
    assert eager_roundings.keep_eager_linspace(gm) == 2
    calls = [n for n in gm.graph.nodes if n.target is EAGER_LINSPACE]
    assert [n.args[:4] for n in calls] == [(0.0, 1.0, 5, None), (0.0, 2.0, 5, 3.0)]
    assert len(gm.graph.find_nodes(op="call_function", target=torch.linspace)) == 1
    assert all(torch.equal(a, b) for a, b in zip(gm(x, start), spaced(x, start), strict=True))


def test_linspace_of_a_symbolic_count_is_eagers_op_too(fresh_compile):
    """A graph compiled for every size: the count a symbol, one graph, eager's values at each size."""
    recorded = RecordedGraph()
    ramp = lambda x: x * torch.linspace(0.0, 1.0, x.shape[0])  # noqa: E731
    compiled = torch.compile(ramp, backend="h3_fused", dynamic=True,
                             options={"dtype_policy": "bf16", "post_grad_custom_post_pass": recorded})
    for n in (5, 9, 17):
        assert torch.equal(compiled(torch.ones(n)), ramp(torch.ones(n)))
    assert EAGER_LINSPACE in recorded.targets
