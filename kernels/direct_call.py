"""When a call of a public op may run the op's body itself, without the dispatcher.

Through the dispatcher, a call of a ``torch.library`` op in eager passes two Python layers (the autograd
wrapper and the per-device wrapper, each boxing every argument) before it reaches the op's body, and
``wrap_triton`` then launches the kernel through a higher-order op. Nothing needs either when nothing is
watching the call, so the public functions (``ops.py``) run the body directly, and the body launches the
kernel directly, exactly when ``untraced`` holds; every other call goes through ``torch.ops.h3_fused.*``
as before (docs/DESIGN.md, "Direct calls in eager").
"""

from __future__ import annotations

import torch

SCALARS = (bool, int, float, str)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # a Parameter dispatches as a plain tensor


def untraced(values) -> bool:
    """Whether no tracer, mode or transform could see a call with these argument values: each is None, a
    Python scalar, a plain ``torch.Tensor`` or an ``nn.Parameter`` (not another subclass, such as a fake,
    functional or distributed tensor, nor an FX proxy), and there is no ``torch.compile`` or TorchScript
    tracing, Python dispatch mode, torch function mode (``with torch.device(...)`` is one), functorch
    transform (vmap, grad, functionalize) or autograd profiler active."""
    return (not torch.compiler.is_compiling()
            and all(v is None or type(v) in PLAIN_TENSORS or type(v) in SCALARS for v in values)
            and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active()
            and torch._C._get_tracing_state() is None
            and not torch._C._autograd._profiler_enabled())


def needs_grad(values) -> bool:
    """Whether autograd would record a call with these argument values (grad mode on, a tensor requiring
    grad): such a call goes through the dispatcher, whose autograd layer refuses it (``ops._refuse_grad``)."""
    return torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)
