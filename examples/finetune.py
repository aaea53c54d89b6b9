"""A short fine-tune, eager, compiled with plain Inductor and compiled with h3_fused, side by side: of the H3
stand-in (``examples/minimax_h3``, an unfused port of MiniMax-H3), or of any diffusers DiT of
``examples/dit_family.py``, optionally with peft LoRA adapters on its attention and MLP linears.

    python examples/finetune.py                       # the stand-in: tiny on the CPU; two real-size blocks on a GPU
    python examples/finetune.py flux --lora           # diffusers' Flux, LoRA adapters, the rest frozen
    python examples/finetune.py wan --lora --regional --checkpointing --steps 20 --policy fp32

Each step draws noise, moves the latents along the straight path toward it and regresses the model's output on
``noise - latents`` (the stand-in: a timestep per sample, its sampler's convention; a diffusers model: at its
example's timesteps, ``t`` drawn per step). ``--regional``: the repeated blocks compiled each on its own
(``dit_family.compile_regionally``), else the whole model. ``--checkpointing``: diffusers' gradient checkpointing
of the blocks. Prints each step's loss and time for the three, and what the h3_fused compile fused.

On the CPU there is no fused kernel: a site's forward is its reference's operations, which Inductor compiles as
it compiles the unfused site, and its backward is the reference backward, one op per site that runs as eager
torch operations (so that the row gradients are summed in fp32 in a fixed order), where Inductor compiles the
unfused backward into its own code. So on the CPU h3_fused's steps are slower than Inductor's (and, at the tiny
models' sizes, any compiled step than eager's); the fused kernels, and the speed, are on the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable

import torch
from torch._dynamo.utils import counters
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dit_family import MODELS, compile_regionally  # noqa: E402
from h3_fused.patterns import SiteKind  # noqa: E402
from minimax_h3 import H3Config, H3Model, TokenLayout, example_inputs, init_weights  # noqa: E402

VARIANTS = ("eager", "inductor", "h3_fused")
# the linears peft adapts: the attention's projections and the MLPs' (not the modulation's, whose rows the sites read)
LORA_PARTS = ("attn", "attention", "ff", "ffn", "mlp", "proj_mlp", "proj_out")


@dataclasses.dataclass
class Task:
    """A model to fine-tune and its steps' inputs: ``batch(step)`` gives ``(args, kwargs, target)``, ``output``
    the tensor the loss regresses from what the model returns."""

    model: torch.nn.Module
    batch: Callable
    output: Callable


def stand_in(device: str) -> Task:
    if device == "cuda":
        cfg, tokens = dataclasses.replace(H3Config.real(), num_blocks=2, num_refiner_blocks=0), 4096
    else:
        cfg, tokens = H3Config.tiny(num_blocks=2), 128
    model = init_weights(H3Model(cfg, device=device))
    latents, layout = example_inputs(cfg, tokens, device=device)

    def batch(step: int):
        """``x_t`` and the layout at a timestep per segment drawn with seed ``step``, and the velocity target."""
        g = torch.Generator().manual_seed(step)
        noise = torch.randn(latents.shape, generator=g).to(latents.device)
        t = torch.rand(len(layout.timesteps), generator=g).to(latents.device)
        per_token = t[layout.timestep_index.long()].unsqueeze(-1)
        layout_t: TokenLayout = dataclasses.replace(layout, timesteps=t.clamp(1e-3, 1.0))
        return ((1 - per_token) * latents + per_token * noise, layout_t), {}, noise - latents

    return Task(model, batch, lambda out: out)


def diffusers_model(name: str, device: str) -> Task:
    """``dit_family.MODELS[name]`` (tiny on the CPU, real dims with 2 blocks on a GPU), its example's inputs."""
    model, inputs = MODELS[name].example(device, real=device == "cuda")
    latents = inputs["hidden_states"]

    def batch(step: int):
        g = torch.Generator().manual_seed(step)
        noise = torch.randn(latents.shape, generator=g).to(latents)
        t = torch.rand((), generator=g).item()
        return (), dict(inputs, hidden_states=((1 - t) * latents + t * noise).to(latents.dtype)), noise - latents

    return Task(model, batch, lambda out: out[0])


def add_lora(model: torch.nn.Module, rank: int = 4) -> torch.nn.Module:
    """peft LoRA adapters on the linears of the attention and the MLPs (``LORA_PARTS``); everything else frozen."""
    import peft

    targets = [name for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and set(name.split(".")) & set(LORA_PARTS)]
    model.requires_grad_(False)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    model = peft.inject_adapter_in_model(config, model)
    for param_name, p in model.named_parameters():
        p.requires_grad_("lora_" in param_name)
    return model


def build(name: str, device: str, lora: bool = False, checkpointing: bool = False, seed: int = 0) -> Task:
    torch.manual_seed(seed)
    task = stand_in(device) if name == "h3" else diffusers_model(name, device)
    if lora:
        torch.manual_seed(seed)  # the adapters' random initial weights, the same for every variant
        task.model = add_lora(task.model)
    if checkpointing:
        task.model.enable_gradient_checkpointing()
    task.model.train()
    return task


def compile_variant(task: Task, variant: str, policy: str, regional: bool):
    """The callable a step runs: the model, compiled as ``variant`` says (whole, or its blocks ``regional``)."""
    if variant == "eager":
        return task.model
    backend, options = ("h3_fused", {"dtype_policy": policy}) if variant == "h3_fused" else ("inductor", None)
    if regional:
        compile_regionally(task.model, options, backend)
        return task.model
    return torch.compile(task.model, backend=backend, options=options)


def finetune(name: str, variant: str, policy: str = "bf16", steps: int = 8, device: str = "cpu", lora: bool = False,
             regional: bool = False, checkpointing: bool = False, lr: float = 1e-4) -> list[tuple[float, float]]:
    """``(loss, seconds)`` of each step of the fine-tune of ``name`` (``"h3"`` or a ``dit_family.MODELS`` key) with
    ``variant`` (one of ``VARIANTS``); AdamW on what requires a gradient."""
    torch._dynamo.reset()
    counters.clear()
    if device == "cuda" and name != "h3":
        # torch 2.11's cuDNN attention backward fails at Flux's real dims (``mha_graph.execute(...).is_good()``, or
        # an illegal memory access, in eager as compiled): the flash and memory-efficient kernels instead
        torch.backends.cuda.enable_cudnn_sdp(False)
    task = build(name, device, lora, checkpointing)
    fn = compile_variant(task, variant, policy, regional)
    optimizer = torch.optim.AdamW([p for p in task.model.parameters() if p.requires_grad], lr=lr)
    log = []
    for step in tqdm(range(steps), desc=variant, leave=False):
        args, kwargs, target = task.batch(step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(task.output(fn(*args, **kwargs)).float(), target.float())
        loss.backward()
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        log.append((loss.item(), time.perf_counter() - start))
    return log


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="h3", choices=["h3", *MODELS],
                        help="the H3 stand-in (default) or a diffusers DiT of examples/dit_family.py")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per variant (default 8; the first "
                        "steps of the compiled variants include their compile)")
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"],
                        help="h3_fused's dtype policy: bf16 rounds where eager rounds, fp32 once per output "
                             "(default bf16)")
    parser.add_argument("--lora", action="store_true", help="peft LoRA adapters; the model's own weights frozen")
    parser.add_argument("--regional", action="store_true", help="compile the repeated blocks, not the whole model")
    parser.add_argument("--checkpointing", action="store_true", help="diffusers' gradient checkpointing")
    args = parser.parse_args()
    if args.checkpointing and args.model == "h3":
        parser.error("--checkpointing: diffusers' models only")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"fine-tuning {args.model}{' (LoRA)' if args.lora else ''} on {device} (torch {torch.__version__}), "
          f"{args.steps} steps, {'by blocks' if args.regional else 'whole model'}")
    logs = {}
    for variant in VARIANTS:
        logs[variant] = finetune(args.model, variant, args.policy, args.steps, device, args.lora, args.regional,
                                 args.checkpointing)
        if variant == "h3_fused":
            fused = {kind.value: counters["h3_fused"][kind.value] for kind in SiteKind}
            refused = counters["h3_fused"]["refused"]
    print(f"h3_fused ({args.policy}) fused: {fused}; refused {refused}")
    if device == "cpu":
        print("on the CPU the sites' backward runs as eager torch operations (no fused kernel): slower than Inductor")
    print("step | " + " | ".join(f"loss {v:>8s}" for v in VARIANTS) + " | "
          + " | ".join(f"s {v:>8s}" for v in VARIANTS))
    for i, rows in enumerate(zip(*logs.values())):
        print(f"{i:4d} | " + " | ".join(f"{loss:13.5f}" for loss, _ in rows) + " | "
              + " | ".join(f"{s:10.3f}" for _, s in rows))


if __name__ == "__main__":
    main()
