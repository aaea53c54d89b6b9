"""Host time per call of each way to run a site, and where the calls spend it.

    python benchmarks/bench_host.py [--sites A B C] [--tokens 3072] [--calls 300] [--rounds 7] [--profile WAY ...]
        [--out benchmarks/results/host.json]
    python benchmarks/bench_host.py --device cpu --tokens 16 --out benchmarks/results/host_cpu.json

For each site: the microseconds of host time per call, ``--calls`` calls back to back with one
synchronisation at the end (a call that outruns the GPU queues work, so this is the host's rate, not
the device's), the least of ``--rounds`` rounds that take the ways in turn (the host's speed drifts, and
other work on it only ever adds time), for the public function (``public_op``: ``h3_fused.kernels.norm_modulate`` etc.; in eager
the op's body without the dispatcher: argument checks, output allocation, launch), the op through the
dispatcher (``dispatched_op``: ``torch.ops.h3_fused.*``, as a tracer or mode sees it), the argument checks
alone (``check_args``), the launch as the benchmarks time kernels
(``bare_launch``: ``h3_fused.kernels.testing.kernel_launch``, arguments checked once, outputs allocated once, the launch worked
out per call), Triton's launcher alone (``triton_launch``: the launch worked out once, ``kernel[grid](...)``
per call; what a direct call is measured against) and the op inside a compiled graph (``in_graph``); then the ``cProfile`` of the calls of
each way named in ``--profile``, the functions with the most own time first. One row per site and way in
``--out`` (overwritten).

On the CPU (``--device cpu``, the CI machine) there is no kernel to launch: a direct call runs the op's
pure-torch reference, so the ways are the public function, the op through the dispatcher, the argument
checks alone and the reference's computation alone (``reference``, on arguments checked once): what a
direct call spends besides its computation is the first minus the last.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch
from h3_fused.kernels.arguments import check_args
from h3_fused.kernels.launch import plan_launch
from h3_fused.kernels.reference import reference_modulation
from h3_fused.kernels.testing import fused_site, kernel_launch, make_inputs
from record import write_results

WAYS = {"cuda": ["public_op", "dispatched_op", "check_args", "bare_launch", "triton_launch", "in_graph"],
        "cpu": ["public_op", "dispatched_op", "check_args", "reference"]}


def triton_launch(a, outputs):
    """A call of Triton's launcher alone: the launch of the checked arguments ``a`` into ``outputs`` worked out
    once."""
    launch = plan_launch(a)
    tensors, placeholder = launch.inputs(a), launch.placeholder(a)
    return lambda: launch(tensors, *outputs, placeholder, lambda kernel: kernel)


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def host_us_per_call(call, calls: int, device: str) -> float:
    for _ in range(10):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    synchronize(device)
    return host / calls * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", nargs="+", default=["A", "B", "C"], choices=["A", "B", "C"])
    parser.add_argument("--tokens", type=int, default=3072)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cuda", choices=sorted(WAYS))
    parser.add_argument("--profile", nargs="*", default=None, choices=WAYS["cuda"] + WAYS["cpu"],
                        help="default: public_op, and in_graph on CUDA")
    parser.add_argument("--profile-lines", type=int, default=25)
    parser.add_argument("--out", default="benchmarks/results/host.json")
    args = parser.parse_args()
    profiled = args.profile if args.profile is not None else ["public_op"] + ["in_graph"] * (args.device == "cuda")
    if set(profiled) - set(WAYS[args.device]):
        parser.error(f"--profile: on {args.device} the ways are {WAYS[args.device]}")
    rows = []
    for site in args.sites:
        inputs = make_inputs(site, args.tokens, device=args.device)
        op = fused_site(site, "bf16")
        dispatched = fused_site(site, "bf16", dispatcher=True)
        checks = {"policy": "bf16", "has_norm": site != "C"}
        checked = check_args(**inputs, **checks)
        ways = {"public_op": lambda: op(**inputs), "dispatched_op": lambda: dispatched(**inputs),
                "check_args": lambda: check_args(**inputs, **checks)}
        if args.device == "cuda":
            compiled = torch.compile(fused_site(site, "bf16"))
            bare = kernel_launch(site, inputs, "bf16")
            ways |= {"bare_launch": bare, "triton_launch": triton_launch(checked, bare.outputs),
                     "in_graph": lambda: compiled(**inputs)}
        else:
            ways["reference"] = lambda: reference_modulation(checked)
        rounds = [{name: host_us_per_call(call, args.calls, args.device) for name, call in ways.items()}
                  for _ in range(args.rounds)]
        times = {name: min(r[name] for r in rounds) for name in ways}
        rows += [dict(site=site, tokens=args.tokens, way=name, us_per_call=us, rounds=args.rounds)
                 for name, us in times.items()]
        print(f"{site} T={args.tokens}: " + "  ".join(f"{name} {us:6.1f} us" for name, us in times.items()),
              flush=True)
        for name in profiled:
            print(f"{site} T={args.tokens}, {name}:")
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                ways[name]()
            profile.disable()
            synchronize(args.device)
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.profile_lines)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
