"""Reading post-grad FX graphs: op predicates, dtypes, commutative operand matching.

Post-grad (functional, decomposed) graphs spell the modulation math with a few aten/prims ops:
``aten.index.Tensor`` for both ``index_select`` and ``t[idx]``, ``aten.add.Tensor/Scalar``,
``aten.mul.Tensor``, ``prims.convert_element_type`` for every ``.to(dtype)``/upcast, and views.
"""

from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten, prims = torch.ops.aten, torch.ops.prims

ADD = (aten.add.Tensor, aten.add.Scalar)
MUL = (aten.mul.Tensor, aten.mul.Scalar)
CONVERT = (prims.convert_element_type.default, aten._to_copy.default)
VIEW = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
GATHER = (aten.index.Tensor, aten.index_select.default)


class NoMatch(Exception):
    """The candidate is not a site; ``str(self)`` says why (for the debug log)."""


def is_op(node: object, targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node: object):
    return node.meta.get("val") if isinstance(node, Node) else None


def dtype_of(node: object) -> torch.dtype | None:
    v = val(node)
    return getattr(v, "dtype", None)


def shape_of(node: object) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def same_size(a, b) -> bool:
    """``a == b`` for sizes that may be symbolic: true only if provable without adding a guard."""
    return statically_known_true(a == b)


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def device_of(node: object) -> torch.device | None:
    v = val(node)
    return v.device if isinstance(v, torch.Tensor) else None


def expect(cond: bool, why: str) -> None:
    if not cond:
        raise NoMatch(why)


def operands(node: Node, targets, what: str) -> tuple:
    """``(a, b)`` of a binary ``node`` of ``targets`` with no alpha/extra kwargs."""
    expect(is_op(node, targets), f"{node} is not {what}")
    expect(not node.kwargs and len(node.args) == 2, f"{node}: unexpected arguments for {what}")
    return node.args


def either_order(pair: tuple, first_test) -> tuple:
    """``(a, b)`` reordered so that ``first_test(a)`` holds; raises NoMatch if neither does."""
    a, b = pair
    if first_test(a):
        return a, b
    if first_test(b):
        return b, a
    raise NoMatch(f"neither operand of {pair} fits")


def strip_converts(node: object) -> object:
    """The value before any chain of dtype conversions."""
    while is_op(node, CONVERT):
        node = node.args[0]
    return node


def strip_views(node: object) -> object:
    while is_op(node, VIEW):
        node = node.args[0]
    return node


def is_scalar(x: object, value: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and float(x) == value
