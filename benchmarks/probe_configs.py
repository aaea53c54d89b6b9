"""Side by side: the kernel under named launch configurations, per site, row count, policy and index
layout, median of ``--rounds`` alternating rounds of device time after an L2 flush (as
``bench_ops.py``), each against the configuration ``launch_config`` ships for that row count (each line
also says whether every configuration of its policy left bit-identical outputs, ``sites.calls_agree``):

- ``shipped``: what ``launch_config`` picks for the site at ``T`` rows;
- ``shipped_warm_tables``: the same, with warming programs ahead of the programs of rows that bring
  every table row into L2 (``LaunchConfig.warm_tables``; site A ships with them);
- ``w2_ahead`` / ``w4_ahead`` / ``w8_ahead``: one row per program on 2 / 4 / 8 warps, chunks of one
  16-byte vector per thread, the table rows loaded ahead (``tables_ahead``), the shipped warming of
  coming table rows;
- ``w2`` / ``w4`` / ``w8``: the same with the table rows loaded just before their use;
- each of these with ``_warm`` appended (``w8_ahead_warm``): with warming programs too (``warm_tables``);
- ``shipped_maxnreg``: the shipped configuration with ptxas capping the registers per thread at
  ``--maxnreg`` (more programs per SM where the build needs more), added when that option is given;
- ``inductor_epc``: ``bench_ops.inductor_epc``, added with ``--inductor``; one compile serves both
  policies' lines;
- ``tables_in_l2``: the shipped configuration with every table row and the weight already in L2 when it
  starts (after the flush, a copy reads them; timed as copy + kernel minus the copy alone), added with
  ``--tables-in-l2``: the most that warming the tables as the kernel starts could give;
- ``kernel_warmed``: the shipped configuration launched first on ``WARM_ROWS`` rows of their own (the same
  build, the same tables), which leaves the kernel's code and every table row in L2 (its warming programs
  read them all); timed as that launch + kernel minus that launch alone, added with ``--kernel-warmed``.
  Against ``tables_in_l2``: what fetching the kernel's code from DRAM costs as it starts.

    python benchmarks/probe_configs.py [--cases A:2048 A:3072 A:4096] [--policies bf16 fp32]
        [--index uniform runs] [--configs shipped w4_ahead w8] [--maxnreg 64] [--hidden 5376]
        [--inductor] [--tables-in-l2] [--kernel-warmed]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import HIDDEN, alternating_medians, inductor_epc, relative_times  # noqa: E402
from sites import (  # noqa: E402
    INDEX_LAYOUTS,
    LaunchOptions,
    calls_agree,
    kernel_launch,
    make_inputs,
    shipped_launch_config,
    with_launch_config,
)

TABLE_ROWS = 6
WARM_ROWS = 16  # divisible by 16, as the timed row counts: Triton specialises the row count alike


def configurations(site: str, tokens: int, hidden: int) -> dict:
    from h3_fused.kernels.triton_modulation import LaunchConfig

    named = {"shipped": shipped_launch_config(site, hidden, tokens)}
    named["shipped_warm_tables"] = dataclasses.replace(named["shipped"], warm_tables=True)
    for warps in (2, 4, 8):
        for ahead in (False, True):
            name = f"w{warps}" + ("_ahead" if ahead else "")
            named[name] = LaunchConfig(1, 32 * warps * 8, warps, ahead)
            named[f"{name}_warm"] = dataclasses.replace(named[name], warm_tables=True)
    return named


def tables_touch(inputs: dict):
    """A call that reads every table (the ``[K, 6H]`` tensor the site's tables are views of) and the weight
    into scratch buffers, leaving them in L2."""
    reads = [t for t in (inputs.get("shift", inputs.get("gate"))._base, inputs.get("weight")) if t is not None]
    scratch = [torch.empty_like(t) for t in reads]

    def touch():
        for out, t in zip(scratch, reads):
            out.copy_(t)

    return touch


def small_launch(site: str, inputs: dict, policy: str, config, hidden: int):
    """The kernel in launch configuration ``config`` on ``WARM_ROWS`` rows of fresh activations with
    ``inputs``' tables and weight: the same build as the timed call's, which reads no activation of it."""
    small = make_inputs(site, WARM_ROWS, hidden, TABLE_ROWS, seed=1)
    rows = {name: small[name] for name in ("x", "residual", "branch", "index") if name in small}
    return with_launch_config(kernel_launch(site, dict(inputs, **rows), policy), config)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", nargs="+", default=["A:2048", "A:3072", "A:4096", "A:6144"])
    parser.add_argument("--policies", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    parser.add_argument("--index", nargs="+", default=list(INDEX_LAYOUTS), choices=INDEX_LAYOUTS)
    parser.add_argument("--configs", nargs="+", default=["shipped", "w4_ahead", "w8_ahead"])
    parser.add_argument("--maxnreg", type=int, help="also the shipped configuration with this register cap")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--inductor", action="store_true", help="also Inductor with emulate_precision_casts")
    parser.add_argument("--tables-in-l2", action="store_true", help="also the shipped kernel with the tables in L2")
    parser.add_argument("--kernel-warmed", action="store_true",
                        help="also the shipped kernel with its code and tables in L2 (a small launch first)")
    args = parser.parse_args()
    if (args.tables_in_l2 or args.kernel_warmed) and "shipped" not in args.configs:
        parser.error("--tables-in-l2 and --kernel-warmed time the shipped configuration: keep 'shipped' in --configs")
    names = args.configs + ["shipped_maxnreg"] * (args.maxnreg is not None)
    for case in args.cases:
        site, tokens = case.split(":")
        tokens = int(tokens)
        named = configurations(site, tokens, args.hidden)
        for layout in args.index:
            inputs = make_inputs(site, tokens, args.hidden, TABLE_ROWS, index_layout=layout)
            runs, outputs = {}, None
            for policy in args.policies:
                for name in names:
                    capped = name == "shipped_maxnreg"
                    wrap = LaunchOptions(maxnreg=args.maxnreg) if capped else (lambda kernel: kernel)
                    config = named["shipped" if capped else name]
                    launch = kernel_launch(site, inputs, policy, wrap, outputs=outputs)
                    outputs = launch.outputs
                    runs[name, policy] = with_launch_config(launch, config)
                    runs[name, policy]()
            if args.inductor:
                compiled = inductor_epc(site)
                runs["inductor_epc"] = lambda compiled=compiled, inputs=inputs: compiled(**inputs)
                runs["inductor_epc"]()
            if args.tables_in_l2:
                touch = tables_touch(inputs)
                runs["touch"] = touch
                for policy in args.policies:
                    shipped = runs["shipped", policy]
                    runs["touched", policy] = lambda touch=touch, shipped=shipped: (touch(), shipped())
            if args.kernel_warmed:
                for policy in args.policies:
                    warm = small_launch(site, inputs, policy, named["shipped"], args.hidden)
                    shipped = runs["shipped", policy]
                    runs["warm", policy] = warm
                    runs["warmed", policy] = lambda warm=warm, shipped=shipped: (warm(), shipped())
                    runs["warmed", policy]()
            agree = all(calls_agree([runs[name, policy] for name in names], outputs) for policy in args.policies)
            med = alternating_medians(runs, args.rounds)
            inductor = ["inductor_epc"] * args.inductor
            for policy in args.policies:
                line = {name: med[name, policy] for name in names} | {name: med[name] for name in inductor}
                if args.tables_in_l2:
                    line["tables_in_l2"] = med["touched", policy] - med["touch"]
                if args.kernel_warmed:
                    line["kernel_warmed"] = med["warmed", policy] - med["warm", policy]
                print(f"{site} H={args.hidden} T={tokens:6d} {layout:7s} {policy} shipped={named['shipped']}: "
                      + relative_times(line, "shipped") + f"; outputs identical: {agree}", flush=True)


if __name__ == "__main__":
    main()
