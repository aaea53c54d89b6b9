"""The fused modulation ops, ``torch.ops.h3_fused.*``, and the public functions that call them.

Each op is a ``torch.library.triton_op``: under ``torch.compile`` its body is traced, so on CUDA the
Triton kernel is inlined into Inductor's generated code (no dispatcher call). For CPU tensors (and any
device Triton must not be launched on) the body is the pure-torch reference (``reference.py``, eager's
operations in eager's order): called directly it is bit-identical to eager under ``bf16``; traced, its
operations are the graph's, and Inductor generates their CPU code as it would the unfused site's.

The public functions ``norm_modulate``, ``gate_norm_modulate`` and ``gate_residual`` take the op's
arguments and call its body directly where no tracer, mode or transform could see the call and autograd
would not record it (``direct_call``), else the op: in eager the dispatcher's layers cost more host time
than the kernel takes at small T. The body launches the kernel without ``wrap_triton`` on the same
condition. The op (``public_function.op``) is what graphs hold and what ``opcheck`` checks.

Their autograd formulas (``autograd.py``) call ``h3_fused::modulation_backward`` (``backward.py``), a
``triton_op`` as well, so that Inductor inlines the backward kernels into the compiled backward graph as it
inlines the forward's.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.library import triton_op

from .arguments import ModulationArgs, check_args, check_index_on_host
from .direct_call import MAX_LAYOUTS, call_layout, plan_direct_call
from .launch import launch_modulation
from .reference import reference_modulation
from .runtime import launch_context, triton_allowed, untraced

Tensor = torch.Tensor


def _empty_outputs(a: ModulationArgs, want_u: bool, want_y: bool):
    def make(want, shape):
        return torch.empty(shape, dtype=a.dtype, device=a.device) if want else None

    return make(want_u, a.out_shape), make(want_y, a.y_shape)


def _run(a: ModulationArgs, raw: dict, want_u: bool, want_y: bool):
    if a.rows == 0 or a.hidden == 0:
        return _empty_outputs(a, want_u, want_y)
    if not triton_allowed(a.device, a.dtype):  # traced, the reference's ops are the graph's: Inductor compiles them
        if a.gathered and untraced(raw.values()):
            check_index_on_host(a.index, a.num_table_rows)
        u, y = reference_modulation(a)
        return (u if want_u else None), (y if want_y else None)
    if a.gathered and a.device.type == "cpu":  # the Triton interpreter: validate indices on the host
        check_index_on_host(a.index, a.num_table_rows)
    u, y = _empty_outputs(a, want_u, want_y)
    with launch_context(a.device, raw.values()) as wrap:
        launch_modulation(a, u, y, wrap)
    return u, y


class PublicOp:
    """The public function of the ``triton_op`` ``h3_fused::name`` whose body is ``body`` (registered here; its
    autograd formula in ``autograd.py``): a call goes through the dispatcher (``dispatched``,
    ``torch.ops.h3_fused.name``) unless ``direct_call.call_layout`` lets it skip it; then, where ``plans`` (a
    forward op's ``direct_call.plan_direct_call``) gives a ``DirectLaunch`` for the call's layout, it launches
    from that (worked out at the first call of the layout, kept in ``launches``), else it runs the body.
    ``op`` is the ``CustomOpDef``."""

    def __init__(self, name: str, body, plans: bool = False):
        self.op = triton_op(f"h3_fused::{name}", mutates_args=())(body)
        self.body = body
        self.dispatched = getattr(torch.ops.h3_fused, name)
        self.signature = inspect.signature(body) if plans else None
        self.launches = {}
        functools.update_wrapper(self, body)

    def __call__(self, *args, **kwargs):
        values = (*args, *kwargs.values())
        layout = call_layout(values)
        if layout is None:
            return self.dispatched(*args, **kwargs)
        if self.signature is None:
            return self.body(*args, **kwargs)
        key = (len(args), tuple(kwargs), layout)
        launch = self.launches.get(key, _UNPLANNED)
        if launch is _UNPLANNED:
            launch = plan_direct_call(self.signature, args, kwargs)
            if len(self.launches) >= MAX_LAYOUTS:
                del self.launches[next(iter(self.launches))]
            self.launches[key] = launch
        return self.body(*args, **kwargs) if launch is None else launch(values)


_UNPLANNED = object()


def _public_op(name: str):
    """The decorator that makes a forward op's body the ``PublicOp`` ``name``."""
    return functools.partial(PublicOp, name, plans=True)


@_public_op("norm_modulate")
def norm_modulate(
    x: Tensor, weight: Tensor | None, shift: Tensor, scale: Tensor, index: Tensor | None,
    shift_bias: Tensor | None = None, scale_bias: Tensor | None = None, *, eps: float = 1e-6, policy: str = "auto",
    norm_rounds_before_weight: bool = False, upcast_tables: bool = False, norm: str = "rms", norm_in_fp32: bool = False,
) -> Tensor:
    """Site A: ``y = R(R(norm(x) * R(1 + scale[index])) + shift[index])`` (roundings per policy); without an
    ``index``, ``shift`` and ``scale`` are rows that broadcast to ``x`` (per sample or per token), or with a
    leading dim of ``M`` copies more (``[M, B, 1, H]``), which makes ``y`` ``M`` modulations of the one norm,
    ``[M, *x.shape]``, as torch broadcasts them (the norm computed once). ``norm``:
    ``"rms"`` or ``"layer"`` (``weight`` its elementwise scale, or None); ``norm_in_fp32``: the norm of ``x``
    upcast to fp32, its output and the affine fp32, rounded once at ``y``. ``shift_bias``, ``scale_bias``: ``[H]``
    rows added to given rows (both or neither; ``arguments.check_row_biases``); they take no gradient."""
    raw = dict(x=x, residual=None, branch=None, gate=None, weight=weight, shift=shift, scale=scale, index=index,
               shift_bias=shift_bias, scale_bias=scale_bias, eps=eps, policy=policy,
               norm_rounds_before_weight=norm_rounds_before_weight, upcast_tables=upcast_tables, norm=norm,
               norm_in_fp32=norm_in_fp32)
    a = check_args(**raw, has_norm=True)
    return _run(a, raw, want_u=False, want_y=True)[1]


@_public_op("gate_norm_modulate")
def gate_norm_modulate(
    residual: Tensor, gate: Tensor, branch: Tensor, weight: Tensor | None, shift: Tensor, scale: Tensor,
    index: Tensor | None, gate_bias: Tensor | None = None, shift_bias: Tensor | None = None,
    scale_bias: Tensor | None = None, *, eps: float = 1e-6, policy: str = "auto",
    norm_rounds_before_weight: bool = False, upcast_tables: bool = False, norm: str = "rms", norm_in_fp32: bool = False,
) -> tuple[Tensor, Tensor]:
    """Site B: ``u = R(residual + gate[index] * branch)``, ``y = norm_modulate(u, ...)`` (``y`` with ``norm_modulate``'s
    copies, where ``shift`` and ``scale`` have them); returns ``(u, y)``. Biases: as ``norm_modulate``'s, and the
    gate's."""
    raw = dict(x=None, residual=residual, branch=branch, gate=gate, weight=weight, shift=shift, scale=scale,
               index=index, gate_bias=gate_bias, shift_bias=shift_bias, scale_bias=scale_bias, eps=eps, policy=policy,
               norm_rounds_before_weight=norm_rounds_before_weight, upcast_tables=upcast_tables, norm=norm,
               norm_in_fp32=norm_in_fp32)
    a = check_args(**raw, has_norm=True)
    u, y = _run(a, raw, want_u=True, want_y=True)
    return u, y


@_public_op("gate_residual")
def gate_residual(
    residual: Tensor, gate: Tensor, branch: Tensor, index: Tensor | None, gate_bias: Tensor | None = None, *,
    policy: str = "auto", upcast_tables: bool = False,
) -> Tensor:
    """Site C: ``u = R(residual + [R](gate[index] * branch))``; without an ``index``, ``gate`` is rows that
    broadcast to the residual, maybe plus ``gate_bias`` (as ``norm_modulate``'s biases)."""
    raw = dict(x=None, residual=residual, branch=branch, gate=gate, weight=None, shift=None, scale=None,
               index=index, gate_bias=gate_bias, eps=0.0, policy=policy, norm_rounds_before_weight=False,
               upcast_tables=upcast_tables)
    a = check_args(**raw, has_norm=False)
    return _run(a, raw, want_u=True, want_y=False)[0]
