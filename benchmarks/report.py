"""Markdown tables of a benchmark JSON: time, share of the copy bandwidth and mismatch per variant.

    python benchmarks/report.py benchmarks/results/ops.json            # docs/BENCHMARKS.md's op table
    python benchmarks/report.py benchmarks/results/ops.json --readme   # the README's
    python benchmarks/report.py benchmarks/results/ops.json --over-copy h3_fused_bf16
    python benchmarks/report.py benchmarks/results/training.json       # the training tables
    python benchmarks/report.py benchmarks/results/family.json         # the DiT family's tables

Rows of several hidden sizes (``bench_ops.py --hidden``) get an ``H`` column.
"""

import argparse
import json

README_COLUMNS = {  # variant: the README's column, in the README's order
    "copy_same_bytes": "copy, same bytes", "eager": "eager", "inductor": "Inductor",
    "inductor_epc": "Inductor `emulate_precision_casts`", "hand_fused": "hand-fused one-row `fp32`",
    "hand_fused_bf16": "hand-fused one-row `bf16`",
    "h3_fused_fp32": "h3_fused `fp32`", "h3_fused_bf16": "h3_fused `bf16`",
}


def _case(r: dict) -> tuple:
    return r["site"], r.get("H"), r["T"]


def _case_columns(rows: list) -> tuple[str, str, object]:
    """The header and rule of a table's first columns (an ``H`` column where the rows have several H),
    and the function that writes a case's cells."""
    if len({r.get("H") for r in rows}) > 1:
        return "| site | H | T | ", "|---|---|---|", lambda c: f"| {c[0]} | {c[1]:,} | {c[2]:,} | "
    return "| site | T | ", "|---|---|", lambda c: f"| {c[0]} | {c[2]:,} | "


def readme_table(rows: list) -> None:
    """Device time and share per variant; the share of ``y`` not bit-identical to eager (``mm``) in each
    site's first row, for the variants that can differ."""
    header, rule, case_cells = _case_columns(rows)
    print(header + " | ".join(README_COLUMNS.values()) + " |")
    print(rule + "---|" * len(README_COLUMNS))
    first_of_site = set()
    for case in dict.fromkeys(map(_case, rows)):
        cells = []
        for variant in README_COLUMNS:
            r = next(r for r in rows if (*_case(r), r["variant"]) == (*case, variant))
            cell = f"{r['us_graph']:.1f} us, {100 * r['roof_share']:.1f}%"
            if case[0] not in first_of_site and r.get("mismatch") is not None and variant not in ("eager", "h3_fused_fp32"):
                cell += f", mm {r['mismatch']:.2g}".replace("e-0", "e-")
            cells.append(cell)
        first_of_site.add(case[0])
        print(case_cells(case) + " | ".join(cells) + " |")


def over_copy_table(rows: list, variant: str) -> None:
    """``variant``'s device time against the copy of the same bytes, per site and T: the difference, and
    between each T and the previous one the ratio of the two times' increases (what each further row
    costs against the copy's further bytes). A constant difference with a ratio near 1 is a fixed cost
    of the launch (ramp and tail), not a lower streaming rate."""
    times = {(*_case(r), r["variant"]): r["us_graph"] for r in rows}
    header, rule, case_cells = _case_columns(rows)
    print(header + f"copy, same bytes | {variant} | over the copy | increase against the copy's |")
    print(rule + "---|---|---|---|")
    previous = None
    for case in dict.fromkeys(map(_case, rows)):
        if (*case, variant) not in times:
            continue
        copy, ours = times[(*case, "copy_same_bytes")], times[(*case, variant)]
        ratio = ""
        if previous and previous[0] == case[:2]:
            ratio = f"{(ours - previous[2]) / (copy - previous[1]):.3f}"
        print(case_cells(case) + f"{copy:.1f} us | {ours:.1f} us | {ours - copy:+.1f} us | {ratio} |")
        previous = (case[:2], copy, ours)


TRAINING_VARIANTS = ("eager", "inductor", "inductor_epc", "h3_fused_bf16", "h3_fused_fp32", "h3_fused_bf16_compiled")


def training_tables(rows: list) -> None:
    """From ``bench_training.py``'s rows: forward + backward per site and T (device time, share of the copy
    bandwidth over the minimal bytes), the gradients' relative errors against fp64 and determinism, and the
    block's training step."""
    steps = [r for r in rows if r["kind"] == "step"]
    cases = sorted({(r["site"], r["T"]) for r in steps})
    variants = [v for v in (*TRAINING_VARIANTS, "copy_same_bytes") if any(r["variant"] == v for r in steps)]
    print("| site | T | " + " | ".join(variants) + " |\n|---|---|" + "---|" * len(variants))
    for site, tokens in cases:
        cells = {r["variant"]: f"{r['us_graph']:.0f} us, {100 * r['roof_share']:.0f}%" for r in steps
                 if (r["site"], r["T"]) == (site, tokens)}
        print(f"| {site} | {tokens:,} | " + " | ".join(cells.get(v, "") for v in variants) + " |")
    accuracy = [r for r in rows if r["kind"] == "accuracy"]
    print("\n| site | T | variant | gradient errors against fp64 | same bits twice |\n|---|---|---|---|---|")
    for r in sorted(accuracy, key=lambda r: (r["site"], r["T"], TRAINING_VARIANTS.index(r["variant"]))):
        errors = ", ".join(f"{k} {v:.1e}" for k, v in r["errors"].items())
        print(f"| {r['site']} | {r['T']:,} | {r['variant']} | {errors} | {'yes' if r['deterministic'] else 'no'} |")
    configs = [r for r in rows if r["kind"] == "backward_config"]
    if configs:
        print("\n| site | T | backward alone: configuration | us | same bits as shipped |\n|---|---|---|---|---|")
        for r in configs:
            print(f"| {r['site']} | {r['T']:,} | {r['variant']} | {r['us_graph']:.1f} | "
                  f"{'yes' if r['identical_to_shipped'] else 'no'} |")
    blocks = [r for r in rows if r["kind"] == "block"]
    if blocks:
        print("\n| block, T | variant | ms per training step | peak GiB |\n|---|---|---|---|")
        for r in blocks:
            print(f"| {r['T']:,} | {r['variant']} | {r['ms']:.1f} | {r['peak_gib']:.2f} |")


FAMILY_SITE_VARIANTS = {"copy_same_bytes": "copy, same bytes", "inductor": "Inductor",
                        "inductor_epc": "Inductor `emulate_precision_casts`", "h3_fused_bf16": "h3_fused `bf16` (backend)",
                        "h3_fused_op": "h3_fused `bf16` (op)"}


def family_tables(rows: list) -> None:
    """From ``bench_family.py``'s rows: per model, site and T the device time and share of the copy bandwidth per
    variant (``mm``: the share of the output not eager's bits, where not 0; ``unfused``: the backend fused nothing);
    then per model the 2-block forwards."""
    sites = [r for r in rows if r["part"] == "sites"]
    if sites:
        print("| model | H | site | T | " + " | ".join(FAMILY_SITE_VARIANTS.values()) + " |")
        print("|---|---|---|---|" + "---|" * len(FAMILY_SITE_VARIANTS))
        for case in dict.fromkeys((r["model"], r["H"], r["site"], r["T"]) for r in sites):
            cells = []
            for variant in FAMILY_SITE_VARIANTS:
                r = next(r for r in sites if (r["model"], r["H"], r["site"], r["T"], r["variant"]) == (*case, variant))
                cell = f"{r['us_graph']:.1f} us, {100 * r['roof_share']:.0f}%"
                if r.get("mismatch"):
                    cell += f", mm {r['mismatch']:.1g}".replace("e-0", "e-")
                if variant == "h3_fused_bf16" and not r["fused"]:
                    cell += ", unfused"
                cells.append(cell)
            print(f"| {case[0]} | {case[1]:,} | {case[2]} | {case[3]:,} | " + " | ".join(cells) + " |")
    blocks = [r for r in rows if r["part"] == "blocks"]
    if blocks:
        print("\n| model | T | variant | mode | ms per forward | CUDA kernels | eager's bits |\n|---|---|---|---|---|---|---|")
        for r in blocks:
            bits = "yes" if r["equal"] else f"no ({100 * (1 - r['mismatch']):.1f}% of elements)"
            print(f"| {r['model']} | {r['T']:,} | {r['variant']} | {r['mode']} | {r['ms']:.2f} | {r['kernels']} | {bits} |")


def main(src: str, readme: bool, over_copy: str | None = None) -> None:
    with open(src) as f:
        rows = json.load(f)
    if rows and "kind" in rows[0]:
        training_tables(rows)
        return
    if rows and "part" in rows[0]:
        family_tables(rows)
        return
    if readme:
        readme_table(rows)
        return
    if over_copy:
        over_copy_table(rows, over_copy)
        return
    main_rows = [r for r in rows if not r["variant"].startswith("sweep")]
    variants = list(dict.fromkeys(r["variant"] for r in main_rows))
    print(f"{rows[0]['device']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, "
          f"copy bandwidth {rows[0]['roof_gbs']:.0f} GB/s\n")
    header, rule, case_cells = _case_columns(main_rows)
    print(header + " | ".join(variants) + " |")
    print(rule + "---|" * len(variants))
    for case in dict.fromkeys(map(_case, main_rows)):
        cells = []
        for v in variants:
            r = next(r for r in main_rows if (*_case(r), r["variant"]) == (*case, v))
            cell = f"{r['us_graph']:.1f} us ({100 * r['roof_share']:.0f}%)"
            if "us" in r:  # not the copy of the same bytes, which has no call time or outputs
                cell += f", call {r['us']:.0f} us, mm {r['mismatch']:.1e}"
            cells.append(cell)
        print(case_cells(case) + " | ".join(cells) + " |")
    sweeps = [r for r in rows if r["variant"].startswith("sweep")]
    if sweeps:
        print("\n| site | T | config | us | share | regs | spills |\n|---|---|---|---|---|---|---|")
        for r in sweeps:
            print(f"| {r['site']} | {r['T']:,} | {r['variant'][6:]} | {1e3 * r['ms']:.1f} | "
                  f"{100 * r['roof_share']:.0f}% | {r.get('regs', '')} | {r.get('spills', '')} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("--readme", action="store_true", help="the README's table")
    parser.add_argument("--over-copy", metavar="VARIANT", help="VARIANT's time against the copy of the same bytes")
    args = parser.parse_args()
    main(args.src, args.readme, args.over_copy)
