"""What the benchmarks share beyond the site catalogue (``h3_fused.kernels.testing``): comparing outputs bit for
bit, launching with extra Triton options, and loading another commit's kernels beside the installed ones."""

from __future__ import annotations

import functools
import sys

import torch


def identical_outputs(outputs, others) -> bool:
    """Whether two ``(u, y)`` tuples (e.g. ``kernel_launch(...).outputs``) are bit-identical wherever the
    first has an output."""
    return all(a is None or torch.equal(a, b) for a, b in zip(outputs, others))


def calls_agree(calls, outputs) -> bool:
    """Whether every one of ``calls`` (calls that write into the same ``outputs``: ``kernel_launch`` calls
    given one ``outputs``) leaves in them what the first leaves, bit
    for bit. Each call runs on outputs filled with NaN, so that one that wrote nothing does not agree."""
    first = None
    for call in calls:
        for t in outputs:
            if t is not None:
                t.fill_(float("nan"))
        call()
        got = tuple(None if t is None else t.clone() for t in outputs)
        if first is None:
            first = got
        elif not identical_outputs(first, got):
            return False
    return True


class LaunchOptions:
    """A ``wrap`` for ``launch_modulation`` that launches the kernel with extra Triton launch options, e.g.
    ``debug=False`` (no index assertion, and none of the int32 overflow checks Triton adds in debug
    mode) or ``maxnreg=64`` (ptxas caps the registers per thread)."""

    def __init__(self, **options):
        self.options = options

    def __call__(self, kernel):
        self.kernel = kernel
        return self

    def __getitem__(self, grid):
        return functools.partial(self.kernel[grid], **self.options)


def load_kernel_module(path: str):
    """The kernel package's ``launch.py`` of another commit, imported beside the installed one so that both can
    be timed in one process: ``path`` is a folder holding that commit's ``kernels/`` files
    (``git archive REV kernels | tar -x --strip-components=1 -C DIR``). Only ``launch.py`` and what it imports
    are loaded (not the package's ``__init__``, which would register the ops a second time)."""
    import importlib
    import types

    name = "h3_fused_baseline_kernels"
    package = types.ModuleType(name)
    package.__path__ = [path]
    sys.modules[name] = package
    return importlib.import_module(f"{name}.launch")
