"""Ulysses sequence parallelism with 2 gloo ranks reproduces the single-process forward."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import assert_bf16_policy
from minimax_h3 import H3Config, H3Model, enable_ulysses, example_inputs, gather_rows, init_weights, shard_rows

WORLD = 2
TOKENS = 96


def _rank_main(rank: int, init_file: str, out_dir: str, compile_backend: str | None, options: dict):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        cfg = H3Config.tiny()
        model = enable_ulysses(init_weights(H3Model(cfg)))
        latents, layout = example_inputs(cfg, TOKENS)
        local_latents, local_layout = shard_rows(latents, layout, rank, WORLD)
        run = model if compile_backend is None else torch.compile(model, backend=compile_backend,
                                                                  options=options)
        with torch.no_grad():
            out = gather_rows(run(local_latents, local_layout))
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "out.pt"))
    finally:
        dist.destroy_process_group()


def run_sequence_parallel(tmp_path, compile_backend=None, options=None) -> torch.Tensor:
    mp.spawn(_rank_main, args=(str(tmp_path / "init"), str(tmp_path), compile_backend, options or {}),
             nprocs=WORLD, join=True)
    return torch.load(tmp_path / "out.pt")


def single_process_reference() -> torch.Tensor:
    cfg = H3Config.tiny()
    latents, layout = example_inputs(cfg, TOKENS)
    with torch.no_grad():
        return init_weights(H3Model(cfg))(latents, layout)


def test_two_gloo_ranks_equal_single_process(tmp_path):
    got = run_sequence_parallel(tmp_path)
    expected = single_process_reference()
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_two_gloo_ranks_compiled_with_h3_fused_match_eager_per_policy(tmp_path):
    expected = single_process_reference()
    (tmp_path / "bf16").mkdir()
    (tmp_path / "fp32").mkdir()
    got_bf16 = run_sequence_parallel(tmp_path / "bf16", "h3_fused", {"dtype_policy": "bf16"})
    assert_bf16_policy(got_bf16, expected)
    got_fp32 = run_sequence_parallel(tmp_path / "fp32", "h3_fused", {"dtype_policy": "fp32"})
    assert not torch.equal(got_fp32, expected)
    torch.testing.assert_close(got_fp32, expected, rtol=0.05, atol=0.02 * expected.abs().max().item())
