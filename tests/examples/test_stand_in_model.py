"""The stand-in H3 model: structure, index construction, checkpoints, spellings, determinism."""

import dataclasses

import pytest
import torch
from helpers import PUBLIC_SPELLINGS
from minimax_h3 import (
    CheckpointError,
    H3Config,
    H3Model,
    NativeRMSNorm,
    build_table_index,
    example_inputs,
    init_weights,
    load_checkpoint,
    save_checkpoint,
)

TINY = H3Config.tiny()


def tiny_model(seed=0, **overrides):
    return init_weights(H3Model(dataclasses.replace(TINY, **overrides)), seed=seed)


def test_layer_shapes_and_dtypes():
    model = tiny_model()
    latents, layout = example_inputs(TINY, 64)
    t_emb = model.time_embed(layout.timesteps)
    assert t_emb.dtype == torch.float32 and t_emb.shape == (layout.timesteps.numel(), TINY.time_embed_dim)
    tables = model.adaln_proj(t_emb)
    assert len(tables) == 6
    for t in tables:
        assert t.shape == (3 * layout.timesteps.numel(), TINY.hidden_size) and t.dtype == torch.bfloat16
    x = model.patch_embed(latents.to(torch.bfloat16))
    assert x.shape == (64, TINY.hidden_size) and x.dtype == torch.bfloat16
    y = model.blocks[0](x, tables, layout.index, layout.positions, layout.cu_seqlens)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    out = model(latents, layout)
    assert out.shape == latents.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_tables_are_strided_views_of_one_buffer():
    model = tiny_model()
    _, layout = example_inputs(TINY, 32)
    tables = model.adaln_proj(model.time_embed(layout.timesteps))
    base = tables[0]
    for i, t in enumerate(tables):
        assert t.stride() == (6 * TINY.hidden_size, 1)
        assert not t.is_contiguous()
        assert t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        assert t.storage_offset() == i * TINY.hidden_size


def test_index_mixed_modalities_and_padding():
    timesteps = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.75, 0.75, 0.75, 0.5])
    modality = torch.tensor([0, 1, 1, 0, 2, -1, 0, -1])
    unique, index = build_table_index(timesteps, modality)
    assert unique.tolist() == [0.0, 0.5, 0.75]
    # inverse: [1,1,0,0,2,2,2,1]; pad (-1) uses the video row of its timestep
    assert index.tolist() == [3, 4, 1, 0, 8, 6, 6, 3]
    assert index.dtype == torch.int64
    assert build_table_index(timesteps, modality, dtype=torch.int32)[1].dtype == torch.int32
    with pytest.raises(ValueError, match="modality"):
        build_table_index(timesteps, torch.full_like(modality, 3))
    with pytest.raises(ValueError, match="differ"):
        build_table_index(timesteps, modality[:3])


def test_checkpoint_round_trip(tmp_path):
    a, b = tiny_model(seed=1), tiny_model(seed=2)
    path = tmp_path / "h3.safetensors"
    save_checkpoint(a, path)
    from safetensors.torch import load_file

    assert "blocks.0.norm1.weight" in load_file(str(path))
    load_checkpoint(b, path)
    latents, layout = example_inputs(TINY, 48)
    assert torch.equal(a(latents, layout), b(latents, layout))


def test_bad_checkpoints_name_the_keys(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    missing = dict(state)
    del missing["blocks.1.norm2.weight"]
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: blocks\.1\.norm2\.weight"):
        load_checkpoint(model, tmp_path / "missing.safetensors")
    shaped = dict(state, **{"blocks.0.attn.qkv.weight": torch.zeros(3, 3, dtype=torch.bfloat16)})
    save_file(shaped, str(tmp_path / "shape.safetensors"))
    with pytest.raises(CheckpointError, match=r"blocks\.0\.attn\.qkv\.weight: checkpoint \(3, 3\)"):
        load_checkpoint(model, tmp_path / "shape.safetensors")
    extra = dict(state, **{"blocks.9.norm1.weight": torch.ones(4)})
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected keys: blocks\.9\.norm1\.weight"):
        load_checkpoint(model, tmp_path / "extra.safetensors")
    load_checkpoint(model, tmp_path / "extra.safetensors", strict=False)




@pytest.mark.parametrize("spell", PUBLIC_SPELLINGS, ids=repr)
def test_every_spelling_computes_the_same_model(spell):
    reference = tiny_model()
    variant = tiny_model(spellings=spell)
    variant.load_state_dict(reference.state_dict())
    latents, layout = example_inputs(TINY, 64)
    v_latents, v_layout = example_inputs(variant.cfg, 64)
    assert torch.equal(v_latents.reshape(latents.shape), latents)
    expected = reference(latents, layout)
    got = variant(v_latents, v_layout).reshape(expected.shape)
    # Only the rounding points differ: a few bf16 ulps at the output.
    assert (got - expected).abs().max() <= 0.05 * expected.abs().max()
    assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.999


def test_native_rmsnorm_rounds_before_the_weight():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    norm = NativeRMSNorm(64, 1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x32 = x.float()
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(norm(x), (x32 * r).to(torch.bfloat16) * norm.weight)


def test_fixed_seed_is_deterministic():
    latents, layout = example_inputs(TINY, 64, seed=3)
    latents2, layout2 = example_inputs(TINY, 64, seed=3)
    assert torch.equal(latents, latents2) and torch.equal(layout.index, layout2.index)
    assert torch.equal(tiny_model(seed=5)(latents, layout), tiny_model(seed=5)(latents2, layout2))


def test_attention_island_and_inline_agree():
    island, inline = tiny_model(), tiny_model(inline_attention=True)
    latents, layout = example_inputs(TINY, 64)
    torch.testing.assert_close(island(latents, layout), inline(latents, layout), rtol=2e-2, atol=2e-2)


def test_real_config_on_meta_has_the_published_parameter_count():
    cfg = H3Config.real()
    with torch.device("meta"):
        model = H3Model(cfg, device="meta")
    H, I, F, C, E = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, cfg.in_channels, cfg.time_embed_dim
    per_block = 2 * H + (H * 3 * I + 3 * I) + 2 * cfg.head_dim + (I * H + H) + (H * 2 * F + 2 * F) + (F * H + H)
    expected = (
        (C * H + H)
        + (cfg.time_freq_dim * cfg.time_hidden_dim + cfg.time_hidden_dim + cfg.time_hidden_dim * E + E)
        + (E * 18 * H + 18 * H)
        + (cfg.num_blocks + cfg.num_refiner_blocks) * per_block
        + (H + E * 2 * H + 2 * H + H * C + C)
    )
    assert sum(p.numel() for p in model.parameters()) == expected
    assert len(model.blocks) == 50 and len(model.refiner_blocks) == 2
    assert model.blocks[0].attn.qkv.weight.shape == (3 * 7168, 5376)
    assert model.blocks[0].mlp.fc1.weight.shape == (2 * 14336, 5376)
    assert model.adaln_proj.linear.weight.shape == (18 * 5376, 2688)


def test_euler_sampler_integrates_the_flow_deterministically():
    from minimax_h3 import TokenLayout, euler_sample

    model = tiny_model()
    noise, layout = example_inputs(TINY, 48, seed=1)
    video = layout.index % 3 != 1
    modality = layout.index % 3

    def layout_at(sigma):
        per_token = torch.where(video, torch.tensor(sigma), torch.tensor(0.0))
        return TokenLayout.build(per_token, modality, layout.positions, layout.cu_seqlens)

    seen = []
    with torch.no_grad():
        out = euler_sample(model, noise, layout_at, steps=4, on_step=lambda i, x: seen.append((i, x.clone())))
        again = euler_sample(model, noise, layout_at, steps=4)
        # one step by hand: x1 = x0 + (sigma1 - sigma0) * v(x0, sigma0)
        first = noise + (0.75 - 1.0) * model(noise, layout_at(1.0))
    assert [i for i, _ in seen] == [0, 1, 2, 3] and torch.equal(seen[-1][1], out)
    assert torch.equal(out, again) and out.dtype == torch.float32 and out.shape == noise.shape
    assert torch.equal(seen[0][1], first)
    with pytest.raises(ValueError, match="steps"):
        euler_sample(model, noise, layout_at, steps=0)
