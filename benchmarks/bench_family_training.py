"""Training the DiT family on a CUDA GPU: each model's sites forward + backward at its real width, and a LoRA
training step of 2 real-size blocks of each model.

    python benchmarks/bench_family_training.py --out benchmarks/results/family_training.json [--parts sites lora]

1. ``sites``: per model (``bench_family.MODELS``: its hidden size and site form), sites A, B and C, batch 1 at
   16,384 tokens: the forward and the backward of the activations and the modulation projection (fixed incoming
   gradients), eager, Inductor, Inductor with ``emulate_precision_casts``, the eager site compiled with
   ``backend="h3_fused"`` (``bf16``) and the fused op called directly. ``us_graph`` (``timing.graph_ms``),
   ``roof_share``: the minimal bytes of forward + backward (``minimal_step_bytes``) over it against the run's copy
   bandwidth; ``errors``: each gradient's relative error (norm) against the fp64 gradients of the site's math.
2. ``lora``: ``examples/finetune.py``'s task for each model at the released dims with 2 blocks, peft LoRA adapters
   on the attention and MLP linears, the rest frozen, compiled by blocks (diffusers' ``compile_repeated_blocks``):
   eager, Inductor and h3_fused (``bf16``) as ``finetune.VARIANTS`` name them; ms per step (forward, backward and
   AdamW, host included) and peak memory.
One JSON list of rows in ``--out`` (overwritten after each model).
"""

from __future__ import annotations

import gc
import os
import sys

import torch
from bench_family import MODELS, SITE_VARIANTS, fresh, link_libdevice_first
from bench_training import Step, in_fp64, relative_errors
from h3_fused.kernels.testing import family_eager_site, family_exact_site, family_fused_site, family_inputs
from record import run_parts
from timing import call_ms, copy_bandwidth, graph_ms

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import finetune  # noqa: E402

TOKENS = 16384
# Activation-sized tensors read or written once by forward + backward (as bench_training.STREAMS): A: x, y | x,
# dy, dx; B: res, branch, u, y | u, branch, dy, du, dres, dbranch; C: res, branch, u | branch, du, dbranch
STREAMS = {"A": 5, "B": 10, "C": 6}  # a norm modulated M times: each further modulation's y and dy (A, B)
ROWS_READ = {"A": 2, "B": 3, "C": 1}  # modulation rows a site reads: shift, scale (and gate)


def minimal_step_bytes(site: str, form, inputs: dict) -> int:
    """What forward + backward must move: ``STREAMS`` activation-sized tensors (and each further modulation's ``y``
    and ``dy``), and where the rows are one per token, the rows read by the forward and the backward and their
    gradients written (rows per sample or for all are negligible)."""
    lead = inputs.get("x", inputs.get("residual"))
    modulation = inputs["modulation"]
    per_token_rows = modulation.numel() // 6 * modulation.element_size() if modulation.dim() == 3 else 0
    further = form.modulations - 1 if site != "C" else 0
    return (STREAMS[site] + 2 * further) * lead.numel() * lead.element_size() + \
        3 * (ROWS_READ[site] + 2 * further) * per_token_rows


def sites_part(models, rows: list, save) -> None:
    roof = copy_bandwidth()
    print(f"copy bandwidth {roof:.0f} GB/s on {torch.cuda.get_device_name()}", flush=True)
    for model in models:
        hidden, form, _ = MODELS[model]
        for site in ("A", "B", "C"):
            fresh()
            inputs = family_inputs(site, form, 1, TOKENS, hidden)
            exact = Step(family_exact_site(site, form), in_fp64(inputs))()
            nbytes = minimal_step_bytes(site, form, inputs)
            case = dict(part="sites", model=model, site=site, T=TOKENS, H=hidden, norm=form.norm, source=form.source,
                        in_fp32=form.in_fp32, modulations=form.modulations, roof_gbs=roof)
            eager = family_eager_site(site, form)
            calls = {name: eager if spec is None else torch.compile(eager, backend=spec[0], options=spec[1],
                                                                     dynamic=False)
                     for name, spec in SITE_VARIANTS.items()}
            calls["h3_fused_op"] = family_fused_site(site, form, "bf16")
            for name, fn in calls.items():
                step = Step(fn, inputs)
                errors = relative_errors(step(), {k: v for k, v in exact.items() if k in step.names})
                try:
                    ms = graph_ms(step)
                except RuntimeError as e:  # a variant that cannot be captured in a CUDA graph: timed as called
                    print(f"  {name}: no CUDA graph ({str(e).splitlines()[0][:120]}); timed with do_bench", flush=True)
                    ms = call_ms(step)
                gbs = nbytes / ms / 1e6
                rows.append(dict(case, variant=name, us_graph=ms * 1e3, gbs=gbs, roof_share=gbs / roof, errors=errors))
                print(f"{model:13s} {site} {name:14s} {ms * 1e3:8.1f} us {100 * gbs / roof:5.1f}%  "
                      + " ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
                del step
                gc.collect()
        save()


def lora_part(models, rows: list, save, steps: int = 5) -> None:
    """``finetune.finetune``'s LoRA steps by blocks: the median of ``steps`` after two (the compile's)."""
    for model in models:
        for variant in finetune.VARIANTS:
            fresh()
            torch.cuda.reset_peak_memory_stats()
            log = finetune.finetune(model, variant, "bf16", steps + 2, "cuda", lora=True, regional=True)
            peak = torch.cuda.max_memory_allocated() / 2**30
            times = sorted(seconds for _, seconds in log[2:])
            ms = 1e3 * times[len(times) // 2]
            rows.append(dict(part="lora", model=model, variant=variant, ms=ms, peak_gib=peak,
                             losses=[loss for loss, _ in log]))
            print(f"{model:13s} LoRA step {variant:9s} {ms:8.2f} ms, peak {peak:6.2f} GiB", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
        save()


def main():
    link_libdevice_first()
    run_parts(__doc__, "benchmarks/results/family_training.json", {"sites": sites_part, "lora": lora_part},
              list(MODELS))


if __name__ == "__main__":
    main()
