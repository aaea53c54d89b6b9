"""The RMSNorms of a post-grad graph outside the modulation sites, and their replacement by
``torch.ops.h3_fused.eager_rms_norm`` (eager's bits; ``h3_fused.kernels.eager_norm`` says why and how).

A norm is matched from its output down, by the same structural matcher as a site's norm (``sites.match_norm``:
``nn.RMSNorm`` / ``F.rms_norm`` with one rounding, or the native spelling with two), with or without a weight;
the graph is read from its end, so that a weighted norm is taken whole before its unweighted core is seen.
Nodes of a fused site's replacement (which on the CPU spell the site's own norm in torch ops) are never taken.
A norm whose intermediate values are used elsewhere (the inverse RMS saved for a backward, say) is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .graph_view import CONVERT, MUL, NoMatch, dtype_of, is_op, shape_of
from .replacements import INHERITED_META, NORM_META, SITE_META, erase_unused, splice
from .sites import ACTIVATION_DTYPES, Norm, check_interior, match_norm


@dataclass
class StandaloneNorm:
    """An RMSNorm outside every site: its output node and what ``match_norm`` found."""

    output: Node
    norm: Norm


def _is_candidate(node: Node) -> bool:
    """A value a norm can end in: a product or a cast, in an activation dtype, with a last dim."""
    return (node.op == "call_function" and SITE_META not in node.meta and (is_op(node, MUL) or is_op(node, CONVERT))
            and dtype_of(node) in ACTIVATION_DTYPES and bool(shape_of(node)))


def find_norms(graph: Graph, refuse=lambda node, why: None, wanted=lambda node: True) -> list[StandaloneNorm]:
    """The RMSNorms of ``graph`` outside its sites whose output ``wanted`` takes, in graph order. ``refuse(node,
    why)`` hears of each such norm that cannot be replaced (its intermediate values used elsewhere), not again of
    the norms inside it."""
    found, taken, refused = [], set(), set()
    for node in reversed(graph.nodes):
        if node in taken or not _is_candidate(node) or not wanted(node):
            continue
        try:
            norm = match_norm(node, dtype_of(node), shape_of(node)[-1])
        except NoMatch:
            continue  # not a norm
        if norm.kind != "rms" or norm.in_fp32:
            continue  # eager_rms_norm computes RMSNorms of the activations only
        inside = set(norm.nodes)
        if any(SITE_META in n.meta for n in inside):
            continue  # part of a fused site's replacement
        try:
            check_interior([n for n in norm.nodes if n is not node], inside)
        except NoMatch as why:
            if node not in refused:  # a norm inside a refused one is tried (its output may be what is shared), once told
                refuse(node, why)
            refused.update(inside)
            continue
        found.append(StandaloneNorm(node, norm))
        taken.update(inside)
    return found[::-1]


def replace_norm(graph: Graph, found: StandaloneNorm) -> Node:
    """Put one ``eager_rms_norm`` call where the norm was, traced under functionalization (on CUDA, where it
    launches the forward kernel, Inductor then inlines the kernel); returns the node of its output."""
    norm, output = found.norm, found.output
    inputs = [n for n in (norm.x, norm.weight) if n is not None]

    def fn(x, weight=None):
        return (torch.ops.h3_fused.eager_rms_norm(x, weight, norm.eps, norm.rounds_before_weight),)

    meta = {k: output.meta[k] for k in INHERITED_META if k in output.meta}
    (new,) = splice(graph, fn, inputs, output, dict(meta, **{NORM_META: f"eager_rms_norm@{output.name}"}))
    new.meta.setdefault("val", output.meta.get("val"))
    output.replace_all_uses_with(new)
    erase_unused(graph, norm.nodes)
    return new
