"""Where the ops run and how their kernels are launched there: the helpers every op and launch shares.

- ``interpreting``: Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors;
- ``triton_allowed``: whether a Triton kernel runs for a device and dtype (else the pure-torch reference);
- ``untraced``: whether no tracer, mode or transform could see a call with given argument values;
- ``launch_context``: the ``wrap`` a kernel is launched with, on the tensors' device;
- ``ceil_div``: on the host, also of symbolic sizes.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.library import wrap_triton

from .private_api import nothing_watching

SCALARS = (bool, int, float, str)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter dispatches as a plain tensor


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_allowed(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels run for tensors of ``dtype`` on ``device`` (else the pure-torch reference):
    on CUDA, and on CPU tensors under the Triton interpreter; not for fp64, which only the reference takes."""
    return dtype != torch.float64 and (device.type == "cuda" or (device.type == "cpu" and interpreting()))


def ceil_div(a, b):
    """``ceil(a / b)`` of non-negative integers, symbolic ones too. On the host, in place of ``triton.cdiv``,
    a ``constexpr_function`` whose wrapper costs about 1.5 us a call, several per launch."""
    return (a + b - 1) // b


def untraced(values) -> bool:
    """Whether no tracer, mode or transform could see a call with these argument values: each is None, a
    Python scalar, a plain ``torch.Tensor`` or an ``nn.Parameter`` (not another subclass, such as a fake,
    functional or distributed tensor, nor an FX proxy), and nothing is watching
    (``private_api.nothing_watching``)."""
    return nothing_watching() and all(v is None or type(v) in PLAIN_TENSORS or type(v) in SCALARS for v in values)


def _direct(kernel):
    return kernel


@contextlib.contextmanager
def launch_context(device: torch.device, values):
    """The ``wrap`` to launch a kernel with (``wrap_triton`` for tracers; the identity where a call with these
    argument ``values`` is untraced, and always under the interpreter, whose kernels torch 2.12's
    ``wrap_triton`` refuses), inside the tensors' device: Triton launches on the current device, and neither
    torch.library nor ``wrap_triton``'s eager launch sets a device guard for a Python kernel (a compiled
    graph's code guards its own device; a tracer entering it changes nothing it records)."""
    direct = interpreting() or untraced(values)
    elsewhere = device.type == "cuda" and device.index != torch.cuda.current_device()
    with torch.cuda.device(device) if elsewhere else contextlib.nullcontext():
        yield _direct if direct else wrap_triton
