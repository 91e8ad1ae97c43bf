"""EAGLE-3 drafter: public layouts, draft forward parity, bad drafters. Lossless decoding with
drafters of both layouts: tests/test_tree_engine.py and tests/test_engine.py; with proposals forced
by hand: tests/test_engine_tiny.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig
from eagle3_jax.model import eagle3
from eagle3_jax.model.llama import KVCache
from eagle3_jax.presets import EAGLE3_8B, EAGLE3_70B
from eagle3_jax.weights.eagle3 import CheckpointError, load_drafter, public_shapes
from eagle3_jax.weights.tensors import write

# docs/EAGLE3.md, "Drafter checkpoints" (PyTorch [out, in] layout).
SHAPES_8B = {
    "fc.weight": (4096, 12288), "midlayer.self_attn.q_proj.weight": (4096, 8192),
    "midlayer.self_attn.k_proj.weight": (1024, 8192), "midlayer.self_attn.v_proj.weight": (1024, 8192),
    "midlayer.self_attn.o_proj.weight": (4096, 4096), "midlayer.mlp.gate_proj.weight": (14336, 4096),
    "midlayer.mlp.up_proj.weight": (14336, 4096), "midlayer.mlp.down_proj.weight": (4096, 14336),
    "midlayer.hidden_norm.weight": (4096,), "midlayer.input_layernorm.weight": (4096,),
    "midlayer.post_attention_layernorm.weight": (4096,), "norm.weight": (4096,),
    "lm_head.weight": (32000, 4096), "d2t": (32000,),
}
TINY_TARGET = ModelConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_layers=6, num_heads=4,
                          num_kv_heads=2, head_dim=6, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                          max_position_embeddings=128, tie_word_embeddings=False)


def tiny_draft_config(hidden=24, target_hidden=24, vocab=64, draft_vocab=32) -> dict:
    return {"hidden_size": hidden, "intermediate_size": 40, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 6, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab,
            "draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden, "max_position_embeddings": 16}


def write_public_drafter(path, config: dict, own_embedding=False, seed=0, fmt="safetensors"):
    """Random weights under the exact public names and dtypes (fp16, int64 d2t, bool t2d)."""
    cfg = DraftConfig.from_hf(config)
    rng = np.random.default_rng(seed)
    tensors = {name: (rng.standard_normal(shape) * (0.3 if len(shape) == 2 else 0.1) + (len(shape) == 1))
               .astype(np.float16) for name, shape in public_shapes(cfg, own_embedding).items() if name != "d2t"}
    used = np.sort(rng.choice(cfg.vocab_size, cfg.draft_vocab_size, replace=False))
    tensors["d2t"] = (used - np.arange(cfg.draft_vocab_size)).astype(np.int64)
    tensors["t2d"] = np.isin(np.arange(cfg.vocab_size), used)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        write(tensors, path / "model.safetensors")
    else:
        import torch

        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, path / "pytorch_model.bin")
    return tensors


def test_full_size_layouts_through_eval_shape():
    for config, own_embedding in ((EAGLE3_8B, False), (EAGLE3_70B, True)):
        cfg = DraftConfig.from_hf(config)
        expected = dict(SHAPES_8B)
        if own_embedding:  # 70B: fc reads 3 x 8192, its own 6144-wide embedding
            h = 6144
            expected.update({"fc.weight": (h, 3 * 8192), "midlayer.self_attn.q_proj.weight": (h, 2 * h),
                             "midlayer.self_attn.k_proj.weight": (1024, 2 * h),
                             "midlayer.self_attn.v_proj.weight": (1024, 2 * h),
                             "midlayer.self_attn.o_proj.weight": (h, h), "midlayer.mlp.gate_proj.weight": (16384, h),
                             "midlayer.mlp.up_proj.weight": (16384, h), "midlayer.mlp.down_proj.weight": (h, 16384),
                             "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
                             "midlayer.post_attention_layernorm.weight": (h,), "norm.weight": (h,),
                             "lm_head.weight": (32000, h), "embed_tokens.weight": (128256, h)})
        assert public_shapes(cfg, own_embedding) == expected
        shapes = jax.eval_shape(lambda k, c=cfg, own=own_embedding: eagle3.init_draft_params(c, k, own_embedding=own),
                                jax.random.PRNGKey(0))
        # Our [in, out] parameters are the transposes of the public [out, in] tensors; q/k/v fused
        # as [2H, kv groups, q heads per group + 2, hd], gate/up as [H, 2, I].
        assert shapes.fc.shape == expected["fc.weight"][::-1]
        assert shapes.wqkv.shape == ((2 * 6144, 8, 6 + 2, 128) if own_embedding else (2 * 4096, 8, 4 + 2, 128))
        assert shapes.w_gate_up.shape == ((6144, 2, 16384) if own_embedding else (4096, 2, 14336))
        assert shapes.lm_head.shape == expected["lm_head.weight"][::-1]
        assert (shapes.embed is None) == (not own_embedding)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_public_layouts_load(tmp_path, fmt):
    plain = write_public_drafter(tmp_path / "8b", tiny_draft_config(), fmt=fmt)
    cfg, params = load_drafter(tmp_path / "8b", TINY_TARGET, jnp.float32)
    assert params.embed is None and cfg.draft_vocab_size == 32
    np.testing.assert_array_equal(params.fc, plain["fc.weight"].astype(np.float32).T)
    np.testing.assert_array_equal(params.d2t, plain["d2t"])
    # 70B layout: narrower drafter over a wider target, with its own embedding.
    wide_target = ModelConfig(**{**TINY_TARGET.__dict__, "hidden_size": 32, "capture_layer_ids": ()})
    write_public_drafter(tmp_path / "70b", tiny_draft_config(hidden=24, target_hidden=32), own_embedding=True, fmt=fmt)
    cfg, params = load_drafter(tmp_path / "70b", wide_target, jnp.float32)
    assert params.embed.shape == (64, 24) and params.fc.shape == (96, 24)


def test_bin_converts_to_safetensors(tmp_path):
    from eagle3_jax.weights.eagle3 import convert_bin_to_safetensors

    write_public_drafter(tmp_path / "bin", tiny_draft_config(), fmt="bin")
    out = convert_bin_to_safetensors(tmp_path / "bin", tmp_path / "st")
    _, a = load_drafter(tmp_path / "bin", TINY_TARGET, jnp.float32)
    _, b = load_drafter(out, TINY_TARGET, jnp.float32)
    np.testing.assert_array_equal(a.wqkv, b.wqkv)


def test_save_load_round_trip_is_exact(tmp_path):
    """fp16 weights survive save (split into the public q/k/v, gate/up) -> load (fused) bit for bit."""
    from eagle3_jax.weights.eagle3 import save_drafter

    cfg = DraftConfig.from_hf(tiny_draft_config(hidden=24, target_hidden=32))
    params = eagle3.init_draft_params(cfg, jax.random.PRNGKey(3), jnp.float16, own_embedding=True)
    save_drafter(params, cfg, tmp_path)
    _, loaded = load_drafter(tmp_path, dtype=jnp.float16)
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def _np_rms(x, w, eps):
    return w * (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps))


def _np_rope(x, pos, theta):  # x [T, heads, hd], rotate-half layout
    hd = x.shape[-1]
    ang = pos[:, None] * (1.0 / theta ** (np.arange(0, hd, 2) / hd))[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def reference_draft_step(w, cfg, embed, tokens, h, pos, cache):
    """An independent NumPy EAGLE-3 midlayer on the public tensors: h [T, H] -> h [T, H]."""
    f = {k: v.astype(np.float64) for k, v in w.items() if v.dtype != np.bool_}
    e = embed[tokens]
    x = np.concatenate([_np_rms(e, f["midlayer.input_layernorm.weight"], cfg.rms_norm_eps),
                        _np_rms(h, f["midlayer.hidden_norm.weight"], cfg.rms_norm_eps)], -1)
    t, hd, nh, nkv = len(tokens), cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q = _np_rope((x @ f["midlayer.self_attn.q_proj.weight"].T).reshape(t, nh, hd), pos, cfg.rope_theta)
    k = _np_rope((x @ f["midlayer.self_attn.k_proj.weight"].T).reshape(t, nkv, hd), pos, cfg.rope_theta)
    v = (x @ f["midlayer.self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
    cache["k"] = np.concatenate([cache["k"], k]) if "k" in cache else k
    cache["v"] = np.concatenate([cache["v"], v]) if "v" in cache else v
    cache["pos"] = np.concatenate([cache["pos"], pos]) if "pos" in cache else pos
    out = np.zeros((t, nh, hd))
    for i in range(t):
        for head in range(nh):
            kv = head // (nh // nkv)
            s = cache["k"][:, kv] @ q[i, head] / np.sqrt(hd)
            s = np.where(cache["pos"] <= pos[i], s, -np.inf)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ cache["v"][:, kv]
    h = h + out.reshape(t, nh * hd) @ f["midlayer.self_attn.o_proj.weight"].T
    m = _np_rms(h, f["midlayer.post_attention_layernorm.weight"], cfg.rms_norm_eps)
    gate, up = m @ f["midlayer.mlp.gate_proj.weight"].T, m @ f["midlayer.mlp.up_proj.weight"].T
    return h + (gate / (1 + np.exp(-gate)) * up) @ f["midlayer.mlp.down_proj.weight"].T


def test_draft_forward_matches_numpy_reference(tmp_path):
    w = write_public_drafter(tmp_path, tiny_draft_config(hidden=24, target_hidden=32), own_embedding=True, seed=3)
    cfg, params = load_drafter(tmp_path, dtype=jnp.float32)
    rng = np.random.default_rng(1)
    t = 7
    tokens, captures = rng.integers(0, 64, t), rng.standard_normal((t, 3 * 32))
    embed = w["embed_tokens.weight"].astype(np.float64)
    # Paged cache: 2 pages of 8 positions for the one row, page 0 is scratch.
    cache = KVCache.zeros(1, 3, 8, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    table = jnp.array([[1, 2]])
    step = jax.jit(eagle3.draft_forward, static_argnames="cfg")

    # First step: fc over the captures, positions 0..t-1.
    ref_cache = {}
    ref_h = reference_draft_step(w, cfg, embed, tokens, captures @ w["fc.weight"].astype(np.float64).T,
                                 np.arange(t), ref_cache)
    h0 = eagle3.fuse_captures(params, jnp.asarray(captures, jnp.float32)[None])
    h, cache = step(params, cfg, params.embed, jnp.asarray(tokens)[None], h0, jnp.arange(t)[None], cache, table)
    np.testing.assert_allclose(np.asarray(h)[0], ref_h, rtol=1e-5, atol=1e-5 * np.abs(ref_h).max())

    # Logits over the draft vocabulary and the d2t offsets to target ids.
    logits = np.asarray(eagle3.draft_logits(params, cfg, h))[0]
    ref_norm = _np_rms(ref_h, w["norm.weight"].astype(np.float64), cfg.rms_norm_eps)
    ref_logits = ref_norm @ w["lm_head.weight"].astype(np.float64).T
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5 * np.abs(ref_logits).max())
    draft_ids = ref_logits.argmax(-1)
    np.testing.assert_array_equal(
        np.asarray(eagle3.to_target_ids(params, jnp.asarray(draft_ids))), draft_ids + w["d2t"][draft_ids]
    )
    assert np.all(w["t2d"][draft_ids + w["d2t"][draft_ids]])

    # Two chain steps: our own pre-norm hidden fed back, one position further each time.
    prev, ref_prev = h[:, -1:], ref_h[-1:]
    for j in range(2):
        token = int(draft_ids[-1]) + j
        ref_prev = reference_draft_step(w, cfg, embed, np.array([token]), ref_prev, np.array([t + j]), ref_cache)
        prev, cache = step(params, cfg, params.embed, jnp.array([[token]]), prev, jnp.array([[t + j]]), cache, table)
        np.testing.assert_allclose(np.asarray(prev)[0], ref_prev, rtol=1e-5, atol=1e-5 * np.abs(ref_prev).max())


@pytest.mark.parametrize(
    "change, own_embedding, message",
    [
        ({"vocab_size": 65}, False, "vocab_size 65"),
        ({"target_hidden_size": 32}, False, "target_hidden_size 32"),
        ({"hidden_size": 20, "head_dim": 5}, False, "no embed_tokens"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}}, False, "capture layer 9"),
    ],
)
def test_drafters_that_do_not_fit_the_target(tmp_path, change, own_embedding, message):
    config = {**tiny_draft_config(vocab=64), **change}
    write_public_drafter(tmp_path, config, own_embedding=own_embedding)
    with pytest.raises(ConfigError, match=message):
        load_drafter(tmp_path, TINY_TARGET, jnp.float32)


def test_bad_d2t_capture_count_and_missing_tensors(tmp_path):
    from safetensors.numpy import load_file

    write_public_drafter(tmp_path, tiny_draft_config())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    good_fc = tensors["fc.weight"]
    tensors["fc.weight"] = good_fc[:, : 2 * 24]  # fc over 2 captures where the config says 3
    write(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"fc.weight' has shape \(24, 48\), expected \(24, 72\)"):
        load_drafter(tmp_path, TINY_TARGET, jnp.float32)
    tensors["fc.weight"] = good_fc
    tensors["d2t"][5] = 1000
    write(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="d2t maps draft id 5 to target id"):
        load_drafter(tmp_path, TINY_TARGET, jnp.float32)
    del tensors["midlayer.hidden_norm.weight"]
    write(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*midlayer\.hidden_norm\.weight"):
        load_drafter(tmp_path, TINY_TARGET, jnp.float32)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or pytorch_model\.bin"):
        load_drafter(tmp_path, TINY_TARGET, jnp.float32)
