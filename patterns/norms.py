"""The norms of a post-grad graph outside the modulation sites, and their replacement by eager's computation of
them: ``torch.ops.h3_fused.eager_rms_norm`` for an RMSNorm, ``torch.ops.h3_fused.eager_layer_norm`` for a LayerNorm
(eager's bits; ``h3_fused.kernels.eager_norm`` says why and how). An RMSNorm on CUDA whose output an elementwise
op reads (the rotary embedding of q and k) keeps only its statistics in an op, ``eager_rms_norm_rstd``, and its
products in the graph, which Inductor fuses into that reader as it would the whole norm.

A norm is matched from its output down, by the same structural matcher as a site's norm (``sites.match_norm``:
``nn.RMSNorm`` / ``F.rms_norm`` with one rounding, or the native spelling with two; ``nn.LayerNorm`` /
``F.layer_norm``, here also with a bias), with or without a weight; the graph is read from its end, so that a
weighted norm is taken whole before its unweighted core is seen. Nodes of a fused site's replacement (which on
the CPU spell the site's own norm in torch ops) are never taken. A norm whose intermediate values are used
elsewhere (the inverse RMS saved for a backward, say) is left as it is. Norms of the activations upcast to fp32
whose output stays fp32 are left to Inductor.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from .graph_view import ADD, CONVERT, MUL, NoMatch, aten, device_of, dtype_of, is_op, shape_of
from .replacements import INHERITED_META, NORM_META, SITE_META, erase_unused, splice
from .sites import ACTIVATION_DTYPES, Norm, check_interior, match_norm


@dataclass
class StandaloneNorm:
    """A norm outside every site: its output node, what ``match_norm`` found, and whether it is replaced by its
    statistics and its products (``applies_statistics``)."""

    output: Node
    norm: Norm
    statistics_alone: bool = False


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
        found.append(StandaloneNorm(node, norm, applies_statistics(node, norm)))
        taken.update(inside)
    return found[::-1]


# where Inductor's elementwise code computes the products of a norm applied from its statistics as eager's norm
# kernel does (its C++ code on the CPU drops bf16 roundings before torch 2.13, and eager's CPU norm may vectorize
# its products otherwise: there the whole norm stays one op)
STATISTICS_ALONE_ON = ("cuda",)


def _is_view(node: Node) -> bool:
    """A view op (its result aliases its input: ``view``, ``permute``, ``unbind``, ...), or an item of one's list."""
    if node.target is operator.getitem:
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema and schema.returns and schema.returns[0].alias_info and not schema.is_mutable)


def read_elementwise(node: Node) -> bool:
    """Whether an elementwise op (``torch.Tag.pointwise``, or a ``cat`` or ``stack`` of such values) reads
    ``node``, directly or through views: where Inductor would fuse the norm's products into the reader."""
    for user in node.users:
        if user.op != "call_function":
            continue
        if torch.Tag.pointwise in getattr(user.target, "tags", ()) or user.target in (aten.cat.default,
                                                                                       aten.stack.default):
            return True
        if _is_view(user) and read_elementwise(user):
            return True
    return False


def applies_statistics(output: Node, norm: Norm) -> bool:
    """Whether the norm ``norm`` ending in ``output`` is replaced by its statistics and its products
    (``replace_norm``): an RMSNorm on a device of ``STATISTICS_ALONE_ON``, its weight (if any) of its input's dtype
    (with another, eager computes the norm by other ops), read by an elementwise op."""
    device = device_of(output)
    return (norm.kind == "rms" and device is not None and device.type in STATISTICS_ALONE_ON
            and (norm.weight is None or dtype_of(norm.weight) == dtype_of(norm.x)) and read_elementwise(output))


def replace_norm(graph: Graph, found: StandaloneNorm) -> Node:
    """Put one ``eager_rms_norm`` or ``eager_layer_norm`` call where the norm was, or (``found.statistics_alone``)
    one ``eager_rms_norm_rstd`` call and the products ``eager_rms_norm`` computes from its ``r``, the same bits,
    traced under functionalization (on CUDA, where the ops launch the forward kernel, Inductor then inlines the
    kernel); returns the node of its output. A LayerNorm is computed as the graph computes it, on its input upcast to fp32 with its
    weight and bias upcast (exact), then rounded to the output's dtype: eager's ``F.layer_norm`` of the activations
    computes in fp32 and rounds once, the same bits."""
    norm, output = found.norm, found.output
    parameters = {k: v for k, v in (("weight", norm.weight), ("bias", norm.bias)) if v is not None}
    dtype = dtype_of(output)

    def rms(x, weight=None):
        if not found.statistics_alone:
            return (torch.ops.h3_fused.eager_rms_norm(x, weight, norm.eps, norm.rounds_before_weight),)
        # eager_rms_norm's products on its statistics: R(R(x32 * r) * w) for the native spelling, else R(x32 * r * w32)
        normed = x.float() * torch.ops.h3_fused.eager_rms_norm_rstd(x, norm.eps, norm.rounds_before_weight)
        if norm.rounds_before_weight:
            out = normed.to(x.dtype)
            return (out if weight is None else out * weight.to(x.dtype),)
        return ((normed if weight is None else normed * weight.float()).to(x.dtype),)

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
