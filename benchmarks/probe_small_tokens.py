"""Where sites A and B lose time at small T, against a copy of the same bytes.

    python benchmarks/probe_small_tokens.py --out benchmarks/results/probe_small_tokens.json

For each site and T, in alternating rounds (device time after an L2 flush, as ``bench_ops.py``): the
copy of the site's minimal bytes; the kernel as shipped; the same kernel with its table rows (and the
norm weight) already in L2 when it starts (timed as flush + touch + kernel minus flush + touch); and
launch configurations whose programs each touch one line of the tables first
(``LaunchConfig.warm_tables``). The
gap between the shipped kernel and the copy, as a function of T, separates a fixed cost (ramp-up and
tail) from a per-row one; the warm-table row says how much of the fixed cost is the first programs
waiting for table rows that a cold L2 must fetch from DRAM after the norm's reduction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, graph_ms  # noqa: E402
from sites import fused_site, kernel_launch, make_inputs, minimal_bytes  # noqa: E402

TOKENS = (1024, 3072, 6144, 15808)


def with_config(launch, config):
    """``launch`` with ``launch_config`` answering ``config``."""
    from h3_fused.kernels import triton_modulation as tm

    def run():
        original = tm.launch_config
        tm.launch_config = lambda hidden, has_gate: config
        try:
            return launch()
        finally:
            tm.launch_config = original

    return run


def table_toucher(inputs):
    """A call that reads every table and the norm weight once (through L2) into scratch copies."""
    tables = [inputs[k] for k in ("gate", "shift", "scale", "weight") if inputs.get(k) is not None]
    scratch = [torch.empty_like(t) for t in tables]
    return lambda: [s.copy_(t) for s, t in zip(scratch, tables)]


def variants(site, inputs):
    from h3_fused.kernels.triton_modulation import LaunchConfig, launch_config

    shipped = launch_config(HIDDEN, site != "A")
    warm = LaunchConfig(shipped.block_t, shipped.chunk, shipped.num_warps, warm_tables=True)
    runs = {}
    for policy in ("bf16", "fp32"):
        launch = kernel_launch(site, inputs, policy)
        runs[policy] = with_config(launch, shipped)
        runs[f"{policy}_warm"] = with_config(launch, warm)
    if site == "A":
        launch = kernel_launch(site, inputs, "bf16")
        for warps in (8,):
            chunk = 32 * warps * 8
            runs[f"bf16_w{warps}"] = with_config(launch, LaunchConfig(1, chunk, warps))
            runs[f"bf16_w{warps}_warm"] = with_config(launch, LaunchConfig(1, chunk, warps, True))
    return runs


def check_same_outputs(site, inputs):
    """The configurations that warm the tables store what the shipped one stores, bit for bit, under both policies."""
    from h3_fused.kernels.triton_modulation import LaunchConfig, launch_config

    shipped = launch_config(HIDDEN, site != "A")
    for policy in ("bf16", "fp32"):
        op = fused_site(site, policy)
        want = with_config(lambda: op(**inputs), shipped)()
        got = with_config(lambda: op(**inputs), LaunchConfig(shipped.block_t, shipped.chunk, shipped.num_warps,
                                                              warm_tables=True))()
        for w, g in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            if not torch.equal(w.view(torch.int16), g.view(torch.int16)):
                raise RuntimeError(f"site {site}, {policy}: warming the tables changed the output")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/probe_small_tokens.json")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sites", nargs="+", default=["A", "B"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    args = parser.parse_args()
    rows = []
    for site in args.sites:
        for tokens in args.tokens:
            inputs = make_inputs(site, tokens, HIDDEN)
            nbytes = minimal_bytes(site, tokens, HIDDEN)
            src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device="cuda")
            dst = torch.empty_like(src)
            check_same_outputs(site, inputs)
            runs = variants(site, inputs)
            touch = table_toucher(inputs)
            shipped = runs["bf16"]
            timers = {name: (lambda run=run: graph_ms(run)) for name, run in runs.items()}
            timers["copy_same_bytes"] = lambda: graph_ms(lambda: dst.copy_(src))
            timers["bf16_tables_warm"] = lambda: (graph_ms(lambda: (touch(), shipped()))
                                                  - graph_ms(touch))
            for run in runs.values():
                run()
            times = {name: [] for name in timers}
            for _ in range(args.rounds):
                for name, timer in timers.items():
                    times[name].append(timer() * 1e3)
            us = {name: statistics.median(t) for name, t in times.items()}
            copy = us["copy_same_bytes"]
            print(f"{site} T={tokens:6d}  " + "  ".join(
                f"{name} {t:.1f} us ({copy / t:.1%} of copy)" for name, t in us.items()), flush=True)
            rows.append(dict(site=site, T=tokens, us=us, rounds=times, nbytes=nbytes,
                             gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
