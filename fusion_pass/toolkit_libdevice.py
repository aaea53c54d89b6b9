"""The CUDA toolkit's libdevice for Triton under the ``bf16`` policy, on the torches that do not link it.

Eager's CUDA kernels take their transcendental functions (``pow``, ``erf``, ...) from the libdevice of the CUDA
toolkit; Triton links the copy it bundles, whose ``pow`` is a last place apart on some arguments (the rotary
frequencies ``1 / theta ** (arange / d)`` of LTX-Video and HunyuanVideo, and so every output of those models
compiled whole). Inductor links the toolkit's libdevice where ``eager_numerics.use_pytorch_libdevice`` is set
(torch 2.12 on; the backend sets it under ``bf16``) or, from torch 2.13, under ``emulate_precision_casts``; torch
2.11's Inductor cannot. There, under ``bf16`` on CUDA, the backend does what later torches do: it points Triton at
``$CUDA_HOME/nvvm/libdevice/libdevice.10.bc`` through ``TRITON_LIBDEVICE_PATH`` (which Triton reads when it
compiles a kernel, in this process and in the compile workers, which inherit it when they start), unless the
user already chose a libdevice. The setting is the process's, as it is on the later torches; Triton's cache keys
include the path, so kernels built with the bundled copy are not reused for it. Compile workers already running
were started without it: they are restarted once, so that every kernel of the compile is built with it.
"""

from __future__ import annotations

import functools
import os
import pathlib

import torch._inductor.config as inductor_config

from .logs import log

LIBDEVICE_VARIABLE = "TRITON_LIBDEVICE_PATH"


def inductor_links_toolkit_libdevice() -> bool:
    """Whether this torch's Inductor can link the toolkit's libdevice itself (``use_pytorch_libdevice``)."""
    return "eager_numerics.use_pytorch_libdevice" in inductor_config.get_config_copy()


def toolkit_libdevice() -> pathlib.Path | None:
    """The CUDA toolkit's ``libdevice.10.bc`` (under ``CUDA_HOME``, as Inductor finds it), or None."""
    from torch.utils.cpp_extension import CUDA_HOME

    path = pathlib.Path(CUDA_HOME or "/nonexistent") / "nvvm" / "libdevice" / "libdevice.10.bc"
    return path if path.is_file() else None


@functools.cache
def link_toolkit_libdevice() -> None:
    """Point Triton at the toolkit's libdevice where Inductor does not (see the module's docstring); once per
    process, a choice the user made (``TRITON_LIBDEVICE_PATH``) kept."""
    if inductor_links_toolkit_libdevice() or LIBDEVICE_VARIABLE in os.environ:
        return
    path = toolkit_libdevice()
    if path is None:
        log.warning("h3_fused: no CUDA toolkit libdevice under CUDA_HOME: Inductor's pow, erf, ... use Triton's "
                    "bundled libdevice, a last place apart from eager's on some arguments; set %s to the toolkit's "
                    "libdevice.10.bc for eager's bits", LIBDEVICE_VARIABLE)
        return
    os.environ[LIBDEVICE_VARIABLE] = str(path)
    log.info("h3_fused: Triton links the CUDA toolkit's libdevice (%s), as eager's kernels do", path)
    _restart_compile_workers()


def _restart_compile_workers() -> None:
    """Shut down Inductor's compile workers if they run (started before the variable was set); the next compile
    starts them again, inheriting it."""
    from torch._inductor import async_compile

    if async_compile.AsyncCompile.process_pool.cache_info().currsize:
        async_compile.shutdown_compile_workers()
