"""The benchmarks' own tests import the benchmark scripts' modules (``harness``, ``report``, ``hand_fused``, ...),
which live in ``benchmarks/``; no other test depends on that folder."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
