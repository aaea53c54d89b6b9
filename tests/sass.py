"""Compiling the forward kernel for sm_90 without a GPU, and reading its SASS (support of the codegen tests).

``compile_site`` compiles ``modulation_kernel`` with the launch configuration the ops use (pointers, strides
and the row count 16-divisible, as Triton specialises them for the benchmark's shapes); ``instructions``
disassembles a cubin with the ``cuobjdump`` that ships with Triton. The Triton installed here may differ
from the GPU box's: the tests read the build's structure, not the box's exact SASS.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from h3_fused.kernels.arguments import check_args
from h3_fused.kernels.backward_kernel import modulation_backward_kernel
from h3_fused.kernels.forward_kernel import modulation_kernel
from h3_fused.kernels.launch import ForwardSpecialisation, plan_launch
from h3_fused.kernels.launch_backward import Needs, backward_config, backward_specialisation
from h3_fused.kernels.launch_plan import constexprs
from h3_fused.kernels.testing import (
    FamilyForm,
    backward_inputs,
    family_backward_inputs,
    family_inputs,
    family_op_biases,
    family_op_gate,
    family_op_rows,
    make_inputs,
    shipped_launch_config,
    shipped_sum_order,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = ("x_ptr", "res_ptr", "branch_ptr", "gate_ptr", "w_ptr", "shift_ptr", "scale_ptr", "gate_bias_ptr",
            "shift_bias_ptr", "scale_bias_ptr", "u_ptr", "y_ptr")
SCALARS = dict(n_rows="i32", num_table_rows="i32", tokens="i32", eps="fp32", stride_x="i32", stride_res="i32",
               stride_branch="i32", stride_gate="i32", stride_shift="i32", stride_scale="i32",
               stride_gate_token="i32", stride_shift_token="i32", stride_scale_token="i32")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_site(site: str, policy: str, hidden: int, config=None, index: str = "i64", constants=None,
                 native: bool = False, fp_fusion: bool = True, norm: str = "rms"):
    """``modulation_kernel`` compiled for sm_90 as the ops launch it (or with ``config``) at a symbolic row
    count, for an index of Triton type ``index`` (``"i64"`` or ``"i32"``) and the ``nn.RMSNorm`` spelling,
    the native one (``native``) or a LayerNorm (``norm="layer"``); ``constants``: scalar arguments made
    constants, as Triton does with a value of 1 (e.g. ``{"n_rows": 1}``); ``fp_fusion``: Triton's
    ``enable_fp_fusion``."""
    config = config or shipped_launch_config(site, hidden, None, policy, native, norm)
    flags = dict(norm_rounds_before_weight=native, norm=norm) if site != "C" else {}
    a = check_args(**make_inputs(site, 1, hidden, device="cpu"), **flags, policy=policy, has_norm=site != "C")
    spec = ForwardSpecialisation.of(a, config, shipped_sum_order(site, hidden, None, policy, native, norm))
    # tokens is 1 where the rows are gathered, which Triton (and Inductor) make a constant
    constants = constexprs(spec) | dict(INTERPRETED=False, tokens=1) | (constants or {})
    signature = {name: "*bf16" for name in POINTERS} | {"idx_ptr": f"*{index}"} | SCALARS
    signature |= {name: "constexpr" for name in constants}
    names = modulation_kernel.arg_names
    aligned = [n for n in names if n.endswith("_ptr") or n.startswith("stride_") or n == "n_rows"]
    source = ASTSource(fn=modulation_kernel, signature={n: signature[n] for n in names},
                       constexprs={(names.index(k),): v for k, v in constants.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, debug=True, enable_fp_fusion=fp_fusion))


TRITON_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                torch.int64: "*i64"}


def compile_family_site(site: str, form: FamilyForm, policy: str, hidden: int, fp_fusion: bool = True):
    """``modulation_kernel`` compiled for sm_90 as the ops launch it for ``site`` in a DiT family ``form`` (rows given
    without an index, maybe with biases), each pointer of its tensor's dtype (the placeholders' bf16), the row and
    token counts runtime values; ``fp_fusion``: Triton's ``enable_fp_fusion``."""
    inputs = family_inputs(site, form, 1, 4, hidden, device="cpu")
    shift, scale = family_op_rows(form, inputs["modulation"])
    gate = family_op_gate(form, inputs["modulation"])
    names = {"A": ("shift", "scale"), "B": ("gate", "shift", "scale"), "C": ("gate",)}[site]
    lead = {"x": inputs["x"]} if site == "A" else {"residual": inputs["residual"], "branch": inputs["branch"]}
    a = check_args(**lead, **{k: v for k, v in dict(gate=gate, shift=shift, scale=scale).items() if k in names},
                   **family_op_biases(form, inputs.get("table"), names), policy=policy, has_norm=site != "C",
                   **(form.op_flags() if site != "C" else {}))
    plan = plan_launch(a)
    tensors = [*plan.inputs(a), a.lead, a.lead]  # then u and y, of the activations' dtype
    constants = constexprs(plan.launch.spec) | dict(INTERPRETED=False)
    names = modulation_kernel.arg_names
    pointers = [n for n in names if n.endswith("_ptr")]
    signature = {n: TRITON_TYPES[t.dtype] if t is not None else "*bf16" for n, t in zip(pointers, tensors)}
    signature |= {n: "fp32" if n == "eps" else "i32" for n in names if n not in signature} | {
        n: "constexpr" for n in constants}
    source = ASTSource(fn=modulation_kernel, signature={n: signature[n] for n in names},
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=plan.launch.num_warps, debug=True, enable_fp_fusion=fp_fusion))


def compile_backward(site: str, policy: str, hidden: int, fp_fusion: bool = True, form: FamilyForm | None = None):
    """``modulation_backward_kernel`` compiled for sm_90 as the backward launches it for ``site`` with every
    gradient asked for, at symbolic row counts; ``fp_fusion``: Triton's ``enable_fp_fusion``; ``form``: a DiT
    family form's site (``family_backward_inputs``), else H3's."""
    if form is None:
        a, rows = backward_inputs(site, 4, hidden, device="cpu", policy=policy)
        ordered = False
    else:
        saved, a, rows = family_backward_inputs(site, form, 1, 4, hidden, device="cpu", policy=policy)
        ordered = saved.ordered_index
    config = backward_config(hidden, a.rows, a.device, site != "C", site != "A")
    spec = backward_specialisation(a, Needs(), config, ordered)
    constants = constexprs(spec) | dict(INTERPRETED=False)
    names = modulation_backward_kernel.arg_names
    table = a.gate if a.gate is not None else a.scale
    pointer_types = dict(idx_ptr="*i32" if a.index.dtype == torch.int32 else "*i64", order_ptr="*i64", seg_ptr="*i64",
                         **{name: "*fp32" for name in ("gate_ptr", "scale_ptr", "w_ptr") if table.dtype == torch.float32})
    signature = {name: "constexpr" if name in constants else pointer_types.get(name, "*fp32" if
                 name.startswith("part_") else "*bf16") if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"
                 for name in names}
    source = ASTSource(fn=modulation_backward_kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=config.num_warps, debug=True, enable_fp_fusion=fp_fusion))


def _cuobjdump(cubin: bytes, what: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([CUOBJDUMP, what, f.name], capture_output=True, text=True, check=True).stdout


def instructions(cubin: bytes) -> list[str]:
    """The SASS instructions, in order, without addresses and encodings."""
    return re.findall(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", _cuobjdump(cubin, "--dump-sass"))


def instruction_mix(cubin: bytes) -> tuple[int, collections.Counter]:
    opcodes = [re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", i).group(1) for i in instructions(cubin)]
    return int(re.search(r"REG:(\d+)", _cuobjdump(cubin, "--dump-resource-usage")).group(1)), collections.Counter(opcodes)
