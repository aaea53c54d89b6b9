"""Reading post-grad FX graphs: op predicates, dtypes, commutative operand matching.

Post-grad (functional, decomposed) graphs spell the modulation math with a few aten/prims ops:
``aten.index.Tensor`` for both ``index_select`` and ``t[idx]``, ``aten.add.Tensor/Scalar``,
``aten.mul.Tensor``, ``prims.convert_element_type`` for every ``.to(dtype)``/upcast, and views.
"""

from __future__ import annotations

import os
import re
import sys

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten, prims = torch.ops.aten, torch.ops.prims

ADD = (aten.add.Tensor, aten.add.Scalar)
MUL = (aten.mul.Tensor, aten.mul.Scalar)
CONVERT = (prims.convert_element_type.default, aten._to_copy.default)
# views that only reshape (given modulation rows pass through them to the shape the site broadcasts them at)
VIEW = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
        aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
GATHER = (aten.index.Tensor, aten.index_select.default)


class NoMatch(Exception):
    """The candidate is not a site: ``str(self)`` says why, in the model's terms; ``hint``, where one helps, what
    to do about it."""

    def __init__(self, why: str, hint: str | None = None):
        super().__init__(why)
        self.hint = hint


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


def expect(cond: bool, why: str, hint: str | None = None) -> None:
    if not cond:
        raise NoMatch(why, hint)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in [^\n]+\n\s*([^\n]*)')


def _library_dirs() -> tuple[str, ...]:
    """torch's folder and this package's (wherever it is installed)."""
    packages = [sys.modules.get(name) for name in ("h3_fused", "h3_fused.patterns", "h3_fused.kernels")]
    return (os.path.dirname(torch.__file__), *(os.path.dirname(m.__file__) + os.sep for m in packages if m))


def source_of(node: object, prefix: str = "") -> str:
    """``prefix`` and the model's source line that made ``node`` (``file.py:123 `code```), from the stack
    Dynamo recorded: its last frame outside torch and this package; ``""`` where none is known."""
    trace = node.meta.get("stack_trace") if isinstance(node, Node) else None
    library = _library_dirs()
    frames = [(f, n, code) for f, n, code in _FRAME.findall(trace or "") if not f.startswith(library)]
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{prefix}{os.path.basename(path)}:{line} `{code.strip()}`"


def describe(value: object) -> str:
    """``value`` in a log line: the op that makes it (``mul``, ``var_mean``, ...), a graph input, or a constant."""
    if isinstance(value, Node):
        if value.op == "placeholder":
            return "a graph input"
        if value.op == "call_function":
            name = getattr(value.target, "__name__", str(value.target))
            return f"`{name.split('.')[0]}`"
        return f"a {value.op}"
    return repr(value)


def operands(node: Node, targets, what: str) -> tuple:
    """``(a, b)`` of a binary ``node`` of ``targets`` with no alpha/extra kwargs."""
    expect(is_op(node, targets), f"expected `{what}`, found {describe(node)}")
    expect(not node.kwargs and len(node.args) == 2, f"`{what}` has extra arguments ({describe(node)} with {node.kwargs})")
    return node.args


def either_order(pair: tuple, first_test, what: str) -> tuple:
    """``(a, b)`` reordered so that ``first_test(a)`` holds; raises NoMatch, saying ``what`` was looked for."""
    a, b = pair
    if first_test(a):
        return a, b
    if first_test(b):
        return b, a
    raise NoMatch(f"neither operand ({describe(a)}, {describe(b)}) is {what}")


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
