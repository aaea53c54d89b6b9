"""The three modulation sites written as the unfused model writes them, their inputs, and calls of the fused
kernels on them.

Shared by the benchmarks and the tests (pytest puts ``benchmarks/`` on the path): ``eager_site(site)`` is the
eager function a fused op replaces; ``make_inputs`` builds real-size inputs (strided ``[K, H]`` chunk views,
int64 index); ``fused_site`` calls the public op, ``kernel_launch`` the forward kernel alone, with any launch
configuration or build.
"""

from __future__ import annotations

import dataclasses
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
                  outputs=None, config=None, free_sum_order=False):
    """A call that launches the fused kernel alone on ``inputs`` (arguments checked once, outputs
    allocated once; no op dispatch) and returns what the launch returns (the compiled kernel); the call's
    ``outputs`` attribute holds ``(u, y)`` (None where the site has no such output). ``config``: a
    ``LaunchConfig`` to launch with instead of the shipped one. ``kernel_module``: another version of
    ``h3_fused.kernels.launch`` to launch instead (``load_kernel_module``). ``outputs``: the ``outputs`` of
    another call on inputs of the same shapes, to write into instead of allocating. ``free_sum_order``: the
    norm's squares added in the kernel's own order, not an eager kernel's (the policy's other roundings kept),
    with the configuration ``launch_config`` picks for that. Calls timed side by
    side share them: with outputs of their own, identical kernels differed by up to 1.7%, the same way in
    every run, by where their outputs lay (docs/BENCHMARKS.md, "Method")."""
    from h3_fused.kernels import launch as shipped
    from h3_fused.kernels.arguments import check_args

    launch_modulation = (kernel_module or shipped).launch_modulation

    a = check_args(**inputs, policy=policy, has_norm=site != "C")
    if free_sum_order:
        a = dataclasses.replace(a, rounding=dataclasses.replace(a.rounding, norm_sum_order=None))
    if outputs is None:
        outputs = tuple(torch.empty(a.out_shape, dtype=a.dtype, device=a.device) if wanted else None
                        for wanted in (site != "A", site != "C"))
    u, y = outputs

    def launch():
        return launch_modulation(a, u, y, wrap, config)

    launch.outputs = (u, y)
    return launch


def site_rounding(site: str, policy: str, native: bool = False):
    """The ``contract.Rounding`` of ``site`` under ``policy`` with bf16 activations and tables, for the
    ``nn.RMSNorm`` spelling or the native one (``native``)."""
    from h3_fused.kernels.contract import rounding_for

    gate, norm = site != "A", site != "C"
    return rounding_for(policy, torch.bfloat16, torch.bfloat16 if gate else None, torch.bfloat16 if norm else None,
                        norm_rounds_before_weight=native, upcast_tables=False)


def shipped_sum_order(site: str, hidden: int, rows: int | None, policy: str, native: bool = False) -> int:
    """The ``NORM_SUM_ORDER`` the launch picks for ``site`` (see ``site_rounding``) at ``rows`` rows."""
    from h3_fused.kernels.launch import norm_sum_order

    return norm_sum_order(site_rounding(site, policy, native), hidden, site != "C", rows)


def shipped_launch_config(site: str, hidden: int, rows: int | None, policy: str, native: bool = False):
    """The configuration ``launch_config`` picks for ``site`` (A: a norm; B: a gate and a norm; C: a gate) at
    ``hidden`` columns and ``rows`` rows (None: a symbolic count) under ``policy`` (see ``site_rounding``);
    under ``bf16`` the norm's squares add in the order of the eager kernel the spelling runs."""
    from h3_fused.kernels.launch import launch_config

    return launch_config(hidden, site != "A", site != "C", rows, shipped_sum_order(site, hidden, rows, policy, native))


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


def minimal_bytes(site: str, tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Each activation read once and each output written once (tables and index are negligible)."""
    streams = {"A": 2, "B": 4, "C": 3}[site]
    return streams * tokens * hidden * itemsize


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
