"""How every GPU benchmark here times things, and writes what it measured.

- ``graph_ms``: device time, the call replayed in a CUDA graph after an L2 flush, minus the flush alone
  (no host overhead, cold L2); ``do_bench`` (``triton.testing``) for a call as a user makes it.
- ``alternating_rounds``: several calls timed in rounds, one after the other in each round, so that drift
  of the GPU's clocks between them cancels in the medians (how kernel changes are compared: side by side).
- ``copy_bandwidth``: the roof, a 2 GiB device-to-device copy measured in the same run; ``copy_same_bytes``
  a copy of a given byte count timed as the kernels are (ramp-up and tail included).
- ``cuda_kernels``: the kernels one call launches (``torch.profiler``); ``kernel_kind`` and ``device_us_by_kind``
  sort them by what launched them (h3_fused's kernels, Inductor's, matmuls, attention, other).

What they measured is written by ``record.write_results``.
"""

from __future__ import annotations

import re
import statistics

import torch
from triton.testing import do_bench, do_bench_cudagraph

_FLUSH_BUFFER = None
FLUSHES = {  # how ``graph_ms`` evicts L2 before each replay, from a 256 MB buffer
    "write": lambda buffer: buffer.zero_(),  # as do_bench does: L2 is left full of dirty lines
    "read": lambda buffer: buffer.max(),  # L2 is left full of clean lines: evicting them writes nothing
}


def graph_ms(fn, flush: str = "write") -> float:
    """Median device time of ``fn`` in ms with a cold L2 and no host overhead (CUDA-graph replay)."""
    global _FLUSH_BUFFER
    if _FLUSH_BUFFER is None:
        _FLUSH_BUFFER = torch.empty(256 * 1024**2, dtype=torch.int8, device="cuda").zero_()
    evict = FLUSHES[flush]
    both = do_bench_cudagraph(lambda: (evict(_FLUSH_BUFFER), fn()), return_mode="median")
    alone = do_bench_cudagraph(lambda: evict(_FLUSH_BUFFER), return_mode="median")
    return both - alone


def call_ms(fn) -> float:
    """Median time of a plain call of ``fn`` in ms, host overhead included (``do_bench``, L2 flushed)."""
    return do_bench(fn, return_mode="median")


def alternating_rounds(runs: dict, rounds: int, flush: str = "write") -> dict[str, list[float]]:
    """Each call of ``runs`` timed with ``graph_ms`` (in us) in ``rounds`` rounds, every round timing them
    one after the other."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(graph_ms(run, flush) * 1e3)
    return times


def alternating_medians(runs: dict, rounds: int, flush: str = "write") -> dict[str, float]:
    """The median of each call's ``alternating_rounds`` (in us)."""
    return {name: statistics.median(t) for name, t in alternating_rounds(runs, rounds, flush).items()}


def relative_times(medians: dict, reference) -> str:
    """``medians`` on one line, each with its difference to ``medians[reference]``."""
    return "  ".join(f"{name} {m:6.1f} us ({m / medians[reference] - 1:+.1%})" for name, m in medians.items())


def mismatch(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of elements of two 16-bit tensors that are not bit-identical."""
    return (got.view(torch.int16) != ref.view(torch.int16)).float().mean().item()


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy (bytes read + written)."""
    src = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


def copy_same_bytes_ms(nbytes: int) -> float:
    """``graph_ms`` of a device-to-device copy moving ``nbytes`` (half read, half written)."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return graph_ms(lambda: dst.copy_(src))


def cuda_kernels(fn) -> list:
    """The CUDA kernel events of one call of ``fn`` (after a warm-up call), from ``torch.profiler``."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


KERNEL_KINDS = (  # a CUDA kernel's kind, by its name: the first pattern that matches (else "other")
    ("h3_fused", re.compile(r"modulation(_backward)?_kernel|reduce_partials_kernel")),
    ("inductor", re.compile(r"^triton_")),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|cublas", re.IGNORECASE)),
    ("attention", re.compile(r"flash|fmha|attention", re.IGNORECASE)),
)


def kernel_kind(name: str) -> str:
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), "other")


def device_us_by_kind(kernels: list) -> dict[str, float]:
    """The device time (us) of ``cuda_kernels``' events, summed by ``kernel_kind``, and ``"total"``."""
    by_kind = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ["other"], 0.0)
    for e in kernels:
        by_kind[kernel_kind(e.name)] += e.device_time
    return {**by_kind, "total": sum(by_kind.values())}
