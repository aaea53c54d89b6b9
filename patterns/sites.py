"""Search side of the three modulation sites: structural matchers over aten FX graphs.

Each ``*_site`` function takes a candidate output node and returns a ``Site`` (its kind, its input nodes,
the rounding points the graph performs, and the interior nodes a replacement removes) or raises
``NoMatch`` with the reason. Operand order of ``+`` and ``*`` does not matter; table upcasts (``.float()``
before or after the gather), ``.to(long)`` on the index and index views are looked through. Every check
the fused op's contract needs is made here, so that a match is always safe. ``[R]`` marks a rounding the
graph may or may not perform (the ``Site`` records which):

    SiteKind.NORM_MODULATE       (site A)  y = [R](n * [R](1 + scale[idx]) + shift[idx]),  n = RMSNorm(x)
    SiteKind.GATE_RESIDUAL       (site C)  u = [R](res + [R](gate[idx] * branch))
    SiteKind.GATE_NORM_MODULATE  (site B)  C followed by A on the stored residual u

The graphs are Inductor's post-grad graphs (inference) or the aten graph the backend traces before
autograd (training, ``h3_fused.training``); both spell the math with the ops ``graph_view`` names.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from .graph_view import (
    ADD,
    CONVERT,
    GATHER,
    MUL,
    VIEW,
    NoMatch,
    aten,
    describe,
    device_of,
    dtype_of,
    either_order,
    expect,
    is_op,
    is_scalar,
    operands,
    same_shape,
    same_size,
    shape_of,
    source_of,
    strip_converts,
    strip_views,
)

LOW_PRECISION = (torch.bfloat16, torch.float16)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DEVICES = ("cuda", "cpu")
f32 = torch.float32


@dataclass
class Gather:
    """``table[index]`` per token; ``upcast`` when the table is converted to fp32 around the gather."""

    output: Node
    table: Node
    index: Node
    upcast: bool
    nodes: list[Node]


def match_gather(node: object) -> Gather:
    nodes = []
    top = node
    while is_op(top, CONVERT) or is_op(top, VIEW):
        nodes.append(top)
        top = top.args[0]
    expect(is_op(top, GATHER), f"{describe(top)} is not a per-token gather of table rows (`table[index]`)",
           hint=_row_source_hint(node, top))
    nodes.append(top)
    if top.target == aten.index.Tensor:
        table, indices = top.args
        expect(len(indices) == 1 and indices[0] is not None, "the table is indexed along another dim than its rows")
        index = indices[0]
    else:
        table, dim, index = top.args
        expect(dim == 0, f"the table is gathered along dim {dim}, not its rows")
    table_src = strip_converts(table)
    index_src = strip_views(strip_converts(strip_views(index)))
    expect(dtype_of(index_src) in (torch.int32, torch.int64), f"the index is {dtype_of(index_src)}, not int32 or int64")
    expect(shape_of(table_src) is not None and len(shape_of(table_src)) == 2,
           f"the gathered table has shape {shape_of(table_src)}, not [K, H]")
    table_dtype = dtype_of(table_src)
    expect(table_dtype in ACTIVATION_DTYPES, f"the table is {table_dtype}")
    upcast = table_dtype in LOW_PRECISION and dtype_of(node) == f32
    expect(dtype_of(node) in (table_dtype, f32), f"the gathered rows are converted to {dtype_of(node)}")
    return Gather(node, table_src, index_src, upcast, nodes)


def _row_source_hint(rows: object, source: object) -> str | None:
    """What the rows ``rows`` (which come from ``source``, not a gather) are, where that helps: modulation
    broadcast per sample (one row per sample, or one for all), or rows split after their gather."""
    shape = shape_of(rows)
    if shape is not None and (len(shape) < 2 or same_size(shape[-2], 1)):
        return "modulation broadcast per sample (`scale[:, None]`, as in Flux or Wan) is not fused"
    if is_op(source, (operator.getitem,)) and is_op(source.args[0], (aten.split.Tensor, aten.split_with_sizes.default)):
        if is_op(strip_views(strip_converts(source.args[0].args[0])), GATHER):
            return ("the rows are gathered and then split (`table[index].chunk(n)`); each table gathered on its own "
                    "(`table.chunk(n)[k][index]`) fuses")
    return None


def _is_gather(node: object) -> bool:
    try:
        match_gather(node)
        return True
    except NoMatch:
        return False


@dataclass
class Norm:
    """``RMSNorm(x)`` over the last dim, spelled ``nn.RMSNorm`` (one rounding) or natively (two)."""

    x: Node
    weight: Node | None
    eps: float
    rounds_before_weight: bool
    nodes: list[Node]


def _match_norm_core(node: object, act: torch.dtype):
    """``x32 * rsqrt(mean(x32^2, -1, keepdim) + eps)`` -> (x, eps, nodes)."""
    x32, r = either_order(operands(node, MUL, "x * rsqrt(mean(x^2) + eps)"),
                          lambda v: not is_op(v, (aten.rsqrt.default,)), "the input of the norm")
    expect(is_op(r, (aten.rsqrt.default,)), "the normalized value has no `rsqrt(mean(x^2) + eps)` factor: not an RMSNorm")
    expect(not is_op(x32, (aten.sub.Tensor,)), "the norm subtracts the mean: a LayerNorm",
           hint="LayerNorm is not fused, only RMSNorm")
    shifted = r.args[0]
    mean, eps = either_order(operands(shifted, ADD, "mean(x^2) + eps"), lambda v: is_op(v, (aten.mean.dim,)),
                             "the mean of the squares")
    expect(isinstance(eps, (int, float)) and not isinstance(eps, bool), "the norm's eps is not a constant",
           hint="a float attribute becomes a graph input under dynamic=True: pass eps as nn.RMSNorm does, "
                "or compile with dynamic_token_dim instead")
    sq_in, dims = mean.args[0], mean.args[1]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    rank = len(shape_of(x32) or ())
    expect(keepdim and len(dims) == 1 and dims[0] in (-1, rank - 1), f"the norm reduces dims {dims}, not the last")
    expect(not mean.kwargs.get("dtype"), "the norm's mean converts its dtype")
    if is_op(sq_in, (aten.pow.Tensor_Scalar,)):
        expect(sq_in.args[0] is x32 and is_scalar(sq_in.args[1], 2), "the mean is not of the squares of the normalized value")
    else:
        a, b = operands(sq_in, MUL, "x * x")
        expect(a is x32 and b is x32, "the mean is not of the squares of the normalized value")
    expect(dtype_of(x32) == f32, f"the norm computes in {dtype_of(x32)}, not fp32")
    x = x32.args[0] if is_op(x32, CONVERT) else x32
    expect(dtype_of(x) == act, f"the norm's input is {dtype_of(x)}, its output {act}")
    nodes = [node, r, shifted, mean, sq_in] + ([x32] if x32 is not x else [])
    return x, float(eps), nodes


def _weight_source(w: object, hidden: int) -> Node:
    src = strip_converts(w)
    expect(isinstance(src, Node) and same_shape(shape_of(src), (hidden,)), f"the norm's weight is not [H={hidden}]")
    expect(dtype_of(src) in ACTIVATION_DTYPES, f"the norm's weight is {dtype_of(src)}")
    return src


def _match_fused_norm(n: Node, act: torch.dtype, hidden: int) -> Norm:
    """``n = _fused_rms_norm(x, [H], w, eps)[0]``: ``nn.RMSNorm`` / ``F.rms_norm`` as the graph traced before
    autograd holds it on CUDA (one rounding, ``R(x32 * r * w32)``); ``eps=None`` is fp32's machine epsilon."""
    fused = n.args[0]
    x, shape, weight, eps = (list(fused.args) + [None, None])[:4]
    expect(isinstance(shape, (list, tuple)) and len(shape) == 1 and same_size(shape[0], hidden),
           f"the norm is over {shape}, not the last dim H={hidden}")
    expect(dtype_of(x) == act, f"the norm's input is {dtype_of(x)}, its output {act}")
    expect(eps is None or (isinstance(eps, (int, float)) and not isinstance(eps, bool)), "the norm's eps is not a constant")
    eps = torch.finfo(torch.promote_types(act, f32)).eps if eps is None else float(eps)
    return Norm(x, _weight_source(weight, hidden) if weight is not None else None, eps, False, [n, fused])


def match_norm(n: object, act: torch.dtype, hidden: int) -> Norm:
    """``n`` is the norm output in the activation dtype ``act``."""
    if is_op(n, (operator.getitem,)) and is_op(n.args[0], (aten._fused_rms_norm.default,)) and n.args[1] == 0:
        return _match_fused_norm(n, act, hidden)
    nodes: list[Node] = []
    weight, before = None, False
    top = n
    if act != f32 and is_op(top, MUL) and dtype_of(top) == act:  # native: R(R(x*r) * w)
        cast, w = either_order(operands(top, MUL, "normed * weight"), lambda v: is_op(v, CONVERT),
                               "the normalized value cast to the activation dtype")
        weight, before = _weight_source(w, hidden), True
        nodes += [top] + ([w] if w is not weight else [])
        top = cast
    if act != f32:
        expect(is_op(top, CONVERT) and dtype_of(top) == act, f"the value modulated is {describe(top)}, not a norm cast to {act}")
        nodes.append(top)
        top = top.args[0]
    if weight is None:
        a, b = operands(top, MUL, "normed [* weight]")
        if not (is_op(a, (aten.rsqrt.default,)) or is_op(b, (aten.rsqrt.default,))):  # (x * r) * w
            core, w = either_order((a, b), lambda v: is_op(v, MUL), "the normalized value")
            weight = _weight_source(w, hidden)
            nodes += [top] + ([w] if w is not weight else [])
            top = core
    x, eps, core_nodes = _match_norm_core(top, act)
    return Norm(x, weight, eps, before, nodes + core_nodes)


@dataclass
class Affine:
    """``y = [R](n * [R](1 + scale[idx]) + shift[idx])`` in ``compute`` dtype, output in ``act``."""

    y: Node
    n: Node
    shift: Gather
    scale: Gather
    compute: torch.dtype
    nodes: list[Node]


def _site_output(out: object) -> tuple[torch.dtype, Node, list[Node]]:
    """``(activation dtype, the value before an optional final cast, [that cast])`` of a site output."""
    expect(isinstance(out, Node), "not a value of the graph")
    act = dtype_of(out)
    expect(act in ACTIVATION_DTYPES, f"the output is {act}, not bf16, fp16 or fp32")
    if is_op(out, CONVERT):
        return act, out.args[0], [out]
    return act, out, []


ADDCMUL = (aten.addcmul.default,)


def match_affine(y: object) -> Affine:
    act, top, nodes = _site_output(y)
    expect(not is_op(top, ADDCMUL), "`torch.addcmul(shift, n, 1 + scale)` (the product not rounded before the add) "
                                    "is not fused")
    compute = dtype_of(top)
    q, shift_rows = either_order(operands(top, ADD, "n * (1 + scale[idx]) + shift[idx]"), lambda v: is_op(v, MUL),
                                 "a product")
    shift = match_gather(shift_rows)
    p, n = either_order(operands(q, MUL, "n * (1 + scale[idx])"), lambda v: is_op(v, ADD) and
                        any(is_scalar(a, 1.0) for a in v.args), "`1 + scale[idx]`")
    scale_rows, one = either_order(operands(p, ADD, "1 + scale[idx]"), lambda v: isinstance(v, Node), "a tensor")
    expect(is_scalar(one, 1.0), f"the scale term adds {one!r}, not 1")
    scale = match_gather(scale_rows)
    expect({dtype_of(p), dtype_of(q), compute} == {compute}, "the modulation mixes dtypes between its steps")
    expect(compute in (act, f32), f"the modulation computes in {compute}")
    nodes += [top, q, p]
    return Affine(y, n, shift, scale, compute, nodes)


@dataclass
class Gated:
    """``u = [R](res + [R](gate[idx] * branch))``; ``product`` is the dtype of the product."""

    u: Node
    residual: Node
    branch: Node
    gate: Gather
    product: torch.dtype
    nodes: list[Node]


def match_gated(u: object) -> Gated:
    act, top, nodes = _site_output(u)
    expect(not is_op(top, ADDCMUL), "`torch.addcmul(residual, gate, branch)` (the product not rounded before the "
                                    "add) is not fused")

    def gated_product(v):
        return is_op(v, MUL) and len(v.args) == 2 and any(_is_gather(a) for a in v.args)

    res, prod = either_order(operands(top, ADD, "res + gate[idx] * branch"), lambda v: not gated_product(v),
                             "the residual")
    expect(gated_product(prod), "no `gate[idx] * branch` term")
    gate_rows, branch = either_order(operands(prod, MUL, "gate[idx] * branch"), _is_gather, "a gather of table rows")
    gate = match_gather(gate_rows)
    expect(not _is_gather(res), "the residual is itself a gather of table rows, not a residual stream")
    for name, v in (("residual", res), ("branch", branch)):
        expect(dtype_of(v) == act and same_shape(shape_of(v), shape_of(u)),
               f"the {name} is {dtype_of(v)} {shape_of(v)}, the output {act} {shape_of(u)}")
    expect(dtype_of(top) in (act, f32) and dtype_of(prod) == dtype_of(top), "the gated residual mixes dtypes")
    return Gated(u, res, branch, gate, dtype_of(prod), nodes + [top, prod])


def check_site(outputs: list[Node], gathers: list[Gather], act_node: Node, interior: list[Node]) -> bool:
    """Checks shared by every site: one index, [K, H] tables, device, interior values used only inside.
    Returns whether the index broadcasts over leading dims of the activations (``index_broadcast``)."""
    hidden = shape_of(act_node)[-1]
    index = gathers[0].index
    for g in gathers:
        expect(g.index is index, "its tables are gathered with different index tensors")
        expect(same_size(shape_of(g.table)[1], hidden), f"a table is {shape_of(g.table)[1]} wide, the activations {hidden}")
        expect(same_size(shape_of(g.table)[0], shape_of(gathers[0].table)[0]),
               "tables of one site have different row counts")
    lead = shape_of(act_node)[:-1]
    broadcast = not same_size(_numel(shape_of(index)), _numel(lead))
    expect(not broadcast or broadcasts_to(shape_of(index), lead),
           f"the index has shape {shape_of(index)}, the activations {lead} rows")
    device = device_of(act_node)
    expect(device is not None and device.type in DEVICES, f"the activations are on {device}, not CUDA or the CPU")
    for g in gathers:
        expect(device_of(g.table) == device and device_of(index) == device, "its tensors are on different devices")
    inside = set(interior) | set(outputs)
    check_interior(interior, inside)
    return broadcast


def broadcasts_to(index_shape, rows) -> bool:
    """Whether ``table[index]`` rows broadcast over the activations' ``rows`` dims as ``index.expand(rows)``
    (dims aligned from the right, each equal or 1: one layout shared by every sample of a batch)."""
    if len(index_shape) > len(rows):
        return False
    return all(same_size(i, r) or same_size(i, 1) for i, r in zip(index_shape, rows[len(rows) - len(index_shape):]))


def check_interior(interior: list[Node], inside: set[Node]) -> None:
    for node in interior:
        outside = [u for u in node.users if u not in inside]
        if outside:
            raise NoMatch(f"an intermediate value ({describe(node)}) is also used elsewhere, by {describe(outside[0])}"
                          f"{source_of(outside[0], ' at ')}",
                          hint="in a training graph Inductor's post-grad pass sees values saved for the backward: "
                               "compile with backend='h3_fused', which fuses before autograd, or run inference "
                               "under torch.no_grad()")


def _numel(shape) -> object:
    total = 1
    for s in shape:
        total = total * s
    return total


class SiteKind(enum.Enum):
    """What a site computes; its value is the name of the ``torch.ops.h3_fused`` op that replaces it."""

    NORM_MODULATE = "norm_modulate"  # site A: y from x
    GATE_NORM_MODULATE = "gate_norm_modulate"  # site B: (u, y) from residual, gate, branch
    GATE_RESIDUAL = "gate_residual"  # site C: u from residual, gate, branch

    @property
    def letter(self) -> str:
        """The spec's name of the site: ``A``, ``B`` or ``C``."""
        return {"norm_modulate": "A", "gate_norm_modulate": "B", "gate_residual": "C"}[self.value]

    @property
    def has_norm(self) -> bool:
        return self is not SiteKind.GATE_RESIDUAL

    @property
    def has_gate(self) -> bool:
        return self is not SiteKind.NORM_MODULATE

    @property
    def lead(self) -> str:
        """The input whose shape, dtype and device the outputs take."""
        return "residual" if self.has_gate else "x"


@dataclass
class Site:
    """A matched site: what to call, with which input nodes, and which nodes it replaces."""

    kind: SiteKind
    outputs: list[Node]  # (y,), (u, y) or (u,)
    inputs: dict[str, Node | None]
    eps: float
    norm_rounds_before_weight: bool
    upcast_tables: bool
    interior: list[Node] = field(default_factory=list)
    index_broadcast: bool = False  # the index is expanded over leading dims of the activations (a batch)

    @property
    def lead(self) -> Node:
        return self.inputs[self.kind.lead]


def _upcast(gathers: list[Gather], compute: torch.dtype) -> bool:
    flags = {g.upcast for g in gathers}
    expect(len(flags) == 1, "some of its tables are upcast to fp32 and others are not")
    upcast = flags.pop()
    expect(upcast == (compute == f32 and dtype_of(gathers[0].table) in LOW_PRECISION),
           "the tables' upcast and the dtype of the modulation disagree")
    return upcast


def _gather_interior(gathers: list[Gather]) -> list[Node]:
    """Conversions/views wrapped around a gather belong to the site; the gather itself may be shared."""
    return [n for g in gathers for n in g.nodes[:-1]]


def norm_modulate_site(y: Node) -> Site:
    aff = match_affine(y)
    act = dtype_of(y)
    hidden = shape_of(y)[-1]
    norm = match_norm(aff.n, act, hidden)
    gathers = [aff.scale, aff.shift]
    expect(same_shape(shape_of(norm.x), shape_of(y)), "the output's shape is not the norm input's (a broadcast)")
    upcast = _upcast(gathers, aff.compute) if aff.compute != act else False
    expect(aff.compute == act or upcast or dtype_of(aff.scale.table) == f32,
           f"the modulation computes in {aff.compute} with {dtype_of(aff.scale.table)} tables")
    interior = aff.nodes + norm.nodes + _gather_interior(gathers)
    interior = [n for n in interior if n is not y]
    broadcast = check_site([y], gathers, norm.x, interior)
    return Site(SiteKind.NORM_MODULATE, [y], dict(x=norm.x, weight=norm.weight, shift=aff.shift.table, scale=aff.scale.table,
                               index=aff.scale.index), norm.eps, norm.rounds_before_weight, upcast, interior, broadcast)


def gate_residual_site(u: Node) -> Site:
    gated = match_gated(u)
    act = dtype_of(u)
    upcast = _upcast([gated.gate], gated.product) if gated.product != act else False
    interior = [n for n in gated.nodes + _gather_interior([gated.gate]) if n is not u]
    broadcast = check_site([u], [gated.gate], u, interior)
    return Site(SiteKind.GATE_RESIDUAL, [u], dict(residual=gated.residual, gate=gated.gate.table, branch=gated.branch,
                               index=gated.gate.index), 0.0, False, upcast, interior, broadcast)


def merge_gate_and_norm(c: Site, a: Site) -> Site:
    """Site C whose stored residual is the input of site A: one B-shaped site with outputs (u, y)."""
    u = c.outputs[0]
    expect(a.inputs["x"] is u, "the norm input is not this gated residual")
    expect(a.inputs["index"] is c.inputs["index"], "the gate and the modulation use different index tensors")
    expect(a.upcast_tables == c.upcast_tables, "the gate and the modulation tables differ in upcasting")
    expect(same_size(shape_of(c.inputs["gate"])[0], shape_of(a.inputs["shift"])[0]), "gate and modulation tables differ in K")
    inputs = dict(residual=c.inputs["residual"], gate=c.inputs["gate"], branch=c.inputs["branch"],
                  weight=a.inputs["weight"], shift=a.inputs["shift"], scale=a.inputs["scale"],
                  index=c.inputs["index"])
    interior = c.interior + a.interior
    check_interior(interior, set(interior) | {u, a.outputs[0]})
    return Site(SiteKind.GATE_NORM_MODULATE, [u, a.outputs[0]], inputs, a.eps, a.norm_rounds_before_weight, a.upcast_tables,
                interior, c.index_broadcast)


def _anchor_top(node: Node) -> object:
    """A site's output is an ``add``, or the fp32 -> low-precision cast of one (fp32 affine)."""
    if is_op(node, CONVERT):
        return node.args[0] if dtype_of(node.args[0]) == f32 and dtype_of(node) in LOW_PRECISION else None
    return node


def _products(top: object) -> list[tuple]:
    """The factors of each product ``top`` adds (maybe under a convert): of its ``mul`` operands where it is an
    ``add``, of its product where it is an ``addcmul``."""
    top = _anchor_top(top)
    if is_op(top, ADDCMUL):
        return [tuple(top.args[1:3])]
    if not is_op(top, (aten.add.Tensor,)) or len(top.args) != 2:
        return []
    return [tuple(m.args) for m in top.args if is_op(m, MUL)]


def is_affine_candidate(node: Node) -> bool:
    """Cheap filter: an ``add`` (maybe under a convert) of a product with a factor ``1 + t``, or an ``addcmul``
    of such a product."""
    return any(is_op(p, ADD) and any(is_scalar(a, 1.0) for a in p.args) for factors in _products(node)
               for p in factors)


def is_gated_candidate(node: Node) -> bool:
    """Cheap filter: an ``add`` (maybe under a convert) of a product with a gathered factor, or an ``addcmul``
    of such a product."""
    return any(is_op(strip_views(strip_converts(a)), GATHER) for factors in _products(node) for a in factors)
