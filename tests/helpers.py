"""Shared helpers of the pass tests: tiny models and counting fused ops that really ran."""

from __future__ import annotations

import dataclasses

import torch
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights

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
