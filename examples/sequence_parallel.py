"""Ulysses sequence parallelism of the stand-in model, each rank compiled with h3_fused, against one process.

    torchrun --nproc-per-node 2 examples/sequence_parallel.py                  # NCCL on 2 GPUs, gloo on the CPU
    torchrun --nproc-per-node 2 examples/sequence_parallel.py --policy fp32 --out sp.json

On GPUs: real-size blocks (``--blocks``, default 2), T = 15,808 rows split across the ranks; on the CPU the
tiny model. Every rank builds the same model (one seed) and takes its share of the rows; attention trades
rows for heads by all-to-all. Rank 0 also runs the whole sequence in one process and compares: the gathered
eager output with the one-process eager output, and the gathered compiled output (``compile_repeated_blocks``
with ``dtype_policy``) with the one-process compiled output: bit for bit under ``bf16``, within the policy's
bound under ``fp32``. It prints the sites each rank fused, the comparisons, and ms per forward on P ranks
against one; exits 1 where a comparison fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import h3_fused  # noqa: E402
from minimax_h3 import H3Config, H3Model, enable_ulysses, example_inputs, gather_rows, init_weights, shard_rows  # noqa: E402


def build(device: torch.device, blocks: int, sequence_parallel: bool) -> H3Model:
    if device.type == "cuda":
        cfg = dataclasses.replace(H3Config.real(), num_blocks=blocks, num_refiner_blocks=0)
    else:
        cfg = H3Config.tiny()
    model = init_weights(H3Model(cfg, device=device))
    return enable_ulysses(model) if sequence_parallel else model


def ms_per_forward(fn, device: torch.device, distributed: bool, repeats: int = 10) -> float:
    """Wall time per call over ``repeats`` calls after 3 warm-up calls, every rank in step (a collective
    inside ``fn`` must be called the same number of times on every rank)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if distributed:
            dist.barrier()

    for _ in range(3):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats * 1e3


def compare(policy: str, got: torch.Tensor, expected: torch.Tensor) -> dict:
    equal = torch.equal(got, expected)
    diff = (got.float() - expected.float()).abs().max().item()
    bound = 0.02 * expected.float().abs().max().item()
    return dict(equal=equal, max_abs_diff=diff, ok=equal if policy == "bf16" else diff <= bound)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=None, help="default 15,808 on GPUs, 96 on the CPU")
    parser.add_argument("--out", help="write rank 0's results here as JSON")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    options = {"dtype_policy": args.policy}
    try:
        model = build(device, args.blocks, sequence_parallel=True)
        tokens = args.tokens or (15808 if cuda else 96)
        latents, layout = example_inputs(model.cfg, tokens, device=device)
        local_latents, local_layout = shard_rows(latents, layout, rank, world)
        with torch.no_grad():
            sp_eager = gather_rows(model(local_latents, local_layout))
            h3_fused.compile_repeated_blocks(model, options=options)
            sp_compiled = gather_rows(model(local_latents, local_layout))
            sp_ms = ms_per_forward(lambda: model(local_latents, local_layout), device, distributed=True)
        fused = [None] * world
        dist.all_gather_object(fused, dict(counters["h3_fused"]))
        if rank != 0:
            return
        one = build(device, args.blocks, sequence_parallel=False)
        with torch.no_grad():
            eager = one(latents, layout)
            h3_fused.compile_repeated_blocks(one, options=options)
            compiled = one(latents, layout)
            one_ms = ms_per_forward(lambda: one(latents, layout), device, distributed=False)
        results = dict(ranks=world, device=torch.cuda.get_device_name(device) if cuda else "cpu",
                       backend=dist.get_backend(), torch=torch.__version__, policy=args.policy,
                       blocks=model.cfg.num_blocks, hidden=model.cfg.hidden_size, tokens=tokens,
                       fused_per_rank=fused, eager=compare("bf16", sp_eager, eager),
                       compiled=compare(args.policy, sp_compiled, compiled),
                       ms_per_forward=dict(ranks=sp_ms, one_process=one_ms))
        print(json.dumps(results, indent=1), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        if not (results["eager"]["ok"] and results["compiled"]["ok"]):
            sys.exit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
