"""Side by side: site A on the shipped launch configuration against programs that read the row twice
(``LaunchConfig.reread_row``: the sum of squares from a first read through L1, the modulation from a
second read, instead of holding the row in registers), on 2 to 16 warps, with the table rows loaded
ahead and without. Median of ``--rounds`` alternating rounds of device time after an L2 flush;
``differ``: the share of ``y`` elements not bit-identical to the shipped configuration's.

    python benchmarks/probe_reread.py [--rounds 5] [--tokens 1024 3072 ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_rounds, mismatch  # noqa: E402
from sites import kernel_launch, make_inputs, with_launch_config  # noqa: E402


def variants():
    from h3_fused.kernels.triton_modulation import LaunchConfig

    for warps in (2, 4, 8, 16):
        for ahead in (False, True):
            yield f"w{warps}{'_ahead' if ahead else ''}_reread", LaunchConfig(1, 32 * warps * 8, warps, ahead, True)
    yield "w4_kept", LaunchConfig(1, 1024, 4)
    yield "w8_kept", LaunchConfig(1, 2048, 8)


def main():
    from h3_fused.kernels.triton_modulation import launch_config

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1024, 3072, 6144, 15808, 63232])
    parser.add_argument("--policies", nargs="+", default=["bf16", "fp32"])
    args = parser.parse_args()
    for tokens in args.tokens:
        inputs = make_inputs("A", tokens, HIDDEN)
        for policy in args.policies:
            launches = {"shipped": kernel_launch("A", inputs, policy)}
            runs = dict(launches)
            for name, config in variants():
                launches[name] = kernel_launch("A", inputs, policy)
                runs[name] = with_launch_config(launches[name], config)
            regs = {name: run().n_regs for name, run in runs.items()}
            ref = launches["shipped"].outputs[1]
            differ = {name: mismatch(launch.outputs[1], ref) for name, launch in launches.items()}
            med = {name: statistics.median(v) for name, v in alternating_rounds(runs, args.rounds).items()}
            shipped = launch_config(HIDDEN, False, tokens)
            print(f"A T={tokens:6d} {policy} shipped {shipped}", flush=True)
            for name, m in med.items():
                print(f"   {name:18s} {m:8.1f} us {m / med['shipped'] - 1:+6.1%} r{regs[name]:3d} differ {differ[name]:.1e}",
                      flush=True)


if __name__ == "__main__":
    main()
