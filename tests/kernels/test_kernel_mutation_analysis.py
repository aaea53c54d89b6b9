"""Inductor's analysis of the kernel finds that it writes its outputs and nothing else.

Before inlining an op's Triton kernel into a compiled graph, Inductor compiles the kernel to Triton IR
with the op's arguments and reads which tensors it stores to (``get_mutated_tensors``). Where that
analysis fails, it logs a warning and assumes that every input is written; the op passes one tensor for
several pointer arguments a site does not use, and compiled graphs around it then returned wrong
outputs (the analysis stops at any ``tl.inline_asm_elementwise``, "an op
we do not know how to analyze", and at ``.to`` on an integer argument Triton made a constant). These
tests run the analysis without a GPU, for a Hopper target, on the exact arguments ``launch_modulation``
passes (captured through ``h3_fused.kernels.testing.kernel_launch``), for every site, both policies, the builds for many rows and for few, and one table row (an
argument Triton specialises to a constant) as well as several.
"""

from __future__ import annotations

import pytest
import torch
import triton
from h3_fused.kernels.forward_kernel import modulation_kernel
from h3_fused.kernels.testing import kernel_launch, make_inputs, shipped_launch_config
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
    """A ``wrap`` for ``launch_modulation`` that records the launch's arguments instead of launching."""

    def __call__(self, kernel):
        return self

    def __getitem__(self, grid):
        def record(*args, num_warps, enable_fp_fusion, **constexprs):
            self.arguments = dict(zip(modulation_kernel.arg_names, args)) | constexprs

        return record


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
    constants = {name: v for name, v in captured.arguments.items() if name not in tensors}
    written = get_mutated_tensors(kernel_side_table.add_kernel(modulation_kernel),
                                  kernel_side_table.add_constant_args(constants), tensors, {})
    outputs = [t for t in launch.outputs if t is not None]
    assert written and all(any(tensors[name] is t for t in outputs) for name in written), written
    assert all(any(tensors[name] is t for name in written) for t in outputs), written
