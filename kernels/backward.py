"""The backward of the fused ops: ``h3_fused::modulation_backward`` and the autograd formulas that call it.

``modulation_backward`` is a ``torch.library.triton_op`` like the forward ops, so that under
``torch.compile`` Inductor inlines its kernels (``backward_kernel.py``) into the compiled backward graph; on
the CPU (and for fp64) it calls ``h3_fused::reference_modulation_backward``, the pure-torch reference. Each
forward op saves what its backward reads: the rows it normalized (``x``, or the stored residual ``u``, an
output), the branch, the tables, the weight and the index; never a normalized or modulated row, and not
the per-row ``rsqrt``, which the backward recomputes from the rows it reads anyway. Autograd's
``needs_input_grad`` decides which gradients are computed. The backward has no backward: double backward
(``create_graph=True``) through a fused site raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from .arguments import ModulationArgs, as_rows, check_args, check_index_on_host
from .launch import triton_allowed
from .launch_backward import Needs, launch_backward
from .ops import PublicOp, gate_norm_modulate, gate_residual, launch_context, norm_modulate
from .reference import reference_backward

Tensor = torch.Tensor
GRADIENTS = ("lead", "branch", "gate", "weight", "shift", "scale")  # the order of the backward op's outputs


def _forward_args(u, branch, gate, weight, shift, scale, index, dy, du, eps, policy, norm_rounds_before_weight,
                  upcast_tables) -> ModulationArgs:
    """The forward's checked arguments, from what its backward receives (site C has no ``u``: ``du`` stands
    for the residual)."""
    flags = dict(policy=policy, upcast_tables=upcast_tables)
    if scale is None:
        return check_args(residual=du, gate=gate, branch=branch, index=index, **flags, has_norm=False)
    norm = dict(weight=weight, shift=shift, scale=scale, index=index, eps=eps,
                norm_rounds_before_weight=norm_rounds_before_weight, **flags)
    if gate is None:
        return check_args(x=u, **norm, has_norm=True)
    return check_args(residual=u, gate=gate, branch=branch, **norm, has_norm=True)


def _outputs(a: ModulationArgs, grads: dict) -> tuple[Tensor, ...]:
    """The op's six outputs: each gradient in its input's shape, an empty tensor where none was asked for."""
    shapes = dict(lead=a.out_shape, branch=a.out_shape)
    return tuple(grads[name].view(shapes.get(name, grads[name].shape)) if name in grads
                 else a.index.new_empty(0, dtype=a.dtype) for name in GRADIENTS)


def _rows(t: Tensor | None, a: ModulationArgs, name: str) -> Tensor | None:
    if t is None:
        return None
    if t.shape != a.out_shape:
        raise ValueError(f"{name} must have the shape of the activations {tuple(a.out_shape)}, got {tuple(t.shape)}")
    return as_rows(name, t.to(a.dtype), a.hidden)


@custom_op("h3_fused::reference_modulation_backward", mutates_args=())
def reference_modulation_backward(
    u: Tensor | None, branch: Tensor | None, gate: Tensor | None, weight: Tensor | None, shift: Tensor | None,
    scale: Tensor | None, index: Tensor, dy: Tensor | None, du: Tensor | None, eps: float, policy: str,
    norm_rounds_before_weight: bool, upcast_tables: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch gradients of any site (``reference.reference_backward``), as ``modulation_backward`` returns them."""
    a = _forward_args(u, branch, gate, weight, shift, scale, index, dy, du, eps, policy, norm_rounds_before_weight,
                      upcast_tables)
    check_index_on_host(a.index, a.num_table_rows)
    grads = reference_backward(a, _rows(u, a, "u"), _rows(dy, a, "dy"), _rows(du, a, "du"), Needs(*needs))
    return _outputs(a, grads)


@reference_modulation_backward.register_fake
def _(u, branch, gate, weight, shift, scale, index, dy, du, eps, policy, norm_rounds_before_weight, upcast_tables,
      needs):
    lead = u if u is not None else du
    wanted = dict(zip(GRADIENTS, needs))
    like = dict(lead=lead, branch=lead, gate=gate, weight=weight, shift=shift, scale=scale)
    return tuple(torch.empty(like[name].shape, dtype=like[name].dtype, device=lead.device)
                 if wanted[name] and like[name] is not None and (name != "branch" or gate is not None)
                 else index.new_empty(0, dtype=lead.dtype) for name in GRADIENTS)


def _backward_body(
    u: Tensor | None, branch: Tensor | None, gate: Tensor | None, weight: Tensor | None, shift: Tensor | None,
    scale: Tensor | None, index: Tensor, dy: Tensor | None, du: Tensor | None, *, eps: float, policy: str,
    norm_rounds_before_weight: bool, upcast_tables: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients ``needs`` asks for (in ``GRADIENTS`` order) of the site whose saved values these are:
    site A ``u = x``, site B ``u`` = the stored residual, site C no ``u``; ``dy``, ``du``: the gradients of
    the site's outputs ``y`` and ``u``. A gradient not asked for is an empty tensor."""
    raw = dict(u=u, branch=branch, gate=gate, weight=weight, shift=shift, scale=scale, index=index, dy=dy, du=du,
               eps=eps, policy=policy, norm_rounds_before_weight=norm_rounds_before_weight, upcast_tables=upcast_tables)
    a = _forward_args(**raw)
    if a.rows == 0 or a.hidden == 0 or not triton_allowed(a.device, a.dtype):
        return torch.ops.h3_fused.reference_modulation_backward(**raw, needs=needs)
    if a.device.type == "cpu":  # the Triton interpreter: validate indices on the host
        check_index_on_host(a.index, a.num_table_rows)
    with launch_context(a.device, (*raw.values(), needs)) as wrap:
        grads = launch_backward(a, _rows(u, a, "u"), _rows(dy, a, "dy"), _rows(du, a, "du"), Needs(*needs), wrap)
    return _outputs(a, grads)


modulation_backward = PublicOp("modulation_backward", _backward_body)


def _no_double_backward(ctx, inputs, keyword_only_inputs, output):
    raise NotImplementedError("h3_fused::modulation_backward has no backward: double backward "
                              "(create_graph=True) through a fused modulation site is not supported")


modulation_backward.op.register_autograd(_no_double_backward, setup_context=_no_double_backward)

# Each forward op: its positional inputs, the name of each in the backward's ``GRADIENTS``, and which of its
# outputs are ``(du, dy)`` (A: y; B: u, y; C: u).
SITES = {
    "norm_modulate": (norm_modulate, ("x", "weight", "shift", "scale", "index"), ("y",)),
    "gate_norm_modulate": (gate_norm_modulate, ("residual", "gate", "branch", "weight", "shift", "scale", "index"),
                           ("u", "y")),
    "gate_residual": (gate_residual, ("residual", "gate", "branch", "index"), ("u",)),
}
AS_GRADIENT = dict(x="lead", residual="lead", branch="branch", gate="gate", weight="weight", shift="shift",
                   scale="scale")


def _register(public: PublicOp, input_names: tuple[str, ...], outputs: tuple[str, ...]) -> None:
    def setup_context(ctx, inputs, keyword_only_inputs, output):
        named = dict(zip(input_names, inputs))
        result = dict(zip(outputs, output if isinstance(output, tuple) else (output,)))
        u = named.get("x", result.get("u")) if "scale" in named else None
        ctx.save_for_backward(u, named.get("branch"), named.get("gate"), named.get("weight"), named.get("shift"),
                              named.get("scale"), named["index"])
        ctx.flags = dict(eps=keyword_only_inputs.get("eps", 0.0), policy=keyword_only_inputs["policy"],
                         norm_rounds_before_weight=keyword_only_inputs.get("norm_rounds_before_weight", False),
                         upcast_tables=keyword_only_inputs["upcast_tables"])

    def backward(ctx, *grads):
        incoming = dict(zip(outputs, grads))
        wanted = {AS_GRADIENT[name]: need for name, need in zip(input_names, ctx.needs_input_grad) if name != "index"}
        # site C: the residual's gradient is the incoming one itself, in every policy (nothing to compute or copy)
        passes_through = "y" not in outputs and wanted["lead"]
        needs = [wanted.get(name, False) and not (name == "lead" and passes_through) for name in GRADIENTS]
        result = {}
        if any(needs):
            result = dict(zip(GRADIENTS, modulation_backward(*ctx.saved_tensors, incoming.get("y"), incoming.get("u"),
                                                             needs=needs, **ctx.flags)))
        if passes_through:
            result["lead"] = incoming["u"]
        return tuple(result[AS_GRADIENT[name]] if name != "index" and wanted[AS_GRADIENT[name]] else None
                     for name in input_names)

    public.op.register_autograd(backward, setup_context=setup_context)


for _public, _inputs, _outputs_of in SITES.values():
    _register(_public, _inputs, _outputs_of)
