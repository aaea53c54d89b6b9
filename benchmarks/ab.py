"""A/B harness: forward-kernel variants timed side by side in one process, and whether their outputs agree.

    python benchmarks/ab.py --cases A:3072 A:15808 B:15808 [--policies bf16 fp32]
        [--configs shipped w8 w4_preload ...] [--baseline DIR] [--no-index-check] [--native] [--free-order]
        [--index uniform runs] [--hidden 5376] [--rounds 7] [--flush write|read]

Every variant of a case writes into the same output buffers (``h3_fused.kernels.testing.kernel_launch``) and is timed with
``timing.graph_ms`` in alternating rounds; the line printed per case and policy gives each variant's median
and its difference to the first. Variants: the launch configurations named in ``--configs`` (``CONFIGS``);
with ``--baseline DIR``, the shipped configuration of another commit's kernel (``DIR`` holds that commit's
``kernels/`` files: ``git archive REV kernels | tar -x --strip-components=1 -C DIR``); with
``--no-index-check``, the shipped configuration built without the device-side index assertion. ``--native``:
the sites' norm in the native spelling (``norm_rounds_before_weight``; under ``bf16`` its own sum order).
``--free-order``: the shipped kernel with the norm's squares added in its own order (the cost of an eager
kernel's order: ``--native --free-order`` for the mean's). Results:
``benchmarks/results/ab.json`` (overwritten).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from h3_fused.kernels.testing import (
    INDEX_LAYOUTS,
    kernel_launch,
    make_inputs,
    shipped_launch_config,
    shipped_sum_order,
)
from harness import LaunchOptions, calls_agree, load_kernel_module
from record import write_results
from timing import alternating_medians, relative_times


def configurations(site: str, tokens: int, hidden: int, policy: str, native: bool = False) -> dict:
    """Named launch configurations under ``policy``: the shipped one, ``w{2,4,8}`` (one 16-byte vector per thread
    and chunk on that many warps; the shipped chunk where the norm's sum takes eager's order), each
    also with ``_preload`` (table chunks one early), and any of them with ``_warm`` (warming programs first) or
    ``_nowarm`` (no warming of coming rows)."""
    from h3_fused.kernels.launch import LaunchConfig, sum_order_chunk

    named = {"shipped": shipped_launch_config(site, hidden, tokens, policy, native)}
    fixed = sum_order_chunk(hidden, shipped_sum_order(site, hidden, tokens, policy, native))  # None: any chunk
    for warps, preload in itertools.product((2, 4, 8), (False, True)):
        named[f"w{warps}" + "_preload" * preload] = LaunchConfig(1, fixed or 32 * warps * 8, warps, preload)
    for name, config in list(named.items()):
        named[f"{name}_warm"] = dataclasses.replace(config, warm_tables_first=True)
        named[f"{name}_nowarm"] = dataclasses.replace(config, warm_rows_ahead=0, warm_tables_first=False)
    return named


def variants(site, inputs, policy, names, configs, baseline, no_index_check, free_order, outputs=None):
    """The calls to time, all writing into one set of outputs: ``{name: call}``."""
    runs = {}
    for name in names:
        runs[name] = kernel_launch(site, inputs, policy, outputs=outputs, config=configs[name])
        outputs = runs[name].outputs
    if baseline is not None:
        runs["baseline"] = kernel_launch(site, inputs, policy, kernel_module=baseline, outputs=outputs)
    if no_index_check:
        runs["no_index_check"] = kernel_launch(site, inputs, policy, LaunchOptions(debug=False), outputs=outputs)
    if free_order:
        runs["free_order"] = kernel_launch(site, inputs, policy, outputs=outputs, free_sum_order=True)
    return runs, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["A:3072", "A:15808", "B:15808", "C:15808"])
    parser.add_argument("--policies", nargs="+", default=["bf16"], choices=["bf16", "fp32"])
    parser.add_argument("--configs", nargs="+", default=["shipped"])
    parser.add_argument("--baseline", help="a folder with another commit's kernels/ files")
    parser.add_argument("--no-index-check", action="store_true")
    parser.add_argument("--native", action="store_true", help="the native RMSNorm spelling at sites A and B")
    parser.add_argument("--free-order", action="store_true", help="also the norm's sum in the kernel's own order")
    parser.add_argument("--index", nargs="+", default=["uniform"], choices=INDEX_LAYOUTS)
    parser.add_argument("--hidden", type=int, default=5376)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--flush", default="write", choices=["write", "read"])
    parser.add_argument("--out", default="benchmarks/results/ab.json")
    args = parser.parse_args()
    baseline = load_kernel_module(args.baseline) if args.baseline else None
    rows = []
    for case, layout in itertools.product(args.cases, args.index):
        site, tokens = case.split(":")
        tokens = int(tokens)
        inputs = make_inputs(site, tokens, args.hidden, index_layout=layout)
        native = args.native and site != "C"
        if native:
            inputs["norm_rounds_before_weight"] = True
        for policy in args.policies:
            configs = configurations(site, tokens, args.hidden, policy, native)
            unknown = set(args.configs) - set(configs)
            if unknown:
                parser.error(f"unknown configurations {sorted(unknown)}; known: {sorted(configs)}")
            runs, outputs = variants(site, inputs, policy, args.configs, configs, baseline, args.no_index_check,
                                    args.free_order)
            agree = calls_agree(list(runs.values()), outputs)
            medians = alternating_medians(runs, args.rounds, args.flush)
            print(f"{site} H={args.hidden} T={tokens:6d} {layout:7s} {policy}: "
                  + relative_times(medians, next(iter(medians))) + f"; outputs identical: {agree}", flush=True)
            rows.append(dict(site=site, T=tokens, H=args.hidden, index=layout, policy=policy, native=args.native, us=medians,
                             outputs_identical=agree, shipped=repr(configs["shipped"])))
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
