"""Side by side at small T: the shipped kernel against the same launch with each program prefetching its
table rows (one ``prefetch.global.L1`` or ``.L2`` per line, spread over the program's threads, once its
activation loads are issued). Prints us per variant, median of ``--rounds`` alternating rounds.

    python benchmarks/probe_prefetch_l1.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, graph_ms  # noqa: E402
from sites import kernel_launch, make_inputs, with_launch_config  # noqa: E402


def main():
    from h3_fused.kernels.triton_modulation import launch_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 3072, 15808])
    args = parser.parse_args()
    for site in "AB":
        for tokens in args.tokens:
            inputs = make_inputs(site, tokens, HIDDEN)
            shipped = launch_config(HIDDEN, site == "B", tokens)
            runs = {}
            for mode, name in ((0, "shipped"), (1, "prefetch_L1"), (2, "prefetch_L2")):
                base = kernel_launch(site, inputs, "bf16")
                runs[name] = (base, with_launch_config(base, dataclasses.replace(shipped, prefetch_tables=mode)))
            outs = {}
            for name, (base, run) in runs.items():
                run()
                outs[name] = [t.clone() for t in base.outputs if t is not None]
            same = all(all(a.equal(b) for a, b in zip(outs["shipped"], o)) for o in outs.values())
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, (_, run) in runs.items():
                    times[name].append(graph_ms(run) * 1e3)
            med = {name: statistics.median(v) for name, v in times.items()}
            print(f"{site} T={tokens:6d} " + "  ".join(f"{n} {m:7.1f} us ({m / med['shipped'] - 1:+.1%})"
                                                      for n, m in med.items()) + f"  outputs identical: {same}",
                  flush=True)


if __name__ == "__main__":
    main()
