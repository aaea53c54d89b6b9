"""diffusers' DiTs compiled with h3_fused: what fuses, and how close to eager it computes.

    python examples/dit_family.py                      # every model, tiny, on the CPU (on a GPU: real dims, 2 blocks)
    python examples/dit_family.py flux wan --policy fp32 --regional

Builds each model of diffusers 0.42 named below with random weights in bf16 (the modules of
``_keep_in_fp32_modules`` fp32, as ``from_pretrained(torch_dtype=torch.bfloat16)`` loads them), from a tiny config
on the CPU or, on a GPU, at the released model's dims with 2 blocks and a few thousand tokens; runs one forward
eagerly and compiled with ``backend="h3_fused"`` (whole model, or by repeated blocks: diffusers'
``compile_repeated_blocks`` where the model names its blocks, else ``h3_fused.compile_repeated_blocks``); prints the
sites fused per op, the candidates refused with their reasons, and the share of output elements bit-identical to
eager's with the largest difference (``bf16`` keeps eager's roundings; ``fp32`` does not, by design).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable

import diffusers
import h3_fused
import torch
from h3_fused import find_repeated_block_classes
from h3_fused.patterns import SiteKind
from torch._dynamo.utils import counters

bf16 = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Family:
    """A diffusers DiT: its class, a tiny and a real-size config (2 blocks), and one forward's inputs for a
    config at a token count (``inputs(config, tokens, device)``)."""

    cls: str
    tiny: dict
    real: dict
    inputs: Callable
    tokens: tuple[int, int]  # tiny, real

    def build(self, device: str, real: bool, seed: int = 0) -> torch.nn.Module:
        """Random weights in the checkpoint's precision, for inference."""
        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(diffusers, self.cls)(**(self.real if real else self.tiny))
        keep = getattr(model, "_keep_in_fp32_modules", None) or []
        if not keep:  # torch's own `to` (diffusers' warns about an empty list)
            return torch.nn.Module.to(model, bf16).eval()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            tensor.data = tensor.data.to(torch.float32 if any(k in name for k in keep) else bf16)
        return model.eval()

    def example(self, device: str, real: bool, seed: int = 0) -> tuple[torch.nn.Module, dict]:
        model = self.build(device, real, seed)
        config = dict(model.config)  # the class's defaults under the config's overrides
        g = torch.Generator().manual_seed(seed)
        inputs = self.inputs(config, self.tokens[real], g)
        return model, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _randn(g, *shape):
    return torch.randn(*shape, generator=g).to(bf16)


def _side(tokens: int) -> int:
    side = int(tokens ** 0.5)
    return side - side % 2


def _flux_inputs(c, tokens, g):
    side = _side(tokens)
    text = 8 if c["joint_attention_dim"] < 64 else 512
    return dict(hidden_states=_randn(g, 2, side * side, c["in_channels"]),
                encoder_hidden_states=_randn(g, 2, text, c["joint_attention_dim"]),
                pooled_projections=_randn(g, 2, c["pooled_projection_dim"]), timestep=torch.tensor([0.5, 0.7]),
                img_ids=torch.randn(side * side, 3, generator=g), txt_ids=torch.zeros(text, 3), return_dict=False)


def _wan_inputs(c, tokens, g, per_token=False):
    frames, side = 2, _side(tokens // 2) * 2  # patches of 2 x 2: tokens = frames * (side / 2)^2
    patches = frames * (side // 2) ** 2
    timestep = torch.tensor([[500] * patches, [700] * patches]) if per_token else torch.tensor([500, 700])
    return dict(hidden_states=_randn(g, 2, c["in_channels"], frames, side, side), timestep=timestep,
                encoder_hidden_states=_randn(g, 2, 8, c["text_dim"]), return_dict=False)


def _hunyuan_inputs(c, tokens, g):
    side = _side(tokens // 2)
    return dict(hidden_states=_randn(g, 2, c["in_channels"], 2, side, side), timestep=torch.tensor([500, 700]),
                encoder_hidden_states=_randn(g, 2, 8, c["text_embed_dim"]), encoder_attention_mask=torch.ones(2, 8),
                pooled_projections=_randn(g, 2, c["pooled_projection_dim"]), guidance=torch.tensor([3000.0, 3000.0]),
                return_dict=False)


def _qwen_inputs(c, tokens, g):
    """The image's tokens; with ``zero_cond_t`` (Qwen-Image-Edit) half of them the target, half a condition image,
    which the blocks modulate with the rows of timestep 0."""
    images = 2 if c["zero_cond_t"] else 1
    side = _side(tokens // images)
    return dict(hidden_states=_randn(g, 2, images * side * side // 4, c["in_channels"]),
                encoder_hidden_states=_randn(g, 2, 7, c["joint_attention_dim"]),
                encoder_hidden_states_mask=torch.ones(2, 7), timestep=torch.tensor([0.5, 0.7]),
                img_shapes=[[(1, side // 2, side // 2)] * images] * 2, return_dict=False)


def _ltx_inputs(c, tokens, g, per_token=False):
    side = _side(tokens // 2)
    patches = 2 * side * side  # patches of 1 x 1 x 1
    timestep = torch.tensor([[500] * patches, [700] * patches]) if per_token else torch.tensor([500, 700])
    return dict(hidden_states=_randn(g, 2, patches, c["in_channels"]),
                encoder_hidden_states=_randn(g, 2, 8, c["caption_channels"]), timestep=timestep,
                encoder_attention_mask=torch.ones(2, 8), num_frames=2, height=side, width=side, return_dict=False)


def _sd3_inputs(c, tokens, g):
    side = c["sample_size"]
    return dict(hidden_states=_randn(g, 2, c["in_channels"], side, side),
                encoder_hidden_states=_randn(g, 2, 8, c["joint_attention_dim"]),
                pooled_projections=_randn(g, 2, c["pooled_projection_dim"]), timestep=torch.tensor([500, 700]),
                return_dict=False)


MODELS = {
    "flux": Family(
        "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)),
        dict(in_channels=64, num_layers=1, num_single_layers=1), _flux_inputs, (64, 4096)),
    "wan": Family(
        "WanTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32),
        dict(num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16, ffn_dim=13824,
             num_layers=2), _wan_inputs, (32, 4096)),
    "wan_ti2v": Family(
        "WanTransformer3DModel",
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
             text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=32),
        dict(num_attention_heads=24, attention_head_dim=128, in_channels=48, out_channels=48, ffn_dim=14336,
             num_layers=2), lambda c, t, g: _wan_inputs(c, t, g, per_token=True), (32, 4096)),
    "hunyuan_video": Family(
        "HunyuanVideoTransformer3DModel",
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
             num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=32,
             pooled_projection_dim=16, rope_axes_dim=(4, 6, 6)),
        dict(num_layers=1, num_single_layers=1, num_refiner_layers=1), _hunyuan_inputs, (64, 4096)),
    "qwen_image": Family(
        "QwenImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=16, axes_dims_rope=(4, 6, 6)),
        dict(num_layers=2), _qwen_inputs, (64, 16384)),
    "qwen_image_edit": Family(
        "QwenImageTransformer2DModel",
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=16, axes_dims_rope=(4, 6, 6), zero_cond_t=True),
        dict(num_layers=2, zero_cond_t=True), _qwen_inputs, (128, 16384)),
    "ltx_video": Family(
        "LTXVideoTransformer3DModel",
        dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
             num_layers=2, caption_channels=16),
        dict(num_layers=2), _ltx_inputs, (32, 4096)),
    "ltx_video_per_token": Family(  # a timestep per token (as LTX-Video's conditioning frames take theirs)
        "LTXVideoTransformer3DModel",
        dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
             num_layers=2, caption_channels=16),
        dict(num_layers=2), lambda c, t, g: _ltx_inputs(c, t, g, per_token=True), (32, 4096)),
    "sd3": Family(
        "SD3Transformer2DModel",
        dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
             pos_embed_max_size=16),
        dict(sample_size=128, num_layers=2, attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
             caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192), _sd3_inputs, (16, 4096)),
    "sd3_5": Family(  # SD3.5's dual-attention blocks: one norm output modulated twice; q/k RMSNorms
        "SD3Transformer2DModel",
        dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
             pos_embed_max_size=16, dual_attention_layers=(0, 1), qk_norm="rms_norm"),
        dict(sample_size=128, num_layers=2, attention_head_dim=64, num_attention_heads=38, joint_attention_dim=4096,
             caption_projection_dim=2432, pooled_projection_dim=2048, pos_embed_max_size=192, dual_attention_layers=(0, 1),
             qk_norm="rms_norm"), _sd3_inputs, (16, 4096)),
}


def compile_regionally(model: torch.nn.Module, options: dict, backend: str = "h3_fused") -> None:
    """diffusers' ``compile_repeated_blocks`` where the model names its blocks, else h3_fused's (another
    ``backend``: each instance of the repeated block classes compiled, as diffusers does it)."""
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(backend=backend, options=options)
    elif backend == "h3_fused":
        h3_fused.compile_repeated_blocks(model, options=options)
    else:
        classes = tuple(find_repeated_block_classes(model))
        for block in [m for m in model.modules() if isinstance(m, classes)]:
            block.compile(backend=backend, options=options)


def compare(name: str, device: str, real: bool, policy: str, regional: bool) -> dict:
    """One forward of ``name``, eager and compiled: the counters of the compile, its refusals and the agreement."""
    torch._dynamo.reset()
    counters.clear()
    refusals = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = lambda record: refusals.append(record.getMessage()) if "not fused" in record.getMessage() else None
    logger = logging.getLogger("h3_fused")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        model, inputs = MODELS[name].example(device, real)
        options = {"dtype_policy": policy}
        with torch.no_grad():
            expected = model(**inputs)[0]
            if regional:
                compile_regionally(model, options)
                got = model(**inputs)[0]
            else:
                got = torch.compile(model, backend="h3_fused", options=options)(**inputs)[0]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    made = counters["h3_fused"]
    return dict(sites={kind.value: made[kind.value] for kind in SiteKind},
                norms={kind: made[f"eager_{kind}_norm"] for kind in ("rms", "layer")}, refused=made["refused"], reasons=refusals, equal=torch.equal(got, expected),
                same=(got == expected).float().mean().item(), max_diff=(got.float() - expected.float()).abs().max().item())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", choices=[[], *MODELS], metavar="MODEL",
                        help=f"which models (default: all of {', '.join(MODELS)})")
    parser.add_argument("--policy", default="bf16", choices=["bf16", "fp32"], help="h3_fused's dtype policy")
    parser.add_argument("--regional", action="store_true", help="compile the repeated blocks instead of the model")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"{'real dims, 2 blocks' if device == 'cuda' else 'tiny configs'} on {device} (torch {torch.__version__}), "
          f"{'regional' if args.regional else 'whole-model'} compile, policy {args.policy}")
    for name in args.models or MODELS:
        r = compare(name, device, device == "cuda", args.policy, args.regional)
        sites = ", ".join(f"{op} {n}" for op, n in r["sites"].items() if n) or "none"
        norms = ", ".join(f"{kind} {n}" for kind, n in r["norms"].items() if n) or "none"
        print(f"{name:14s} sites fused: {sites}; other norms as eager computes them: {norms}; refused {r['refused']}; "
              f"bit-identical {100 * r['same']:7.3f}%, max|diff| {r['max_diff']:.3e}")
        for reason in dict.fromkeys(r["reasons"]):
            print(f"    {reason}")


if __name__ == "__main__":
    main()
