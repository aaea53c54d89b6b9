"""Plot achieved GB/s against T per variant and site, with the copy bandwidth as the roof.

    python benchmarks/plot.py benchmarks/results/ops.json docs/ops_bandwidth.png
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = [r for r in json.load(f) if not r["variant"].startswith("sweep")]
    sites = sorted({r["site"] for r in rows})
    fig, axes = plt.subplots(1, len(sites), figsize=(5 * len(sites), 4), sharey=True)
    for ax, site in zip(axes, sites):
        mine = [r for r in rows if r["site"] == site]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            pts = sorted((r["T"], r["gbs"]) for r in mine if r["variant"] == variant)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=variant)
        ax.axhline(mine[0]["roof_gbs"], color="k", linestyle="--", label="copy bandwidth")
        ax.set_xscale("log")
        ax.set_title(f"site {site}")
        ax.set_xlabel("tokens T")
    axes[0].set_ylabel("GB/s over the minimal bytes")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{rows[0]['gpu']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
