"""The three modulation sites written as the unfused model writes them, and their inputs.

Shared by the op benchmark and the GPU tests: ``eager_site(kind)`` is the eager function a fused op
replaces; ``make_inputs`` builds real-size inputs (strided ``[K, H]`` chunk views, int64 index).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.nn.functional as F

SITES = ("A", "B", "C")


def eager_a(x, weight, shift, scale, index, eps):
    n = F.rms_norm(x, (x.shape[-1],), weight, eps)
    return (n * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)).to(x.dtype)


def eager_b(residual, gate, branch, weight, shift, scale, index, eps):
    u = (residual + gate.index_select(0, index) * branch).to(residual.dtype)
    return u, eager_a(u, weight, shift, scale, index, eps)


def eager_c(residual, gate, branch, index):
    return (residual + gate.index_select(0, index) * branch).to(residual.dtype)


INDEX_LAYOUTS = ("uniform", "runs")


def make_inputs(site: str, tokens: int, hidden: int = 5376, table_rows: int = 6, *, device="cuda",
                dtype=torch.bfloat16, seed: int = 0, index_layout: str = "uniform"):
    """Inputs of ``site``. ``index_layout``: ``uniform``, each row's table row drawn independently (the
    worst case for the table rows' reuse in a program's L1), or ``runs``, the same draw sorted into
    ``table_rows`` contiguous runs, as the model lays its index out (each sample's tokens share a timestep
    and each modality's tokens are adjacent, so the index is constant over long runs)."""
    if index_layout not in INDEX_LAYOUTS:
        raise ValueError(f"index_layout must be one of {INDEX_LAYOUTS}, got {index_layout!r}")
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).mul_(scale).to(dtype)

    tables = randn(table_rows, 6 * hidden, scale=0.3).chunk(6, dim=-1)  # row stride 6H, as in the model
    index = torch.randint(0, table_rows, (tokens,), generator=g, device=device)
    if index_layout == "runs":
        index = index.sort().values
    weight = 1.0 + randn(hidden, scale=0.1)
    x, branch = randn(tokens, hidden), randn(tokens, hidden)
    if site == "A":
        return dict(x=x, weight=weight, shift=tables[0], scale=tables[1], index=index, eps=1e-5)
    if site == "B":
        return dict(residual=x, gate=tables[2], branch=branch, weight=weight, shift=tables[0],
                    scale=tables[1], index=index, eps=1e-5)
    return dict(residual=x, gate=tables[2], branch=branch, index=index)


def eager_site(site: str):
    return {"A": eager_a, "B": eager_b, "C": eager_c}[site]


def fused_site(site: str, policy: str, *, dispatcher: bool = False):
    """A call of the site's public function (``h3_fused.kernels.*``: in eager, the op's body without the
    dispatcher); ``dispatcher=True``: of the op through the dispatcher (``torch.ops.h3_fused.*``), as a
    tracer or mode sees it."""
    from h3_fused.kernels import gate_norm_modulate, gate_residual, norm_modulate

    if dispatcher:
        norm_modulate, gate_norm_modulate, gate_residual = (
            op.dispatched for op in (norm_modulate, gate_norm_modulate, gate_residual))
    if site == "A":
        return lambda x, weight, shift, scale, index, eps: norm_modulate(
            x, weight, shift, scale, index, eps=eps, policy=policy)
    if site == "B":
        return lambda residual, gate, branch, weight, shift, scale, index, eps: gate_norm_modulate(
            residual, gate, branch, weight, shift, scale, index, eps=eps, policy=policy)
    return lambda residual, gate, branch, index: gate_residual(residual, gate, branch, index, policy=policy)


def kernel_launch(site: str, inputs: dict, policy: str, wrap=lambda kernel: kernel, kernel_module=None,
                  outputs=None):
    """A call that launches the fused kernel alone on ``inputs`` (arguments checked once, outputs
    allocated once; no op dispatch) and returns what the launch returns (the compiled kernel); the call's
    ``outputs`` attribute holds ``(u, y)`` (None where the site has no such output). ``launch_config`` is
    read at each call, so a benchmark may swap it between calls. ``kernel_module``: another version of
    ``h3_fused.kernels.triton_modulation`` to launch instead (``load_kernel_module``). ``outputs``: the
    ``outputs`` of another call on inputs of the same shapes, to write into instead of allocating. Calls
    timed side by side share them: with outputs of their own, identical kernels differed by up to 1.7%,
    the same way in every run, by where their outputs lay (runs 84-85, docs/BENCHMARKS.md)."""
    from h3_fused.kernels import triton_modulation
    from h3_fused.kernels.contract import check_args

    launch_modulation = (kernel_module or triton_modulation).launch_modulation

    a = check_args(**inputs, policy=policy, has_norm=site != "C")
    if outputs is None:
        outputs = tuple(torch.empty(a.out_shape, dtype=a.dtype, device=a.device) if wanted else None
                        for wanted in (site != "A", site != "C"))
    u, y = outputs

    def launch():
        return launch_modulation(a, u, y, wrap)

    launch.outputs = (u, y)
    return launch


def shipped_launch_config(site: str, hidden: int, rows: int | None):
    """The configuration ``launch_config`` picks for ``site`` (A: a norm; B: a gate and a norm; C: a gate) at
    ``hidden`` columns and ``rows`` rows (None: a symbolic count)."""
    from h3_fused.kernels.triton_modulation import launch_config

    return launch_config(hidden, site != "A", site != "C", rows)


def identical_outputs(outputs, others) -> bool:
    """Whether two ``(u, y)`` tuples (e.g. ``kernel_launch(...).outputs``) are bit-identical wherever the
    first has an output."""
    return all(a is None or torch.equal(a, b) for a, b in zip(outputs, others))


def calls_agree(calls, outputs) -> bool:
    """Whether every one of ``calls`` (calls that write into the same ``outputs``: ``kernel_launch`` calls
    given one ``outputs``, or those run ``with_launch_config``) leaves in them what the first leaves, bit
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


@contextlib.contextmanager
def launch_config_answering(choose):
    """Within the block, the kernel's ``launch_config(hidden, has_gate, has_norm, rows)`` answers ``choose``'s
    configuration instead of its own."""
    from h3_fused.kernels import triton_modulation as tm

    original = tm.launch_config
    tm.launch_config = choose
    try:
        yield
    finally:
        tm.launch_config = original


def with_launch_config(launch, config):
    """``launch`` (e.g. a ``kernel_launch``) run with the launch configuration ``config``."""

    def run():
        with launch_config_answering(lambda hidden, has_gate, has_norm, rows: config):
            return launch()

    return run


def minimal_bytes(site: str, tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Each activation read once and each output written once (tables and index are negligible)."""
    streams = {"A": 2, "B": 4, "C": 3}[site]
    return streams * tokens * hidden * itemsize


def load_module_file(path: str, name: str):
    """The Python file ``path`` imported as module ``name`` (e.g. a version of a file from another commit,
    ``git show REV:FILE > PATH``, beside the installed one)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_kernel_module(path: str):
    """A copy of ``kernels/triton_modulation.py`` from another commit, imported beside the installed one
    (as ``h3_fused.kernels._baseline_modulation``, so its relative imports resolve), e.g. from
    ``git show REV:kernels/triton_modulation.py > FILE``."""
    import h3_fused.kernels  # noqa: F401  (the parent package of the copy)

    return load_module_file(path, "h3_fused.kernels._baseline_modulation")
