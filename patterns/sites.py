"""Search side of the three modulation sites: one parameterised structural matcher over aten FX graphs.

Each ``*_site`` function takes a candidate output node and returns a ``Site`` (its kind, its input nodes,
the rounding points the graph performs, and the interior nodes a replacement removes) or raises
``NoMatch`` with the reason. Operand order of ``+`` and ``*`` does not matter; table upcasts (``.float()``
before or after the gather), ``.to(long)`` on the index and index views are looked through. Every check
the fused op's contract needs is made here, so that a match is always safe. ``[R]`` marks a rounding the
graph may or may not perform (the ``Site`` records which):

    SiteKind.NORM_MODULATE       (site A)  y = [R](n * [R](1 + scale[t]) + shift[t]),  n = norm(x)
    SiteKind.GATE_RESIDUAL       (site C)  u = [R](res + [R](gate[t] * branch))
    SiteKind.GATE_NORM_MODULATE  (site B)  C followed by A on the stored residual u

What varies, each a parameter of the match, not a pattern of its own:

- the norm (``Norm``): an RMSNorm (``nn.RMSNorm``, ``F.rms_norm``, the native two-rounding spelling, diffusers'
  ``RMSNorm``) or a LayerNorm (``nn.LayerNorm``, ``F.layer_norm``), with or without weight, of the activations
  or of the activations upcast to fp32 (then its output and the affine stay fp32, one rounding at ``y``);
- the rows ``scale[t]``, ``shift[t]``, ``gate[t]`` (``Rows``): gathered from ``[K, H]`` tables by a per-token
  index (MiniMax-H3), or given: one per sample broadcast over its tokens (``[B, 1, H]``, ``[B, H][:, None]``:
  Flux, Wan, SD3, ...), one per token (``[B, T, H]`` from a split, chunk or unbind of a group of modulation
  rows: Wan 2.2 TI2V, LTX-Video), one for all, or chosen per token between two rows per sample by
  ``torch.where`` (Qwen-Image-Edit's ``zero_cond_t``: gathered from the two by an index the replacement computes
  from the condition); ``1 +`` before or after the view;
- where the affine and the residual compute: in the activation dtype, or in fp32 with one cast after
  (``(x.float() + branch * gate).type_as(x)``).

The graphs are Inductor's post-grad graphs (inference) or the aten graph the backend traces before
autograd (training, ``h3_fused.training``); both spell the math with the ops ``graph_view`` names.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
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


SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
WHERE = (aten.where.self,)


@dataclass
class Rows:
    """The modulation rows a site reads, one per token: gathered, ``table[index]`` (``index`` set, ``source`` the
    ``[K, H]`` table), or given (``index`` None, ``source`` the rows before views and casts, which the op takes
    reshaped to ``shape``: ``[.., 1 or T, H]``, broadcasting to the activations), or chosen per token between two
    rows per sample, ``torch.where(choice, source, second)`` (``second`` and its ``second_shape`` as ``source``
    and ``shape``; the op gathers them from the two stacked, by an index computed from ``choice``). ``upcast``:
    converted to fp32 where the site uses them.

    Rows per token taken from a sum of rows and a row shared by all (``(table + temb).chunk(6, dim=2)``: Wan 2.2
    TI2V, LTX-Video's per-token timesteps) may be matched (``match_rows``' ``row_biases``) as the rows with a bias:
    ``source`` the rows before the sum, of which the op reads the ``view`` ``(dim, start, length, bias_start)``:
    ``length`` elements from ``start`` along ``dim``, ``bias`` the shared row's tensor (read flat: ``H`` elements from
    ``bias_start`` are added), and ``summed`` the same rows as the graph's sums, for a site that cannot take them
    so (``_with_bias``)."""

    output: Node
    source: Node
    index: Node | None
    shape: tuple | None
    upcast: bool
    nodes: list[Node]
    choice: Node | None = None
    second: Node | None = None
    second_shape: tuple | None = None
    bias: Node | None = None
    view: tuple[int, int, int, int] | None = None
    summed: Rows | None = None

    @property
    def gathered(self) -> bool:
        return self.index is not None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the modulation rows before any conversion the site makes: the sum's, with a bias."""
        return dtype_of((self.summed or self).source)


def _is_split_member(node: object) -> bool:
    """One of a group of rows (a split, chunk or unbind of one tensor, or a ``select`` along a dim other than its
    last, as LTX-Video's ``norm_out`` takes ``values[:, :, 0]``): how a model hands out its modulation."""
    if is_op(node, (aten.select.int,)):
        shape = shape_of(node.args[0])
        return shape is not None and node.args[1] % len(shape) != len(shape) - 1
    return is_op(node, (operator.getitem,)) and is_op(node.args[0], SPLITS)


def match_rows(node: object, act_shape: tuple, shape: tuple | None = None, row_biases: bool = False) -> Rows:
    """The rows ``node`` reads for activations of ``act_shape``: a gather of table rows, or given rows that
    broadcast to them, one per sample, one per token (one of a group of modulation rows) or one for all.
    ``shape``: the rows' shape where the site broadcasts them, if a view after ``node`` gives it (``(1 +
    scale)[:, None]``). ``row_biases``: rows per token from a sum of rows and a row shared by all are the rows with a
    bias where they can be (``_with_bias``)."""
    nodes = []
    top = node
    while is_op(top, CONVERT) or is_op(top, VIEW):
        nodes.append(top)
        top = top.args[0]
    expect(isinstance(top, Node) and shape_of(top) is not None, f"the modulation rows are {describe(top)}")
    if is_op(top, GATHER):
        return _gathered(node, top, nodes + [top])
    shape = shape or shape_of(node)
    hidden = act_shape[-1]
    expect(len(act_shape) <= 3, f"the activations are {len(act_shape)}-dimensional {act_shape}: rows per sample and "
                                "token of [B, T, H] activations only (not per head)")
    expect(len(shape) <= len(act_shape) and same_size(shape[-1], hidden) and all(
        same_size(n, 1) or same_size(n, a) for n, a in zip(reversed(shape), reversed(act_shape))),
        f"the rows {shape} do not broadcast to the activations {act_shape} with a full row of H={hidden}")
    per_token = len(shape) >= 2 and not same_size(shape[-2], 1)
    if is_op(top, WHERE) and per_token:  # (a choice per sample makes rows per sample, taken as they are)
        return _chosen(node, top, nodes + [top], act_shape, shape)
    expect(not per_token or _is_split_member(top),
           f"{describe(top)} gives a row per token that is not one of a group of modulation rows (a split, chunk, "
           "unbind or select)")
    dtype = dtype_of(top)
    expect(dtype in ACTIVATION_DTYPES, f"the rows are {dtype}")
    expect(dtype_of(node) in (dtype, f32), f"the rows are converted to {dtype_of(node)}")
    rows = Rows(node, top, None, shape, dtype in LOW_PRECISION and dtype_of(node) == f32, nodes)
    return (_with_bias(rows, hidden) or rows) if row_biases and per_token else rows


def _exact_source(v: object) -> object:
    """``v`` before exact conversions (to its own dtype, or of bf16/fp16 to fp32)."""
    while is_op(v, CONVERT) and (dtype_of(v) == dtype_of(v.args[0]) or (
            dtype_of(v) == f32 and dtype_of(v.args[0]) in LOW_PRECISION)):
        v = v.args[0]
    return v


def _split_chunk(member: Node) -> tuple[Node, int, int, int] | None:
    """``(group, dim, start, length)``: the slice of ``group`` a split member (``_is_split_member``) is, along
    ``dim`` (an unbind's or a select's: length 1, the dim dropped), or None where the split's sizes are not known."""
    if member.target == aten.select.int:
        group, dim, j = member.args
        return group, dim % len(shape_of(group)), j % shape_of(group)[dim], 1
    split, j = member.args[0], member.args[1]
    group = split.args[0]
    full = shape_of(group)
    if split.target == aten.unbind.int:
        dim = split.args[1] if len(split.args) > 1 else split.kwargs.get("dim", 0)
        return group, dim % len(full), j, 1
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % len(full)
    sizes = split.args[1]
    if isinstance(sizes, int):
        return group, dim, j * sizes, sizes
    return (group, dim, sum(sizes[:j]), sizes[j]) if all(isinstance(n, int) for n in sizes) else None


def _with_bias(rows: Rows, hidden: int) -> Rows | None:
    """``rows`` (per token, one slice of ``sum`` by a split) as rows with a bias, where ``sum = rows' + shared``, each
    maybe converted exactly, the sum's dtype theirs promoted (the op adds them in that dtype), and the slice is one
    row of ``H``: ``sum`` ``[..., n, H]`` split along another dim than ``H`` into its ``n`` rows (``rows'`` may be
    ``[..., 1, H]``, one row for the ``n``), or ``[..., n * H]`` split along its last dim into chunks of ``H``.
    ``shared`` broadcasts over every other dim and is only reshaped from its tensor, so that that tensor's elements
    are ``sum``'s row in order: the bias is the slice of them at the same place. Else None: the rows stay the
    graph's sums."""
    chunk = _split_chunk(rows.source)
    if chunk is None:
        return None
    total, dim, start, length = chunk
    if not (is_op(total, ADD) and len(total.args) == 2 and not total.kwargs and
            all(isinstance(v, Node) for v in total.args)):
        return None
    full = shape_of(total)
    if full is None:
        return None
    last = dim == len(full) - 1
    if not same_size(length, hidden if last else 1) or not (last or same_size(full[-1], hidden)):
        return None
    for given, shared in (total.args, total.args[::-1]):
        given_shape, shared_shape = shape_of(given), shape_of(shared)
        if given_shape is None or len(given_shape) != len(full) or not all(
                same_size(g, n) or (k == dim and not last and same_size(g, 1))
                for k, (g, n) in enumerate(zip(given_shape, full))):
            continue
        if shared_shape is None or len(shared_shape) > len(full):
            continue
        aligned = (1,) * (len(full) - len(shared_shape)) + tuple(shared_shape)
        if not (same_size(aligned[dim], full[dim]) and same_size(aligned[-1], full[-1]) and all(
                same_size(n, 1) for k, n in enumerate(aligned[:-1]) if k != dim)):
            continue
        source, bias = _exact_source(given), _exact_source(shared)
        while is_op(bias, VIEW):  # each keeps the elements' order
            bias = _exact_source(bias.args[0])
        if dtype_of(source) not in ACTIVATION_DTYPES or dtype_of(bias) not in ACTIVATION_DTYPES or \
                shape_of(bias) is None or not same_size(_numel(shape_of(bias)), _numel(aligned)) or \
                torch.promote_types(dtype_of(source), dtype_of(bias)) != dtype_of(total):
            continue
        given_start = start if same_size(given_shape[dim], full[dim]) else 0  # one row for all n: broadcast
        return Rows(rows.output, source, None, rows.shape, rows.upcast, rows.nodes, bias=bias,
                    view=(dim, given_start, length, start * (1 if last else hidden)), summed=rows)
    return None


def same_value(a: object, b: object, depth: int = 4) -> bool:
    """Whether ``a`` and ``b`` are one value: the same node, or the same operation of the same values (up to
    ``depth`` operations deep; a model that writes ``index == 0`` once per row group computes one condition)."""
    if a is b:
        return True
    if isinstance(a, Node) and isinstance(b, Node):
        return depth > 0 and a.op == b.op == "call_function" and a.target == b.target and a.kwargs == b.kwargs and \
            len(a.args) == len(b.args) and all(same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))
    return not isinstance(a, Node) and not isinstance(b, Node) and a == b


def _chosen(node: Node, where: Node, nodes: list[Node], act_shape: tuple, shape: tuple) -> Rows:
    """Rows chosen per token between two rows per sample, ``torch.where(choice, first, second)`` with a boolean
    ``choice`` per token (``[B, T, 1]`` or ``[B, T]``), as Qwen-Image's ``zero_cond_t`` picks its modulation."""
    choice, first, second = where.args
    expect(all(isinstance(v, Node) for v in (choice, first, second)), "rows chosen between a row and a constant")
    expect(len(act_shape) == 3 and len(shape) == 3, "rows chosen per token of activations other than [B, T, H]")
    expect(dtype_of(choice) == torch.bool and shape_of(choice) is not None, "the rows are chosen by a non-boolean")
    choice_shape = tuple(shape_of(choice))
    expect(len(choice_shape) in (2, 3) and same_shape(choice_shape[:2], act_shape[:2]) and (
        len(choice_shape) == 2 or same_size(choice_shape[2], 1)),
        f"the rows are chosen by a {choice_shape} condition, not one per token of {tuple(act_shape[:2])}")
    a, b = (match_rows(v, act_shape) for v in (first, second))
    for r in (a, b):
        expect(not r.gathered and r.choice is None and len(r.shape) == 3 and same_size(r.shape[0], act_shape[0])
               and same_size(r.shape[1], 1), f"{describe(r.source)}: rows chosen per token between rows that are "
                                             "not one per sample")
    dtype = dtype_of(a.source)
    expect(dtype_of(b.source) == dtype and dtype_of(first) == dtype_of(second), "the two rows differ in dtype")
    return Rows(node, a.source, None, a.shape, dtype in LOW_PRECISION and dtype_of(node) == f32,
                nodes + a.nodes + b.nodes, choice, b.source, b.shape)


def _gathered(node: Node, gather: Node, nodes: list[Node]) -> Rows:
    if gather.target == aten.index.Tensor:
        table, indices = gather.args
        expect(len(indices) == 1 and indices[0] is not None, "the table is indexed along another dim than its rows")
        index = indices[0]
    else:
        table, dim, index = gather.args
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
    return Rows(node, table_src, index_src, None, upcast, nodes)


@dataclass
class Norm:
    """A norm over the last dim of ``x``: ``kind`` ``"rms"`` (``nn.RMSNorm`` / ``F.rms_norm``, one rounding; the
    native spelling, ``rounds_before_weight``: the mean of the squares written out, which on CUDA torch's generic
    reduction computes, and the normalized row rounded before the weight, as diffusers' ``RMSNorm`` also does) or
    ``"layer"`` (``nn.LayerNorm`` / ``F.layer_norm``, one rounding), with or without weight (and a LayerNorm's
    bias); ``in_fp32``: computed on ``x`` upcast to fp32 and its output left in fp32 (no rounding)."""

    x: Node
    weight: Node | None
    eps: float
    rounds_before_weight: bool
    nodes: list[Node]
    kind: str = "rms"
    in_fp32: bool = False
    bias: Node | None = None  # a LayerNorm's, outside the sites (``match_norm``'s ``bias_allowed``)


RSQRT = (aten.rsqrt.default,)


def _constant_eps(eps: object) -> float:
    expect(isinstance(eps, (int, float)) and not isinstance(eps, bool), "the norm's eps is not a constant",
           hint="a float attribute becomes a graph input under dynamic=True: pass eps as nn.RMSNorm does, "
                "or compile with dynamic_token_dim instead")
    return float(eps)


def _last_dim(dims, keepdim, rank: int) -> None:
    expect(keepdim and len(dims) == 1 and dims[0] in (-1, rank - 1), f"the norm reduces dims {dims}, not the last")


def _norm_input(x32: object, act: torch.dtype, in_fp32: bool) -> Node:
    """The activations a norm normalizes: ``x32`` is them in fp32 (or the activations themselves, where a mixed
    product promotes them: diffusers' ``RMSNorm``)."""
    x = x32.args[0] if is_op(x32, CONVERT) else x32
    expect(isinstance(x, Node) and dtype_of(x) == act,
           f"the norm's input is {dtype_of(x)}, the activations {act}" + (" (upcast to fp32)" if in_fp32 else ""))
    return x


def _match_norm_core(node: object, act: torch.dtype, in_fp32: bool):
    """``x * rsqrt(mean(x32^2, -1, keepdim) + eps)`` (``x`` in fp32, or bf16 beside an fp32 ``rsqrt``: diffusers'
    ``RMSNorm``), or ``(x32 - mean) * rsqrt(var + eps)`` of ``var_mean(x32)`` (a LayerNorm) -> (x, eps, kind,
    nodes)."""
    xn, r = either_order(operands(node, MUL, "x * rsqrt(mean(x^2) + eps)"), lambda v: not is_op(v, RSQRT),
                         "the input of the norm")
    expect(is_op(r, RSQRT), "the normalized value has no `rsqrt(...)` factor: not a norm")
    expect(dtype_of(node) == f32, f"the norm computes in {dtype_of(node)}, not fp32")
    shifted = r.args[0]
    if is_op(xn, (aten.sub.Tensor,)):  # a LayerNorm
        x32, mean = operands(xn, (aten.sub.Tensor,), "x - mean")
        var, eps = either_order(operands(shifted, ADD, "var + eps"), lambda v: isinstance(v, Node), "the variance")
        expect(is_op(var, (operator.getitem,)) and is_op(mean, (operator.getitem,)) and var.args[0] is mean.args[0]
               and (var.args[1], mean.args[1]) == (0, 1) and is_op(var.args[0], (aten.var_mean.correction,)),
               "the norm subtracts something other than the mean its variance is about: not a LayerNorm")
        stats = var.args[0]
        expect(stats.args[0] is x32 and stats.kwargs.get("correction", 1) == 0,
               "the variance is not the biased variance of the normalized value")
        _last_dim(stats.args[1], stats.kwargs.get("keepdim", False), len(shape_of(x32) or ()))
        expect(dtype_of(x32) == f32, f"the LayerNorm computes in {dtype_of(x32)}, not fp32")
        return _norm_input(x32, act, in_fp32), _constant_eps(eps), "layer", [node, r, shifted, xn, var, mean, stats]
    mean, eps = either_order(operands(shifted, ADD, "mean(x^2) + eps"), lambda v: is_op(v, (aten.mean.dim,)),
                             "the mean of the squares")
    eps = _constant_eps(eps)
    sq_in, dims = mean.args[0], mean.args[1]
    _last_dim(dims, mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False), len(shape_of(xn) or ()))
    expect(not mean.kwargs.get("dtype"), "the norm's mean converts its dtype")
    if is_op(sq_in, (aten.pow.Tensor_Scalar,)):
        expect(is_scalar(sq_in.args[1], 2), "the mean is not of the squares of the normalized value")
        squared = sq_in.args[0]
    else:
        squared, b = operands(sq_in, MUL, "x * x")
        expect(b is squared, "the mean is not of the squares of the normalized value")
    expect(strip_converts(squared) is strip_converts(xn) and dtype_of(squared) == f32,
           "the mean is not of the squares of the normalized value")
    x = _norm_input(squared, act, in_fp32)
    nodes = [node, r, shifted, mean, sq_in] + [v for v in {squared, xn} if v is not x]
    return x, eps, "rms", nodes


def _weight_source(w: object, hidden: int, what: str = "weight") -> Node:
    src = strip_converts(w)
    expect(isinstance(src, Node) and same_shape(shape_of(src), (hidden,)), f"the norm's {what} is not [H={hidden}]")
    expect(dtype_of(src) in ACTIVATION_DTYPES, f"the norm's {what} is {dtype_of(src)}")
    return src


def _over_last_dim(shape: object, hidden: int) -> None:
    """A fused norm's ``normalized_shape`` is the last dim, ``[H]``."""
    expect(isinstance(shape, (list, tuple)) and len(shape) == 1 and same_size(shape[0], hidden),
           f"the norm is over {shape}, not the last dim H={hidden}")


def _match_fused_norm(n: Node, act: torch.dtype, hidden: int) -> Norm:
    """``n = _fused_rms_norm(x, [H], w, eps)[0]``: ``nn.RMSNorm`` / ``F.rms_norm`` as the graph traced before
    autograd holds it on CUDA (one rounding, ``R(x32 * r * w32)``); ``eps=None`` is fp32's machine epsilon."""
    fused = n.args[0]
    x, shape, weight, eps = (list(fused.args) + [None, None])[:4]
    _over_last_dim(shape, hidden)
    expect(dtype_of(x) == act, f"the norm's input is {dtype_of(x)}, its output {act}")
    expect(eps is None or (isinstance(eps, (int, float)) and not isinstance(eps, bool)), "the norm's eps is not a constant")
    eps = torch.finfo(torch.promote_types(act, f32)).eps if eps is None else float(eps)
    return Norm(x, _weight_source(weight, hidden) if weight is not None else None, eps, False, [n, fused])


def _match_native_layer_norm(n: Node, act: torch.dtype, hidden: int, bias_allowed: bool) -> Norm:
    """``n = native_layer_norm(x, [H], w, b, eps)[0]``: ``nn.LayerNorm`` / ``F.layer_norm`` as the graph traced before
    autograd holds it, of the activations (one rounding) or of their fp32 upcast (``in_fp32``)."""
    stats = n.args[0]
    x, shape, weight, bias, eps = stats.args
    _over_last_dim(shape, hidden)
    in_fp32 = act != f32 and dtype_of(n) == f32
    x = _norm_input(x, act, in_fp32)
    expect(bias is None or bias_allowed, "the norm adds a bias: not fused")
    return Norm(x, _weight_source(weight, hidden) if weight is not None else None, _constant_eps(eps), False,
                [n, stats], "layer", in_fp32, _weight_source(bias, hidden, "bias") if bias is not None else None)


RMS_NORM_FUNCTIONS = (torch.rms_norm, F.rms_norm, torch.nn.RMSNorm)  # eager runs torch's fused RMSNorm kernel


def _traced_from_rms_norm(nodes: list[Node]) -> bool:
    """Whether Dynamo traced ``nodes`` from a call of ``F.rms_norm`` (or ``nn.RMSNorm``), as their
    ``source_fn_stack`` records (not from a mean of the squares written out)."""
    return any(fn in RMS_NORM_FUNCTIONS for n in nodes for _, fn in n.meta.get("source_fn_stack", ()))


def match_norm(n: object, act: torch.dtype, hidden: int, bias_allowed: bool = False) -> Norm:
    """``n`` is the norm's output: in the activation dtype ``act``, or in fp32 where the norm is computed on the
    activations upcast to fp32 (``Norm.in_fp32``). ``bias_allowed``: a LayerNorm may add a bias (``+ b``, ``[H]``,
    after its weight), which no site's kernel adds."""
    if is_op(n, (operator.getitem,)) and is_op(n.args[0], (aten._fused_rms_norm.default,)) and n.args[1] == 0:
        return _match_fused_norm(n, act, hidden)
    if is_op(n, (operator.getitem,)) and is_op(n.args[0], (aten.native_layer_norm.default,)) and n.args[1] == 0:
        return _match_native_layer_norm(n, act, hidden, bias_allowed)
    in_fp32 = act != f32 and dtype_of(n) == f32
    nodes: list[Node] = []
    weight, before = None, False
    top = n
    if act != f32 and not in_fp32 and is_op(top, MUL) and dtype_of(top) == act:  # native: R(R(x*r) * w)
        cast, w = either_order(operands(top, MUL, "normed * weight"), lambda v: is_op(v, CONVERT),
                               "the normalized value cast to the activation dtype")
        weight, before = _weight_source(w, hidden), True
        nodes += [top] + ([w] if w is not weight else [])
        top = cast
    if act != f32 and not in_fp32:
        expect(is_op(top, CONVERT) and dtype_of(top) == act, f"the value modulated is {describe(top)}, not a norm cast to {act}")
        nodes.append(top)
        top = top.args[0]
    bias = None
    if is_op(top, ADD) and len(top.args) == 2 and all(isinstance(v, Node) for v in top.args):
        expect(bias_allowed, "the norm adds a bias: not fused")
        normed, b = either_order(top.args, lambda v: is_op(v, MUL), "the normalized value [* weight]")
        bias = _weight_source(b, hidden, "bias")
        nodes += [top] + ([b] if b is not bias else [])
        top = normed
    if weight is None:
        a, b = operands(top, MUL, "normed [* weight]")
        if not (is_op(a, RSQRT) or is_op(b, RSQRT)):  # (x * r) * w
            core, w = either_order((a, b), lambda v: is_op(v, MUL), "the normalized value")
            weight = _weight_source(w, hidden)
            nodes += [top] + ([w] if w is not weight else [])
            top = core
    x, eps, kind, core_nodes = _match_norm_core(top, act, in_fp32)
    expect(not (before and kind == "layer"), "a LayerNorm rounded before its weight is not fused")
    expect(bias is None or kind == "layer", "an RMSNorm that adds a bias")
    # an RMSNorm without weight whose mean of the squares is written out (diffusers' ``RMSNorm``, LTX-Video's) is
    # the native spelling: on CUDA torch's generic reduction computes its mean; it rounds once either way. The same
    # nodes traced from ``F.rms_norm`` (their source function says so) are its fused kernel's: that kernel's order
    before = before or (kind == "rms" and weight is None and not _traced_from_rms_norm(core_nodes))
    return Norm(x, weight, eps, before, nodes + core_nodes, kind, in_fp32, bias)


@dataclass
class Affine:
    """``y = [R](n * [R](1 + scale[t]) + shift[t])`` in ``compute`` dtype, output in ``act``."""

    y: Node
    n: Node
    shift: Rows
    scale: Rows
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


def _one_plus(v: object) -> tuple[object, list[Node]] | None:
    """``(t, nodes)`` where ``v`` is ``1 + t`` (or ``t + 1``), maybe under views (``(1 + scale)[:, None]``)."""
    nodes = []
    while is_op(v, VIEW):
        nodes.append(v)
        v = v.args[0]
    if not (is_op(v, ADD) and len(v.args) == 2 and not v.kwargs):
        return None
    t, one = v.args if is_scalar(v.args[1], 1.0) else v.args[::-1]
    return (t, nodes + [v]) if is_scalar(one, 1.0) and isinstance(t, Node) else None


def match_affine(y: object, row_biases: bool = False) -> Affine:
    act, top, nodes = _site_output(y)
    expect(not is_op(top, ADDCMUL), "`torch.addcmul(shift, n, 1 + scale)` (the product not rounded before the add) "
                                    "is not fused")
    compute = dtype_of(top)
    q, shift_rows = either_order(operands(top, ADD, "n * (1 + scale[t]) + shift[t]"), lambda v: is_op(v, MUL),
                                 "a product")
    p, n = either_order(operands(q, MUL, "n * (1 + scale[t])"), lambda v: _one_plus(v) is not None, "`1 + scale[t]`")
    scale_rows, p_nodes = _one_plus(p)
    act_shape = shape_of(y)
    shift = match_rows(shift_rows, act_shape, row_biases=row_biases)
    scale = match_rows(scale_rows, act_shape, shape_of(p), row_biases)  # as the product broadcasts them: `1 +` first
    expect({dtype_of(p), dtype_of(q), compute} == {compute}, "the modulation mixes dtypes between its steps")
    expect(compute in (act, f32), f"the modulation computes in {compute}")
    return Affine(y, n, shift, scale, compute, nodes + [top, q] + p_nodes)


@dataclass
class Gated:
    """``u = [R](res + [R](gate[t] * branch))``; ``product`` is the dtype of the product."""

    u: Node
    residual: Node
    branch: Node
    gate: Rows
    product: torch.dtype
    nodes: list[Node]


def _exact(v: object, act: torch.dtype) -> tuple[object, list[Node]]:
    """``v`` before an upcast of the activations to fp32 (exact: ``x.float()``), with that cast."""
    if is_op(v, CONVERT) and dtype_of(v) == f32 and dtype_of(v.args[0]) == act:
        return v.args[0], [v]
    return v, []


def match_gated(u: object, row_biases: bool = False) -> Gated:
    act, top, nodes = _site_output(u)
    expect(not is_op(top, ADDCMUL), "`torch.addcmul(residual, gate, branch)` (the product not rounded before the "
                                    "add) is not fused")
    act_shape = shape_of(u)

    def gate_rank(v) -> int:
        """How surely ``v`` is the gate's rows: 3 gathered, 2 one of a group of modulation rows (a split, chunk or
        unbind), 1 rows by their shape alone (broadcast over tokens), 0 not rows."""
        if not isinstance(v, Node):
            return 0
        try:
            rows = match_rows(v, act_shape)
        except NoMatch:
            return 0
        return 3 if rows.gathered else 2 if _is_split_member(rows.source) else 1

    def gated_product(v):
        return is_op(v, MUL) and len(v.args) == 2 and any(gate_rank(a) for a in v.args)

    res, prod = either_order(operands(top, ADD, "res + gate[t] * branch"), lambda v: not gated_product(v),
                             "the residual")
    expect(gated_product(prod), "no `gate[t] * branch` term")
    first, second = operands(prod, MUL, "gate[t] * branch")
    gate_rows, branch = (first, second) if gate_rank(first) >= gate_rank(second) else (second, first)
    gate = match_rows(gate_rows, act_shape, row_biases=row_biases)
    residual_source = strip_views(strip_converts(res))
    expect(not (is_op(residual_source, GATHER) or _is_split_member(residual_source)),
           "the residual is itself modulation rows (a gather, or one of a split of rows), not a residual stream")
    (res, res_cast), (branch, branch_cast) = _exact(res, act), _exact(branch, act)
    for name, v in (("residual", res), ("branch", branch)):
        expect(dtype_of(v) == act and same_shape(shape_of(v), act_shape),
               f"the {name} is {dtype_of(v)} {shape_of(v)}, the output {act} {act_shape}")
    expect(dtype_of(top) in (act, f32) and dtype_of(prod) == dtype_of(top), "the gated residual mixes dtypes")
    expect(not (res_cast or branch_cast) or dtype_of(top) == f32, "the gated residual mixes dtypes")
    return Gated(u, res, branch, gate, dtype_of(prod), nodes + [top, prod] + res_cast + branch_cast)


def check_site(outputs: list[Node], tables: list[Rows], act_node: Node, interior: list[Node]) -> bool:
    """Checks shared by every site: one row source (one index for gathered rows; given rows that broadcast to
    the activations), [K, H] tables, device, interior values used only inside. Returns whether the index
    broadcasts over leading dims of the activations (``index_broadcast``)."""
    hidden = shape_of(act_node)[-1]
    expect(len({rows.gathered for rows in tables}) == 1, "some of its rows are gathered by an index and others not")
    expect(all(same_value(rows.choice, tables[0].choice) for rows in tables),
           "its rows are chosen per token by different conditions, or some chosen and others not")
    device = device_of(act_node)
    expect(device is not None and device.type in DEVICES, f"the activations are on {device}, not CUDA or the CPU")
    broadcast = False
    if tables[0].gathered:
        index = tables[0].index
        for g in tables:
            expect(g.index is index, "its tables are gathered with different index tensors")
            expect(same_size(shape_of(g.source)[1], hidden),
                   f"a table is {shape_of(g.source)[1]} wide, the activations {hidden}")
            expect(same_size(shape_of(g.source)[0], shape_of(tables[0].source)[0]),
                   "tables of one site have different row counts")
        lead = shape_of(act_node)[:-1]
        broadcast = not same_size(_numel(shape_of(index)), _numel(lead))
        expect(not broadcast or broadcasts_to(shape_of(index), lead),
               f"the index has shape {shape_of(index)}, the activations {lead} rows")
        expect(device_of(index) == device, "its tensors are on different devices")
    for g in tables:
        expect(device_of(g.source) == device, "its tensors are on different devices")
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
    """A matched site: what to call, with which input nodes, and which nodes it replaces. Given rows (no
    ``index`` input) are reshaped to ``row_shapes[name]`` before the call, as the graph broadcasts them."""

    kind: SiteKind
    outputs: list[Node]  # (y,), (u, y) or (u,); with copies, every modulation's y
    inputs: dict[str, Node | None]
    eps: float
    norm_rounds_before_weight: bool
    upcast_tables: bool
    interior: list[Node] = field(default_factory=list)
    index_broadcast: bool = False  # the index is expanded over leading dims of the activations (a batch)
    norm: str = "rms"
    norm_in_fp32: bool = False
    row_shapes: dict[str, tuple] = field(default_factory=dict)
    # modulations of the one norm: ``y`` and ``shift``/``scale``, then ``y`` of ``shift_j``/``scale_j`` for j >= 1
    copies: int = 1
    # rows with a bias (inputs ``{name}_bias``): ``(dim, start, length, bias_start)``, the slice of the input ``name``
    # they are and where the bias input's row added to them starts (``Rows.view``)
    row_views: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)

    @property
    def lead(self) -> Node:
        return self.inputs[self.kind.lead]

    @property
    def gathered(self) -> bool:
        return self.inputs.get("index") is not None

    def without_fused_backward(self) -> str | None:
        """What of this site the fused backward does not cover (``kernels.autograd``), or None: it restates rows
        given without an index as tables gathered by one index, which rows that broadcast differently (a gate
        per sample beside shift and scale per token, where a gated residual and its norm merge) do not share."""
        if self.row_views:
            return "modulation rows given with biases (" + ", ".join(f"{name}_bias" for name in self.row_views) + ")"
        if self.gathered or self.inputs.get("choice") is not None:
            return None
        rank = len(shape_of(self.lead) or ())
        shapes = {name: (1,) * (rank - len(shape)) + tuple(shape[:-1]) for name, shape in self.row_shapes.items()}
        if len(set(shapes.values())) > 1:
            return "modulation rows that broadcast differently (" + ", ".join(
                f"{name} {list(dims)}" for name, dims in shapes.items()) + ")"
        return None


def _upcast(tables: list[Rows], compute: torch.dtype) -> bool:
    flags = {g.upcast for g in tables}
    expect(len(flags) == 1, "some of its tables are upcast to fp32 and others are not")
    upcast = flags.pop()
    expect(upcast == (compute == f32 and tables[0].dtype in LOW_PRECISION),
           "the tables' upcast and the dtype of the modulation disagree")
    return upcast


def _rows_interior(tables: list[Rows]) -> list[Node]:
    """Conversions/views wrapped around a gather or given rows belong to the site; the gather itself (and the
    rows' source) may be shared."""
    return [n for g in tables for n in (g.nodes[:-1] if g.gathered else g.nodes)]


def _one_form(tables: dict[str, Rows], biases_allowed: bool = True) -> dict[str, Rows]:
    """A site's rows all with their biases, or (where some have none, or ``biases_allowed`` is false) all as the
    graph's sums: the op takes a bias for every row or for none."""
    if biases_allowed and all(rows.bias is not None for rows in tables.values()):
        return tables
    return {name: rows.summed or rows for name, rows in tables.items()}


def _row_shapes(**tables: Rows) -> dict[str, tuple]:
    return {name: rows.shape for name, rows in tables.items() if not rows.gathered} | {
        f"{name}_second": rows.second_shape for name, rows in tables.items() if rows.choice is not None}


def _row_views(**tables: Rows) -> dict[str, tuple[int, int, int, int]]:
    return {name: rows.view for name, rows in tables.items() if rows.bias is not None}


def _row_inputs(**tables: Rows) -> dict[str, Node | None]:
    """The inputs the rows of a site add to its op's: each table's source (and its bias, where it has one; where
    the rows are chosen per token, the second rows and the condition, ``choice``), and the index."""
    inputs = {name: rows.source for name, rows in tables.items()}
    inputs |= {f"{name}_bias": rows.bias for name, rows in tables.items() if rows.bias is not None}
    first = next(iter(tables.values()))
    if first.choice is not None:
        inputs |= {f"{name}_second": rows.second for name, rows in tables.items()} | {"choice": first.choice}
    return inputs | {"index": first.index}


def _affine_output(product: Node) -> object:
    """The output of the modulation whose product is ``product`` (``n * (1 + scale')``): the ``add`` that is its one
    user, or that add's cast where the add's one user casts it (an fp32 affine), or None."""
    users = list(product.users)
    if len(users) != 1 or not is_op(users[0], ADD):
        return None
    top = users[0]
    cast = next(iter(top.users)) if len(top.users) == 1 else None
    return cast if cast is not None and _anchor_top(cast) is top else top


def _other_modulations(aff: Affine) -> list[Affine]:
    """The other modulations of ``aff``'s norm output, ``n * (1 + scale') + shift'`` of the same ``n`` (SD3.5's
    ``SD35AdaLayerNormZeroX`` modulates one norm twice), in the order of ``n``'s users. A use of ``n`` that is not
    one is left to ``check_interior``, which refuses the site for it."""
    others = []
    for user in aff.n.users:
        if user in aff.nodes or not (is_op(user, MUL) and any(_one_plus(v) is not None for v in user.args)):
            continue
        out = _affine_output(user)
        try:
            other = match_affine(out)
        except NoMatch:
            continue
        if other.n is aff.n:
            others.append(other)
    return others


def _check_copies(affines: list[Affine]) -> None:
    """Modulations of one norm, which the op takes as rows (or tables) with a leading dim of copies (stacked): rows
    given, or tables gathered by one index (not chosen per token), of one shape and dtype, computed alike."""
    first = affines[0]
    for rows in (a_rows for a in affines for a_rows in (a.shift, a.scale)):
        expect(rows.choice is None, "a norm modulated more than once by rows chosen per token: not fused (the "
               "matcher takes copies of rows given, or of tables gathered by one index)")
        expect(rows.index is first.shift.index, "a norm modulated more than once by rows gathered by different "
               "indices, or gathered and given: not fused")
    for other in affines[1:]:
        for name in ("shift", "scale"):
            ours, theirs = getattr(first, name), getattr(other, name)
            shapes = (shape_of(ours.source), shape_of(theirs.source)) if ours.gathered else (ours.shape, theirs.shape)
            expect(same_shape(*shapes) and ours.dtype == theirs.dtype,
                   f"the norm's modulations read {name} rows of different shapes or dtypes "
                   f"({shapes[0]} {ours.dtype}, {shapes[1]} {theirs.dtype})")
        expect(other.compute == first.compute, "the norm's modulations compute in different dtypes")


def norm_modulate_site(y: Node, row_biases: bool = False) -> Site:
    """Site A from its output ``y``, with every other modulation of the same norm output as copies (``Site.copies``;
    outputs ``y`` first, then the others). ``row_biases``: as ``match_rows``'."""
    aff = match_affine(y, row_biases)
    act = dtype_of(y)
    hidden = shape_of(y)[-1]
    norm = match_norm(aff.n, act, hidden)
    affines = [aff, *_other_modulations(aff)]
    if len(affines) > 1:
        _check_copies(affines)
    rows = _one_form({f"{name}{f'_{j}' if j else ''}": getattr(a, name) for j, a in enumerate(affines)
                      for name in ("shift", "scale")}, biases_allowed=len(affines) == 1)
    tables = list(rows.values())
    scale = rows["scale"]
    expect(same_shape(shape_of(norm.x), shape_of(y)), "the output's shape is not the norm input's (a broadcast)")
    upcast = _upcast(tables, aff.compute) if aff.compute != act else False
    expect(aff.compute == act or upcast or scale.dtype == f32,
           f"the modulation computes in {aff.compute} with {scale.dtype} tables")
    expect(not norm.in_fp32 or (aff.compute == f32 and (scale.dtype == f32 or scale.upcast)),
           "a norm computed in fp32 modulated by rows in the activation dtype is not fused")
    outputs = [a.y for a in affines]
    interior = [n for a in affines for n in a.nodes] + norm.nodes + _rows_interior(tables)
    interior = [n for n in interior if n not in outputs]
    broadcast = check_site(outputs, tables, norm.x, interior)
    return Site(SiteKind.NORM_MODULATE, outputs, dict(x=norm.x, weight=norm.weight, **_row_inputs(**rows)),
                norm.eps, norm.rounds_before_weight, upcast, interior, broadcast, norm.kind, norm.in_fp32,
                _row_shapes(**rows), copies=len(affines), row_views=_row_views(**rows))


def gate_residual_site(u: Node, row_biases: bool = False) -> Site:
    """Site C from its output ``u``. ``row_biases``: as ``match_rows``'."""
    gated = match_gated(u, row_biases)
    act = dtype_of(u)
    gate = gated.gate
    upcast = _upcast([gate], gated.product) if gated.product != act else False
    interior = [n for n in gated.nodes + _rows_interior([gate]) if n is not u]
    broadcast = check_site([u], [gate], u, interior)
    return Site(SiteKind.GATE_RESIDUAL, [u], dict(residual=gated.residual, branch=gated.branch,
                                                  **_row_inputs(gate=gate)),
                0.0, False, upcast, interior, broadcast, row_shapes=_row_shapes(gate=gate),
                row_views=_row_views(gate=gate))


def merge_gate_and_norm(c: Site, a: Site) -> Site:
    """Site C whose stored residual is the input of site A: one B-shaped site with outputs (u, y)."""
    u = c.outputs[0]
    expect(a.inputs["x"] is u, "the norm input is not this gated residual")
    expect(a.inputs["index"] is c.inputs["index"], "the gate and the modulation use different index tensors")
    expect(same_value(a.inputs.get("choice"), c.inputs.get("choice")),
           "the gate and the modulation are chosen per token by different conditions, or one of them is not")
    expect(a.upcast_tables == c.upcast_tables, "the gate and the modulation tables differ in upcasting")
    expect(bool(a.row_views) == bool(c.row_views), "the gate's rows come with a bias and the modulation's without, or "
                                                   "the reverse")
    if c.gathered:
        expect(same_size(shape_of(c.inputs["gate"])[0], shape_of(a.inputs["shift"])[0]),
               "gate and modulation tables differ in K")
    # one index and one condition (checked above): the gate's, which is computed before the residual it gates
    inputs = c.inputs | {k: v for k, v in a.inputs.items() if k not in ("x", "choice")}
    interior = c.interior + a.interior
    check_interior(interior, set(interior) | {u, *a.outputs})
    return Site(SiteKind.GATE_NORM_MODULATE, [u, *a.outputs], inputs, a.eps, a.norm_rounds_before_weight,
                a.upcast_tables, interior, c.index_broadcast, a.norm, a.norm_in_fp32, c.row_shapes | a.row_shapes,
                a.copies, c.row_views | a.row_views)


def _anchor_top(node: Node) -> object:
    """A site's output is an ``add``, or the fp32 -> low-precision cast of one (fp32 affine)."""
    if is_op(node, CONVERT):
        return node.args[0] if dtype_of(node.args[0]) == f32 and dtype_of(node) in LOW_PRECISION else None
    return node


def _products(top: object) -> list[tuple]:
    """The factors of each product ``top`` adds (maybe under a convert): of its ``mul`` operands where it is an
    ``add``, of its product where it is an ``addcmul``. An fp32 ``add`` whose one user casts it down is left to
    that cast, the site's output."""
    if not is_op(top, CONVERT) and len(getattr(top, "users", ())) == 1 and \
            _anchor_top(next(iter(top.users))) is top:
        return []
    top = _anchor_top(top)
    if is_op(top, ADDCMUL):
        return [tuple(top.args[1:3])]
    if not is_op(top, (aten.add.Tensor,)) or len(top.args) != 2:
        return []
    return [tuple(m.args) for m in top.args if is_op(m, MUL)]


def is_affine_candidate(node: Node) -> bool:
    """Cheap filter: an ``add`` (maybe under a convert) of a product with a factor ``1 + t`` (maybe viewed), or an
    ``addcmul`` of such a product."""
    return any(_one_plus(p) is not None for factors in _products(node) for p in factors)


def is_gated_candidate(node: Node) -> bool:
    """Cheap filter: an ``add`` (maybe under a convert) of a product with a factor that is modulation rows: a
    gather, or rows broadcast over tokens, or one of a split of rows; or an ``addcmul`` of such a product. Not
    a sum of two such products (a rotary embedding's ``x * cos + rotated(x) * sin``): a residual is no product."""
    def rows_like(v):
        core = strip_views(strip_converts(v))
        shape = shape_of(v)
        return is_op(core, GATHER + (aten.where.self,)) or _is_split_member(core) or (
            shape is not None and len(shape) >= 2 and same_size(shape[-2], 1))

    gated = [any(rows_like(a) for a in factors) for factors in _products(node)]
    return any(gated) and not (len(gated) == 2 and all(gated))
