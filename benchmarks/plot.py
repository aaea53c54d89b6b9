"""Plots of the benchmark results.

    python benchmarks/plot.py benchmarks/results/ops.json docs/ops_bandwidth.png      # GB/s against T
    python benchmarks/plot.py benchmarks/results/model.json docs/trajectory_psnr.png  # PSNR per step

The op results give achieved GB/s against T per variant and site, with the copy bandwidth as the
roof and a copy of the same bytes per T (dotted); the model results give each variant's PSNR against eager at every step of the trajectory.
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_bandwidth(rows, dst: str) -> None:
    rows = [r for r in rows if not r["variant"].startswith("sweep")]
    sites = sorted({r["site"] for r in rows})
    fig, axes = plt.subplots(1, len(sites), figsize=(5 * len(sites), 4), sharey=True)
    for ax, site in zip(axes, sites):
        mine = [r for r in rows if r["site"] == site]
        for variant in dict.fromkeys(r["variant"] for r in mine):
            pts = sorted((r["T"], r["gbs"]) for r in mine if r["variant"] == variant)
            style = dict(color="k", linestyle=":", marker="") if variant == "copy_same_bytes" else dict(marker="o")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=variant, **style)
        ax.axhline(mine[0]["roof_gbs"], color="k", linestyle="--", label="copy bandwidth")
        ax.set_xscale("log")
        tokens = sorted({r["T"] for r in mine})
        ax.set_xticks(tokens, [f"{t:,}" for t in tokens])
        ax.minorticks_off()
        ax.set_title(f"site {site}")
        ax.set_xlabel("tokens T")
    axes[0].set_ylabel("GB/s over the minimal bytes")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"{rows[0]['device']}, torch {rows[0]['torch']}, triton {rows[0]['triton']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


def plot_psnr(rows, dst: str) -> None:
    runs = [r for r in rows if r["level"] == "trajectory" and r["variant"] != "eager"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        ax.plot(range(1, len(r["psnr"]) + 1), r["psnr"], marker=".", label=r["variant"])
    ax.set_xlabel("sampling step")
    ax.set_ylabel("PSNR of the latent against eager (dB)")
    ax.set_title(f"{runs[0]['blocks']} real-size blocks, T = {runs[0]['T']:,}, {runs[0]['steps']} Euler steps", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


def main(src: str, dst: str) -> None:
    with open(src) as f:
        rows = json.load(f)
    (plot_psnr if "level" in rows[0] else plot_bandwidth)(rows, dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
