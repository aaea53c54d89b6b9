"""The autograd formulas of the fused ops, registered in one place.

Each forward op (``ops.py``) saves a ``backward.SavedSite`` and differentiates through
``h3_fused::modulation_backward``, which computes only the gradients autograd asks for
(``ctx.needs_input_grad``). What an op saves and returns follows from its signature: its first input is the
lead (``x``, or the residual), it has a ``u`` output where it has a gate and a ``y`` output where it has a norm.
The backward op itself has no backward (``_no_double_backward``).
"""

from __future__ import annotations

import inspect

from .backward import GRADIENTS, SavedSite, modulation_backward, rows_without_fused_backward
from .ops import PublicOp, gate_norm_modulate, gate_residual, norm_modulate


def _gradient_name(input_name: str) -> str:
    """The name of an input's gradient among the backward's ``GRADIENTS`` (the lead input's is ``lead``)."""
    return "lead" if input_name in ("x", "residual") else input_name


def register(public: PublicOp) -> None:
    """Register the autograd formula of the forward op ``public``."""
    parameters = inspect.signature(public.body).parameters
    input_names = [name for name, p in parameters.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    outputs = ("u",) * ("gate" in input_names) + ("y",) * ("scale" in input_names)

    def setup_context(ctx, inputs, keyword_only_inputs, output):  # the parameters' names are torch's
        named = dict(zip(input_names, inputs))
        result = dict(zip(outputs, output if isinstance(output, tuple) else (output,)))
        normalized = named.get("x", result.get("u")) if "scale" in named else None
        flags = {k: keyword_only_inputs[k] for k in ("norm_rounds_before_weight", "norm", "norm_in_fp32")
                 if k in keyword_only_inputs}  # site C takes no norm's flags
        saved = SavedSite(normalized, named.get("branch"), named.get("gate"), named.get("weight"), named.get("shift"),
                          named.get("scale"), named["index"], eps=keyword_only_inputs.get("eps", 0.0),
                          policy=keyword_only_inputs["policy"], upcast_tables=keyword_only_inputs["upcast_tables"],
                          **{"norm_rounds_before_weight": False, **flags})
        ctx.save_for_backward(*saved.tensors())
        ctx.flags = saved.flags()
        lead = named.get("x", named.get("residual"))
        biases = [name for name in input_names if name.endswith("_bias") and named.get(name) is not None]
        ctx.unsupported = ("modulation rows given with biases (" + ", ".join(biases) + "): add them to the rows"
                           if biases else None if saved.index is not None else
                           rows_without_fused_backward(saved.tables(), lead.dim()))

    def backward(ctx, *grads):
        if ctx.unsupported:
            raise NotImplementedError(f"h3_fused::{public.op._name.split('::')[-1]} has no fused backward yet "
                                      f"for {ctx.unsupported}")
        incoming = dict(zip(outputs, grads))
        wanted = {_gradient_name(name): need for name, need in zip(input_names, ctx.needs_input_grad)
                  if name != "index"}
        # site C: the residual's gradient is the incoming one itself, in every policy (nothing to compute or copy)
        passes_through = "y" not in outputs and wanted["lead"]
        needs = [wanted.get(name, False) and not (name == "lead" and passes_through) for name in GRADIENTS]
        result = {}
        if any(needs):
            saved = SavedSite.of(ctx.saved_tensors, ctx.flags)
            given = saved.tables() if saved.index is None else {}
            if given:  # rows given per sample, per token or one for all: as tables gathered by an index
                lead = saved.u if saved.u is not None else incoming["u"]
                saved = saved.gathered(lead.shape)
            result = dict(zip(GRADIENTS, modulation_backward(*saved.tensors(), incoming.get("y"), incoming.get("u"),
                                                             **saved.flags(), needs=needs)))
            for name, rows in given.items():  # each table's gradient, [K, H], in its rows' shape
                if result[name].numel():
                    result[name] = result[name].view(rows.shape)
        if passes_through:
            result["lead"] = incoming["u"]
        return tuple(result[_gradient_name(name)] if name != "index" and wanted[_gradient_name(name)] else None
                     for name in input_names[:len(ctx.needs_input_grad)])  # the inputs the call passed

    public.op.register_autograd(backward, setup_context=setup_context)


def _no_double_backward(ctx, inputs, keyword_only_inputs, output):
    raise NotImplementedError("h3_fused::modulation_backward has no backward: double backward "
                              "(create_graph=True) through a fused modulation site is not supported")


for _public in (norm_modulate, gate_norm_modulate, gate_residual):
    register(_public)
modulation_backward.op.register_autograd(_no_double_backward, setup_context=_no_double_backward)
