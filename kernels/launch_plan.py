"""A kernel's specialisation, declared once, and one launch of it worked out ahead of the call.

``specialisation(kernel)`` makes a class the declaration of ``kernel``'s constexpr parameters: a frozen
dataclass whose fields are those parameters in the kernel's order, checked against the kernel's signature when
the module is imported (a constexpr added to one and not the other fails there, naming it). Every launch passes
a specialisation by name (``constexprs``); a launch through the compiled kernel's own launcher passes its values
in the declared order (``values``), which is the kernel's.

``KernelLaunch`` is everything of a launch but the tensors: the kernel, grid, warps, the runtime scalars and the
specialisation, so that calls of one layout share it (``direct_call.py``); ``bind`` gives the launch through the
kernel Triton compiled for it (``CompiledLaunch``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from torch.library import wrap_triton

from .private_api import compiled_launcher, launch_compiled

# Triton options of a direct launch (one Inductor does not compile: it compiles a user's kernel with Triton's
# defaults). The kernels' arithmetic is explicit (``tl.fma`` where a multiply-add is one, ``device_math.mul_rn``
# where it must not be), so contracting multiply-adds changes no result; it lets ptxas fold exact operations, as
# the builds the benchmarks measured do, and saying so keeps Triton from warning that its default will change.
DIRECT_LAUNCH_OPTIONS = dict(enable_fp_fusion=True)


def constexpr_names(kernel) -> list[str]:
    """The names of ``kernel``'s constexpr parameters, in order: from its signature's annotations, which a
    ``JITFunction`` and the interpreter's ``InterpretedFunction`` both keep on the Python function."""
    fn = getattr(kernel, "fn", kernel)
    return [name for name, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)]


def specialisation(kernel):
    """Class decorator: the class as a frozen dataclass declaring ``kernel``'s constexpr parameters, one field
    each, in the kernel's order. Raises ``TypeError`` where the fields and the kernel's constexprs differ."""

    def declare(cls):
        cls = dataclasses.dataclass(frozen=True)(cls)
        declared = [f.name for f in dataclasses.fields(cls)]
        expected = constexpr_names(kernel)
        if declared != expected:
            raise TypeError(f"{cls.__name__} declares {declared}, but {kernel.__name__}'s constexprs are {expected}")
        return cls

    return declare


def row_stride(t) -> int:
    """A tensor argument's row stride, 0 for one a site has not (a placeholder the kernel never reads)."""
    return 0 if t is None else t.stride(0)


def constexprs(spec) -> dict[str, Any]:
    """A specialisation's constexprs by name."""
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}


def values(spec) -> tuple:
    """A specialisation's constexpr values in the kernel's order."""
    return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec))


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One launch of ``kernel`` but its tensors: ``grid``, ``num_warps``, the runtime ``scalars`` (the kernel's
    parameters after its tensors, before its constexprs) and the ``spec`` (the kernel's ``specialisation``)."""

    kernel: Any
    grid: tuple
    num_warps: int
    scalars: tuple
    spec: Any

    def __call__(self, tensors, wrap=lambda kernel: kernel):
        """Launch on ``tensors`` (the kernel's tensor parameters, in order) through ``wrap``
        (``torch.library.wrap_triton``, or the identity for a direct launch, with ``DIRECT_LAUNCH_OPTIONS``); returns
        what the launch returns (the compiled kernel, launched directly)."""
        options = {} if wrap is wrap_triton else DIRECT_LAUNCH_OPTIONS
        return wrap(self.kernel)[self.grid](*tensors, *self.scalars, **constexprs(self.spec), num_warps=self.num_warps,
                                            **options)

    def bind(self, compiled) -> CompiledLaunch | None:
        """This launch through ``compiled``, the kernel Triton compiled for it (what a direct launch returned), or
        None where it has no launcher of the form Inductor's launchers call (``private_api.compiled_launcher``)."""
        launcher = compiled_launcher(compiled)
        if launcher is None:
            return None
        return CompiledLaunch(launcher, (*self.grid, 1, 1)[:3], self.scalars, values(self.spec))


@dataclasses.dataclass(frozen=True)
class CompiledLaunch:
    """A ``KernelLaunch`` through the launcher of the kernel Triton compiled for it, instead of
    ``JITFunction.run``, which binds and specialises every argument again to find the same kernel.

    Valid only for arguments of the layout it was compiled for, which fixes everything Triton specialises on:
    the dtypes, the integer arguments (row counts and strides, from the shapes and strides), the 16-byte
    alignment of every pointer, the device; and only while Triton has no launch hook
    (``private_api.no_launch_hooks``), since it passes none."""

    launcher: tuple
    grid: tuple[int, int, int]
    scalars: tuple
    constexpr_values: tuple

    def __call__(self, tensors, stream: int) -> None:
        launch_compiled(self.launcher, self.grid, stream, (*tensors, *self.scalars, *self.constexpr_values))
