"""The public functions run the op's body directly only where nothing could see the call; every traced,
moded, transformed, profiled or grad-recording call goes through the dispatcher (``kernels/direct_call.py``)."""

import pytest
import torch
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels.direct_call import untraced
from test_ops_cpu import make as make_inputs
from torch.utils._python_dispatch import TorchDispatchMode


def make():
    """``test_ops_cpu.make``'s inputs, the weight as a model holds it: an ``nn.Parameter``."""
    t = make_inputs(tokens=8, hidden=64, rows=3)
    t["weight"] = torch.nn.Parameter(t["weight"], requires_grad=False)
    return t


def call_each(t):
    """Each public function once, positional and keyword arguments mixed as users write them."""
    return (norm_modulate(t["x"], t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16"),
            *gate_norm_modulate(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                                eps=1e-5, policy="bf16"),
            gate_residual(residual=t["x"], gate=t["gate"], branch=t["branch"], index=t["index"], policy="bf16"))


@pytest.fixture
def dispatched_calls(monkeypatch):
    """The names of the ops each public function sent through the dispatcher."""
    calls = []
    for public in (norm_modulate, gate_norm_modulate, gate_residual):
        def counting(*args, _name=public.__name__, _dispatched=public.dispatched, **kwargs):
            calls.append(_name)
            return _dispatched(*args, **kwargs)

        monkeypatch.setattr(public, "dispatched", counting, raising=True)
    return calls


class RecordingMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_eager_calls_skip_the_dispatcher_and_match_it(dispatched_calls):
    t = make()
    assert torch.is_grad_enabled()  # no input requires grad: autograd would record nothing
    direct = call_each(t)
    assert dispatched_calls == []
    expected = (norm_modulate.dispatched(t["x"], t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5,
                                         policy="bf16"),
                *gate_norm_modulate.dispatched(t["x"], t["gate"], t["branch"], t["weight"], t["shift"], t["scale"],
                                               t["index"], eps=1e-5, policy="bf16"),
                gate_residual.dispatched(t["x"], t["gate"], t["branch"], t["index"], policy="bf16"))
    for got, want in zip(direct, expected):
        assert torch.equal(got, want)


def test_a_dispatch_mode_sees_every_op():
    t = make()
    with RecordingMode() as mode:
        call_each(t)
    assert [op for op in mode.ops if op.startswith("h3_fused.") and "reference" not in op] == [
        "h3_fused.norm_modulate.default", "h3_fused.gate_norm_modulate.default", "h3_fused.gate_residual.default"]


@pytest.mark.parametrize("context", ["function_mode", "profiler", "vmap", "grad_recorded"])
def test_watched_calls_go_through_the_dispatcher(context, dispatched_calls):
    t = make()
    every = ["norm_modulate", "gate_norm_modulate", "gate_residual"]

    def site_a(x):
        return norm_modulate(x, t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16")

    if context == "function_mode":
        with torch.device("cpu"):
            call_each(t)
        assert dispatched_calls == every
    elif context == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            call_each(t)
        assert dispatched_calls == every
        assert any(e.name == "h3_fused::norm_modulate" for e in prof.events())
    elif context == "vmap":
        xs = torch.stack([t["x"], t["x"].flip(0)])
        with torch.no_grad():
            got = torch.vmap(site_a)(xs)
        assert dispatched_calls == ["norm_modulate"]
        assert torch.equal(got, torch.stack([site_a(x) for x in xs]))
    else:  # autograd records the call: through the dispatcher's autograd layer, which saves for the backward
        t["shift"] = t["shift"].clone().requires_grad_()
        y = site_a(t["x"])
        assert dispatched_calls == ["norm_modulate"] and y.grad_fn is not None


def test_untraced_refuses_subclasses_proxies_and_active_tracers():
    t = make()
    assert untraced([t["x"], t["weight"], None, 1e-5, "bf16", False])
    with torch._subclasses.FakeTensorMode() as fake:
        assert not untraced([fake.from_tensor(t["x"])])
    assert not untraced([torch.fx.Proxy(torch.fx.Graph().placeholder("x"))])
    seen = []
    torch.jit.trace(lambda x: (seen.append(untraced([x])), x + 1)[1], (t["x"],), check_trace=False)
    assert seen == [False]


def test_compiled_and_symbolically_traced_calls_hold_the_op():
    t = make()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def site_a(x):
        return norm_modulate(x, t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5, policy="bf16")

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(site_a, backend=backend, fullgraph=True)(t["x"])
        assert torch.equal(got, site_a(t["x"]))
    assert any("h3_fused.norm_modulate" in str(n.target) for n in graphs[0].graph.nodes)

    class SiteA(torch.nn.Module):
        def forward(self, x, weight, shift, scale, index):
            return norm_modulate(x, weight, shift, scale, index, eps=1e-5, policy="bf16")

    traced = torch.fx.symbolic_trace(SiteA())
    assert any("h3_fused.norm_modulate" in str(n.target) for n in traced.graph.nodes)
