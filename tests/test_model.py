"""Foundation: the Llama target against transformers, configs, checkpoints and bad input."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.config import ConfigError, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.model.layers import rope_inv_freq
from eagle3_jax.presets import LLAMA31_8B, LLAMA33_70B
from eagle3_jax.weights.llama import load_llama, save_llama
from eagle3_jax.weights.tensors import CheckpointError, write

TINY = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128, "tie_word_embeddings": False}


def contiguous_forward(params, cfg, ids, length=128):
    """Whole-sequence forward of one row through the paged path, padded to `length` tokens so
    every prompt shares one executable (causal: the padding cannot change earlier positions)."""
    t, pages = len(ids), length // 16
    cache = llama.KVCache.zeros(cfg.num_layers, pages + 1, 16, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    padded = jnp.asarray([ids + [0] * (length - t)])
    hidden, captures, _ = _forward(params, cfg, padded, jnp.arange(length)[None], cache,
                                   jnp.arange(1, pages + 1)[None])
    return np.asarray(llama.logits(params, hidden))[0, :t], np.asarray(captures)[0, :t]


_forward = jax.jit(llama.forward, static_argnames="cfg")


@pytest.fixture(scope="module")
def smollm2_params(smollm2_dir):
    return load_llama(smollm2_dir, jnp.float32)


@pytest.mark.slow
def test_logits_parity_with_transformers(smollm2_params, hf_model, chat_ids):
    import torch

    cfg, params = smollm2_params
    for ids in chat_ids[:4]:
        ours, captures = contiguous_forward(params, cfg, ids)
        with torch.no_grad():
            out = hf_model(torch.tensor([ids]), output_hidden_states=True)
        ref = out.logits[0].numpy()
        rel = np.abs(ours - ref).max(-1) / np.abs(ref).max(-1)  # per position
        assert rel.max() <= 1e-4, rel.max()
        # Captures are the residual stream entering layers 2, L//2, L-3: HF's hidden_states[i].
        assert cfg.capture_layer_ids == (2, 15, 27)
        ref_caps = np.concatenate([out.hidden_states[i][0].numpy() for i in cfg.capture_layer_ids], -1)
        np.testing.assert_allclose(captures, ref_caps, rtol=1e-4, atol=1e-4 * np.abs(ref_caps).max())


def test_fused_projections_match_transformers_tiny_gqa():
    """A random transformers Llama with 3 q heads per kv head, loaded through the fused wqkv /
    w_gate_up: q head j sits at wqkv[:, j // 3, j % 3], logits match, and the HF tensors come back
    bit for bit. With the norm gains folded into the projections (as the engine serves them), the
    logits still match, from two argument buffers fewer per layer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_jax.weights.llama import params_from_hf, params_to_hf

    config = {**TINY, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 2,
              "num_hidden_layers": 2}
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"},
                                      initializer_range=0.2)).eval()
    with torch.no_grad():  # gains away from 1, so that folding them is tested
        for name, w in hf.named_parameters():
            if name.endswith("layernorm.weight"):
                w.uniform_(0.5, 1.5)
    tensors = {k: v.numpy() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_hf(config)
    params = params_from_hf(tensors, cfg, jnp.float32)

    hd, wqkv = cfg.head_dim, np.asarray(params.layers[1].wqkv)
    assert wqkv.shape == (48, 2, 3 + 2, hd)
    q, k, v = (tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    for j in range(6):  # HF q head j reads kv head j // 3
        np.testing.assert_array_equal(wqkv[:, j // 3, j % 3], q[j * hd:(j + 1) * hd].T)
    for g in range(2):
        np.testing.assert_array_equal(wqkv[:, g, 3], k[g * hd:(g + 1) * hd].T)
        np.testing.assert_array_equal(wqkv[:, g, 4], v[g * hd:(g + 1) * hd].T)
    gate_up = np.asarray(params.layers[1].w_gate_up)
    np.testing.assert_array_equal(gate_up[:, 0], tensors["model.layers.1.mlp.gate_proj.weight"].T)
    np.testing.assert_array_equal(gate_up[:, 1], tensors["model.layers.1.mlp.up_proj.weight"].T)

    ids = list(np.random.default_rng(0).integers(0, cfg.vocab_size, 20))
    ours, _ = contiguous_forward(params, cfg, ids, length=32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    folded = llama.fold_norm_gains(params)
    assert len(jax.tree.leaves(params)) - len(jax.tree.leaves(folded)) == 2 * cfg.num_layers
    folded_logits, _ = contiguous_forward(folded, cfg, ids, length=32)
    np.testing.assert_allclose(folded_logits, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())

    back = params_to_hf(params)
    assert set(back) == set(tensors)
    for name, x in tensors.items():
        np.testing.assert_array_equal(back[name], x, err_msg=name)


@pytest.mark.slow
def test_greedy_matches_transformers_generate(target_llm, hf_model, chat_ids):
    import torch

    from eagle3_jax import SamplingParams

    prompts = chat_ids[:8]
    ours = target_llm.generate(prompts, SamplingParams(max_tokens=24))
    # One left-padded batch (transformers derives the positions from the mask): a row that ends
    # early is padded with EOS after it, so each reference stops at its first EOS.
    width = max(map(len, prompts))
    ids = torch.tensor([[2] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        refs = hf_model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=2,
                                 pad_token_id=2)[:, width:].tolist()
    for out, ref in zip(ours, refs):
        ref = ref[:ref.index(2) + 1] if 2 in ref else ref
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == 2 else "length")


@pytest.mark.parametrize("b, t, g, r, hd, blocks, splits", [
    (2, 5, 3, 3, 64, 8, None),  # SmolLM2's verify of K+1 = 5 tokens (9 heads over 3 kv heads)
    (2, 5, 3, 3, 64, 8, 1),  # the same, each row's keys in one program
    (3, 1, 2, 4, 32, 6, 3),  # decode: one token, a table width that is not a power of two, 3 -> 2 splits
    (3, 1, 2, 2, 32, 16, 8),  # 4 splits, more than a short row's blocks: some programs see nothing
    (1, 4, 8, 4, 128, 16, None),  # Llama-3.1-8B's verify of 4 tokens (32 heads over 8 kv heads)
])
def test_pallas_attention_matches_the_xla_form(b, t, g, r, hd, blocks, splits):
    """The Pallas kernel (run by Pallas' interpreter here) against layers.paged_attention: the
    rows' pages scattered over the pool, each row at its own length (page boundaries included),
    a padded row that sees one position; the keys split between programs (some of them past a
    row's end) or not."""
    from eagle3_jax.model import layers, pallas_attention

    rng = np.random.default_rng(b * 100 + t)
    page, num_pages = 16, b * blocks + 3
    q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), jnp.float32)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, page, g, hd)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(num_pages)[:b * blocks].reshape(b, blocks), jnp.int32)
    starts = rng.integers(0, blocks * page - t, b)
    starts[0] = page - t // 2 - 1  # the new tokens straddle a page boundary
    if b > 1:
        starts[-1] = 0  # a padded row: positions 0..t-1
    positions = jnp.asarray(starts[:, None] + np.arange(t), jnp.int32)
    assert pallas_attention.supports(t, g * r, g, page)
    want = layers.paged_attention(q, k_pages, v_pages, positions, table)
    got = pallas_attention.paged_attention(q, k_pages, v_pages, positions, table, splits=splits)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("b, t, g, r, hd", [
    (2, 5, 3, 3, 64),  # SmolLM2's verify of K+1 = 5 tokens
    (3, 1, 2, 4, 32),  # decode
])
def test_pallas_attention_block_matches_the_xla_form(b, t, g, r, hd):
    """attention_block with the kernels (RoPE + KV write + q tiles in one, then attention) against
    the XLA form: the same output and the same pages, a row's tokens straddling a page boundary,
    a padded row whose tokens run past its table (they go to the scratch page, never to a real one).
    The cache holds two layers; the block works on layer 1 and leaves layer 0 as it was."""
    from eagle3_jax.model import layers

    rng = np.random.default_rng(t)
    page, blocks, d = 16, 4, 48
    num_pages = b * blocks + 1
    x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    wqkv = jnp.asarray(rng.standard_normal((d, g, r + 2, hd)) / np.sqrt(d), jnp.float32)
    wo = jnp.asarray(rng.standard_normal((g * r * hd, d)) / np.sqrt(g * r * hd), jnp.float32)
    norm_w = jnp.asarray(1 + 0.1 * rng.standard_normal(d), jnp.float32)
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((2, num_pages, page, g, hd)), jnp.float32) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, blocks), jnp.int32)
    starts = rng.integers(0, blocks * page - t, b)
    starts[0] = page - t // 2 - 1  # straddles a page boundary
    starts[-1] = blocks * page - 1  # the padded row: its tokens past the first run off the table
    positions = jnp.asarray(starts[:, None] + np.arange(t), jnp.int32)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    h = layers.rms_norm(x, norm_w, 1e-5)
    want = layers.attention_block(h, wqkv, wo, positions, k_pages, v_pages, 1, table, inv_freq=inv_freq,
                                  attention="xla")
    got = layers.attention_block(
        h, wqkv, wo, positions, k_pages, v_pages, 1, table, inv_freq=inv_freq, attention="pallas"
    )
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5, rtol=2e-5)
    for pages_got, pages_want, before in zip(got[1:], want[1:], (k_pages, v_pages)):
        # page 0 is scratch: padded writes collide there
        np.testing.assert_allclose(np.asarray(pages_got[1, 1:]), np.asarray(pages_want[1, 1:]), atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(pages_got[0]), np.asarray(before[0]))
        np.testing.assert_array_equal(np.asarray(pages_want[0]), np.asarray(before[0]))
    assert not np.array_equal(np.asarray(got[1][1, 1:]), np.asarray(k_pages[1, 1:]))  # the write happened


@pytest.mark.parametrize("shape, dtype", [((2, 3, 576), jnp.bfloat16), ((5, 48), jnp.float32)])
def test_pallas_add_rms_norm_matches_the_xla_form(shape, dtype):
    """The residual add + RMSNorm kernel (interpreted here) against the XLA form, with and without
    something to add and a gain, at a width that is not a power of two (SmolLM2's 576)."""
    from eagle3_jax.model import layers, pallas_norm

    rng = np.random.default_rng(len(shape))
    x, delta = (jnp.asarray(3 * rng.standard_normal(shape), dtype) for _ in range(2))
    weight = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1]), dtype)
    for d in (None, delta):
        for w in (None, weight):
            got = pallas_norm.add_rms_norm(x, d, w, 1e-5)
            want = layers.add_rms_norm(x, d, w, 1e-5)
            for g, r in zip(got, want):
                assert g.shape == r.shape == shape and g.dtype == dtype
                np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=1e-6, atol=1e-6)
    s, y = want
    np.testing.assert_allclose(
        np.asarray(s, np.float32), np.asarray(x, np.float32) + np.asarray(delta, np.float32), rtol=1e-2
    )  # the sum, rounded to the stream's dtype
    ms = np.mean(np.asarray(y, np.float32) ** 2 / np.asarray(weight, np.float32) ** 2, axis=-1)
    np.testing.assert_allclose(ms, 1.0, rtol=3e-2)  # unit mean square before the gain


def test_param_counts_from_eval_shape():
    for config, expected in ((LLAMA31_8B, 8_030_261_248), (LLAMA33_70B, 70_553_706_496)):
        cfg = ModelConfig.from_hf(config)
        shapes = jax.eval_shape(lambda k, c=cfg: llama.init_params(c, k), jax.random.PRNGKey(0))
        assert llama.count_params(shapes) == expected


def test_llama3_rope_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(**{k: v for k, v in LLAMA31_8B.items() if k not in ("architectures", "model_type")})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf(LLAMA31_8B)
    np.testing.assert_allclose(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), ref.numpy(), rtol=1e-6)


def test_transformers5_rope_parameters_layout():
    v4 = ModelConfig.from_hf(LLAMA31_8B)
    v5_dict = {k: v for k, v in LLAMA31_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5_dict["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA31_8B["rope_scaling"]}
    assert ModelConfig.from_hf(v5_dict) == v4
    assert v4.head_dim == 128 and v4.num_kv_heads == 8 and v4.eos_token_ids == (128001, 128008, 128009)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "mistral"}, "model_type"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_attention_heads": 5}, "num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"vocab_size": "many"}, "vocab_size"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf({**LLAMA31_8B, **change})


@pytest.fixture
def tiny_checkpoint(tmp_path):
    cfg = ModelConfig.from_hf(TINY)
    params = llama.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_llama(params, tmp_path)
    return tmp_path, cfg, params


def test_checkpoint_round_trip_and_sharded_index(tiny_checkpoint, tmp_path_factory):
    from safetensors.numpy import load_file

    path, cfg, params = tiny_checkpoint
    _, loaded = load_llama(path, jnp.float32)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool((a == b).all()), params, loaded))
    # The same tensors split over two files with an index load identically.
    sharded = tmp_path_factory.mktemp("sharded")
    tensors = load_file(str(path / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        write({n: tensors[n] for n in part}, sharded / file)
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    (sharded / "config.json").write_text(json.dumps(TINY))
    _, from_shards = load_llama(sharded, jnp.float32)
    np.testing.assert_array_equal(from_shards.layers[2].w_down, params.layers[2].w_down)


def test_wrong_shape_missing_and_extra_tensors_are_named(tiny_checkpoint):
    from safetensors.numpy import load_file

    path, _, _ = tiny_checkpoint
    tensors = load_file(str(path / "model.safetensors"))
    good = dict(tensors)
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    write(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        load_llama(path, jnp.float32)
    del good["model.norm.weight"]
    write(good, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*model\.norm\.weight"):
        load_llama(path, jnp.float32)
    good["model.norm.weight"] = np.ones(32, np.float32)
    good["model.layers.9.mlp.up_proj.weight"] = np.ones((2, 2), np.float32)
    write(good, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected.*layers\.9"):
        load_llama(path, jnp.float32)


def test_truncated_safetensors_names_the_file(tiny_checkpoint):
    path, _, _ = tiny_checkpoint
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_llama(path, jnp.float32)


@pytest.mark.slow
def test_bad_prompts_get_clear_errors(target_llm, chat_ids):
    from eagle3_jax import SamplingParams

    limit = target_llm.engine.cfg.max_model_len
    outs = target_llm.generate(["", [], [5, 49152, 7], [1] * limit, chat_ids[0]], SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in outs] == ["error"] * 4 + ["length"]
    assert "empty" in outs[0].error and "empty" in outs[1].error
    assert "49152" in outs[2].error and "vocabulary" in outs[2].error
    assert f"{limit} tokens" in outs[3].error and "context" in outs[3].error
    assert len(outs[4].token_ids) == 4
