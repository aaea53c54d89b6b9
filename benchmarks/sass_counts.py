"""Instruction mix of the shipped kernel per site and policy, compiled for sm_90 without a GPU.

    python benchmarks/sass_counts.py [--hidden 5376]

Compiles ``modulation_kernel`` with the launch configuration the ops use, disassembles it with the
``cuobjdump`` that ships with Triton, and prints registers, the instruction count per thread (the
kernel has no loop, so static = dynamic) and the most frequent opcodes. The Triton installed here may
differ from the GPU box's: read the counts as a comparison between builds, not as the box's SASS.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from h3_fused.kernels.contract import rounding_for
from h3_fused.kernels.triton_modulation import launch_config, modulation_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = ("x_ptr", "res_ptr", "branch_ptr", "gate_ptr", "w_ptr", "shift_ptr", "scale_ptr", "u_ptr", "y_ptr")
SCALARS = dict(n_rows="i32", num_table_rows="i32", eps="fp32", inv_hidden="fp32", stride_x="i32", stride_res="i32",
               stride_branch="i32", stride_gate="i32", stride_shift="i32", stride_scale="i32")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_site(site: str, policy: str, hidden: int):
    gate, norm = site in "BC", site in "AB"
    block_t, block_h, num_warps = launch_config(hidden, norm)
    r = rounding_for(policy, torch.bfloat16, torch.bfloat16 if gate else None, torch.bfloat16 if norm else None,
                     norm_rounds_before_weight=False, upcast_tables=False)
    constants = dict(HIDDEN=hidden, HAS_GATE=gate, HAS_NORM=norm, HAS_WEIGHT=norm, ROUND_GATE=r.gate_product,
                     ROUND_NORM=r.norm_output, ROUND_NORM_BEFORE_WEIGHT=r.norm_before_weight,
                     ROUND_AFFINE=r.affine, PORTABLE=False, BLOCK_T=block_t, BLOCK_H=block_h)
    signature = {name: "*bf16" for name in POINTERS} | {"idx_ptr": "*i64"} | SCALARS
    signature |= {name: "constexpr" for name in constants}
    names = modulation_kernel.arg_names
    source = ASTSource(fn=modulation_kernel, signature={n: signature[n] for n in names},
                       constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, debug=True))


def instruction_mix(cubin: bytes) -> tuple[int, collections.Counter]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    opcodes = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass)
    return int(re.search(r"REG:(\d+)", usage).group(1)), collections.Counter(opcodes)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=5376)
    args = parser.parse_args()
    print(f"triton {triton.__version__}, sm_90, H = {args.hidden}\n")
    print("| site | policy | registers | instructions per thread | most frequent |\n|---|---|---|---|---|")
    for site in "ABC":
        for policy in ("bf16", "fp32"):
            regs, mix = instruction_mix(compile_site(site, policy, args.hidden).asm["cubin"])
            top = ", ".join(f"{op} {n}" for op, n in mix.most_common(8))
            print(f"| {site} | {policy} | {regs} | {sum(mix.values())} | {top} |", flush=True)


if __name__ == "__main__":
    main()
