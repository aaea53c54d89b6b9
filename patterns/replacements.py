"""Replace side: put one ``torch.ops.h3_fused`` call where a matched site was.

Two forms: ``decomposed`` (Inductor's post-grad graphs, inference) traces the replacement under
functionalization, so the ``triton_op`` decomposes into its Triton kernel call (inlined by Inductor) on
CUDA, and into the pure-torch reference's operations on the CPU (which Inductor compiles); otherwise (the graph the backend traces before
autograd, training) the replacement is a call of the op itself, whose registered autograd formula
AOT autograd then traces into the fused forward and backward. The traced nodes are spliced in after the
site's last input and before the first outside use of its outputs, carrying the site's activation
checkpointing tags; the site's interior nodes are then erased.
"""

from __future__ import annotations

import contextlib

import torch
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import fwd_only
from torch._subclasses.functional_tensor import dispatch_functionalize
from torch.fx import Graph, Node
from torch.fx.experimental.proxy_tensor import make_fx

from .graph_view import NoMatch, expect
from .sites import Site, SiteKind


def replacement_fn(site: Site, policy: str):
    """``(fn, input_nodes)``: ``fn(*inputs)`` returns the site's outputs through the fused op."""
    names = [k for k, v in site.inputs.items() if v is not None]
    ops = torch.ops.h3_fused
    flags = dict(policy=policy, upcast_tables=site.upcast_tables)
    norm_flags = dict(flags, eps=site.eps, norm_rounds_before_weight=site.norm_rounds_before_weight)
    if site.norm != "rms" or site.norm_in_fp32:  # the defaults stay out of the graph
        norm_flags.update(norm=site.norm, norm_in_fp32=site.norm_in_fp32)

    def fn(*tensors):
        t = dict(zip(names, tensors))
        hidden = t[site.kind.lead].shape[-1]
        for name, (dim, start, length, bias_start) in site.row_views.items():  # rows with a bias: the sum's operands
            t[name] = t[name].narrow(dim, start, length)
            t[f"{name}_bias"] = t[f"{name}_bias"].reshape(-1).narrow(0, bias_start, hidden)
        t.update({name: t[name].reshape(shape) for name, shape in site.row_shapes.items()})
        lead = t[site.kind.lead]
        rows = lead.shape[:-1]  # one index per row: expanded over a batch the gathers broadcast over
        index = None
        if site.gathered:
            index = t["index"].expand(rows) if site.index_broadcast else t["index"].reshape(rows)
        if "choice" in t:  # rows chosen per token between two per sample: gathered from the two stacked, [2B, H]
            samples, hidden = rows[0], lead.shape[-1]
            for name in [k for k in ("shift", "scale", "gate") if f"{k}_second" in t]:
                t[name] = torch.cat([t[name].reshape(samples, hidden), t[f"{name}_second"].reshape(samples, hidden)])
            first = torch.arange(samples, device=lead.device)[:, None]
            index = first + samples * (~t["choice"].reshape(rows)).long()
        if site.copies > 1:  # the norm's modulations as copies of its rows (each with the activations' dims, as
            for name in ("shift", "scale"):  # the op takes them) or of its tables: y [M, ...], one modulation each
                copies = [t[name]] + [t[f"{name}_{j}"] for j in range(1, site.copies)]
                dims = 2 if site.gathered else lead.dim()
                t[name] = torch.stack([c.view((1,) * (dims - c.dim()) + tuple(c.shape)) for c in copies])
        weight = t.get("weight")
        biases = {k: t[k] for k in ("gate_bias", "shift_bias", "scale_bias") if k in t}  # none: the defaults
        if site.kind is SiteKind.NORM_MODULATE:
            y = ops.norm_modulate(lead, weight, t["shift"], t["scale"], index, **biases, **norm_flags)
            return tuple(y.unbind(0)) if site.copies > 1 else (y,)
        if site.kind is SiteKind.GATE_NORM_MODULATE:
            u, y = ops.gate_norm_modulate(lead, t["gate"], t["branch"], weight, t["shift"], t["scale"], index,
                                          **biases, **norm_flags)
            return (u, *y.unbind(0)) if site.copies > 1 else (u, y)
        return (ops.gate_residual(lead, t["gate"], t["branch"], index, **biases, **flags),)

    return fn, [site.inputs[k] for k in names]


def _position(graph: Graph) -> dict[Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


# What the replacement takes over from the site: the model's source line, and the tags with which
# torch.utils.checkpoint's tracing marks its region (the partitioner recomputes such nodes in the backward)
INHERITED_META = ("stack_trace", "nn_module_stack", "recompute", "ac_graph_id")
SITE_META = "h3_fused_site"  # on every node of a replacement: which site it computes, for later passes to read
NORM_META = "h3_fused_norm"  # on every node of an RMSNorm's replacement (``norms.replace_norm``): which norm


def replace_site(graph: Graph, site: Site, policy: str, decomposed: bool = True) -> list[Node]:
    """Splice the fused op in for ``site``; returns its new output nodes (``NoMatch`` if it cannot)."""
    fn, inputs = replacement_fn(site, policy)
    pos = _position(graph)
    last_input = max(inputs, key=pos.__getitem__)
    interior = set(site.interior) | set(site.outputs)
    outside_users = [u for out in site.outputs for u in out.users if u not in interior]
    expect(all(pos[u] > pos[last_input] for u in outside_users),
           "an output is used before every input of the site is ready")
    inherited = {k: site.outputs[-1].meta[k] for k in INHERITED_META if k in site.outputs[-1].meta}
    inherited[SITE_META] = f"{site.kind.value}@{site.outputs[-1].name}"
    new_outputs = splice(graph, fn, inputs, last_input.next, inherited, decomposed)
    for old, new in zip(site.outputs, new_outputs):
        new.meta.setdefault("val", old.meta.get("val"))
        old.replace_all_uses_with(new)
    erase_unused(graph, interior, pos)
    return list(new_outputs)


def splice(graph: Graph, fn, inputs: list[Node], before: Node, meta: dict, decomposed: bool = True) -> tuple:
    """Trace ``fn`` (a tuple of outputs from tensors) on the values of ``inputs`` (``decomposed``: under
    functionalization, so that a ``triton_op`` decomposes into its Triton kernel call; else a call of each op)
    and insert its nodes before ``before``, each with ``meta``; returns the nodes of its outputs."""
    vals = [n.meta["val"] for n in inputs]
    with detect_fake_mode(vals) or contextlib.nullcontext():  # Triton HOPs trace only under the fake mode
        traced = fwd_only(dispatch_functionalize(fn), vals) if decomposed else make_fx(fn)(*vals)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    first = before.prev
    with graph.inserting_before(before):
        outputs = graph.graph_copy(traced.graph, dict(zip(placeholders, inputs)))
    node = first.next
    while node is not before:
        node.meta.update(meta)
        node = node.next
    return outputs


def erase_unused(graph: Graph, nodes, pos: dict[Node, int] | None = None) -> None:
    """Erase the ``nodes`` (a replaced site's or norm's) that nothing uses any more, last first, then whatever
    they used that nothing else uses (gathers, index casts, weight casts)."""
    pos = pos or _position(graph)
    frontier: list[Node] = []
    for node in sorted(set(nodes), key=pos.__getitem__, reverse=True):
        if not node.users:
            frontier += node.all_input_nodes
            graph.erase_node(node)
    while frontier:
        node = frontier.pop()
        if node.op == "call_function" and not node.users and not node.is_impure() and not node._erased:
            frontier += node.all_input_nodes
            graph.erase_node(node)


__all__ = ["NORM_META", "SITE_META", "NoMatch", "erase_unused", "replace_site", "replacement_fn", "splice"]
