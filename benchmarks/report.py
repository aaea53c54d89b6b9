"""Markdown table of an op-benchmark JSON: time, share of the copy bandwidth and mismatch per variant.

    python benchmarks/report.py benchmarks/results/ops.json
"""

import json
import sys


def main(src: str) -> None:
    with open(src) as f:
        rows = json.load(f)
    main_rows = [r for r in rows if not r["variant"].startswith("sweep")]
    variants = list(dict.fromkeys(r["variant"] for r in main_rows))
    print(f"{rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}, "
          f"copy bandwidth {rows[0]['roof_gbs']:.0f} GB/s\n")
    print("| site | T | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for key in dict.fromkeys((r["site"], r["T"]) for r in main_rows):
        cells = []
        for v in variants:
            r = next(r for r in main_rows if (r["site"], r["T"], r["variant"]) == (*key, v))
            cell = f"{r['us_graph']:.1f} us ({100 * r['roof_share']:.0f}%)"
            if "us" in r:  # not the copy of the same bytes, which has no call time or outputs
                cell += f", call {r['us']:.0f} us, mm {r['mismatch']:.1e}"
            cells.append(cell)
        print(f"| {key[0]} | {key[1]:,} | " + " | ".join(cells) + " |")
    sweeps = [r for r in rows if r["variant"].startswith("sweep")]
    if sweeps:
        print("\n| site | T | config | us | share | regs | spills |\n|---|---|---|---|---|---|---|")
        for r in sweeps:
            print(f"| {r['site']} | {r['T']:,} | {r['variant'][6:]} | {1e3 * r['ms']:.1f} | "
                  f"{100 * r['roof_share']:.0f}% | {r.get('regs', '')} | {r.get('spills', '')} |")


if __name__ == "__main__":
    main(sys.argv[1])
