"""When a call of a public op may run without the dispatcher, and what such a call runs.

Through the dispatcher, a call of a ``torch.library`` op in eager passes two Python layers (the autograd
wrapper and the per-device wrapper, each boxing every argument) before it reaches the op's body, and
``wrap_triton`` then launches the kernel through a higher-order op. Nothing needs either when nothing is
watching the call, so the public functions (``ops.py``) skip both exactly when ``call_layout`` says so; every
other call goes through ``torch.ops.h3_fused.*`` (docs/DESIGN.md, "Direct calls in eager").

A direct call's host time is then the checks of its arguments and the working out of its launch, which
depend only on the arguments' layout (shapes, strides, dtypes, devices, pointer alignment) and scalars:
``DirectLaunch`` is that work done once per layout, and a later call of the same layout launches from it, on
CUDA through the launcher of the kernel its first call compiled (``launch.CompiledLaunch``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from .arguments import check_args, check_index_on_host
from .launch import CompiledLaunch, KernelLaunch, no_launch_hooks, plan_launch, triton_allowed

SCALARS = (bool, int, float, str)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter dispatches as a plain tensor
MAX_LAYOUTS = 256  # per op; beyond, the layout seen first is forgotten (eager calls of ever new shapes)


def _nothing_watching() -> bool:
    """No ``torch.compile`` or TorchScript tracing, Python dispatch mode, torch function mode (``with
    torch.device(...)`` is one), functorch transform (vmap, grad, functionalize) or autograd profiler active."""
    return not (torch.compiler.is_compiling()
                or torch._C._len_torch_dispatch_stack()
                or torch._C._is_torch_function_mode_enabled()
                or torch._C._are_functorch_transforms_active()
                or torch._C._get_tracing_state() is not None
                or torch._C._autograd._profiler_enabled())


def untraced(values) -> bool:
    """Whether no tracer, mode or transform could see a call with these argument values: each is None, a
    Python scalar, a plain ``torch.Tensor`` or an ``nn.Parameter`` (not another subclass, such as a fake,
    functional or distributed tensor, nor an FX proxy), and nothing is watching (``_nothing_watching``)."""
    return _nothing_watching() and all(v is None or type(v) in PLAIN_TENSORS or type(v) in SCALARS for v in values)


def call_layout(values) -> tuple | None:
    """The layout of a call with these argument values where the call may skip the dispatcher: it is
    ``untraced`` and autograd would not record it (grad mode off, or no tensor requiring grad; else the
    dispatcher's autograd layer refuses it, ``ops._refuse_grad``). Each tensor as its shape, strides, dtype,
    device and whether its data is 16-byte aligned (which Triton specialises a pointer on), every other value
    with its type (``1`` and ``True`` are different layouts). None otherwise."""
    if not _nothing_watching():
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
    per slot of the launch; each value is the tensor the slot reads, a view of it at most), into new contiguous
    outputs shaped as the first slot's tensor (``x`` or the residual; ``u`` where ``want_u``, ``y`` where
    ``want_y``), on ``device`` (made current for the launch). Under the interpreter (CPU tensors) the index
    is checked on the host first (``index_position``, ``num_table_rows``). On CUDA the first call launches
    through Triton's ``JITFunction.run`` and keeps the kernel it compiled (``compiled``); later calls launch
    that kernel directly while Triton has no launch hook."""

    launch: KernelLaunch
    positions: tuple[int, ...]
    device: torch.device
    want_u: bool
    want_y: bool
    index_position: int | None
    num_table_rows: int
    compiled: CompiledLaunch | None = field(default=None, compare=False)

    def __call__(self, values):
        """The op's outputs for a call with these argument values (of this layout): ``y`` (site A), ``(u, y)``
        (site B) or ``u`` (site C)."""
        if self.index_position is not None:
            check_index_on_host(values[self.index_position].reshape(-1), self.num_table_rows)
        tensors = [values[p] for p in self.positions]
        lead = tensors[0]  # x or the residual: the outputs' shape, dtype and device
        u, y = (torch.empty_like(lead, memory_format=torch.contiguous_format) if wanted else None
                for wanted in (self.want_u, self.want_y))
        if self.device.type == "cuda" and self.device.index != torch._C._cuda_getDevice():
            with torch.cuda.device(self.device):  # Triton launches on the current device
                self._launch(tensors, u, y)
        else:
            self._launch(tensors, u, y)
        return (u, y) if self.want_u and self.want_y else (u if self.want_u else y)

    def _launch(self, tensors, u, y):
        if self.compiled is not None and no_launch_hooks():
            self.compiled(tensors, u, y, torch._C._cuda_getCurrentRawStream(self.device.index))
            return
        kernel = self.launch(tensors, u, y, _direct)
        if self.device.type == "cuda" and self.compiled is None:
            self.compiled = self.launch.bind(kernel)


def _direct(kernel):
    return kernel


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
    positions = tuple(names.index(slot) if slot in names else -1 for slot in launch.slots)
    values = (*args, *kwargs.values())
    if any(p < 0 or getattr(a, slot).data_ptr() != values[p].data_ptr()
           for slot, p in zip(launch.slots, positions)):
        return None
    on_host = a.device.type == "cpu"  # the interpreter: no kernel assertion guards the index
    return DirectLaunch(launch, positions, a.device, want_u=a.gate is not None, want_y=a.scale is not None,
                        index_position=names.index("index") if on_host else None, num_table_rows=a.num_table_rows)
