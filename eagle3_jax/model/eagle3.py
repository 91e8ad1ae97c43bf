"""The EAGLE-3 draft head as pure functions. One step, for token embeddings e and incoming hidden
states g (docs/EAGLE3.md, "The draft forward pass"):
  h = fc(g) for the target's captures g [.., n_capture * H_target], else g (the last step's pre-norm h)
  x = concat(input_layernorm(e), hidden_norm(h))            # embedding FIRST, width 2H
  h = h + o_proj(attention(q, k, v of x))                    # RoPE, GQA, paged KV
  h = h + mlp(post_attention_layernorm(h))                   # SwiGLU
  logits = lm_head(norm(h)) over the draft vocabulary
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import DraftConfig
from eagle3_jax.model.layers import (
    TreeAttention,
    add_rms_norm,
    attention_block,
    project,
    qkv_shape,
    rms_norm,
    rope_inv_freq,
    swiglu,
)
from eagle3_jax.model.llama import KVCache


@struct.dataclass
class DraftParams:
    """The midlayer's q/k/v and gate/up fused as the target's (model/layers.py), its input 2H wide."""

    fc: jax.Array  # [n_capture * H_target, H]
    hidden_norm: jax.Array
    input_norm: jax.Array
    wqkv: jax.Array
    wo: jax.Array  # [heads*hd, H]
    mlp_norm: jax.Array
    w_gate_up: jax.Array
    w_down: jax.Array  # [I, H]
    norm: jax.Array
    lm_head: jax.Array  # [H, V_draft]
    d2t: jax.Array  # [V_draft] int32 offsets: target id = draft id + d2t[draft id]
    embed: jax.Array | None  # [V, H] own embedding (70B layout); None: use the target's


def init_draft_params(cfg: DraftConfig, key: jax.Array, dtype=jnp.bfloat16,
                      own_embedding: bool = False) -> DraftParams:
    """Random draft weights with the identity vocabulary map (d2t = 0)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    keys = iter(jax.random.split(key, 7))

    def dense(*shape):
        return (0.02 * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    ones = jnp.ones((h,), dtype)
    return DraftParams(
        fc=dense(cfg.num_captures * cfg.target_hidden_size, h), hidden_norm=ones, input_norm=ones,
        wqkv=dense(*qkv_shape(2 * h, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)),
        wo=dense(cfg.q_size, h), mlp_norm=ones, w_gate_up=dense(h, 2, i), w_down=dense(i, h), norm=ones,
        lm_head=dense(h, cfg.draft_vocab_size),
        d2t=jnp.zeros((cfg.draft_vocab_size,), jnp.int32),
        embed=dense(cfg.vocab_size, h) if own_embedding else None)


def fuse_captures(params: DraftParams, captures: jax.Array, gemv: str = "xla") -> jax.Array:
    """Target captures [..., n_capture * H_target] -> the first step's hidden input [..., H]."""
    return project(captures, params.fc, gemv)


def draft_layer(params: DraftParams, cfg: DraftConfig, target_embed: jax.Array, tokens: jax.Array,
                h: jax.Array, attend, gemv: str = "xla", norm_kernel: bool = False):
    """The midlayer around `attend`, shared by inference (paged) and training (its own mask): tokens
    [B, T], h [B, T, H], attend(x [B, T, 2H]) -> (o_proj output [B, T, H], aux) -> (h [B, T, H], aux)."""
    embed = target_embed if params.embed is None else params.embed
    e = embed[tokens].astype(h.dtype)
    x = jnp.concatenate([rms_norm(e, params.input_norm, cfg.rms_norm_eps),
                         rms_norm(h, params.hidden_norm, cfg.rms_norm_eps)], axis=-1)
    attn, aux = attend(x)
    h, x = add_rms_norm(h, attn, params.mlp_norm, cfg.rms_norm_eps, norm_kernel)
    return h + swiglu(x, params.w_gate_up, params.w_down, gemv), aux


def draft_forward(params: DraftParams, cfg: DraftConfig, target_embed: jax.Array, tokens: jax.Array,
                  h: jax.Array, positions: jax.Array, cache: KVCache,
                  block_table: jax.Array, attention: str = "xla",
                  pin_kv: Callable[[KVCache], KVCache] | None = None,
                  gemv: str = "xla", tree: TreeAttention | None = None) -> tuple[jax.Array, KVCache]:
    """One draft step: tokens, positions [B, T]; h [B, T, H] (`fuse_captures` on the first step,
    the previous pre-norm output after); the rest as `llama.forward`'s -> (pre-norm h, cache)."""
    def paged(x):
        out, k_pages, v_pages = attention_block(
            x, params.wqkv, params.wo, positions, cache.k, cache.v, 0, block_table,
            inv_freq=rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), attention=attention,
            gemv=gemv, tree=tree)
        cache_out = KVCache(k=k_pages, v=v_pages)
        return out, cache_out if pin_kv is None else pin_kv(cache_out)

    return draft_layer(params, cfg, target_embed, tokens, h, paged, gemv, norm_kernel=attention == "pallas")


def draft_logits(params: DraftParams, cfg: DraftConfig, hidden: jax.Array, gemv: str = "xla") -> jax.Array:
    """pre-norm hidden [..., H] -> f32 logits over the draft vocabulary [..., V_draft]."""
    return project(rms_norm(hidden, params.norm, cfg.rms_norm_eps), params.lm_head, gemv, out_dtype=jnp.float32)


def to_target_ids(params: DraftParams, draft_ids: jax.Array) -> jax.Array:
    return draft_ids + params.d2t[draft_ids]
