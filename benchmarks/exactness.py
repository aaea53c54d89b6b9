"""Whole models against eager, bit for bit: where a compiled H3 differs from eager, and by how much.

    python benchmarks/exactness.py --out benchmarks/results/exactness.json [--tokens 4096 15808]
        [--clients stand-in diffusers] [--modes regional whole] [--steps 20] [--locate-depth 3]

For each client (``stand-in``: ``examples/minimax_h3`` at real dims, 2 blocks; ``diffusers``: its
``MiniMaxH3Transformer3DModel`` at the checkpoint's dims and precision, 2 blocks), row count, compile mode
(``regional``: the repeated blocks compiled; ``whole``: ``torch.compile`` of the model) and variant (h3_fused
``bf16``; Inductor with ``emulate_precision_casts``, the other way to eager's roundings): whether every output
equals eager's (``outputs_equal``) and the share of output elements that differ (``mismatch``; diffusers' two
outputs, video and audio, together). Then a trajectory row per variant: ``--steps`` Euler steps of the
stand-in (regional, the first row count, the layout of its first step throughout), the share of each
step's latent that differs from eager's.
Then, for each client at the first row count, where the model's compiled code departs from eager
(``--locate-depth`` levels; 0: not at all): the whole model and its first block of each kind, each compiled
alone, and, inside any module whose compiled outputs differ
from eager's, each of its submodules, compiled alone and called on the inputs that module received in the
eager call, a row each (``kind`` ``module``, ``module`` its name in the model). The deepest differing modules
whose submodules all match are where the divergence is.
One row per case in ``--out`` (overwritten). Real dims on CUDA; on the CPU (a smoke run) the tiny dims.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from minimax_h3 import H3Config, H3Model, euler_sample, example_inputs, init_weights  # noqa: E402
from record import write_results  # noqa: E402

VARIANTS = {"h3_fused_bf16": ("h3_fused", {"dtype_policy": "bf16"}),
            "inductor_epc": ("inductor", {"emulate_precision_casts": True})}
BLOCKS = 2


def mismatch(got, expected) -> float:
    """The share of elements of the outputs ``got`` (tensors) that differ from ``expected``'s bits."""
    differ = sum(int((g.reshape(-1) != e.reshape(-1)).sum()) for g, e in zip(got, expected))
    return differ / sum(e.numel() for e in expected)


def compiled(model, mode: str, variant: str):
    backend, options = VARIANTS[variant]
    if mode == "whole":
        return torch.compile(model, backend=backend, options=options)
    if isinstance(model, H3Model):  # its blocks, as benchmarks/bench_model.py compiles them
        for block in model.blocks:
            block.compile(backend=backend, options=options)
    else:  # diffusers' own regional compile
        model.compile_repeated_blocks(backend=backend, options=options)
    return model


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stand_in_config() -> H3Config:
    dims = H3Config.real() if DEVICE == "cuda" else H3Config.tiny()
    return dataclasses.replace(dims, num_blocks=BLOCKS, num_refiner_blocks=0)


def stand_in(tokens: int):
    """The stand-in, a call of it on ``tokens`` rows and its width: ``(model, call, hidden)``; the call returns a
    tuple."""
    cfg = stand_in_config()
    model = init_weights(H3Model(cfg, device=DEVICE))
    latents, layout = example_inputs(cfg, tokens, device=DEVICE)
    return model, lambda m: (m(latents, layout),), cfg.hidden_size


def diffusers_client(tokens: int):
    from diffusers_h3 import REAL_DIMS_FEW_BLOCKS, TINY, build_model, make_request

    model = build_model(DEVICE, dict(REAL_DIMS_FEW_BLOCKS if DEVICE == "cuda" else TINY, num_layers=BLOCKS))
    other = 512 if DEVICE == "cuda" else tokens // 4
    request, video, audio = make_request(model, video_rows=tokens - 2 * other, audio_rows=other, text_rows=other,
                                         batch=1, device=DEVICE)
    inputs = request.model_inputs(video, audio, torch.tensor(0.7))

    def call(m):
        out = m(**inputs)
        return out.sample, out.audio_sample

    return model, call, model.config.hidden_size


CLIENTS = {"stand-in": stand_in, "diffusers": diffusers_client}


def first_calls(model, call, root: torch.nn.Module) -> dict:
    """The first call of ``root`` and of each module inside it in an eager call of ``model``: ``{module: (args,
    kwargs, outputs)}``."""
    calls, handles = {}, []

    def record(module, args, kwargs, output):
        calls.setdefault(module, (args, kwargs, output))

    for module in root.modules():
        handles.append(module.register_forward_hook(record, with_kwargs=True))
    try:
        call(model)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def locate(root: torch.nn.Module, name: str, calls: dict, compile_module, depth: int) -> list[dict]:
    """``{module, outputs_equal, mismatch}`` of ``root`` compiled alone (``compile_module(module)``) on the inputs
    of its eager call (``calls``, ``first_calls``'), then of each of its submodules that ran, down to ``depth``
    levels below where the outputs differ."""
    args, kwargs, expected = calls[root]
    got = compile_module(root)(*args, **kwargs)
    expected = [e for e in torch.utils._pytree.tree_leaves(expected) if torch.is_tensor(e)]
    if not expected:  # nothing to compare
        return []
    share = mismatch([g for g in torch.utils._pytree.tree_leaves(got) if torch.is_tensor(g)], expected)
    rows = [dict(module=name, outputs_equal=share == 0, mismatch=share)]
    if share and depth > 0:
        for child_name, child in root.named_children():
            if child in calls:
                rows += locate(child, f"{name}.{child_name}", calls, compile_module, depth - 1)
    return rows


def first_blocks(model) -> dict[str, torch.nn.Module]:
    """The first block of each kind of the model's repeated blocks (diffusers' ``_repeated_blocks``, what its
    regional compile compiles; the stand-in's ``H3Block``), by name."""
    kinds = getattr(model, "_repeated_blocks", None) or ["H3Block"]
    firsts = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in kinds and kind not in {type(m).__name__ for m in firsts.values()}:
            firsts[name] = module
    return firsts


def locate_rows(client: str, tokens: int, depth: int) -> list[dict]:
    rows = []
    for variant in VARIANTS:
        release()
        model, call, hidden = CLIENTS[client](tokens)
        backend, options = VARIANTS[variant]

        def compile_module(module):
            torch._dynamo.reset()
            return torch.compile(module, backend=backend, options=options)

        with torch.no_grad():  # the model itself and its top-level modules (whole-model compile), then its blocks
            for name, block in {"model": model, **first_blocks(model)}.items():
                calls = first_calls(model, call, block)
                for row in locate(block, name, calls, compile_module, depth):
                    rows.append(dict(client=client, kind="module", hidden=hidden, tokens=tokens, blocks=BLOCKS,
                                     mode="alone", variant=variant, policy="bf16", **row))
                    print(f"{client} T={tokens} {variant} {row['module']}: mismatch {row['mismatch']:.2e}",
                          flush=True)
                del calls
        del model, call
    return rows


def release():
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def trajectory(rows, tokens: int, steps: int):
    cfg = stand_in_config()
    latents, layout = example_inputs(cfg, tokens, device=DEVICE)
    runs = {}
    for variant in (None, *VARIANTS):
        release()
        model = init_weights(H3Model(cfg, device=DEVICE))
        if variant is not None:
            model = compiled(model, "regional", variant)
        latent_steps = []
        with torch.no_grad():
            euler_sample(model, latents, lambda sigma: layout, steps=steps,
                         on_step=lambda i, x: latent_steps.append(x.clone()))
        runs[variant] = latent_steps
    for variant in VARIANTS:
        per_step = [mismatch((g,), (e,)) for g, e in zip(runs[variant], runs[None])]
        rows.append(dict(client="stand-in", kind="trajectory", hidden=cfg.hidden_size, tokens=tokens, blocks=BLOCKS,
                         mode="regional", variant=variant, policy="bf16", steps=steps,
                         outputs_equal=all(m == 0 for m in per_step), mismatch=per_step[-1],
                         mismatch_per_step=per_step))
        print(f"trajectory {variant}: steps identical to eager {sum(m == 0 for m in per_step)}/{steps}, "
              f"last step mismatch {per_step[-1]:.2e}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="+", default=list(CLIENTS), choices=list(CLIENTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 15808] if DEVICE == "cuda" else [96])
    parser.add_argument("--modes", nargs="+", default=["regional", "whole"], choices=["regional", "whole"])
    parser.add_argument("--steps", type=int, default=20, help="trajectory steps (0: no trajectory)")
    parser.add_argument("--locate-depth", type=int, default=3,
                        help="levels of submodules to look into where compiled code departs from eager")
    parser.add_argument("--out", default="benchmarks/results/exactness.json")
    args = parser.parse_args()
    rows = []
    cases = [(c, t) for c in args.clients for t in args.tokens]
    for client, tokens in tqdm(cases, desc="exactness"):
        release()
        model, call, hidden = CLIENTS[client](tokens)
        with torch.no_grad():
            expected = call(model)
            for mode in args.modes:
                for variant in VARIANTS:
                    release()
                    got = call(compiled(model, mode, variant))
                    share = mismatch(got, expected)
                    rows.append(dict(client=client, kind="forward", hidden=hidden, tokens=tokens, blocks=BLOCKS,
                                     mode=mode, variant=variant, policy="bf16", outputs_equal=share == 0,
                                     mismatch=share))
                    print(f"{client} T={tokens} {mode} {variant}: mismatch {share:.2e}", flush=True)
                    if mode == "regional":  # undo the in-place regional compile for the next variant
                        model, call, _ = CLIENTS[client](tokens)
                        expected_again = call(model)
                        assert all(torch.equal(a, b) for a, b in zip(expected_again, expected)), "eager not repeatable"
        del model, call
    if args.steps:
        trajectory(rows, args.tokens[0], args.steps)
    if args.locate_depth:
        for client in args.clients:
            rows += locate_rows(client, args.tokens[0], args.locate_depth)
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
