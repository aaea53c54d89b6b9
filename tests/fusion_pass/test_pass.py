"""The pass and the backend: chaining the user's post-grad passes, the uuid and the caches, options, cost."""

import subprocess
import sys
import time

import h3_fused
import pytest
import torch
import torch.nn.functional as F
from h3_fused import H3FusionPass
from h3_fused.backend import EAGER_NUMERICS, eager_numerics_patches
from h3_fused.graph_pass import INFERENCE_AWARE
from helpers import assert_bf16_policy, bf16, fused_count, fused_sites_in, inductor_matches_eager_on_cpu, inputs, site_a
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

pytestmark = pytest.mark.usefixtures("fresh_compile")


def test_user_post_grad_pass_is_chained_not_dropped():
    seen = []

    def user_pass(graph):
        seen.append(fused_sites_in(graph))

    with torch._inductor.config.patch(post_grad_custom_post_pass=user_pass):
        assert fused_count(site_a) == 1
    assert seen == [1], "the user's pass ran after ours and saw the fused op"
    assert H3FusionPass(h3_fused.FusionOptions(), chained=(user_pass,)).uuid() is None


def test_a_list_of_user_post_grad_passes_runs_after_ours_in_order():
    seen = []

    def first(graph):
        seen.append(("first", fused_sites_in(graph)))

    def second(graph):
        seen.append(("second", fused_sites_in(graph)))

    with torch._inductor.config.patch(post_grad_custom_post_pass=[first, second]):
        assert fused_count(site_a) == 1
    assert seen == [("first", 1), ("second", 1)]


class NamedPass(INFERENCE_AWARE or CustomGraphPass):
    """A user pass with a uuid; inference-aware where this torch has such passes."""

    def __init__(self, name: str, seen: list):
        self.name, self.seen = name, seen

    def __call__(self, graph, is_inference=None):
        self.seen.append((self.name, is_inference))

    def uuid(self):
        return self.name.encode()


def test_user_passes_are_called_as_inductor_calls_them_and_compiling_twice_does_not_nest_our_pass():
    seen = []
    with torch._inductor.config.patch(post_grad_custom_post_pass=NamedPass("mine", seen)):
        patches = h3_fused.make_config_patches({"dtype_policy": "bf16"})
    ours = patches["post_grad_custom_post_pass"]
    assert [type(p) for p in ours.chained] == [NamedPass]
    again = h3_fused.make_config_patches({"post_grad_custom_post_pass": ours})["post_grad_custom_post_pass"]
    assert again.chained == ours.chained, "the user's pass chained once, not our pass inside our pass"
    with torch._inductor.config.patch(post_grad_custom_post_pass=NamedPass("mine", seen)):
        assert fused_count(site_a) == 1
    # torch 2.12 on: Inductor tells our (inference-aware) pass, which tells the user's; 2.11: neither knows
    assert seen == [("mine", True if INFERENCE_AWARE is not None else None)]


def test_uuid_follows_the_user_passes():
    options = h3_fused.FusionOptions("bf16")
    alone = H3FusionPass(options).uuid()
    one = H3FusionPass(options, (NamedPass("a", []),)).uuid()
    assert None not in (alone, one) and len({alone, one, H3FusionPass(options, (NamedPass("b", []),)).uuid()}) == 3
    assert one == H3FusionPass(options, (NamedPass("a", []),)).uuid()
    assert H3FusionPass(options, (NamedPass("a", []), lambda graph: None)).uuid() is None
    assert H3FusionPass(options, NamedPass("a", [])).uuid() == one, "one pass, as Inductor's setting takes it"
    assert H3FusionPass(options, None).uuid() == alone


def test_uuid_covers_options_and_sources():
    a, b = H3FusionPass(h3_fused.FusionOptions("bf16")), H3FusionPass(h3_fused.FusionOptions("fp32"))
    assert a.uuid() != b.uuid() and a.uuid() == H3FusionPass(h3_fused.FusionOptions("bf16")).uuid()


def test_bad_options_raise_clearly():
    with pytest.raises(Exception, match="dtype_policy must be one of"):
        torch.compile(site_a, backend="h3_fused", options={"dtype_policy": "bf17"})(**inputs())
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option 'dtype_polcy' \\(did you mean 'dtype_policy'\\?\\)"):
        torch.compile(site_a, backend="h3_fused", options={"dtype_polcy": "bf16"})(**inputs())


def test_options_are_checked_where_they_are_given_with_the_nearest_known_key():
    from helpers import tiny

    model, _, _ = tiny()
    with pytest.raises(ValueError, match="unknown option 'dtype_polcy' \\(did you mean 'dtype_policy'\\?\\)"):
        h3_fused.compile_repeated_blocks(model, options={"dtype_polcy": "bf16"})
    with pytest.raises(ValueError, match="did you mean 'emulate_precision_casts'"):
        h3_fused.make_config_patches({"emulate_precision_cast": True})
    with pytest.raises(TypeError, match="options must be a dict"):
        h3_fused.make_config_patches([("dtype_policy", "bf16")])


def test_compile_repeated_blocks_refuses_what_it_cannot_compile():
    from helpers import tiny

    model, latents, layout = tiny()
    with pytest.raises(ValueError, match="no repeated block classes"):
        h3_fused.compile_repeated_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="block_classes must hold nn.Module subclasses"):
        h3_fused.compile_repeated_blocks(model, block_classes=[int])
    with pytest.raises(ValueError, match="has no instance in the model"):
        h3_fused.compile_repeated_blocks(model, block_classes=[torch.nn.Conv2d])
    h3_fused.compile_repeated_blocks(model, dynamic_token_dim=5)
    with pytest.raises(ValueError, match="dynamic_token_dim=5: no tensor argument of H3Block has a dim 5"):
        model(latents, layout)


def test_backend_entry_point_and_callable():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "h3_fused"]
    assert eps and eps[0].load() is h3_fused.h3_fused_backend


def test_pass_cost_on_the_tiny_block_is_under_a_second():
    from helpers import tiny

    model, latents, layout = tiny(num_blocks=1, num_refiner_blocks=0, inline_attention=True)
    block = model.blocks[0]
    x = model.patch_embed(latents.to(bf16))
    tables = model.adaln_proj(model.time_embed(layout.timesteps))
    spent = []
    original = H3FusionPass.__call__

    def timed(self, graph, *args, **kwargs):
        start = time.perf_counter()
        original(self, graph, *args, **kwargs)
        spent.append(time.perf_counter() - start)

    H3FusionPass.__call__ = timed
    try:
        with torch.no_grad():
            torch.compile(block, backend="h3_fused")(x, tables, layout.index, layout.positions, layout.cu_seqlens)
    finally:
        H3FusionPass.__call__ = original
    assert spent and sum(spent) < 1.0


CACHE_SCRIPT = r"""
import sys, torch, h3_fused
from torch._dynamo.utils import counters
import torch.nn.functional as F
H = 64
def f(x, w, shift, scale, idx):
    return F.rms_norm(x, (H,), w, 1e-5) * (1 + scale[idx]) + shift[idx]
t = (0.3 * torch.randn(6, 2 * H)).to(torch.bfloat16).chunk(2, -1)
args = (torch.randn(8, H).to(torch.bfloat16), torch.ones(H, dtype=torch.bfloat16), t[0], t[1], torch.randint(0, 6, (8,)))
policy, route, exact = sys.argv[1], sys.argv[2], sys.argv[3] == "exact"
if route == "backend":
    compiled = torch.compile(f, backend="h3_fused", options={"dtype_policy": policy})
else:  # an Inductor setup of one's own
    compiled = torch.compile(f, options=h3_fused.make_config_patches({"dtype_policy": policy}))
out = compiled(*args)
assert policy == "fp32" or not exact or torch.equal(out, f(*args)), "bf16 is eager's bits"
print("hit", counters["inductor"]["fxgraph_cache_hit"], "miss", counters["inductor"]["fxgraph_cache_miss"],
      "aot_hit", counters["aot_autograd"]["autograd_cache_hit"], "fused", counters["h3_fused"]["norm_modulate"])
"""


@pytest.mark.slow
@pytest.mark.parametrize("route", ["backend", "config_patches"])
def test_fx_graph_and_aot_autograd_caches_hit_in_a_fresh_process_and_policy_change_misses(tmp_path, route):
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1"}

    def run(policy):
        exact = "exact" if inductor_matches_eager_on_cpu() else "close"  # the premise of eager's bits here
        out = subprocess.run([sys.executable, "-c", CACHE_SCRIPT, policy, route, exact], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip().splitlines()[-1]

    # through the backend the counters say what the loaded code fuses; the pass alone cannot hear of a hit
    counted_on_a_hit = 1 if route == "backend" else 0
    assert run("bf16") == "hit 0 miss 1 aot_hit 0 fused 1"
    assert run("bf16") == f"hit 1 miss 0 aot_hit 1 fused {counted_on_a_hit}", "fresh process: both caches hit"
    if route == "backend":  # the backend's options are make_config_patches': the key takes the policy alike
        assert run("fp32") == "hit 0 miss 1 aot_hit 0 fused 1", "a policy change misses"


def test_the_bf16_policy_turns_on_inductors_eager_numerics_unless_the_caller_set_them():
    """Under ``bf16`` eager's roundings, IEEE division and denormals in Inductor's own code (each setting this
    torch has); under ``fp32`` none of them; a setting the caller passes wins."""
    patches = eager_numerics_patches()
    assert "emulate_precision_casts" in patches and set(patches) <= set(EAGER_NUMERICS)
    assert all(h3_fused.make_config_patches({"dtype_policy": "bf16"})[name] is True for name in patches)
    assert not set(patches) & set(h3_fused.make_config_patches({"dtype_policy": "fp32"}))
    opted_out = h3_fused.make_config_patches({"dtype_policy": "bf16", **{name: False for name in patches}})
    assert not any(opted_out[name] for name in patches)


def test_an_inductor_setup_of_ones_own_gets_the_fusion_from_make_config_patches():
    """A serving engine's route: plain ``torch.compile`` with Inductor options from ``make_config_patches``, its
    own post-grad pass chained after ours, the policy applied."""
    seen = []

    def engine_pass(graph):
        seen.append(fused_sites_in(graph))

    options = h3_fused.make_config_patches({"dtype_policy": "bf16", "post_grad_custom_post_pass": engine_pass})
    assert all(options[name] is True for name in eager_numerics_patches())
    t = inputs()
    got = torch.compile(site_a, options=options)(**t)
    assert counters["h3_fused"]["norm_modulate"] == 1 and seen == [1]
    assert_bf16_policy(got, site_a(**t))


def test_two_dynamo_graphs_that_lower_to_one_inductor_graph_count_their_own_sites(tmp_path, monkeypatch):
    """``x.float()`` and ``x.to(torch.float32)`` are two Dynamo graphs whose aten graphs are one: each compile
    keeps its own FX graph cache entry (the pass's uuid holds the Dynamo graph's code), so the second runs the
    pass and counts its site instead of loading the first's code, which would count nothing."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    t = inputs()

    def upcast_by_float(x, scale, shift, idx):
        return (F.layer_norm(x.float(), (x.shape[-1],), None, None, 1e-6) * (1 + scale.float()[idx])
                + shift.float()[idx]).to(x.dtype)

    def upcast_by_to(x, scale, shift, idx):
        return (F.layer_norm(x.to(torch.float32), (x.shape[-1],), None, None, 1e-6)
                * (1 + scale.to(torch.float32)[idx]) + shift.to(torch.float32)[idx]).to(x.dtype)

    counted = []
    with torch._inductor.config.patch(fx_graph_cache=True):
        for fn in (upcast_by_float, upcast_by_to):
            torch._dynamo.reset()
            counters.clear()
            torch.compile(fn, backend="h3_fused", options={"dtype_policy": "bf16"})(
                t["x"], t["scale"], t["shift"], t["idx"])
            counted.append((counters["h3_fused"]["norm_modulate"], counters["inductor"]["fxgraph_cache_hit"]))
    assert counted == [(1, 0), (1, 0)]


def test_our_kernels_are_launched_statically_unless_the_caller_says_otherwise():
    """Inductor's static launcher for our (user-defined) Triton kernels, where this torch has the setting; the
    caller's options still win."""
    known = "static_launch_user_defined_triton_kernels" in torch._inductor.config.get_config_copy()
    assert h3_fused.make_config_patches({}).get("static_launch_user_defined_triton_kernels") is (True if known else None)
    if known:
        off = h3_fused.make_config_patches({"static_launch_user_defined_triton_kernels": False})
        assert off["static_launch_user_defined_triton_kernels"] is False
