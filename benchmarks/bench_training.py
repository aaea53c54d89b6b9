"""Training benchmark: each site's forward + backward, the table gradients' accuracy, and a real-size block's
training step, on a CUDA GPU.

    python benchmarks/bench_training.py                 # -> benchmarks/results/training.json

Rows (``kind``):
- ``step``: a site's forward and backward (every float input's gradient, for fixed incoming gradients) per
  variant: eager, Inductor, Inductor with ``emulate_precision_casts``, h3_fused under ``bf16`` and ``fp32``
  (the ops called directly) and ``bf16`` compiled; ``us_graph`` device time (``timing.graph_ms``: CUDA-graph
  replay after an L2 flush), ``roof_share`` the minimal bytes of forward + backward (``STREAMS``) over it
  against the copy bandwidth of the same run; ``copy_same_bytes`` a copy of those bytes.
- ``accuracy``: per site, T and variant, each gradient's relative error (norm) against the fp64 graph's, and
  whether two runs give the same bits.
- ``backward_config``: the fused backward alone (``launch_backward``) under launch configurations, timed side by
  side in alternating rounds; ``shipped`` is ``backward_config``'s choice.
- ``block``: one real-size block (H = 5,376, FFN 14,336, 56 x 128 heads; attention in its eager island, as the
  model has it) compiled on its own, forward + backward of every parameter and the input: ms per step and
  peak memory, eager against Inductor with ``emulate_precision_casts`` and h3_fused ``bf16``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import os
import sys

import torch
from h3_fused.kernels.testing import SITES, eager_site, fused_site, make_inputs
from record import write_results
from timing import alternating_medians, call_ms, copy_bandwidth, copy_same_bytes_ms, graph_ms

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from minimax_h3 import H3Config, H3Model, example_inputs, init_weights  # noqa: E402

TOKENS = (3072, 15808, 63232)
HIDDEN = 5376
# Activation-sized tensors read or written once by forward + backward (2 bytes an element each):
# A: x, y | x, dy, dx;  B: res, branch, u, y | u, branch, dy, du, dres, dbranch;  C: res, branch, u | branch, du, dbranch
STREAMS = {"A": 5, "B": 10, "C": 6}


def variants(site: str) -> dict:
    eager = eager_site(site)
    return {"eager": eager, "inductor": torch.compile(eager, dynamic=False),
            "inductor_epc": torch.compile(eager, dynamic=False, options={"emulate_precision_casts": True}),
            "h3_fused_bf16": fused_site(site, "bf16"), "h3_fused_fp32": fused_site(site, "fp32"),
            "h3_fused_bf16_compiled": torch.compile(fused_site(site, "bf16"), dynamic=False)}


def differentiable(inputs: dict) -> list[str]:
    return [k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


class Step:
    """Forward and backward of ``fn`` on ``inputs`` (leaves requiring grad), the incoming gradients fixed
    (bf16 values, the same in an fp64 graph). A call returns the gradients of every float input."""

    def __init__(self, fn, inputs: dict, seed: int = 0):
        self.fn = fn
        self.names = differentiable(inputs)
        self.leaves = {k: v.detach().clone().requires_grad_(k in self.names) if isinstance(v, torch.Tensor) else v
                       for k, v in inputs.items()}
        with torch.no_grad():
            outputs = fn(**self.leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        g = torch.Generator(device=outputs[0].device).manual_seed(seed)
        self.incoming = [torch.randn(o.shape, generator=g, device=o.device).to(torch.bfloat16).to(o.dtype)
                         for o in outputs]

    def __call__(self):
        outputs = self.fn(**self.leaves)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return dict(zip(self.names, torch.autograd.grad(outputs, [self.leaves[k] for k in self.names], self.incoming)))


def in_fp64(inputs: dict) -> dict:
    return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


def relative_errors(got: dict, exact: dict) -> dict:
    return {k: ((got[k].double() - exact[k]).norm() / exact[k].norm()).item() for k in exact}


def site_rows(site: str, tokens: int, hidden: int, roof: float) -> list[dict]:
    inputs = make_inputs(site, tokens, hidden, seed=tokens)
    exact = Step(eager_site(site), in_fp64(inputs))()
    nbytes = 2 * STREAMS[site] * tokens * hidden
    case = dict(site=site, T=tokens, H=hidden)
    rows = []
    for name, fn in variants(site).items():
        step = Step(fn, inputs)
        first, second = step(), step()
        errors = relative_errors(first, exact)
        rows.append(dict(case, kind="accuracy", variant=name, errors=errors,
                         deterministic=all(torch.equal(first[k], second[k]) for k in first)))
        del first, second
        try:
            ms, timing = graph_ms(step), "cuda_graph"
        except RuntimeError as e:  # a variant that cannot be captured in a CUDA graph: timed as called
            print(f"  {name}: no CUDA graph ({str(e).splitlines()[0][:120]}); timed with do_bench", flush=True)
            ms, timing = call_ms(step), "do_bench"
        gbs = nbytes / ms / 1e6
        rows.append(dict(case, kind="step", variant=name, us_graph=ms * 1e3, timing=timing, gbs=gbs, roof_gbs=roof,
                         roof_share=gbs / roof))
        print(f"{site} T={tokens:6d} {name:24s} {ms * 1e3:9.1f} us {100 * gbs / roof:5.1f}%  "
              + " ".join(f"{k} {v:.1e}" for k, v in errors.items())
              + f"  deterministic {rows[-2]['deterministic']}", flush=True)
        del step
        gc.collect()
    ms = copy_same_bytes_ms(nbytes)
    rows.append(dict(case, kind="step", variant="copy_same_bytes", us_graph=ms * 1e3, gbs=nbytes / ms / 1e6,
                     roof_gbs=roof, roof_share=nbytes / ms / 1e6 / roof))
    return rows


def backward_config_rows(site: str, tokens: int, hidden: int, rounds: int) -> list[dict]:
    """The fused backward alone under launch configurations, side by side."""
    from h3_fused.kernels.launch_backward import Needs, backward_config, launch_backward
    from h3_fused.kernels.testing import backward_inputs

    a, rows_ = backward_inputs(site, tokens, hidden, seed=5)
    shipped = backward_config(hidden, tokens, a.device, site != "C", site != "A")
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count

    def programs(per_sm):
        rows_per_program = max(8, -(-tokens // (per_sm * sms)))
        return dict(rows_per_program=rows_per_program, programs=-(-tokens // rows_per_program))

    configs = {"shipped": shipped, "no_prefetch": dataclasses.replace(shipped, prefetch=False),
               "two_programs_per_sm": dataclasses.replace(shipped, **programs(2)),
               "warps8": dataclasses.replace(shipped, num_warps=8),
               "warps8_no_prefetch": dataclasses.replace(shipped, num_warps=8, prefetch=False),
               "hoist_tables_toggled": dataclasses.replace(shipped, hoist_tables=not shipped.hoist_tables),
               "early_streams_toggled": dataclasses.replace(shipped, early_streams=not shipped.early_streams)}
    needs = Needs(lead=site != "C")
    runs = {name: (lambda c=c: launch_backward(a, *rows_, needs, lambda kernel: kernel, c))
            for name, c in configs.items()}
    reference = runs["shipped"]()
    agree = {name: all(torch.equal(reference[k], run()[k]) for k in reference) for name, run in runs.items()}
    medians = alternating_medians(runs, rounds)
    print(f"{site} T={tokens} backward alone: "
          + "  ".join(f"{n} {m:.1f} us ({m / medians['shipped'] - 1:+.1%}, same bits {agree[n]})"
                      for n, m in medians.items()), flush=True)
    return [dict(site=site, T=tokens, H=hidden, kind="backward_config", variant=name, us_graph=medians[name],
                 config=repr(configs[name]), identical_to_shipped=agree[name]) for name in configs]


def block_rows(tokens: int) -> list[dict]:
    """A real-size block's training step (forward + backward of every parameter and the input), regional
    compile, per variant: ms and peak memory."""
    cfg = dataclasses.replace(H3Config.real(), num_blocks=1, num_refiner_blocks=0)
    rows = []
    for name in ("eager", "inductor_epc", "h3_fused_bf16"):
        torch._dynamo.reset()
        model = init_weights(H3Model(cfg, device="cuda"))
        latents, layout = example_inputs(cfg, tokens, segments=1, device="cuda")
        with torch.no_grad():
            x = model.patch_embed(latents.to(cfg.dtype))
            tables = [t.detach() for t in model.adaln_proj(model.time_embed(layout.timesteps))]
        x.requires_grad_()
        tables = [t.clone().requires_grad_() for t in tables]
        block = model.blocks[0]
        if name.startswith("inductor"):
            options = {"emulate_precision_casts": True} if name == "inductor_epc" else None
            forward = torch.compile(block, options=options)
        elif name.startswith("h3_fused"):
            forward = torch.compile(block, backend="h3_fused", options={"dtype_policy": name.split("_")[-1]})
        else:
            forward = block
        incoming = torch.randn_like(x)

        def step(forward=forward, x=x, tables=tables, layout=layout, incoming=incoming):
            out = forward(x, tables, layout.index, layout.positions, layout.cu_seqlens)
            torch.autograd.backward(out, incoming)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 5
        peak = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(kind="block", variant=name, T=tokens, H=cfg.hidden_size, ms=ms, peak_gib=peak))
        print(f"block T={tokens} {name:16s} {ms:8.2f} ms per step, peak {peak:6.2f} GiB", flush=True)
        del model, forward, x, tables, step
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/training.json")
    parser.add_argument("--sites", nargs="+", default=list(SITES), choices=SITES)
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["sites", "configs", "block"], choices=["sites", "configs", "block"])
    parser.add_argument("--block-tokens", type=int, default=15808)
    args = parser.parse_args()
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for site, tokens in itertools.product(args.sites, args.tokens):
        if "sites" in args.parts:
            rows += site_rows(site, tokens, args.hidden, roof)
        if "configs" in args.parts and tokens >= 15808:
            rows += backward_config_rows(site, tokens, args.hidden, args.rounds)
        write_results(args.out, rows)  # after each case: a run cut short keeps what it measured
    if "block" in args.parts:
        rows += block_rows(args.block_tokens)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
