"""When a call of a public op may run without the dispatcher, and what such a call runs.

Through the dispatcher, a call of a ``torch.library`` op in eager passes two Python layers (the autograd
wrapper and the per-device wrapper, each boxing every argument) before it reaches the op's body, and
``wrap_triton`` then launches the kernel through a higher-order op. Nothing needs either when nothing is
watching the call, so the public functions (``ops.py``) skip both exactly when ``call_layout`` says so; every
other call goes through ``torch.ops.h3_fused.*`` (docs/DESIGN.md, "Direct calls in eager").

A direct call's host time is then the checks of its arguments and the working out of its launch, which
depend only on the arguments' layout (shapes, strides, dtypes, devices, pointer alignment) and scalars:
``DirectLaunch`` is that work done once per layout, and a later call of the same layout launches from it, on
CUDA through the launcher of the kernel its first call compiled (``launch_plan.CompiledLaunch``). The private
torch and Triton calls this takes are ``private_api``'s; where one is missing, every call is dispatched.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .arguments import check_args, check_index_on_host
from .launch import ForwardLaunch, plan_launch
from .launch_plan import CompiledLaunch
from .private_api import current_cuda_device, current_raw_stream, no_launch_hooks, nothing_watching
from .runtime import PLAIN_TENSORS, SCALARS, triton_allowed

MAX_LAYOUTS = 256  # per op; beyond, the layout seen first is forgotten (eager calls of ever new shapes)


def call_layout(values) -> tuple | None:
    """The layout of a call with these argument values where the call may skip the dispatcher: nothing is
    watching (``private_api.nothing_watching``), each value is None, a Python scalar, a plain tensor or an
    ``nn.Parameter``, and autograd would not record the call (grad mode off, or no tensor requiring grad; the
    dispatcher's autograd layer records such a call). Each tensor as its shape, strides, dtype, device and
    whether its data is 16-byte aligned (which Triton specialises a pointer on), every other value with its type
    (``1`` and ``True`` are different layouts). None otherwise."""
    if not nothing_watching():
        return None
    grad = torch.is_grad_enabled()
    layout = []
    for v in values:
        kind = type(v)
        if kind in PLAIN_TENSORS:
            if grad and v.requires_grad:
                return None
            layout.append((v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16 == 0))
        elif v is None or kind in SCALARS:
            layout.append((kind, v))
        else:
            return None
    return tuple(layout)


@dataclass
class DirectLaunch:
    """A direct call of one layout: the launch (``launch``) on the call's argument values at ``positions`` (one
    per slot of the launch; each value is the tensor the slot reads, a view of it at most; ``placeholder`` in
    the slots of the inputs the site has not, position None), into new contiguous
    outputs (``u`` where ``want_u``, shaped as the first slot's tensor, ``x`` or the residual; ``y`` of ``y_shape``,
    ``ModulationArgs.y_shape``, where it is not None), on ``device`` (made current for the launch). Under the
    interpreter (CPU tensors) the index is checked on the host first (``index_position``, ``num_table_rows``).
    On CUDA the first call launches through Triton's ``JITFunction.run`` and keeps the kernel it compiled
    (``compiled``); later calls launch that kernel directly while Triton has no launch hook."""

    launch: ForwardLaunch
    positions: tuple[int | None, ...]
    placeholder: torch.Tensor | None
    device: torch.device
    want_u: bool
    y_shape: torch.Size | None
    index_position: int | None
    num_table_rows: int
    compiled: CompiledLaunch | None = field(default=None, compare=False)

    def __call__(self, values):
        """The op's outputs for a call with these argument values (of this layout): ``y`` (site A), ``(u, y)``
        (site B) or ``u`` (site C)."""
        if self.index_position is not None:
            check_index_on_host(values[self.index_position].reshape(-1), self.num_table_rows)
        tensors = [None if p is None else values[p] for p in self.positions]
        lead = next(t for t in tensors if t is not None)  # x or the residual: the outputs' shape, dtype and device
        u = torch.empty_like(lead, memory_format=torch.contiguous_format) if self.want_u else None
        y = torch.empty(self.y_shape, dtype=lead.dtype, device=lead.device) if self.y_shape is not None else None
        if self.device.type == "cuda" and self.device.index != current_cuda_device():
            with torch.cuda.device(self.device):  # Triton launches on the current device
                self._launch(tensors, u, y)
        else:
            self._launch(tensors, u, y)
        return (u, y) if self.want_u and y is not None else (u if self.want_u else y)

    def _launch(self, inputs, u, y):
        if self.compiled is not None and no_launch_hooks():
            self.compiled(ForwardLaunch.tensors(inputs, u, y, self.placeholder), current_raw_stream(self.device.index))
            return
        kernel = self.launch(inputs, u, y, self.placeholder, lambda jit_function: jit_function)
        if self.device.type == "cuda" and self.compiled is None:
            self.compiled = self.launch.launch.bind(kernel)


def plan_direct_call(signature: inspect.Signature, args: tuple, kwargs: dict) -> DirectLaunch | None:
    """The ``DirectLaunch`` of a call of the forward op whose body has ``signature`` with ``args`` and ``kwargs``,
    or None where a call of its layout runs the body instead: no Triton kernel for its device and dtype, no
    rows, or an argument the checks copy (a layout the kernel cannot read in place). Raises what the op's
    argument checks raise."""
    names = [*signature.parameters][:len(args)] + [*kwargs]
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    a = check_args(**bound.arguments, has_norm="scale" in signature.parameters)
    if not triton_allowed(a.device, a.dtype) or a.rows == 0 or a.hidden == 0:
        return None
    launch = plan_launch(a)
    positions = tuple(None if slot is None else names.index(slot) if slot in names else -1 for slot in launch.slots)
    values = (*args, *kwargs.values())
    if any(p is not None and (p < 0 or getattr(a, slot).data_ptr() != values[p].data_ptr())
           for slot, p in zip(launch.slots, positions)):
        return None
    on_host = a.device.type == "cpu"  # the interpreter: no kernel assertion guards the index
    return DirectLaunch(launch, positions, launch.placeholder(a), a.device, want_u=a.gate is not None,
                        y_shape=a.y_shape if a.scale is not None else None,
                        index_position=names.index("index") if on_host and a.gathered else None,
                        num_table_rows=a.num_table_rows)
