"""Shared helpers of the tests: tiny models, counting fused ops that really ran, scripts run under the
Triton interpreter."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import h3_fused
import pytest
import torch
import torch.nn.functional as F
from minimax_h3 import H3Config, H3Model, Spellings, example_inputs, init_weights

FUSED_OP_EVENT = "h3_fused::reference_modulation"  # what every fused site runs on the CPU


def tiny(seed=0, tokens=64, **cfg_overrides):
    cfg = H3Config.tiny(**cfg_overrides)
    model = init_weights(H3Model(cfg), seed=seed)
    latents, layout = example_inputs(cfg, tokens)
    return model, latents, layout


def fused_ops_run(fn) -> int:
    """How many fused ops one call of ``fn`` executes (CPU)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == FUSED_OP_EVENT)


PUBLIC_SPELLINGS = [  # spec section 2, one switch at a time, then all at once
    Spellings(norm="native"),
    Spellings(gather="getitem"),
    Spellings(one_plus_first=False, gate_first=False),
    Spellings(trailing_to=False),
    Spellings(upcast_tables=True),
    Spellings(fp32_tables=True),
    Spellings(index_dtype=torch.int32),
    Spellings(batched=True),
    Spellings(norm="native", gather="getitem", upcast_tables=True, index_dtype=torch.int32, batched=True,
              one_plus_first=False, gate_first=False),
]


def regional_against_eager(model, latents, layout, policy="bf16"):
    """``(compiled output, eager output, fused ops per forward)`` after regional compile of ``model``."""
    with torch.no_grad():
        expected = model(latents, layout)
        h3_fused.compile_repeated_blocks(model, options={"dtype_policy": policy})
        got = model(latents, layout)
        ran = fused_ops_run(lambda: model(latents, layout))
    return got, expected, ran


@functools.cache
def inductor_matches_eager_on_cpu() -> bool:
    """Whether this torch's Inductor, with ``emulate_precision_casts``, computes unfused bf16 ops (an
    RMSNorm, gathers, the affine) bit-identically to eager on the CPU: the premise of the tests that
    compare a whole compiled graph with eager bit for bit. True on torch 2.13 and 2.14; on 2.12 the
    C++ backend drops eager's intermediate bf16 roundings. Probed, not read from the version; call it
    before a test compiles (it resets Dynamo)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(16, 64, generator=g).to(torch.bfloat16), torch.randn(64, generator=g).to(torch.bfloat16)
    table, idx = torch.randn(4, 64, generator=g).to(torch.bfloat16), torch.randint(0, 4, (16,), generator=g)

    def unfused(x):
        return F.rms_norm(x, (64,), w, 1e-5) * table[idx] + table[idx]

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(unfused, options={"emulate_precision_casts": True})(x)
    torch._dynamo.reset()
    return torch.equal(compiled, unfused(x))


def assert_bf16_policy(got, expected):
    """A whole compiled graph under ``bf16`` against eager: bit-identical where this torch's Inductor
    reproduces eager (``inductor_matches_eager_on_cpu``); elsewhere the ops Inductor compiles around the
    fused sites round differently from eager (the sites themselves stay exact: tests/test_ops_cpu.py),
    and the output is held to the ``fp32`` policy's bound."""
    if inductor_matches_eager_on_cpu():
        assert torch.equal(got, expected), "bf16 (and auto on the CPU) must be bit-identical to eager"
    else:
        torch.testing.assert_close(got, expected, rtol=0.05, atol=0.02 * expected.abs().max().item())


def run_interpreted(script: str) -> str:
    """``script`` in a fresh process under ``TRITON_INTERPRET=1``; its stdout, after it exits 0."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
