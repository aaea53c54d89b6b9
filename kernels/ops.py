"""The fused modulation ops, ``torch.ops.h3_fused.*``.

Each op is a ``torch.library.triton_op``: under ``torch.compile`` its body is traced, so on CUDA the
Triton kernel is inlined into Inductor's generated code (no dispatcher call). CPU tensors (and any
device Triton must not be launched on) go through ``h3_fused::reference_modulation``, an opaque op
that runs the pure-torch implementation (bit-identical to eager on the CPU under ``bf16``).
"""

from __future__ import annotations

import torch
from torch.library import custom_op, triton_op, wrap_triton

from .contract import ModulationArgs, check_args
from .reference import reference_modulation
from .triton_modulation import interpreting, launch_modulation

Tensor = torch.Tensor


def _empty_outputs(a: ModulationArgs, want_u: bool, want_y: bool):
    def make(want):
        return torch.empty(a.out_shape, dtype=a.dtype, device=a.device) if want else None

    return make(want_u), make(want_y)


def _triton_allowed(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def _run(a: ModulationArgs, raw: dict, want_u: bool, want_y: bool):
    if a.rows == 0 or a.hidden == 0:
        return _empty_outputs(a, want_u, want_y)
    if not _triton_allowed(a.device):
        u, y = torch.ops.h3_fused.reference_modulation(**raw)
        return (u if want_u else None), (y if want_y else None)
    if a.device.type == "cpu":  # the Triton interpreter: validate indices on the host
        _check_index_on_host(a)
    u, y = _empty_outputs(a, want_u, want_y)
    # the interpreter (eager kernel tests on CPU tensors) launches directly: torch 2.12's wrap_triton
    # refuses its interpreted functions
    launch_modulation(a, u, y, (lambda kernel: kernel) if interpreting() else wrap_triton)
    return u, y


def _check_index_on_host(a: ModulationArgs) -> None:
    bad = (a.index < 0) | (a.index >= a.num_table_rows)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise IndexError(f"index out of range: index[{first}] = {int(a.index[first])} "
                         f"is not in [0, {a.num_table_rows})")


@custom_op("h3_fused::reference_modulation", mutates_args=())
def reference_modulation_op(
    x: Tensor | None, residual: Tensor | None, branch: Tensor | None, gate: Tensor | None,
    weight: Tensor | None, shift: Tensor | None, scale: Tensor | None, index: Tensor,
    eps: float, policy: str, norm_rounds_before_weight: bool, upcast_tables: bool,
) -> tuple[Tensor, Tensor]:
    """Pure-torch ``(u, y)`` of any site; an output the site does not produce is empty."""
    a = check_args(x=x, residual=residual, branch=branch, gate=gate, weight=weight, shift=shift, scale=scale,
                   index=index, eps=eps, policy=policy, norm_rounds_before_weight=norm_rounds_before_weight,
                   upcast_tables=upcast_tables, has_norm=scale is not None)
    u, y = reference_modulation(a)
    nothing = a.index.new_empty(0, dtype=a.dtype)
    return (nothing if u is None else u), (nothing if y is None else y)


@reference_modulation_op.register_fake
def _(x, residual, branch, gate, weight, shift, scale, index, eps, policy, norm_rounds_before_weight,
      upcast_tables):
    lead = x if x is not None else residual
    nothing = lead.new_empty(0)
    out = torch.empty_like(lead, memory_format=torch.contiguous_format)
    return (nothing if gate is None else out), (nothing if scale is None else torch.empty_like(out))


@triton_op("h3_fused::norm_modulate", mutates_args=())
def norm_modulate(
    x: Tensor, weight: Tensor | None, shift: Tensor, scale: Tensor, index: Tensor, *,
    eps: float = 1e-6, policy: str = "auto", norm_rounds_before_weight: bool = False,
    upcast_tables: bool = False,
) -> Tensor:
    """Site A: ``y = R(R(rms_norm(x) * R(1 + scale[index])) + shift[index])`` (roundings per policy)."""
    raw = dict(x=x, residual=None, branch=None, gate=None, weight=weight, shift=shift, scale=scale, index=index,
               eps=eps, policy=policy, norm_rounds_before_weight=norm_rounds_before_weight,
               upcast_tables=upcast_tables)
    a = check_args(**raw, has_norm=True)
    return _run(a, raw, want_u=False, want_y=True)[1]


@triton_op("h3_fused::gate_norm_modulate", mutates_args=())
def gate_norm_modulate(
    residual: Tensor, gate: Tensor, branch: Tensor, weight: Tensor | None, shift: Tensor, scale: Tensor,
    index: Tensor, *, eps: float = 1e-6, policy: str = "auto", norm_rounds_before_weight: bool = False,
    upcast_tables: bool = False,
) -> tuple[Tensor, Tensor]:
    """Site B: ``u = R(residual + gate[index] * branch)``, ``y = norm_modulate(u, ...)``; returns ``(u, y)``."""
    raw = dict(x=None, residual=residual, branch=branch, gate=gate, weight=weight, shift=shift, scale=scale,
               index=index, eps=eps, policy=policy, norm_rounds_before_weight=norm_rounds_before_weight,
               upcast_tables=upcast_tables)
    a = check_args(**raw, has_norm=True)
    u, y = _run(a, raw, want_u=True, want_y=True)
    return u, y


@triton_op("h3_fused::gate_residual", mutates_args=())
def gate_residual(
    residual: Tensor, gate: Tensor, branch: Tensor, index: Tensor, *, policy: str = "auto",
    upcast_tables: bool = False,
) -> Tensor:
    """Site C: ``u = R(residual + [R](gate[index] * branch))``."""
    raw = dict(x=None, residual=residual, branch=branch, gate=gate, weight=None, shift=None, scale=None,
               index=index, eps=0.0, policy=policy, norm_rounds_before_weight=False, upcast_tables=upcast_tables)
    a = check_args(**raw, has_norm=False)
    return _run(a, raw, want_u=True, want_y=False)[0]
