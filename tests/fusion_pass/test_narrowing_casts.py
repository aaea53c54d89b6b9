"""``KeepNarrowingCasts``: under ``bf16``, a value cast to a narrower float dtype and straight back keeps eager's
rounding on every supported torch (torch 2.11 and 2.12's Inductor drops the narrow cast; the pass restates it in
a form its pattern does not match)."""

import h3_fused
import h3_fused.backend as backend
import pytest
import torch
from h3_fused.narrowing_casts import KeepNarrowingCasts, inductor_drops_narrowing_round_trips
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
    KeepNarrowingCasts()(gm.graph)
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


@pytest.fixture(params=[True, False], ids=["with_the_pass", "without_the_pass"])
def drops(request, monkeypatch):
    """Whether the backend takes Inductor for one that drops narrowing round trips (so sets the pass), whatever
    this torch's Inductor does (torch 2.11, 2.12 drop them; 2.13 on keep them)."""
    monkeypatch.setattr(backend, "inductor_drops_narrowing_round_trips", lambda: request.param)
    return request.param


@pytest.mark.parametrize("policy", ["bf16", "fp32"])
def test_the_backend_installs_it_under_bf16_where_inductor_drops_round_trips_chaining_the_users(policy, drops):
    user = UserJointPass()
    patches = h3_fused.make_config_patches({"dtype_policy": policy, "joint_custom_pre_pass": user})
    if policy == "bf16" and drops:
        assert isinstance(patches["joint_custom_pre_pass"], KeepNarrowingCasts)
        assert patches["joint_custom_pre_pass"].chained == (user,) and patches["joint_custom_pre_pass"].uuid()
    else:
        assert patches["joint_custom_pre_pass"] is user


def test_this_torch_is_known():
    assert inductor_drops_narrowing_round_trips() == (torch.torch_version.TorchVersion(torch.__version__) < "2.13")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_round_trip_through_bf16_keeps_eagers_rounding_with_the_pass(device, drops, fresh_compile):
    """With the pass: eager's bits on every torch. Without it: eager's bits where this torch's Inductor keeps the
    cast, and not where it drops it (as torch 2.11 on an H100 showed: the pass is what keeps the rounding)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(64, 256, generator=g, device=device)
    expected = round_trips(x)
    got = torch.compile(round_trips, backend="h3_fused", options={"dtype_policy": "bf16"})(x)
    equal = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert equal == (drops or not inductor_drops_narrowing_round_trips())
