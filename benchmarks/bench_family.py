"""The DiT family on a CUDA GPU: each model's sites at its real width, and two real-size blocks of each model.

    python benchmarks/bench_family.py --out benchmarks/results/family.json [--parts sites blocks] [--models flux wan]

1. ``sites``: per model, its site forms (``MODELS``: norm and spelling, rows' source, fp32 rows, modulations of
   one norm) at its hidden size, sites A, B and C (SD3.5's A and B with their norm modulated twice), batch 1 at
   16,384 tokens and at the model's typical count: eager, Inductor, Inductor with ``emulate_precision_casts``, the
   eager site compiled with ``backend="h3_fused"`` (``bf16``) and the fused op called directly, beside a copy of
   the site's minimal bytes (``family_minimal_bytes``). Each row:
   ``us_graph`` (``timing.graph_ms``), ``roof_share`` (minimal bytes over ``us_graph`` against the run's copy
   bandwidth), ``mismatch`` (the share of the outputs' elements not eager's bits) and, for
   the compiled variants, the sites the pass fused.
2. ``blocks``: ``examples/dit_family.py``'s models at the released dims with 2 blocks, eager, Inductor with
   ``emulate_precision_casts``, h3_fused (``bf16``) and h3_fused with ``eager_norms=False`` (what eager's bits
   outside the sites cost), whole-model and by repeated blocks: ms per forward
   (``do_bench``, a call as a user makes it), CUDA kernels per forward and their device time by kind
   (``device_ms``: h3_fused's, Inductor's, matmuls, attention, other; ``total``: what the GPU spent, against
   ``ms``, what the call took), and whether the output is eager's bit for bit (``equal``; ``mismatch``: the
   share of elements that differ).
3. ``norms``: each model's q/k norm (``NORMS``: its input's shape and layout, its spelling) as eager computes it, as
   Inductor + ``emulate_precision_casts`` compiles it alone, as ``eager_rms_norm`` (the whole norm, our kernel) and
   as ``eager_rms_norm_rstd`` (its statistics alone: the price of eager's bits where the rotary embedding reads the
   norm), the statistics also in each launch configuration of ``STATISTICS_CONFIGS``, beside a copy of the bytes
   each must move (``us_graph``, ``roof_share`` against the copy of the norm's input and output, or of the input and
   ``r``; ``equal``: eager's bits).
One JSON list of rows in ``--out`` (overwritten after each model).
"""

from __future__ import annotations

import functools
import gc
import os
import sys

import torch
from h3_fused.kernels import eager_rms_norm, eager_rms_norm_rstd
from h3_fused.kernels.arguments import check_args
from h3_fused.kernels.eager_norm import memory_order
from h3_fused.kernels.launch import LaunchConfig, launch_modulation
from h3_fused.kernels.testing import (
    TABLE_PLUS_ROWS,
    FamilyForm,
    eager_norm,
    family_eager_site,
    family_fused_site,
    family_inputs,
    family_minimal_bytes,
)
from h3_fused.toolkit_libdevice import link_toolkit_libdevice
from record import run_parts
from timing import copy_bandwidth, copy_same_bytes_ms, cuda_kernels, device_us_by_kind, graph_ms, mismatch
from torch._dynamo.utils import counters
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import dit_family  # noqa: E402

MODELS = {  # model: (hidden, its sites' form, its typical tokens per sample; dit-family.md section 5)
    "flux": (3072, FamilyForm("layer", "per_sample"), 4608),
    "wan": (5120, FamilyForm("layer", "per_sample", in_fp32=True), 32760),
    "wan_ti2v": (3072, FamilyForm("layer", TABLE_PLUS_ROWS, in_fp32=True), 27280),  # fp32 table + bf16 temb per token
    "hunyuan_video": (3072, FamilyForm("layer", "per_sample"), 30256),
    "qwen_image": (3072, FamilyForm("layer", "per_sample"), 6912),
    "qwen_image_edit": (3072, FamilyForm("layer", "chosen"), 8192),
    "ltx_video": (2048, FamilyForm("diffusers_rms", "per_sample"), 12288),
    "sd3": (1536, FamilyForm("layer", "per_sample"), 4429),
    "sd3_5": (2432, FamilyForm("layer", "per_sample", modulations=2), 4429),  # SD3.5 Large: one norm modulated twice
}
TOKENS = 16384
SITE_VARIANTS = {  # name -> (backend, options); None: eager
    "eager": None,
    "inductor": ("inductor", {}),
    "inductor_epc": ("inductor", {"emulate_precision_casts": True}),
    "h3_fused_bf16": ("h3_fused", {"dtype_policy": "bf16"}),
}
NORMS = {  # model: its image stream's q/k norm input [B, T, heads, D] (or [B, T, H]), transposed to [B, heads, T, D]
    # where the model norms it so, and whether its spelling is diffusers' RMSNorm (native: the mean's order)
    "flux": ((2, 4096, 24, 128), False, False),
    "wan": ((2, 4096, 5120), False, False),
    "hunyuan_video": ((2, 3872, 24, 128), True, True),
    "qwen_image": ((2, 4096, 24, 128), False, True),
    "sd3_5": ((2, 4096, 38, 64), True, True),
}
# the statistics alone launched otherwise than the shipped configuration, where the mean's order reads rows of one
# chunk (H = 128): several rows a program
STATISTICS_CONFIGS = {"rows16_w4": LaunchConfig(16, 128, 4, warm_rows_ahead=0),
                      "rows4_w2": LaunchConfig(4, 128, 2, warm_rows_ahead=0)}
BLOCK_VARIANTS = {
    **{k: SITE_VARIANTS[k] for k in ("eager", "inductor_epc", "h3_fused_bf16")},
    # the price of eager's bits outside the sites: the q/k norms and LayerNorms with their bias left to Inductor,
    # which fuses them with their neighbours (rotary, residual) in its own order of the sums
    "h3_fused_bf16_inductor_norms": ("h3_fused", {"dtype_policy": "bf16", "eager_norms": False}),
}


def link_libdevice_first() -> None:
    """The CUDA toolkit's libdevice for every compile of the run, before the first: on torch 2.11 h3_fused under
    ``bf16`` links it for the process (``toolkit_libdevice``) and restarts Inductor's compile workers, which would
    otherwise start again beside the timing of the variant that first compiled with it. Inductor +
    ``emulate_precision_casts`` then links it too, as it does itself from torch 2.13."""
    if torch.version.cuda:
        link_toolkit_libdevice()


def fresh() -> None:
    torch._dynamo.reset()
    counters.clear()
    gc.collect()
    torch.cuda.empty_cache()


def outputs_of(result) -> torch.Tensor:
    """Every output of a site's result (``y``, ``(u, y)``, ``u``; a ``y`` per modulation), flattened into one."""
    return torch.cat([t.flatten() for t in (result if isinstance(result, tuple) else (result,))])


def sites_part(models, rows: list, save) -> None:
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    for model in models:
        hidden, form, typical = MODELS[model]
        for tokens in sorted({TOKENS, typical}):
            for site in ("A", "B", "C"):
                fresh()
                inputs = family_inputs(site, form, 1, tokens, hidden)
                eager = family_eager_site(site, form)
                expected = outputs_of(eager(**inputs))
                nbytes = family_minimal_bytes(site, form, inputs)
                case = dict(part="sites", model=model, site=site, T=tokens, H=hidden, norm=form.norm,
                            source=form.source, in_fp32=form.in_fp32, roof_gbs=roof)
                calls = {name: eager if spec is None else torch.compile(eager, backend=spec[0], options=spec[1],
                                                                         dynamic=False)
                         for name, spec in SITE_VARIANTS.items()}
                calls["h3_fused_op"] = family_fused_site(site, form, "bf16")
                for name, fn in calls.items():
                    counters.clear()
                    got = outputs_of(fn(**inputs))
                    fused = sum(counters["h3_fused"][k] for k in ("norm_modulate", "gate_norm_modulate", "gate_residual"))
                    ms = graph_ms(lambda fn=fn: fn(**inputs))
                    gbs = nbytes / ms / 1e6
                    rows.append(dict(case, variant=name, us_graph=ms * 1e3, gbs=gbs, roof_share=gbs / roof,
                                     mismatch=mismatch(got, expected), fused=fused))
                    print(f"{model:13s} {site} T={tokens:6d} {name:14s} {ms * 1e3:8.1f} us {100 * gbs / roof:5.1f}% "
                          f"mismatch {rows[-1]['mismatch']:.1e} fused {fused}", flush=True)
                ms = copy_same_bytes_ms(nbytes)
                rows.append(dict(case, variant="copy_same_bytes", us_graph=ms * 1e3, gbs=nbytes / ms / 1e6,
                                 roof_share=nbytes / ms / 1e6 / roof))
        save()


def compiled(model: torch.nn.Module, variant: str, regional: bool):
    spec = BLOCK_VARIANTS[variant]
    if spec is None:
        return model
    backend, options = spec
    if not regional:
        return torch.compile(model, backend=backend, options=options)
    dit_family.compile_regionally(model, options, backend=backend)
    return model


def blocks_part(models, rows: list, save) -> None:
    for model_name in models:
        family = dit_family.MODELS[model_name]
        for variant, regional in [("eager", False)] + [(v, r) for v in BLOCK_VARIANTS if v != "eager" for r in (True, False)]:
            fresh()
            model, inputs = family.example("cuda", real=True)
            with torch.no_grad():
                expected = model(**inputs)[0]
                fn = compiled(model, variant, regional)
                got = fn(**inputs)[0]
                call = lambda fn=fn, inputs=inputs: fn(**inputs)  # noqa: E731
                gc.collect()
                gc.disable()  # two blocks at a few thousand tokens are bound by the host: no collection of the
                try:  # compiles' leftovers inside the timing (as timeit), which slowed the later variants of a run
                    ms = do_bench(call, return_mode="median")
                finally:
                    gc.enable()
                kernels = cuda_kernels(call)
            device_us = device_us_by_kind(kernels)
            rows.append(dict(part="blocks", model=model_name, variant=variant, mode="regional" if regional else "whole",
                             T=family.tokens[1], ms=ms, kernels=len(kernels),
                             device_ms={kind: us / 1000 for kind, us in device_us.items()},
                             equal=torch.equal(got, expected),
                             mismatch=(got != expected).float().mean().item(),
                             fused=sum(counters["h3_fused"][k] for k in ("norm_modulate", "gate_norm_modulate",
                                                                          "gate_residual"))))
            r = rows[-1]
            kinds = " ".join(f"{kind} {t:.2f}" for kind, t in r["device_ms"].items() if kind != "total")
            print(f"{model_name:13s} {variant:28s} {r['mode']:8s} {ms:8.3f} ms {r['kernels']:4d} kernels "
                  f"(device {r['device_ms']['total']:.2f} ms: {kinds}) equal {r['equal']} "
                  f"(mismatch {r['mismatch']:.1e}) fused {r['fused']}", flush=True)
            del model, inputs, expected, got, fn
            save()


def norms_part(models, rows: list, save) -> None:
    roof = copy_bandwidth()
    for model in [m for m in models if m in NORMS]:
        shape, transposed, native = NORMS[model]
        fresh()
        x = torch.randn(shape, device="cuda").to(torch.bfloat16)
        x = x.transpose(1, 2) if transposed else x
        weight = (1 + 0.1 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
        eager = functools.partial(eager_norm, weight=weight, eps=1e-6, native=native)
        expected, expected_r = eager(x), torch.ops.h3_fused.eager_kernels_rms_norm_rstd(x, 1e-6, native)  # eager's r
        order = memory_order(x) if transposed else list(range(x.dim()))
        a = check_args(x=x.permute(order), eps=1e-6, policy="bf16", norm_rounds_before_weight=native, has_norm=True,
                       stores_rstd=True)  # the rows in the order of their memory, as the op reads them
        r, expected_rows = torch.empty(a.rows, 1, device="cuda"), expected_r.permute(order).reshape(-1, 1)

        def launched(config):
            return lambda: launch_modulation(a, None, r, lambda kernel: kernel, config)

        calls = {"eager": (lambda: eager(x), "norm"),
                 "inductor_epc": (functools.partial(torch.compile(eager, options={"emulate_precision_casts": True},
                                                                  dynamic=False), x), "norm"),
                 "eager_rms_norm": (lambda: eager_rms_norm(x, weight, 1e-6, native), "norm"),
                 "eager_rms_norm_rstd": (lambda: eager_rms_norm_rstd(x, 1e-6, native), "statistics"),
                 **{f"statistics_{name}": (launched(config), "statistics") for name, config in STATISTICS_CONFIGS.items()
                    if native and shape[-1] == 128}}
        moved = {"norm": 2 * x.numel() * 2, "statistics": x.numel() * 2 + expected_r.numel() * 4}
        copies = {what: copy_same_bytes_ms(n) for what, n in moved.items()}
        for name, (call, what) in calls.items():
            got = call()
            same = torch.equal(r, expected_rows) if name.startswith("statistics_") else torch.equal(
                got, expected if what == "norm" else expected_r)
            ms = graph_ms(call)
            rows.append(dict(part="norms", model=model, shape=list(shape), transposed=transposed, native=native,
                             variant=name, output=what, us_graph=ms * 1e3, copy_us=copies[what] * 1e3,
                             roof_share=moved[what] / ms / 1e6 / roof, equal=same))
            print(f"{model:13s} {name:30s} {ms * 1e3:8.1f} us (copy of its bytes {copies[what] * 1e3:7.1f} us) "
                  f"equal {same}", flush=True)
        save()


def main():
    link_libdevice_first()
    run_parts(__doc__, "benchmarks/results/family.json",
              {"sites": sites_part, "blocks": blocks_part, "norms": norms_part}, list(MODELS))


if __name__ == "__main__":
    main()
