"""The one results format of the benchmarks, and its writer and reader.

A results file is a JSON list of rows, one per measurement, each stamped with where it was measured
(``environment()``: the device, torch and Triton), overwritten by each run of its benchmark: the repository keeps
the current numbers, git their history. ``benchmarks/results/`` holds one such file per benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch
import triton


def environment() -> dict:
    """Where a measurement was made: ``device``, the GPU's name (on the CPU, the processor and torch's thread
    count), and the ``torch`` and ``triton`` versions."""
    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)")
    return dict(device=device, torch=torch.__version__, triton=triton.__version__)


def write_results(path: str, rows: list[dict]) -> None:
    """``rows`` as one JSON list at ``path`` (overwritten), each row stamped with ``environment()``. A benchmark
    writes after each part it measures, so that a run cut short keeps what it measured."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    stamp = environment()
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        json.dump([dict(stamp, **row) for row in rows], f, indent=1)
    os.replace(partial, path)


def read_results(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def run_parts(description: str, default_out: str, parts: dict, models: list[str]) -> None:
    """The command line of a benchmark measured in named ``parts`` (``{name: part(models, rows, save)}``, each
    calling ``save()`` after each model), over ``models``: ``--out``, ``--parts``, ``--models``; the rows are
    written to ``--out`` as they come."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=default_out)
    parser.add_argument("--parts", nargs="+", default=list(parts), choices=list(parts))
    parser.add_argument("--models", nargs="+", default=list(models), choices=list(models))
    args = parser.parse_args()
    rows: list[dict] = []
    for part in args.parts:
        parts[part](args.models, rows, lambda: write_results(args.out, rows))
