"""Llama building blocks as pure functions: RMSNorm, RoPE (with llama3 scaling), SwiGLU and
grouped-query attention over a paged KV cache.

Fused projections (target layers and draft midlayer alike): a decode step is launch-bound, each
kernel and each argument buffer costs host time, so q/k/v are one weight and one GEMM, and so are
gate/up:
  wqkv       [D_in, G, R + 2, hd]  G = kv heads, R = q heads per kv head. For kv group g,
                                   [:, g, :R] are q heads g*R .. g*R+R-1 (HF's q head j reads kv
                                   head j // R, so flattening (g, r) is HF's q head order),
                                   [:, g, R] is k head g and [:, g, R+1] is v head g.
  w_gate_up  [D, 2, I]             [:, 0] gate, [:, 1] up.
Checkpoints keep the public separate tensors; weights/layout.py converts.

Paged KV layout (shared by target and drafter): one array for K and one for V, every layer's
pages in it, `[num_layers, num_pages, page_size, kv_heads, head_dim]` (`llama.KVCache`); layer l
reads and writes `[l]`. A request owns pages through its block table row
`[max_blocks]`; logical position p lives at page `block_table[p // page_size]`, slot
`p % page_size`. Page 0 is the scratch page: unallocated block-table entries point at it, so
writes from padded rows and padded tokens land there and are never read by a real row.
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
    """Where a call's T tokens sit in a token tree (a draft level, or the target's verify of a
    tree): token t of row b is stored at its `positions` entry, rotated at rope_positions[b, t],
    and sees every cached position before window_start[b] and, of the W positions window_start[b]
    .. window_start[b] + W - 1, those window_mask[b, t] marks (its ancestors and itself). The
    Pallas kernels also bound each query by its stored position, as a chain's: the mask marks
    nothing stored after its token (ancestors are stored before their descendants)."""

    rope_positions: jax.Array  # [B, T]
    window_start: jax.Array  # [B]
    window_mask: jax.Array  # [B, T, W] bool


def rms_norm(x: jax.Array, weight: jax.Array | None, eps: float) -> jax.Array:
    """[..., D] -> [..., D]; statistics in f32, as transformers' LlamaRMSNorm. weight None: a unit
    gain (the gain already folded into the projection that reads the output, `llama.fold_norm_gains`)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) if weight is None else weight * y.astype(x.dtype)


def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array | None, eps: float,
                 kernel: bool = False) -> tuple[jax.Array, jax.Array]:
    """The pre-norm residual step: x, delta [..., D] (delta None: nothing to add) ->
    (s = x + delta, rms_norm(s, weight)). kernel: one Pallas kernel (model/pallas_norm.py) for
    what XLA compiles into several small ones."""
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
    """Shape of a fused wqkv: [D_in, G, R + 2, hd] (see the module docstring)."""
    return d_in, kv_heads, heads // kv_heads + 2, head_dim


def project(x: jax.Array, w: jax.Array, gemv: str = "xla", out_dtype=None) -> jax.Array:
    """A weight projection: x [..., K] @ w [K, *out] -> [..., *out] (out_dtype, default x's).

    gemv "mosaic" runs the Mosaic GPU kernel where the product fits it (a few rows: decode, verify
    and draft steps; model/mosaic_gemv.py), else XLA's dot, which "xla" always runs; "invariant"
    the batch-invariant GEMM at every row count (model/invariant_gemm.py)."""
    if gemv == "invariant":
        return invariant_gemm.project(x, w, out_dtype)
    rows, k, n = math.prod(x.shape[:-1]), x.shape[-1], math.prod(w.shape[1:])
    if gemv == "mosaic" and mosaic_gemv.supports(rows, k, n, x.dtype):
        return mosaic_gemv.project(x, w, out_dtype)
    return jnp.tensordot(x, w, axes=1, preferred_element_type=out_dtype)


def swiglu(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, gemv: str = "xla") -> jax.Array:
    """x [B, T, D]; w_gate_up [D, 2, I] (gate, up); w_down [I, D] -> [B, T, D].

    One GEMM for gate and up together instead of two (the step is launch-bound)."""
    gate_up = project(x, w_gate_up, gemv)  # [B, T, 2, I]
    return project(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1], w_down, gemv)


def _page_of(positions: jax.Array, block_table: jax.Array, page_size: int) -> jax.Array:
    """positions [B, T] -> the page [B, T] each lives on; past the table's end: scratch."""
    num_blocks = block_table.shape[1]
    block = positions // page_size
    page = jnp.take_along_axis(block_table, jnp.clip(block, 0, num_blocks - 1), axis=1)  # [B, T]
    # Padded tokens can sit past the table's end: send them to scratch, never onto a real page.
    return jnp.where(block < num_blocks, page, SCRATCH_PAGE)


def write_kv(pages: jax.Array, layer: int, new: jax.Array, positions: jax.Array, block_table: jax.Array) -> jax.Array:
    """Scatter new [B, T, kvh, hd] at positions [B, T] into layer `layer` of pages
    [L, P, page, kvh, hd] (in place when the caller donates them)."""
    page_size = pages.shape[2]
    page = _page_of(positions, block_table, page_size)
    # unique_indices: a real page's positions are written once per call (a row's positions are
    # distinct, and no two rows share a page); only scratch is written many times over (padded
    # tokens, padding rows), and what lands there is never read. Without the promise XLA writes
    # every element with an atomic, and the collisions on scratch serialize: a prefill of 8 x 512
    # padded tokens spent 89 of its 99 ms in these scatters on the H200 (BENCHMARKS.md,
    # "Serving with arrivals").
    return pages.at[layer, page, positions % page_size].set(new.astype(pages.dtype), unique_indices=True)


def move_kv(pages: jax.Array, src: jax.Array, dst: jax.Array, block_table: jax.Array) -> jax.Array:
    """Every layer's entries at positions src [B, M] copied to positions dst [B, M] of the same
    row, all read before any is written: pages [L, P, page, kvh, hd] -> pages. A tree's accepted
    path moves this way to the contiguous positions it belongs at."""
    page_size = pages.shape[2]
    moved = pages[:, _page_of(src, block_table, page_size), src % page_size]  # [L, B, M, kvh, hd]
    return pages.at[:, _page_of(dst, block_table, page_size), dst % page_size].set(moved)


def gather_kv(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """pages [P, page, kvh, hd], block_table [B, nb] -> [B, nb * page, kvh, hd] in logical order."""
    b, nb = block_table.shape
    ctx = pages[block_table]  # [B, nb, page, kvh, hd]
    return ctx.reshape(b, nb * pages.shape[1], *pages.shape[2:])


def window_visible(window_start: jax.Array, window_mask: jax.Array, num_keys: int) -> jax.Array:
    """window_start [B], window_mask [B, T, W] -> visible [B, T, S] over key positions 0..S-1:
    those before the window, and those in it that the query's mask row marks."""
    b, t, w = window_mask.shape
    rel = jnp.arange(num_keys)[None, :] - window_start[:, None]  # [B, S]: offset in the window
    idx = jnp.broadcast_to(jnp.clip(rel, 0, w - 1)[:, None, :], (b, t, num_keys))
    marked = jnp.take_along_axis(window_mask, idx, axis=2)  # [B, T, S]
    return (rel < 0)[:, None, :] | (marked & (rel < w)[:, None, :])


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                    block_table: jax.Array, tree: TreeAttention | None = None) -> jax.Array:
    """Causal GQA of new queries over everything cached for their row.

    q [B, T, H, hd] (already rotated), positions [B, T] (each query's position), k/v_pages
    [P, page, kvh, hd] (already holding this step's keys), block_table [B, nb] -> [B, T, H, hd].
    A query at position p sees cached positions 0..p of its row, which this or earlier steps wrote;
    with a `tree`, what its window mask lets it see instead (`window_visible`).
    """
    b, t, h, hd = q.shape
    k = gather_kv(k_pages, block_table)  # [B, S, kvh, hd]
    v = gather_kv(v_pages, block_table)
    kvh = k.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    if tree is None:
        key_pos = jnp.arange(k.shape[1])
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, T, S]
    else:
        visible = window_visible(tree.window_start, tree.window_mask, k.shape[1])
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h, hd)


def fused_qkv(h: jax.Array, wqkv: jax.Array, gemv: str = "xla") -> jax.Array:
    """h [B, T, D_in]; wqkv [D_in, G, R + 2, hd] -> [B, T, G, R + 2, hd]: per kv group, its R q
    heads, then k, then v, none rotated yet."""
    return project(h, wqkv, gemv)


def project_qkv(h: jax.Array, wqkv: jax.Array, positions: jax.Array, *,
                inv_freq, gemv: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D_in]; wqkv [D_in, G, R + 2, hd] -> q [B, T, G*R, hd], k, v [B, T, G, hd];
    q and k rotated to `positions`.

    One GEMM and one argument buffer instead of three (the step is launch-bound). q comes out
    grouped [B, T, G, R, hd]; merging (G, R) gives HF's q head order, which paged_attention splits
    back into the same groups.
    """
    b, t, _ = h.shape
    g, r, hd = wqkv.shape[1], wqkv.shape[2] - 2, wqkv.shape[3]
    qkv = fused_qkv(h, wqkv, gemv)  # [B, T, G, R + 2, hd]
    q = qkv[:, :, :, :r].reshape(b, t, g * r, hd)
    k, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]  # [B, T, G, hd]
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention_block(h: jax.Array, wqkv: jax.Array, wo: jax.Array, positions: jax.Array,
                    k_pages: jax.Array, v_pages: jax.Array, layer: int, block_table: jax.Array, *,
                    inv_freq, attention: str = "xla", gemv: str = "xla",
                    tree: TreeAttention | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention over layer `layer` of the paged cache, from the already-normed input. h
    [B, T, D_in]; wqkv [D_in, G, R + 2, hd]; wo [G*R*hd, D]; k/v_pages [L, P, page, G, hd] ->
    (attn out [B, T, D], k, v pages with this step's keys and values written).

    Written once for the target and the draft midlayer (whose q/k/v read 2H-wide inputs). Head
    counts come from wqkv's shape. attention "pallas" runs the Pallas kernels where the step fits
    them (few new tokens per row, a tree's window not too wide: `pallas_attention.supports`),
    else the XLA form, which "xla" always runs; "invariant" the batch-invariant kernel for any
    step (model/invariant_attention.py). gemv: `project`'s.
    tree: the tokens' RoPE positions and window mask when they form a token tree; `positions`
    then only say where their keys and values are stored.
    """
    b, t, _ = h.shape
    g, r = wqkv.shape[1], wqkv.shape[2] - 2
    window = 0 if tree is None else tree.window_mask.shape[2]
    if attention == "invariant":
        out, k_pages, v_pages = invariant_attention.attention(
            fused_qkv(h, wqkv, gemv), positions, block_table, inv_freq, k_pages, v_pages, layer, SCRATCH_PAGE, tree)
    elif attention == "pallas" and pallas_attention.supports(t, g * r, g, k_pages.shape[2], window):
        # Two kernels after the projection: RoPE + KV write + q tiles, then attention. A tree's
        # window is packed to bits outside them: the same expression every layer, computed once (CSE).
        qkv = fused_qkv(h, wqkv, gemv)  # [B, T, G, R + 2, hd]
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
        out = paged_attention(q, k_pages[layer], v_pages[layer], positions, block_table, tree)  # [B, T, H, hd]
    return project(out.reshape(b, t, -1), wo, gemv), k_pages, v_pages
