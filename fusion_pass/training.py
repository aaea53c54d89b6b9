"""Fusion before autograd, for graphs that compute gradients (training).

In a training graph Inductor's post-grad passes see the forward and the backward apart, after AOT autograd
has differentiated the unfused site: the forward saves the site's interior values for the backward, and the
backward gathers the table gradients with a scatter. So for such graphs the backend traces Dynamo's graph to
aten first (functionalized, composite ops decomposed, as AOT autograd will see it), replaces each site with
a call of its ``torch.ops.h3_fused`` op, and hands that graph to Inductor: AOT autograd then traces the op's
registered autograd formula, a fused forward and a fused backward (``h3_fused.kernels.backward``), and
computes only the gradients something needs.

The trace keeps what the graph says about gradients: grad-mode switches (``torch.no_grad()`` inside the
model) are recorded as they run, and ``torch.utils.checkpoint`` regions are inlined with the tags its
tracing gives them, which the replacement keeps. A graph holding any other higher-order op is compiled as it
is (``log`` says so), as is a graph in which no site fused: nothing changes for it. The functional copies that
functionalization writes for assignments into slices have no derivative; the trace writes each as ops that
have one (``_differentiable_copy``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx.traceback as fx_traceback
from h3_fused.patterns import NoMatch, Site, find_sites
from torch._dynamo import utils as dynamo_utils
from torch._guards import detect_fake_mode
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx import GraphModule, Interpreter
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx

from .logs import log, refuse
from .options import FusionOptions
from .replace import replace_sites

TRACED_THROUGH = {"tag_activation_checkpoint"}  # higher-order ops whose regions the trace inlines faithfully
GRAD_MODE_SWITCHES = (torch._C._set_grad_enabled,)


def computes_gradients(example_inputs) -> bool:
    """Whether AOT autograd will differentiate a graph with these inputs (as it decides it)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


class _Retracer(Interpreter):
    """Runs Dynamo's graph under ``make_fx``, recording each grad-mode switch as a node as it runs it (a trace
    below autograd would otherwise apply the switch and forget it)."""

    def call_function(self, target, args, kwargs):
        if target in GRAD_MODE_SWITCHES:
            get_proxy_mode().tracer.create_proxy("call_function", target, args, kwargs)
        return super().call_function(target, args, kwargs)


def _unsupported(gm: GraphModule) -> str | None:
    """Why the trace could change what ``gm`` computes, or None."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            if node.target.name() not in TRACED_THROUGH:
                return f"it holds the higher-order op {node.target.name()}"
    return None


def _differentiable_copy(dst, src, non_blocking=False):
    """Functionalization writes an assignment into a slice (``out[..., 0::2] = v``, as Wan's rotary embedding
    does) as ``aten.copy(dst, v)``, which has no derivative, and AOT autograd differentiates the graph it is
    handed: the trace writes it as ``v`` cast to ``dst``'s dtype, broadcast to its shape and copied, the same
    values."""
    return src.to(dst.dtype).expand_as(dst).clone()


# Dynamo compiles inside the user's code, under whatever saved-tensor hooks are active there (a non-reentrant
# ``torch.utils.checkpoint`` around a compiled block counts the tensors its forward saves): a trace must not run
# them, or they count what the trace saves, as AOT autograd does not let its own trace do
_hooks_deferred = getattr(dynamo_utils, "_disable_saved_tensors_hooks_during_tracing", contextlib.nullcontext)


def fuse_before_autograd(gm: GraphModule, example_inputs, options: FusionOptions) -> GraphModule | None:
    """``gm`` traced to aten with every site it holds replaced by its op, or None where nothing fused (or the
    graph cannot be traced faithfully: then ``gm`` is compiled as it is)."""
    why = _unsupported(gm)
    if why is not None:
        log.debug("h3_fused: training graph compiled unfused: %s", why)
        return None
    with _hooks_deferred():
        return _fuse(gm, example_inputs, options)


def _fuse(gm: GraphModule, example_inputs, options: FusionOptions) -> GraphModule | None:
    fake_mode = detect_fake_mode(example_inputs)
    fakes = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(dispatch_functionalize(_Retracer(gm).run), tracing_mode="real",
                         decomposition_table={torch.ops.aten.copy.default: _differentiable_copy})(*fakes)
    traced.graph.eliminate_dead_code()
    sites = []
    for site in find_sites(traced.graph, refuse, note=log.debug, unmergeable=Site.without_fused_backward):
        missing = site.without_fused_backward()
        if missing is None:
            sites.append(site)
        else:
            refuse(site.outputs[-1], NoMatch(f"no fused backward for {missing}, and this graph computes gradients"),
                   f"site {site.kind.letter}")
    if not sites:
        return None
    fused = replace_sites(traced.graph, sites, options, decomposed=False)
    if not fused:
        return None
    traced.graph.eliminate_dead_code()
    traced.graph.lint()
    traced.recompile()
    log.debug("h3_fused: %d site(s) fused before autograd", fused)
    return traced
