"""The norms of a post-grad graph outside the modulation sites, and their replacement by eager's computation of
them: ``torch.ops.h3_fused.eager_rms_norm`` for an RMSNorm, ``torch.ops.h3_fused.eager_layer_norm`` for a LayerNorm
(eager's bits; ``h3_fused.kernels.eager_norm`` says why and how).

A norm is matched from its output down, by the same structural matcher as a site's norm (``sites.match_norm``:
``nn.RMSNorm`` / ``F.rms_norm`` with one rounding, or the native spelling with two; ``nn.LayerNorm`` /
``F.layer_norm``, here also with a bias), with or without a weight; the graph is read from its end, so that a
weighted norm is taken whole before its unweighted core is seen. Nodes of a fused site's replacement (which on
the CPU spell the site's own norm in torch ops) are never taken. A norm whose intermediate values are used
elsewhere (the inverse RMS saved for a backward, say) is left as it is. Norms of the activations upcast to fp32
whose output stays fp32 are left to Inductor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .graph_view import ADD, CONVERT, MUL, NoMatch, dtype_of, is_op, shape_of
from .replacements import INHERITED_META, NORM_META, SITE_META, erase_unused, splice
from .sites import ACTIVATION_DTYPES, Norm, check_interior, match_norm


@dataclass
class StandaloneNorm:
    """A norm outside every site: its output node and what ``match_norm`` found."""

    output: Node
    norm: Norm


def _is_candidate(node: Node) -> bool:
    """A value a norm can end in: a product, a sum (a bias) or a cast, in an activation dtype, with a last dim."""
    return (node.op == "call_function" and SITE_META not in node.meta and is_op(node, MUL + ADD + CONVERT)
            and dtype_of(node) in ACTIVATION_DTYPES and bool(shape_of(node)))


def find_norms(graph: Graph, refuse=lambda node, why: None, wanted=lambda node: True) -> list[StandaloneNorm]:
    """The norms of ``graph`` outside its sites whose output ``wanted`` takes, in graph order. ``refuse(node,
    why)`` hears of each such norm that cannot be replaced (its intermediate values used elsewhere), not again of
    the norms inside it."""
    found, taken, refused = [], set(), set()
    for node in reversed(graph.nodes):
        if node in taken or not _is_candidate(node) or not wanted(node):
            continue
        try:
            norm = match_norm(node, dtype_of(node), shape_of(node)[-1], bias_allowed=True)
        except NoMatch:
            continue  # not a norm
        if norm.in_fp32:
            continue  # the eager ops compute norms whose output has the activations' dtype
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
    """Put one ``eager_rms_norm`` or ``eager_layer_norm`` call where the norm was, traced under functionalization
    (on CUDA, where ``eager_rms_norm`` launches the forward kernel, Inductor then inlines the kernel); returns the
    node of its output. A LayerNorm is computed as the graph computes it, on its input upcast to fp32 with its
    weight and bias upcast (exact), then rounded to the output's dtype: eager's ``F.layer_norm`` of the activations
    computes in fp32 and rounds once, the same bits."""
    norm, output = found.norm, found.output
    parameters = {k: v for k, v in (("weight", norm.weight), ("bias", norm.bias)) if v is not None}
    dtype = dtype_of(output)

    def rms(x, weight=None):
        return (torch.ops.h3_fused.eager_rms_norm(x, weight, norm.eps, norm.rounds_before_weight),)

    def layer(x, *values):
        given = {k: v.float() for k, v in zip(parameters, values)}
        out = torch.ops.h3_fused.eager_layer_norm(x.float(), given.get("weight"), given.get("bias"), norm.eps)
        return (out.to(dtype),)

    meta = {k: output.meta[k] for k in INHERITED_META if k in output.meta}
    op = f"eager_{norm.kind}_norm"
    (new,) = splice(graph, layer if norm.kind == "layer" else rms, [norm.x, *parameters.values()], output,
                    dict(meta, **{NORM_META: f"{op}@{output.name}"}))
    new.meta.setdefault("val", output.meta.get("val"))
    output.replace_all_uses_with(new)
    erase_unused(graph, norm.nodes)
    return new
