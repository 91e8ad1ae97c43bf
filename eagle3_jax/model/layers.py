"""Llama building blocks as pure functions: RMSNorm, RoPE (llama3 scaling), SwiGLU and grouped-query
attention over a paged KV cache.

Projections are fused, since a decode step is launch-bound: wqkv [D_in, G, R + 2, hd] (G kv heads, R
q heads per kv head: [:, g, :R] are q heads g*R .. g*R+R-1, HF's order, then k and v head g) and
w_gate_up [D, 2, I] (gate, up); checkpoints keep them apart (weights/layout.py). Paged KV: K, V each
[L, P, page, G, hd]; position p of a row is at page block_table[p // page], slot p % page. Page 0 is
scratch: unallocated entries point at it, so padded rows' and tokens' writes land there, never read.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import Llama3RopeScaling
from eagle3_jax.model import invariant_attention, invariant_gemm, mosaic_gemv, pallas_attention, pallas_norm

SCRATCH_PAGE = 0


class TreeAttention(NamedTuple):
    """A call's T tokens as a token tree: token t of row b is stored at `positions`, rotated at
    rope_positions [B, T], and sees every position before window_start [B] and, of the W from it on,
    those window_mask [B, T, W] marks (ancestors and itself; never one stored after it)."""

    rope_positions: jax.Array
    window_start: jax.Array
    window_mask: jax.Array


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """[..., D] -> [..., D], statistics in f32; weight None: gain folded away (`llama.fold_norm_gains`)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) if weight is None else weight * y.astype(x.dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array | None, eps: float,
                 kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """x, delta [..., D] (None: no add) -> (s = x + delta, rms_norm(s, weight)); kernel: pallas_norm's."""
    if kernel:
        return pallas_norm.add_rms_norm(x, delta, weight, eps)
    s = x if delta is None else x + delta
    return s, rms_norm(s, weight, eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None) -> np.ndarray:
    """[head_dim // 2] f32 inverse frequencies, llama3-scaled when asked (Llama-3.1 recipe)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x [B, T, heads, hd], positions [B, T] -> rotated x (rotate-half layout, as transformers)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [B, T, hd/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def qkv_shape(d_in: int, heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    return d_in, kv_heads, heads // kv_heads + 2, head_dim


def project(x: jax.Array, w: jax.Array, gemv: str = "xla", out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, *out] -> [..., *out]. gemv "mosaic": mosaic_gemv where it fits (a few
    rows), else XLA's dot; "invariant": invariant_gemm at every row count."""
    if gemv == "invariant":
        return invariant_gemm.project(x, w, out_dtype)
    rows, k, n = math.prod(x.shape[:-1]), x.shape[-1], math.prod(w.shape[1:])
    if gemv == "mosaic" and mosaic_gemv.supports(rows, k, n, x.dtype):
        return mosaic_gemv.project(x, w, out_dtype)
    return jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, gemv: str = "xla") -> jax.Array:
    """x [B, T, D]; w_gate_up [D, 2, I] (gate, up); w_down [I, D] -> [B, T, D]."""
    gate_up = project(x, w_gate_up, gemv)
    return project(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w_down, gemv)


def _page_of(positions: jax.Array, block_table: jax.Array, page_size: int) -> jax.Array:
    """positions [B, T] -> the page [B, T] each lives on; past the table's end: scratch."""
    num_blocks = block_table.shape[1]
    block = positions // page_size
    page = jnp.take_along_axis(block_table, jnp.clip(block, 0, num_blocks - 1), axis=1)
    return jnp.where(block < num_blocks, page, SCRATCH_PAGE)


def write_kv(pages: jax.Array, layer: int, new: jax.Array, positions: jax.Array, block_table: jax.Array) -> jax.Array:
    """Scatter new [B, T, kvh, hd] at positions [B, T] into layer `layer` of pages [L, P, page, kvh, hd]."""
    page_size = pages.shape[2]
    page = _page_of(positions, block_table, page_size)
    # unique_indices holds but for scratch, never read (rows share no page): without it XLA writes with
    # atomics, and the collisions on scratch serialize (BENCHMARKS.md, "Serving with arrivals").
    return pages.at[layer, page, positions % page_size].set(new.astype(pages.dtype), unique_indices=True)


def move_kv(pages: jax.Array, src: jax.Array, dst: jax.Array, block_table: jax.Array) -> jax.Array:
    """Every layer's entries at src [B, M] copied to dst [B, M], all read before any is written."""
    page_size = pages.shape[2]
    moved = pages[:, _page_of(src, block_table, page_size), src % page_size]
    return pages.at[:, _page_of(dst, block_table, page_size), dst % page_size].set(moved)


def gather_kv(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """pages [P, page, kvh, hd], block_table [B, nb] -> [B, nb * page, kvh, hd] in logical order."""
    b, nb = block_table.shape
    ctx = pages[block_table]
    return ctx.reshape(b, nb * pages.shape[1], *pages.shape[2:])


def window_visible(window_start: jax.Array, window_mask: jax.Array, num_keys: int) -> jax.Array:
    """window_start [B], window_mask [B, T, W] -> visible [B, T, S]: before the window, or marked in it."""
    b, t, w = window_mask.shape
    rel = jnp.arange(num_keys)[None, :] - window_start[:, None]
    idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], (b, t, num_keys))
    marked = jnp.take_along_axis(window_mask, idx, axis=2)
    return (rel < 0)[:, None, :] | (marked & (rel < w)[:, None, :])


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                    block_table: jax.Array, tree: TreeAttention | None = None) -> jax.Array:
    """Causal GQA: q [B, T, H, hd] (rotated), k/v_pages [P, page, kvh, hd] holding this step's keys,
    positions [B, T] -> [B, T, H, hd]; with a `tree`, a query sees what its window lets it see."""
    b, t, h, hd = q.shape
    k = gather_kv(k_pages, block_table)
    v = gather_kv(v_pages, block_table)
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    if tree is None:
        key_pos = jnp.arange(k.shape[1])
        visible = key_pos[None, None, :] <= positions[:, :, None]
    else:
        visible = window_visible(tree.window_start, tree.window_mask, k.shape[1])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, hd)


def fused_qkv(h: jax.Array, wqkv: jax.Array, gemv: str = "xla") -> jax.Array:
    """h [B, T, D_in]; wqkv [D_in, G, R + 2, hd] -> [B, T, G, R + 2, hd], not rotated."""
    return project(h, wqkv, gemv)


def project_qkv(h: jax.Array, wqkv: jax.Array, positions: jax.Array, *,
                inv_freq, gemv: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D_in] -> q [B, T, G*R, hd] (HF's head order), k, v [B, T, G, hd]; q, k rotated."""
    b, t, _ = h.shape
    g, r, hd = wqkv.shape[1], wqkv.shape[2] - 2, wqkv.shape[3]
    qkv = fused_qkv(h, wqkv, gemv)
    q = qkv[:, :, :, :r].reshape(b, t, g * r, hd)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention_block(h: jax.Array, wqkv: jax.Array, wo: jax.Array, positions: jax.Array,
                    k_pages: jax.Array, v_pages: jax.Array, layer: int, block_table: jax.Array, *,
                    inv_freq, attention: str = "xla", gemv: str = "xla",
                    tree: TreeAttention | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention over layer `layer` of the paged cache (target, or the draft's 2H-wide midlayer): h [B, T,
    D_in] normed, wo [G*R*hd, D] -> (out [B, T, D], k_pages, v_pages with this step's written). "pallas":
    the kernels where `pallas_attention.supports` the step; a causal step taller than that (a prefill
    chunk) writes its KV as the XLA form and attends in query tiles (`pallas_attention.attend_prefill`).
    With a `tree`, `positions` say only where k, v are stored."""
    b, t, _ = h.shape
    g, r = wqkv.shape[1], wqkv.shape[2] - 2
    window = 0 if tree is None else tree.window_mask.shape[2]
    if attention == "invariant":
        out, k_pages, v_pages = invariant_attention.attention(
            fused_qkv(h, wqkv, gemv), positions, block_table, inv_freq, k_pages, v_pages, layer, SCRATCH_PAGE, tree)
    elif attention == "pallas" and pallas_attention.supports(t, g * r, g, k_pages.shape[2], window):
        qkv = fused_qkv(h, wqkv, gemv)
        rope_positions, window_start, window_mask = (None, None, None) if tree is None else tree
        q_tiles, k_pages, v_pages = pallas_attention.rope_and_write(
            qkv, positions, block_table, inv_freq, k_pages, v_pages, layer, SCRATCH_PAGE, rope_positions)
        out = pallas_attention.attend_tiles(q_tiles, k_pages, v_pages, layer, positions, block_table, r,
                                            window_start=window_start, window_mask=window_mask)
    else:
        rope_positions = positions if tree is None else tree.rope_positions
        q, k, v = project_qkv(h, wqkv, rope_positions, inv_freq=inv_freq, gemv=gemv)
        k_pages = write_kv(k_pages, layer, k, positions, block_table)
        v_pages = write_kv(v_pages, layer, v, positions, block_table)
        if attention == "pallas" and tree is None and pallas_attention.supports_prefill(g * r, g, k_pages.shape[2]):
            # Too tall for one tile (a prefill chunk): query tiles, each reading the keys it can see.
            out = pallas_attention.attend_prefill(q, k_pages, v_pages, layer, positions, block_table, r)
        else:
            out = paged_attention(q, k_pages[layer], v_pages[layer], positions, block_table, tree)
    return project(out.reshape(b, t, -1), wo, gemv), k_pages, v_pages
