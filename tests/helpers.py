"""Shared helpers of the pass tests: tiny models and counting fused ops that really ran."""

from __future__ import annotations

import dataclasses

import h3_fused
import torch
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


def with_config(model, **changes):
    return dataclasses.replace(model.cfg, **changes)


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
