"""Inductor's analysis of the kernels finds that they write their outputs and nothing else.

Before inlining an op's Triton kernel into a compiled graph, Inductor compiles the kernel to Triton IR
with the op's arguments and reads which tensors it stores to (``get_mutated_tensors``). Where that
analysis fails, it logs a warning and assumes that every input is written; the op passes one tensor for
several pointer arguments a site does not use, and compiled graphs around it then returned wrong
outputs (the analysis stops at any ``tl.inline_asm_elementwise``, "an op
we do not know how to analyze", and at ``.to`` on an integer argument Triton made a constant). These
tests run the analysis without a GPU, for a Hopper target, on the exact arguments ``launch_modulation``
passes (captured through ``h3_fused.kernels.testing.kernel_launch``), for every site, both policies, the builds for many rows and for few, and one table row (an
argument Triton specialises to a constant) as well as several; and on those ``launch_backward`` passes the
backward kernel, with every gradient asked for and with the activations' alone (a LoRA step's), whose partial
buffers and absent inputs are placeholders.
"""

from __future__ import annotations

import pytest
import torch
import triton
from h3_fused.kernels.backward_kernel import modulation_backward_kernel
from h3_fused.kernels.forward_kernel import modulation_kernel
from h3_fused.kernels.launch_backward import Needs, launch_backward
from h3_fused.kernels.testing import backward_inputs, kernel_launch, make_inputs, shipped_launch_config
from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors, kernel_side_table
from triton.backends.compiler import GPUTarget

HIDDEN = 5376


class _Hopper:
    """An active Triton driver that only names its target: enough for compiling to Triton IR."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def _has_driver() -> bool:
    try:
        triton.runtime.driver.active.get_current_target()
    except RuntimeError:  # no GPU: "0 active drivers"
        return False
    return True


@pytest.fixture
def hopper_target(monkeypatch):
    """The machine's Triton driver where there is one (the GPU box), else ``_Hopper`` for this test
    (``reset_active`` would look for a real driver again, so the attribute itself is restored)."""
    if not _has_driver():
        monkeypatch.setattr(triton.runtime.driver, "_active", _Hopper())


class _Captured:
    """A ``wrap`` for a launch that records the arguments of the launches of ``kernel`` instead of launching
    (``arguments``: the last one's)."""

    def __init__(self, kernel=modulation_kernel):
        self.kernel, self.launched = kernel, None

    def __call__(self, kernel):
        self.launched = kernel
        return self

    def __getitem__(self, grid):
        def record(*args, num_warps, enable_fp_fusion, **constexprs):
            if self.launched is self.kernel:
                self.arguments = dict(zip(self.kernel.arg_names, args)) | constexprs

        return record


def _written(kernel, arguments: dict) -> list[str]:
    """The tensor arguments Inductor's analysis finds ``kernel`` writes with ``arguments``."""
    tensors = {name: v for name, v in arguments.items() if isinstance(v, torch.Tensor)}
    constants = {name: v for name, v in arguments.items() if name not in tensors}
    return get_mutated_tensors(kernel_side_table.add_kernel(kernel), kernel_side_table.add_constant_args(constants),
                               tensors, {})


@pytest.mark.parametrize("table_rows", [1, 6])
@pytest.mark.parametrize("rows", [None, 1], ids=["many_rows", "few_rows"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_inductor_sees_writes_to_the_outputs_only(hopper_target, site, policy, rows, table_rows):
    captured = _Captured()
    launch = kernel_launch(site, make_inputs(site, 4, HIDDEN, table_rows, device="cpu"), policy, wrap=captured,
                           config=shipped_launch_config(site, HIDDEN, rows, policy))
    launch()
    tensors = {name: v for name, v in captured.arguments.items() if isinstance(v, torch.Tensor)}
    written = _written(modulation_kernel, captured.arguments)
    outputs = [t for t in launch.outputs if t is not None]
    assert written and all(any(tensors[name] is t for t in outputs) for name in written), written
    assert all(any(tensors[name] is t for name in written) for t in outputs), written


@pytest.mark.parametrize("needs", [Needs(), Needs(shift=False, scale=False, gate=False, weight=False)],
                         ids=["every_gradient", "activations_only"])
@pytest.mark.parametrize("policy", ["bf16", "fp32"])
@pytest.mark.parametrize("site", ["A", "B", "C"])
def test_inductor_sees_the_backward_write_its_gradients_only(hopper_target, site, policy, needs):
    a, rows = backward_inputs(site, 4, HIDDEN, device="cpu", policy=policy)
    captured = _Captured(modulation_backward_kernel)
    launch_backward(a, *rows, needs, captured)
    written = set(_written(modulation_backward_kernel, captured.arguments))
    outputs = {"dx_ptr", "dbranch_ptr", "part_shift_ptr", "part_scale_ptr", "part_gate_ptr", "part_w_ptr"}
    # the index and the sorted order address the stores (a row's table row, a position's row): the analysis
    # follows their loaded values into the stores' pointers and counts them written (Inductor copies them, a few
    # bytes a row), as it would any scatter's index
    addressing = {"idx_ptr", "order_ptr"} & written
    assert written - addressing and written - addressing <= outputs, written
    written -= addressing
    inputs = [v for name, v in captured.arguments.items() if isinstance(v, torch.Tensor) and name not in outputs]
    for name in written:  # a gradient's buffer is no input, and no placeholder (which no kernel may write)
        assert captured.arguments[name].numel() and not any(captured.arguments[name] is t for t in inputs), name
