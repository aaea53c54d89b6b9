"""The hand-fused one-row baseline against the spec's one-row anchors, side by side with the fused op.

    python benchmarks/probe_hand_fused.py [--baseline OLD_hand_fused.py] [--rounds 5] [--out FILE]

For sites A and B at each T, in alternating rounds (``bench_ops.alternating_rounds``, device time after an
L2 flush): ``hand_fused.py``'s kernel under both of its policies, the ``--baseline`` copy of another
version of ``hand_fused.py`` (e.g. ``git show REV:benchmarks/hand_fused.py``) under ``fp32``, and the fused
op under ``bf16``. Each line gives the medians, their share of the copy bandwidth, the share of ``y`` not
bit-identical to eager, and the spec's one-row anchors (section 4: H200, torch 2.11, triton 3.6), so that
the baseline's fidelity to the design the anchors measured can be read off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_ops import TOKENS, alternating_rounds, copy_bandwidth, mismatch, outputs  # noqa: E402
from hand_fused import hand_fused_site  # noqa: E402
from sites import eager_site, fused_site, load_module_file, make_inputs, minimal_bytes  # noqa: E402

SPEC_ONE_ROW_US = {  # (site, T): (fp32, bf16), spec section 4
    ("A", 3072): (24.4, 23.0), ("A", 15808): (97.7, 95.2), ("A", 63232): (366.0, 358.0),
    ("B", 3072): (40.3, 39.4), ("B", 15808): (176.0, 172.0), ("B", 63232): (672.0, 653.0),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="another version of hand_fused.py, timed under fp32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--out")
    args = parser.parse_args()
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for site in ("A", "B"):
        for tokens in args.tokens:
            inputs = make_inputs(site, tokens)
            calls = {"hand_fused": hand_fused_site(site, "fp32"), "hand_fused_bf16": hand_fused_site(site, "bf16")}
            if args.baseline:
                calls["baseline"] = load_module_file(args.baseline, "hand_fused_baseline").hand_fused_site(site)
            calls["h3_fused_bf16"] = fused_site(site, "bf16")
            reference_y = outputs(site, eager_site(site)(**inputs))[1]
            mismatches = {name: mismatch(outputs(site, call(**inputs))[1], reference_y) for name, call in calls.items()}
            times = alternating_rounds({name: (lambda call=call: call(**inputs)) for name, call in calls.items()},
                                       args.rounds)
            nbytes = minimal_bytes(site, tokens, inputs["shift"].shape[1])
            anchors = SPEC_ONE_ROW_US.get((site, tokens))
            for name, us in times.items():
                median = statistics.median(us)
                share = nbytes / median / 1e3 / roof
                rows.append(dict(site=site, T=tokens, variant=name, us=us, median_us=median, roof_share=share,
                                 mismatch=mismatches[name], spec_one_row_us=anchors))
                print(f"{site} T={tokens:6d} {name:16s} {median:8.1f} us {100 * share:5.1f}%  "
                      f"mismatch {mismatches[name]:.1e}", flush=True)
            if anchors:
                print(f"{site} T={tokens:6d} spec one-row: fp32 {anchors[0]} us, bf16 {anchors[1]} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, roof_gbs=roof, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
