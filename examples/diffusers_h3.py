"""diffusers' MiniMax-H3 transformer compiled with h3_fused: a few flow-matching steps, against eager.

    python examples/diffusers_h3.py                         # tiny model on the CPU; real dims, 2 blocks, on a GPU
    python examples/diffusers_h3.py --regional --policy fp32

Builds ``diffusers.MiniMaxH3Transformer3DModel`` with random weights in the checkpoint's mixed precision
(bf16, the modules of ``_keep_in_fp32_modules`` fp32, as ``from_pretrained(torch_dtype=torch.bfloat16)``
loads it), packs one request (text, video and audio rows in one sequence; the text rows clean, the others at
the step's noise level) for a batch of two samples, and runs ``FlowMatchEulerDiscreteScheduler`` steps
eagerly and compiled with ``backend="h3_fused"`` (whole model, or diffusers' ``compile_repeated_blocks``).
Prints the sites fused, and the share of the final latents bit-identical to eager's with the largest
difference (``bf16`` keeps eager's roundings; ``fp32`` does not, by design).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import h3_fused  # noqa: F401  registers the "h3_fused" backend
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, MiniMaxH3Transformer3DModel
from torch._dynamo.utils import counters
from tqdm import tqdm

TINY = dict(num_attention_heads=2, attention_head_dim=32, hidden_size=64, num_layers=2, num_refiner_layers=2,
            ffn_dim=128, in_channels=4, audio_in_channels=8, text_dim=48, freq_dim=32, time_embed_hidden_dim=64,
            time_embed_dim=32, rope_freq_dim=4)
REAL_DIMS_FEW_BLOCKS = dict(num_layers=2, num_refiner_layers=1)  # the checkpoint's dims, 2 of its 50 blocks


def checkpoint_precision(model: MiniMaxH3Transformer3DModel) -> MiniMaxH3Transformer3DModel:
    """``model`` in bf16 but for the parameters and buffers whose names hold an entry of
    ``_keep_in_fp32_modules`` (the patch projections, the timestep MLP, the output heads, the rotary buffer),
    which stay fp32: what ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads."""
    keep = model._keep_in_fp32_modules
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor.data = tensor.data.to(torch.float32 if any(k in name for k in keep) else torch.bfloat16)
    return model


def build_model(device: str, config: dict | None = None, seed: int = 0) -> MiniMaxH3Transformer3DModel:
    """Random weights (diffusers' initialisation, seeded) in the checkpoint's precision, for inference."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = MiniMaxH3Transformer3DModel(**(config if config is not None else TINY))
    return checkpoint_precision(model).eval()


@dataclasses.dataclass
class Request:
    """One packed sequence: which rows hold text, video and audio, their positions and the conditioning."""

    text: torch.Tensor  # [B, text rows, text_dim]
    text_indices: torch.Tensor
    video_indices: torch.Tensor
    audio_indices: torch.Tensor
    token_tags: torch.Tensor  # per row: 0 video, 1 text, 2 audio
    timestep_indices: torch.Tensor  # per row: 0 the step's noise level, 1 clean (the text)
    position_ids: torch.Tensor  # [rows, 3]

    def model_inputs(self, video, audio, sigma) -> dict:
        timestep = torch.stack([sigma.to(video.device), torch.zeros((), device=video.device)]).float()
        return dict(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=self.text,
                    timestep=timestep, timestep_indices=self.timestep_indices, token_tags=self.token_tags,
                    position_ids=self.position_ids, video_indices=self.video_indices,
                    audio_indices=self.audio_indices, text_indices=self.text_indices)


def make_request(model, video_rows: int, audio_rows: int, text_rows: int, batch: int = 2, seed: int = 0,
                 device: str = "cpu") -> tuple[Request, torch.Tensor, torch.Tensor]:
    """A request with rows of each modality interleaved at random, and its initial noise ``(video, audio)``."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    rows = text_rows + video_rows + audio_rows
    order = torch.randperm(rows, generator=g)
    text_idx, video_idx, audio_idx = (order[:text_rows].sort().values, order[text_rows:text_rows + video_rows].sort().values,
                                      order[text_rows + video_rows:].sort().values)
    tags = torch.zeros(rows, dtype=torch.long)
    tags[text_idx], tags[audio_idx] = 1, 2
    patch = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    request = Request(text=torch.randn(batch, text_rows, cfg.text_dim, generator=g), text_indices=text_idx,
                      video_indices=video_idx, audio_indices=audio_idx, token_tags=tags,
                      timestep_indices=(tags == 1).long(), position_ids=torch.randint(0, 16, (rows, 3), generator=g))
    request = Request(**{k: v.to(device) for k, v in dataclasses.asdict(request).items()})
    noise = (torch.randn(batch, video_rows, patch, generator=g).to(device),
             torch.randn(batch, audio_rows, cfg.audio_in_channels, generator=g).to(device))
    return request, *noise


def sample(model, request: Request, video, audio, steps: int, desc: str):
    """``steps`` Euler steps of the flow-matching scheduler; the final ``(video, audio)`` latents."""
    schedulers = FlowMatchEulerDiscreteScheduler(), FlowMatchEulerDiscreteScheduler()
    for s in schedulers:
        s.set_timesteps(steps)
    with torch.no_grad():
        for i, t in enumerate(tqdm(schedulers[0].timesteps, desc=desc, leave=False)):
            out = model(**request.model_inputs(video, audio, schedulers[0].sigmas[i]))
            video = schedulers[0].step(out.sample, t, video).prev_sample
            audio = schedulers[1].step(out.audio_sample, t, audio).prev_sample
    return video, audio


def agreement(got: torch.Tensor, expected: torch.Tensor) -> str:
    same = (got == expected).float().mean().item()
    return f"{100 * same:7.3f}% bit-identical, max|diff| {(got - expected).abs().max().item():.3e}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32", "auto"])
    parser.add_argument("--regional", action="store_true", help="diffusers' compile_repeated_blocks")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(device, REAL_DIMS_FEW_BLOCKS if device == "cuda" else TINY)
    sizes = (3072, 512, 256) if device == "cuda" else (48, 12, 16)
    request, video, audio = make_request(model, *sizes, device=device)
    print(f"diffusers MiniMaxH3Transformer3DModel on {device}: {model.config.num_layers} blocks, "
          f"H = {model.config.hidden_size}, {sum(sizes)} rows, batch {video.shape[0]}")
    expected = sample(model, request, video, audio, args.steps, "eager")
    options = {"dtype_policy": args.policy}
    start = time.perf_counter()
    if args.regional:
        model.compile_repeated_blocks(backend="h3_fused", options=options)
    else:
        model = torch.compile(model, backend="h3_fused", options=options)
    got = sample(model, request, video, audio, args.steps, "h3_fused")
    print(f"compiled ({'regional' if args.regional else 'whole'}, {args.policy}) and sampled in "
          f"{time.perf_counter() - start:.1f} s; fused {dict(counters['h3_fused'])}")
    for name, g, e in zip(("video", "audio"), got, expected):
        print(f"{name}: {agreement(g, e)}")


if __name__ == "__main__":
    main()
