"""The Llama-3 target as pure functions: `forward` runs any number of new tokens a row (prefill chunks,
decode, verify) against the paged KV cache, returning the final normed hidden states and the EAGLE-3
captures. Layers are a Python loop, unrolled: `lax.scan` over stacked layers was slower.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import ModelConfig
from eagle3_jax.model import invariant_gemm
from eagle3_jax.model.layers import (
    TreeAttention,
    add_rms_norm,
    attention_block,
    project,
    qkv_shape,
    rope_inv_freq,
    swiglu,
)


@struct.dataclass
class LayerParams:
    """One decoder layer (fused layout: model/layers.py); a norm gain None is folded (`fold_norm_gains`)."""

    attn_norm: jax.Array | None
    wqkv: jax.Array
    wo: jax.Array  # [H*hd, D]
    mlp_norm: jax.Array | None
    w_gate_up: jax.Array
    w_down: jax.Array  # [I, D]


@struct.dataclass
class LlamaParams:
    embed: jax.Array  # [V, D]
    layers: tuple[LayerParams, ...]
    norm: jax.Array
    lm_head: jax.Array | None  # [D, V]; None when tied to `embed`


@struct.dataclass
class KVCache:
    """k, v [L, num_pages, page_size, kvh, hd]: one array, not one per layer, since each buffer costs
    host time at dispatch (BENCHMARKS.md, "Host overhead"); donated, so each layer writes in place."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def zeros(cls, num_layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
              dtype) -> KVCache:
        shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
        return cls(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> LlamaParams:
    """Random weights (std 0.02, unit norms): for shapes, sharding and speed, not for text."""
    d, i = cfg.hidden_size, cfg.intermediate_size
    keys = iter(jax.random.split(key, 4 * cfg.num_layers + 2))

    def dense(*shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    layers = tuple(
        LayerParams(attn_norm=jnp.ones((d,), dtype),
                    wqkv=dense(*qkv_shape(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)),
                    wo=dense(cfg.q_size, d), mlp_norm=jnp.ones((d,), dtype), w_gate_up=dense(d, 2, i),
                    w_down=dense(i, d))
        for _ in range(cfg.num_layers))
    return LlamaParams(embed=dense(cfg.vocab_size, d), layers=layers, norm=jnp.ones((d,), dtype),
                       lm_head=None if cfg.tie_word_embeddings else dense(d, cfg.vocab_size))


@jax.jit
def _fold_layer(layer: LayerParams) -> LayerParams:
    def scale_rows(w, gain):  # w [D, ...] * gain [D], in f32, rounded once
        return (w.astype(jnp.float32) * gain.astype(jnp.float32).reshape(-1, *[1] * (w.ndim - 1))).astype(w.dtype)

    return layer.replace(attn_norm=None, wqkv=scale_rows(layer.wqkv, layer.attn_norm),
                         mlp_norm=None, w_gate_up=scale_rows(layer.w_gate_up, layer.mlp_norm))


def fold_norm_gains(params: LlamaParams) -> LlamaParams:
    """RMSNorm gains folded into the next projection, rms_norm(x, g) @ W == rms_norm(x, None) @ (g[:, None] * W):
    two fewer buffers a layer to dispatch (BENCHMARKS.md, "Host overhead"); folded layers pass through."""
    layers = tuple(layer if layer.attn_norm is None else _fold_layer(layer) for layer in params.layers)
    return params.replace(layers=layers)


def sum_shards(x: jax.Array, tp_axis: str | None) -> jax.Array:
    """Inside shard_map over `tp_axis`: the sum of every device's x, added in rank order whatever
    the shape (an all-reduce may pick its algorithm, and so its order, by message size)."""
    if tp_axis is None:
        return x
    parts = jax.lax.all_gather(x, tp_axis)
    total = parts[0]
    for i in range(1, parts.shape[0]):
        total = total + parts[i]
    return total


def embed_tokens(embed: jax.Array, tokens: jax.Array, vocab_size: int, tp_axis: str | None) -> jax.Array:
    """tokens [B, T] -> [B, T, D]; inside shard_map over `tp_axis` with a vocab-split embed [V/tp, D],
    each device looks up its own ids and the one nonzero row per token is summed (exact)."""
    if tp_axis is None or embed.shape[0] == vocab_size:
        return embed[tokens]
    rows = embed.shape[0]
    local = tokens - jax.lax.axis_index(tp_axis) * rows
    here = (local >= 0) & (local < rows)
    return sum_shards(jnp.where(here[..., None], embed[jnp.clip(local, 0, rows - 1)], 0), tp_axis)


def forward(params: LlamaParams, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache, block_table: jax.Array, attention: str = "xla",
            pin_kv: Callable[[KVCache], KVCache] | None = None,
            gemv: str = "xla", tree: TreeAttention | None = None,
            tp_axis: str | None = None) -> tuple[jax.Array, jax.Array, KVCache]:
    """tokens, positions [B, T]; block_table [B, nb] -> (final normed hidden [B, T, D], captures
    [B, T, n_capture * D], cache). pin_kv: applied after each layer's write (`sharding.cache_pin`);
    tp_axis: per device inside shard_map, row-parallel partials added in rank order (`sum_shards`)."""
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    eps, kernel = cfg.rms_norm_eps, attention in ("pallas", "invariant")
    x = embed_tokens(params.embed, tokens, cfg.vocab_size, tp_axis)
    delta = None  # the previous MLP's output, added in the next norm's kernel
    captured = {}
    for i, layer in enumerate(params.layers):
        x, h = add_rms_norm(x, delta, layer.attn_norm, eps, kernel)
        if i in cfg.capture_layer_ids:
            captured[i] = x
        attn, k_pages, v_pages = attention_block(
            h, layer.wqkv, layer.wo, positions, cache.k, cache.v, i, block_table, inv_freq=inv_freq,
            attention=attention, gemv=gemv, tree=tree)
        cache = KVCache(k=k_pages, v=v_pages) if pin_kv is None else pin_kv(KVCache(k=k_pages, v=v_pages))
        x, h = add_rms_norm(x, sum_shards(attn, tp_axis), layer.mlp_norm, eps, kernel)
        delta = sum_shards(swiglu(h, layer.w_gate_up, layer.w_down, gemv), tp_axis)
    captures = jnp.concatenate([captured[i] for i in cfg.capture_layer_ids], axis=-1)
    _, hidden = add_rms_norm(x, delta, params.norm, eps, kernel)
    return hidden, captures, cache


def logits(params: LlamaParams, hidden: jax.Array, gemv: str = "xla") -> jax.Array:
    """hidden [..., D] (final-normed) -> f32 logits [..., V]; a tied lm_head is read as embed [V, D]."""
    if params.lm_head is None and gemv == "invariant":
        return invariant_gemm.project(hidden, params.embed, jnp.float32, transposed=True)
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    return project(hidden, params.lm_head, gemv, out_dtype=jnp.float32)


def count_params(shapes) -> int:
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes))
