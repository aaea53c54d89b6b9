"""Bad-input sweep of the fused ops and the backend: prints a markdown table (input, outcome, message).

    python benchmarks/bad_inputs.py [--device cpu|cuda]

Each row runs one input; "ok" rows also check the result against eager. On CUDA every row runs in a
process of its own and synchronizes, since a device-side assertion leaves the CUDA context unusable.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(__file__))
import h3_fused  # noqa: E402,F401  (registers the ops)
from sites import eager_site, fused_site, make_inputs  # noqa: E402


def case_list(device):
    def inputs(site="B", tokens=8, hidden=64, **over):
        t = make_inputs(site, tokens, hidden, device=device)
        t.update(over)
        return t

    def run(site, **over):
        return lambda: fused_site(site, "bf16")(**inputs(site, **over))

    def matches(site, **over):
        def check():
            t = inputs(site, **over)
            got, ref = fused_site(site, "bf16")(**t), eager_site(site)(**t)
            got, ref = (got, ref) if isinstance(got, tuple) else ((got,), (ref,))
            same = all(torch.equal(torch.nan_to_num(g), torch.nan_to_num(r)) and torch.equal(g.isnan(), r.isnan())
                       for g, r in zip(got, ref))
            return "ok, equal to eager" if same else "ok, differs from eager (see the policy)"
        return check

    x = make_inputs("A", 8, 64, device=device)["x"]
    nan_x = x.clone()
    nan_x[0, 0], nan_x[1, 1], nan_x[2, 2] = float("nan"), float("inf"), -float("inf")
    wide = torch.randn(8, 200, device=device).to(torch.bfloat16)
    yield "index out of range (index[3] = K)", run("A", index=torch.tensor([0, 1, 2, 6, 0, 1, 2, 3], device=device))
    yield "negative index (index[0] = -1)", run("A", index=torch.tensor([-1, 1, 2, 3, 0, 1, 2, 3], device=device))
    yield "index of another shape", run("A", index=torch.zeros(7, dtype=torch.long, device=device))
    yield "float index", run("A", index=torch.zeros(8, device=device))
    yield "branch of another shape", run("C", branch=torch.zeros(4, 64, dtype=torch.bfloat16, device=device))
    yield "branch of another dtype", run("C", branch=torch.zeros(8, 64, device=device))
    yield "table of another width", run("A", shift=torch.zeros(6, 32, dtype=torch.bfloat16, device=device))
    yield "weight of another size", run("A", weight=torch.ones(32, dtype=torch.bfloat16, device=device))
    yield "tables on the meta device", run("A", scale=torch.zeros(6, 64, dtype=torch.bfloat16, device="meta"))
    yield "int activations", run("A", x=torch.zeros(8, 64, dtype=torch.int32, device=device))
    yield "negative eps", run("A", eps=-1.0)
    yield "unknown policy", lambda: h3_fused.kernels.norm_modulate(x, None, x[:6], x[:6], torch.zeros(8, dtype=torch.long, device=device), policy="bf17")
    yield "empty input (T = 0)", matches("B", tokens=0)
    yield "one row (T = 1)", matches("B", tokens=1)
    yield "NaN / +Inf / -Inf in the activations", matches("A", x=nan_x)
    yield "row-strided view (row stride 200)", matches("A", x=wide[:, 8:72])
    yield "storage-offset view (x[1:])", matches("A", tokens=8, x=torch.randn(9, 64, device=device).to(torch.bfloat16)[1:])
    yield "T = 70,000 rows (> 65,535)", matches("B", tokens=70000)
    yield "non-power-of-two H = 200", matches("B", hidden=200)
    if device == "cuda":  # 2.15e9 elements per activation: 64-bit offsets (too large for the CPU runs)
        yield "T x H >= 2^31 elements (400,000 x 5,376)", matches("C", tokens=400_000, hidden=5376)
    yield "backend: unknown dtype_policy", lambda: torch.compile(lambda a: a + 1, backend="h3_fused", options={"dtype_policy": "fp8"})(x)
    yield "backend: unknown Inductor option", lambda: torch.compile(lambda a: a + 1, backend="h3_fused", options={"no_such_option": 1})(x)

    def fp64_model():
        t = make_inputs("A", 8, 64, device=device, dtype=torch.float64)
        fn = eager_site("A")
        got = torch.compile(fn, backend="h3_fused")(**t)
        return "ok, compiled and ran unfused, equal to eager" if torch.allclose(got, fn(**t)) else "WRONG"
    yield "a model the pass cannot handle (fp64 site)", fp64_model


def run_case(name, fn, device) -> str:
    torch._dynamo.reset()
    try:
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        outcome, message = (result if isinstance(result, str) else "ok"), ""
    except Exception as e:  # the sweep records every failure mode, whatever its type
        outcome = type(e).__name__
        lines = str(e).strip().splitlines()
        message = next((m for m in lines if "must" in m or "out of range" in m or "unknown" in m
                        or "Invalid" in m or "not" in m or "assert" in m), lines[0] if lines else "")
    return f"| {name} | {outcome} | {message[:160].replace('|', '/')} |"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--case", type=int, help="run only this row (used for CUDA rows)")
    args = parser.parse_args()
    cases = list(case_list(args.device))
    if args.case is not None:
        print(run_case(*cases[args.case], args.device), flush=True)
        return
    print(f"| input ({args.device}) | outcome | message |\n|---|---|---|")
    if args.device != "cuda":
        for name, fn in cases:
            print(run_case(name, fn, args.device), flush=True)
        return
    with ThreadPoolExecutor(max_workers=8) as pool:  # one process per row, several at a time
        for row in pool.map(lambda item: cuda_row(*item), enumerate(cases)):
            print(row, flush=True)


def cuda_row(i, case) -> str:
    name = case[0]
    proc = subprocess.run([sys.executable, __file__, "--device", "cuda", "--case", str(i)],
                          capture_output=True, text=True, timeout=300)
    row = next((line for line in proc.stdout.splitlines() if line.startswith("|")), None)
    if row is None:  # the process died: report how, with the device-side message if any
        said = [line for line in (proc.stdout + proc.stderr).splitlines() if "h3_fused" in line or "Error" in line]
        row = f"| {name} | process exited {proc.returncode} | {(said[-1] if said else '')[:160].replace('|', '/')} |"
    return row


if __name__ == "__main__":
    main()
