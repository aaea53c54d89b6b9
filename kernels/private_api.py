"""Every private torch and Triton call the eager fast path makes, fenced in one place.

A public op called in eager skips the dispatcher where nothing could see the call (``direct_call.py``), and
launches the kernel Triton compiled at its first call through that kernel's own launcher (``launch_plan.py``).
Both need what neither torch nor Triton exposes publicly: whether a dispatch mode, function mode, functorch
transform, TorchScript trace or the autograd profiler is active; the current CUDA device and raw stream without
the Python wrappers' checks; and the compiled kernel's launcher, called positionally as Inductor's generated
launchers call it. Each is read here, once, from the module that holds it.

``FAST_PATH`` is true where every one of them was found (the CUDA ones in a CUDA build), on a torch in
``TESTED_TORCH`` (the range the tests of this module, ``tests/kernels/test_private_api.py``, hold them to). Where
one has moved or the torch is outside the range, ``FAST_PATH`` is false and every call goes through the
dispatcher and Triton's ``JITFunction.run``, as a traced call does: slower at small sizes, never wrong.
"""

from __future__ import annotations

import torch
from torch.torch_version import TorchVersion

TESTED_TORCH = ("2.11", "2.15")  # from the first, up to and without the second
WATCHING = (  # what tells whether anything could see a call (read on every device)
    "torch._C._len_torch_dispatch_stack",
    "torch._C._is_torch_function_mode_enabled",
    "torch._C._are_functorch_transforms_active",
    "torch._C._get_tracing_state",
    "torch._C._autograd._profiler_enabled",
)
CUDA = ("torch._C._cuda_getDevice", "torch._C._cuda_getCurrentRawStream")  # in CUDA builds only


def _find(dotted: str):
    """The object at the dotted path ``dotted`` below ``torch``, or None where it is not there."""
    found = torch
    for name in dotted.split(".")[1:]:
        found = getattr(found, name, None)
    return found


CALLS = {name: _find(name) for name in WATCHING + (CUDA if torch.version.cuda else ())}
MISSING = tuple(name for name, call in CALLS.items() if call is None)
FAST_PATH = not MISSING and TorchVersion(TESTED_TORCH[0]) <= torch.__version__ < TorchVersion(TESTED_TORCH[1])

_dispatch_modes, _function_modes, _transforms, _tracing_state, _profiling = (CALLS[name] for name in WATCHING)
current_cuda_device = CALLS.get(CUDA[0])  # () -> the current CUDA device's index
current_raw_stream = CALLS.get(CUDA[1])  # (device index) -> the current stream's handle


def nothing_watching() -> bool:
    """No ``torch.compile`` or TorchScript tracing, Python dispatch mode, torch function mode (``with
    torch.device(...)`` is one), functorch transform (vmap, grad, functionalize) or autograd profiler active;
    false wherever ``FAST_PATH`` is."""
    return FAST_PATH and not (torch.compiler.is_compiling()
                              or _dispatch_modes()
                              or _function_modes()
                              or _transforms()
                              or _tracing_state() is not None
                              or _profiling())


def compiled_launcher(compiled):
    """``(run, function, metadata)`` of ``compiled`` (what ``JITFunction.run`` returned): the launcher Inductor's
    generated launchers call, the kernel's handle and its packed metadata; None where it has no such launcher."""
    run, function = getattr(compiled, "run", None), getattr(compiled, "function", None)
    if not FAST_PATH or run is None or function is None:
        return None
    return run, function, getattr(compiled, "packed_metadata", getattr(compiled, "metadata", None))


def launch_compiled(launcher, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
    """Launch the kernel of ``launcher`` (``compiled_launcher``'s) on ``grid`` in ``stream`` with every argument
    of the kernel in its signature's order, constexprs included, and no launch metadata or hooks, as Inductor's
    launchers call it."""
    run, function, metadata = launcher
    run(*grid, stream, function, metadata, None, None, None, *args)


def no_launch_hooks() -> bool:
    """Whether Triton has no launch enter or exit hook (a profiler such as proton installs them, and a launch
    through ``launch_compiled`` passes none); each hook is None or an empty ``HookChain``."""
    from triton import knobs

    return all(hook is None or getattr(hook, "calls", None) == []
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
