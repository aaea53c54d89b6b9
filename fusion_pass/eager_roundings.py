"""``KeepEagerRoundings``: a joint-graph pre-pass that keeps two roundings of eager's which older torches' Inductor
drops whatever its eager-numerics settings say; under ``bf16`` the backend sets it on those torches.

- **A cast to a narrower float dtype cast straight back** (``x.to(bf16).float()``, as a block's ``.type_as(x)``
  output meets the next module's ``.float()``; torch 2.11 and 2.12). Their joint-graph pattern
  ``pointless_convert`` replaces ``convert(convert(x, bf16), fp32)`` by ``convert(x, fp32)``: the bf16 rounding
  eager performs is gone, and with it eager's bits (Wan's last block and its ``norm_out``: the norm then reads the
  unrounded fp32 sum, which no fused site may stand for). From torch 2.13 the pattern keeps a narrowing
  intermediate under ``emulate_precision_casts``. ``restate_narrowing_casts`` writes each such cast with its dtype
  as a keyword argument, ``convert_element_type(x, dtype=bf16)``: the same op, which Inductor lowers the same way,
  but not the two positional arguments the pattern matches.
- **A reciprocal** (``1 / x``, as rotary frequencies ``1 / theta ** (arange / d)`` are written: LTX-Video's,
  HunyuanVideo's; torch 2.11). Eager divides, correctly rounded; torch 2.11's Inductor writes ``reciprocal`` as
  Triton's ``1 / x`` of an integer one, which ``eager_numerics.division_rounding`` does not see (it rounds fp32 by
  fp32 divisions), and Triton divides approximately: a last place apart on about one element in eight. From
  torch 2.12 Inductor's one is an fp32 constant. ``divide_reciprocals`` writes an fp32 ``reciprocal(x)`` as
  ``div(full([], 1.0), x)``, an fp32 division that setting rounds as eager does, and one of bf16 or fp16 as that
  division of ``x`` in fp32 cast back, as eager's kernel computes it. That widening is written with its dtype as
  a keyword argument too: ``x`` is often a narrowing cast itself (``1 / t.to(bf16)``), and the pair would be the
  round trip ``pointless_convert`` drops, rounding ``t`` no more.

Nothing else changes: a cast with other readers, an fp64 reciprocal (Triton divides fp64 correctly rounded) are
left as they are.

Before that graph exists, Inductor's decompositions can drop a rounding too: ``torch.linspace`` decomposes into
``start + step * i`` below the middle and ``end - step * (steps - 1 - i)`` above it, each product and sum
rounded apart (Inductor contracts no multiply-add under ``emulate_precision_casts``), where eager's CUDA kernel
computes the same expressions, which nvcc compiles as multiply-adds by default. Under ``bf16`` the backend puts
``h3_fused::eager_linspace``, an op whose body is ``torch.linspace`` itself, where Dynamo's graph calls
``torch.linspace`` or ``torch.logspace`` with numbers (``keep_eager_linspace``): Inductor calls it as it is,
one launch for a few hundred elements (LTX-Video's rotary frequencies are ``theta ** linspace(...)``), and its
caches key it by name, as no other decomposition table would let them.
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

from .graph_pass import chained_passes, chained_uuids

CAST = torch.ops.prims.convert_element_type.default
RECIPROCAL = torch.ops.aten.reciprocal.default


def _older_than(version: str) -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) < version


def _float_dtype(node: object) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value.dtype if isinstance(value, torch.Tensor) and value.dtype.is_floating_point else None


def _round_trip_casts(graph: Graph) -> list[Node]:
    """The casts to a narrower float dtype whose one user casts back to a wider one: what ``pointless_convert``
    removes."""
    found = []
    for node in graph.find_nodes(op="call_function", target=CAST):
        if len(node.args) != 2:  # restated already
            continue
        source, narrow = _float_dtype(node.args[0]), _float_dtype(node)
        if source is None or narrow is None or narrow.itemsize >= source.itemsize or len(node.users) != 1:
            continue
        user = next(iter(node.users))
        wide = _float_dtype(user) if user.target is CAST else None
        if wide is not None and wide.itemsize > narrow.itemsize:
            found.append(node)
    return found


def _replace(graph: Graph, node: Node, target, args: tuple, kwargs: dict) -> None:
    with graph.inserting_before(node):
        new = graph.call_function(target, args, kwargs)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def restate_narrowing_casts(graph: Graph) -> None:
    """Each narrowing cast that is cast straight back (``_round_trip_casts``) with its dtype a keyword argument."""
    for node in _round_trip_casts(graph):
        _replace(graph, node, CAST, (node.args[0],), {"dtype": node.args[1]})


NARROW_FLOATS = (torch.bfloat16, torch.float16)


def divide_reciprocals(graph: Graph) -> None:
    """Each fp32 ``reciprocal(x)`` as ``div(full([], 1.0, fp32), x)``; one of bf16 or fp16 as
    ``convert(div(full([], 1.0, fp32), convert(x, dtype=fp32)), dtype=dtype)`` (eager's kernel divides in fp32 and
    rounds; both casts' dtypes by keyword, out of ``pointless_convert``'s reach where ``x`` is a narrowing cast or
    the result is widened)."""
    for node in graph.find_nodes(op="call_function", target=RECIPROCAL):
        value = node.meta.get("val")
        dtype = value.dtype if isinstance(value, torch.Tensor) else None
        if dtype != torch.float32 and dtype not in NARROW_FLOATS:
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            one = graph.call_function(torch.ops.aten.full.default, ([], 1.0),
                                      {"dtype": torch.float32, "device": value.device, "pin_memory": False})
            one.meta["val"] = value.new_ones((), dtype=torch.float32)
            if dtype in NARROW_FLOATS:
                x = graph.call_function(CAST, (x,), {"dtype": torch.float32})
                x.meta["val"] = value.to(torch.float32)
                quotient = graph.call_function(torch.ops.aten.div.Tensor, (one, x))
                quotient.meta["val"] = x.meta["val"]
        if dtype in NARROW_FLOATS:
            _replace(graph, node, CAST, (quotient,), {"dtype": dtype})
        else:
            _replace(graph, node, torch.ops.aten.div.Tensor, (one, x), {})


@torch.library.custom_op("h3_fused::eager_linspace", mutates_args=())
def eager_linspace(start: float, end: float, steps: int, base: float | None, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """``torch.linspace(start, end, steps)`` (``base`` None) or ``torch.logspace(start, end, steps, base)``, as
    eager computes it."""
    if base is None:
        return torch.linspace(start, end, steps, dtype=dtype, device=device)
    return torch.logspace(start, end, steps, base, dtype=dtype, device=device)


@eager_linspace.register_fake
def _(start, end, steps, base, dtype, device):
    return torch.empty(steps, dtype=dtype, device=device)


SPACED = {torch.linspace: ("start", "end", "steps"), torch.logspace: ("start", "end", "steps", "base")}


def _spaced_arguments(node: Node, names: tuple) -> dict | None:
    """A call's ``names`` arguments where start, end (and base) are numbers and nothing but ``dtype`` and
    ``device`` is passed besides, else None."""
    if len(node.args) > len(names) or set(node.kwargs) - {*names, "dtype", "device"}:
        return None
    args = dict(zip(names, node.args)) | {k: v for k, v in node.kwargs.items() if k in names}
    numbers = ("start", "end", "base") if "base" in args else ("start", "end")
    if "steps" not in args or not all(isinstance(args.get(k), (int, float)) for k in numbers):
        return None
    return args


def keep_eager_linspace(gm: torch.fx.GraphModule) -> int:
    """Put ``h3_fused::eager_linspace`` where Dynamo's graph ``gm`` calls ``torch.linspace`` or ``torch.logspace``
    with numbers (``_spaced_arguments``); the number of calls replaced."""
    replaced = 0
    for target, names in SPACED.items():
        for node in gm.graph.find_nodes(op="call_function", target=target):
            value, args = node.meta.get("example_value"), _spaced_arguments(node, names)
            if not isinstance(value, torch.Tensor) or args is None:
                continue
            base = float(args.get("base", 10.0)) if target is torch.logspace else None
            _replace(gm.graph, node, torch.ops.h3_fused.eager_linspace.default,
                     (float(args["start"]), float(args["end"]), args["steps"], base, value.dtype, value.device), {})
            replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def rewrites_needed() -> tuple:
    """The rewrites this torch's Inductor needs to keep eager's roundings (none from torch 2.13)."""
    needed = []
    if _older_than("2.13"):
        needed.append(restate_narrowing_casts)
    if _older_than("2.12"):
        needed.append(divide_reciprocals)
    return tuple(needed)


class KeepEagerRoundings(CustomGraphPass):
    """Apply ``rewrites`` (by default ``rewrites_needed()``) to the joint graph; then run ``chained`` (the
    joint-graph pre-passes the user set), in order."""

    def __init__(self, chained=None, rewrites: tuple | None = None):
        self.chained = chained_passes(chained, KeepEagerRoundings)
        self.rewrites = rewrites_needed() if rewrites is None else tuple(rewrites)

    def __call__(self, graph: Graph) -> None:
        for rewrite in self.rewrites:
            rewrite(graph)
        for chained in self.chained:
            chained(graph)

    def uuid(self) -> bytes | None:
        chained = chained_uuids(self.chained)
        if chained is None:
            return None
        digest = hashlib.sha256(get_hash_for_files((str(pathlib.Path(__file__)),)))
        digest.update(repr((torch.__version__, [r.__name__ for r in self.rewrites], chained)).encode())
        return digest.digest()
