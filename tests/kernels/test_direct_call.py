"""The public functions run the op's body directly only where nothing could see the call; every traced,
moded, transformed, profiled or grad-recording call goes through the dispatcher (``kernels/direct_call.py``)."""

import pytest
import torch
from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate
from h3_fused.kernels.runtime import untraced
from h3_fused.kernels.testing import site_tensors as make_inputs
from torch.utils._python_dispatch import TorchDispatchMode


def make():
    """``test_ops_cpu.make``'s inputs, the weight as a model holds it: an ``nn.Parameter``."""
    t = make_inputs(tokens=8, hidden=64, table_rows=3)
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


@pytest.fixture
def planned(monkeypatch):
    """The layouts ``plan_direct_call`` was asked to plan, each public function's launches forgotten first."""
    import h3_fused.kernels.ops as ops

    asked = []
    real = ops.plan_direct_call

    def counting(signature, args, kwargs):
        asked.append(tuple(signature.parameters)[0])
        return real(signature, args, kwargs)

    monkeypatch.setattr(ops, "plan_direct_call", counting)
    for public in (norm_modulate, gate_norm_modulate, gate_residual):
        monkeypatch.setattr(public, "launches", {})
    return asked


@pytest.mark.interpreted
def test_a_layout_is_planned_once_and_later_calls_launch_from_it(planned, dispatched_calls):
    """The kernel launched directly from the plan of the first call's layout, on new values of that layout,
    gives the dispatched op's outputs; another row count is another layout."""
    first, later = make(), make_inputs(tokens=8, hidden=64, table_rows=3, seed=1)
    call_each(first)
    assert planned == ["x", "residual", "residual"]
    for launches in (norm_modulate.launches, gate_norm_modulate.launches, gate_residual.launches):
        assert [launch is not None for launch in launches.values()] == [True]
    later["weight"] = torch.nn.Parameter(later["weight"], requires_grad=False)
    direct = call_each(later)
    assert len(planned) == 3 and dispatched_calls == []
    expected = (norm_modulate.dispatched(later["x"], later["weight"], later["shift"], later["scale"], later["index"],
                                         eps=1e-5, policy="bf16"),
                *gate_norm_modulate.dispatched(later["x"], later["gate"], later["branch"], later["weight"],
                                               later["shift"], later["scale"], later["index"], eps=1e-5,
                                               policy="bf16"),
                gate_residual.dispatched(later["x"], later["gate"], later["branch"], later["index"], policy="bf16"))
    for got, want in zip(direct, expected):
        assert torch.equal(got, want)
    call_each(make_inputs(tokens=9, hidden=64, table_rows=3))
    assert len(planned) == 6


@pytest.mark.interpreted
def test_a_cached_layout_still_checks_what_depends_on_values(planned):
    """An index out of range raises at a layout already planned; ``eps=True`` is not the layout of
    ``eps=1`` (a bool is refused where the int is taken)."""
    t = make()
    args = (t["x"], t["weight"], t["shift"], t["scale"])
    norm_modulate(*args, t["index"], eps=1, policy="bf16")
    with pytest.raises(IndexError, match=r"index\[0\] = 3 is not in \[0, 3\)"):
        norm_modulate(*args, torch.full_like(t["index"], 3), eps=1, policy="bf16")
    with pytest.raises(ValueError, match="eps must be a non-negative float"):
        norm_modulate(*args, t["index"], eps=True, policy="bf16")
    assert len(planned) == 2 and len(norm_modulate.launches) == 1  # the refused call planned nothing


@pytest.mark.interpreted
def test_a_layout_the_kernel_cannot_read_in_place_runs_the_body(planned):
    """A column-strided table is copied by the argument checks: its layout has no plan, and its calls are
    still the reference's."""
    t = make()
    shift = t["shift"].t().contiguous().t()  # the same values, column stride K
    assert shift.stride(1) != 1
    for _ in range(2):
        got = norm_modulate(t["x"], t["weight"], shift, t["scale"], t["index"], eps=1e-5, policy="bf16")
    assert list(norm_modulate.launches.values()) == [None] and len(planned) == 1
    assert torch.equal(got, norm_modulate(t["x"], t["weight"], t["shift"], t["scale"], t["index"], eps=1e-5,
                                          policy="bf16"))


def test_the_layouts_kept_are_bounded(planned, monkeypatch):
    """Beyond ``MAX_LAYOUTS`` layouts the one seen first is forgotten (a CPU layout's entry says: no plan)."""
    import h3_fused.kernels.ops as ops

    monkeypatch.setattr(ops, "MAX_LAYOUTS", 2)
    for tokens in (3, 4, 5):
        gate_residual(*(make_inputs(tokens=tokens, hidden=8, table_rows=2)[k] for k in ("x", "gate", "branch", "index")))
    assert [key[2][0][0][0] for key in gate_residual.launches] == [4, 5]


@pytest.mark.interpreted
def test_a_row_strided_view_launches_from_its_plan_in_place(planned):
    """Activations ``[B, T, H]`` read in place from a wider tensor (row stride 200) and an index ``[B, T]``: the
    layout has a plan, and its outputs are the dispatched op's."""
    t = make_inputs(lead=(2, 5), hidden=64, table_rows=3)
    wide = torch.randn(2, 5, 200).to(torch.bfloat16)
    x = wide[..., 10:74]
    assert x.stride() == (1000, 200, 1)
    for _ in range(2):
        got = gate_norm_modulate(x, t["gate"], t["branch"], t["weight"], t["shift"], t["scale"], t["index"],
                                 eps=1e-5, policy="bf16")
    assert [launch is not None for launch in gate_norm_modulate.launches.values()] == [True] and len(planned) == 1
    expected = gate_norm_modulate.dispatched(x, t["gate"], t["branch"], t["weight"], t["shift"], t["scale"],
                                             t["index"], eps=1e-5, policy="bf16")
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


def test_a_compiled_launch_passes_every_kernel_argument_in_the_kernels_order():
    """``CompiledLaunch`` calls the compiled kernel's launcher as Inductor's launchers do: grid, stream, function,
    metadata, no launch metadata or hooks, then every argument of ``modulation_kernel`` in its signature's order
    (the constexprs included); a kernel without such a launcher is not bound."""
    from types import SimpleNamespace

    from h3_fused.kernels.arguments import check_args
    from h3_fused.kernels.forward_kernel import modulation_kernel
    from h3_fused.kernels.launch import ForwardLaunch, plan_launch
    from h3_fused.kernels.launch_plan import constexprs
    from h3_fused.kernels.private_api import no_launch_hooks

    t = make()
    a = check_args(**{k: t[k] for k in ("x", "weight", "shift", "scale", "index")}, residual=None, branch=None,
                   gate=None, eps=1e-5, policy="bf16", norm_rounds_before_weight=False, upcast_tables=False,
                   has_norm=True)
    plan = plan_launch(a)
    calls = []
    compiled = SimpleNamespace(run=lambda *args: calls.append(args), function="f", packed_metadata="m",
                               metadata=None)
    inputs = list(plan.inputs(a))
    y = torch.empty_like(a.x)
    placeholder = plan.placeholder(a)
    plan.launch.bind(compiled)(ForwardLaunch.tensors(inputs, None, y, placeholder), stream=7)
    (args,) = calls
    assert args[:9] == (plan.launch.grid[0], 1, 1, 7, "f", "m", None, None, None)
    by_name = dict(zip(modulation_kernel.arg_names, args[9:], strict=True))
    assert [by_name[name] for name in modulation_kernel.arg_names[:len(plan.slots)]] == [
        placeholder if t is None else t for t in inputs]
    assert placeholder.numel() == 0 and {n for n, slot in zip(modulation_kernel.arg_names, plan.slots)
                                          if slot is None} == {"res_ptr", "branch_ptr", "gate_ptr", "gate_bias_ptr",
                                                               "shift_bias_ptr", "scale_bias_ptr"}
    assert by_name["u_ptr"] is y and by_name["y_ptr"] is y
    assert all(by_name[name] == value for name, value in constexprs(plan.launch.spec).items())
    assert plan.launch.bind(SimpleNamespace()) is None
    assert no_launch_hooks()
