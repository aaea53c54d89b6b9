"""``KeepNarrowingCasts``: a joint-graph pre-pass that keeps eager's rounding where a value is cast to a narrower
float dtype and straight back (``x.to(bf16).float()``, as a block's ``.type_as(x)`` output meets the next
module's ``.float()``).

torch 2.11 and 2.12's Inductor joint-graph pattern ``pointless_convert`` replaces
``convert(convert(x, bf16), fp32)`` by ``convert(x, fp32)`` whatever ``emulate_precision_casts`` says: the bf16
rounding eager performs is gone, and with it eager's bits (Wan's last block and its ``norm_out``: the norm then
reads the unrounded fp32 sum, which no fused site may stand for). From torch 2.13 the pattern keeps a narrowing
intermediate under ``emulate_precision_casts``. Under ``bf16`` on the torches without that, this pass restates
each such narrowing cast with its dtype as a keyword argument, ``convert_element_type(x, dtype=bf16)``: the same
op, which Inductor lowers the same way, but not the two positional arguments the pattern matches; nothing else
changes.
"""

from __future__ import annotations

import hashlib
import pathlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph, Node

from .graph_pass import chained_passes, chained_uuids

CAST = torch.ops.prims.convert_element_type.default


def inductor_drops_narrowing_round_trips() -> bool:
    """Whether this torch's Inductor removes a narrowing float cast that is cast straight back (torch 2.11, 2.12)."""
    return torch.torch_version.TorchVersion(torch.__version__) < "2.13"


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


class KeepNarrowingCasts(CustomGraphPass):
    """Restate each narrowing cast that is cast straight back (``_round_trip_casts``) with its dtype a keyword
    argument; then run ``chained`` (the joint-graph pre-passes the user set), in order."""

    def __init__(self, chained=None):
        self.chained = chained_passes(chained, KeepNarrowingCasts)

    def __call__(self, graph: Graph) -> None:
        for node in _round_trip_casts(graph):
            with graph.inserting_before(node):
                kept = graph.call_function(CAST, (node.args[0],), {"dtype": node.args[1]})
            kept.meta.update(node.meta)
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
        for chained in self.chained:
            chained(graph)

    def uuid(self) -> bytes | None:
        chained = chained_uuids(self.chained)
        if chained is None:
            return None
        digest = hashlib.sha256(get_hash_for_files((str(pathlib.Path(__file__)),)))
        digest.update(repr((torch.__version__, chained)).encode())
        return digest.digest()
