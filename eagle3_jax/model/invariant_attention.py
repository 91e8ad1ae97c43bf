"""Batch-invariant paged attention: a token's output is bit for bit the same in a decode, a chain's or
a tree's verify, or a prefill chunk, at any batch size (pallas_attention's shared tiles and batch-sized
splits make its sums' order depend on the neighbours). One program per (row, kv head, token, split),
keys in BLOCK_KEYS blocks by position in the token's own sequence, splits over fixed ranges: every
sum's order is fixed by positions alone. A tree node reads its ancestors as at root + depth, where
decode would have stored them, gathered from where the verify did, so its logits equal decode's.
RoPE and the KV write: `pallas_attention.rope_and_write(per_token=True)`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from eagle3_jax.model import pallas_attention
from eagle3_jax.model.pallas_attention import MASKED

BLOCK_KEYS = 64
BLOCKS_PER_SPLIT = 8  # a split's fixed range: 512 key positions


def _kernel(q_ref, vpos_ref, *refs, page_size: int, scale: float, windowed: bool):
    # Program (row, kv head, token, split). q_ref [RT, hd]; vpos_ref [T] own-sequence positions; path_ref
    # [1 + W] (`ancestor_paths`); table_ref [nb]; k_ref, v_ref [L, P * page, hd] -> o_ref [RT, hd], lse_ref [RT].
    path_ref, (table_ref, layer_ref, k_ref, v_ref, o_ref, lse_ref) = (
        (refs[0], refs[1:]) if windowed else (None, refs))
    rows, hd = q_ref.shape
    nb = table_ref.shape[0]
    q, layer = q_ref[...], layer_ref[0]
    vpos = vpos_ref[pl.program_id(2)]
    capacity = -(-nb * page_size // BLOCK_KEYS)  # a padding row's position can run past the table
    first = pl.program_id(3) * BLOCKS_PER_SPLIT
    end = jnp.minimum(jnp.minimum(first + BLOCKS_PER_SPLIT, vpos // BLOCK_KEYS + 1), capacity)

    def body(i, carry):
        key_pos = i * BLOCK_KEYS + jax.lax.iota(jnp.int32, BLOCK_KEYS)
        stored = key_pos
        if windowed:
            start = path_ref[0]
            depth = key_pos - start
            offset = path_ref[1 + jnp.clip(depth, 0, path_ref.shape[0] - 2)]
            stored = jnp.where(depth >= 0, start + offset, key_pos)
        page = table_ref[jnp.clip(stored // page_size, 0, nb - 1)]
        slot = page * page_size + stored % page_size
        k, v = k_ref[layer, slot], v_ref[layer, slot]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return pallas_attention.online_softmax_step(carry, jnp.where((key_pos <= vpos)[None, :], s, MASKED), v)

    init = pallas_attention.online_softmax_init(rows, hd)
    pallas_attention.write_split(jax.lax.fori_loop(first, end, body, init), o_ref, lse_ref)


def ancestor_paths(window_start: jax.Array, window_mask: jax.Array) -> jax.Array:
    """window_start [B], window_mask [B, T, W] -> [B, T, 1 + W] i32: the start, then the offset of
    node t's ancestor at depth d for d = 0 .. depth(t) (0 past it, masked by t's position)."""
    b, t, w = window_mask.shape
    rank = jnp.cumsum(window_mask, axis=-1, dtype=jnp.int32)
    at_depth = window_mask[:, :, None, :] & (rank[:, :, None, :] == jnp.arange(1, w + 1)[:, None])  # [B, T, d, j]
    offsets = jnp.sum(jnp.where(at_depth, jnp.arange(w), 0), axis=-1, dtype=jnp.int32)
    start = jnp.broadcast_to(window_start.astype(jnp.int32)[:, None, None], (b, t, 1))
    return jnp.concatenate([start, offsets], axis=-1)


def num_splits(num_blocks: int, page_size: int) -> int:
    """Splits over a table of num_blocks pages: the same for every step of an engine."""
    return -(-num_blocks * page_size // (BLOCK_KEYS * BLOCKS_PER_SPLIT))


def attention(qkv: jax.Array, positions: jax.Array, block_table: jax.Array, inv_freq, k_pages: jax.Array,
              v_pages: jax.Array, layer, scratch_page: int, tree=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE, the KV write and attention for any tokens a row: qkv [B, T, G, R + 2, hd], positions
    [B, T] (where stored) -> (out [B, T, G*R, hd], k_pages, v_pages)."""
    b, t, g, r2, hd = qkv.shape
    r = r2 - 2
    rope = None if tree is None else tree.rope_positions
    tiles, k_pages, v_pages = pallas_attention.rope_and_write(
        qkv, positions, block_table, inv_freq, k_pages, v_pages, layer, scratch_page, rope, per_token=True)
    vpos = (positions if tree is None else tree.rope_positions).astype(jnp.int32)
    paths = None if tree is None else ancestor_paths(tree.window_start, tree.window_mask)
    out = _attend(tiles, vpos, paths, block_table.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
                  k_pages, v_pages)
    return out[:, :, :, :r].transpose(0, 2, 1, 3, 4).reshape(b, t, g * r, hd), k_pages, v_pages


@jax.jit
def _attend(tiles, vpos, paths, block_table, layer, k_pages, v_pages) -> jax.Array:
    b, g, t, rt, hd = tiles.shape
    num_layers, num_pages, page_size = k_pages.shape[:3]
    splits = num_splits(block_table.shape[1], page_size)
    interpret = _interpret()
    if interpret:  # the interpreter reads inputs whole per program: one layer only
        k_pages, v_pages, layer = k_pages[layer[0]][None], v_pages[layer[0]][None], jnp.zeros((1,), jnp.int32)
        num_layers = 1
    # Slots rather than pages: a key is gathered by its own slot (a tree's ancestors are not contiguous).
    k_slots = k_pages.reshape(num_layers, num_pages * page_size, g, hd)
    v_slots = v_pages.reshape(num_layers, num_pages * page_size, g, hd)
    slots_spec = pl.BlockSpec((num_layers, num_pages * page_size, None, hd), lambda i, j, n, s: (0, 0, j, 0))
    windowed = paths is not None
    path = [paths] if windowed else []
    out, lse = pl.pallas_call(
        functools.partial(_kernel, page_size=page_size, scale=1.0 / math.sqrt(hd), windowed=windowed),
        grid=(b, g, t, splits),
        in_specs=[
            pl.BlockSpec((None, None, None, rt, hd), lambda i, j, n, s: (i, j, n, 0, 0)),
            pl.BlockSpec((None, t), lambda i, j, n, s: (i, 0)),
            *[pl.BlockSpec((None, None, p.shape[2]), lambda i, j, n, s: (i, n, 0)) for p in path],
            pl.BlockSpec((None, block_table.shape[1]), lambda i, j, n, s: (i, 0)),
            pl.BlockSpec((1,), lambda i, j, n, s: (0,)),
            slots_spec, slots_spec,
        ],
        out_specs=[pl.BlockSpec((None, None, None, rt, hd), lambda i, j, n, s: (i, j, s, n, 0)),
                   pl.BlockSpec((None, None, None, rt), lambda i, j, n, s: (i, j, s, n))],
        out_shape=[jax.ShapeDtypeStruct((b, g, splits, t * rt, hd), tiles.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((b, g, splits, t * rt), jnp.float32)],
        interpret=interpret,
        compiler_params=_compiler_params(),
        name="eagle3_invariant_attention",
    )(tiles, vpos, *path, block_table, layer, k_slots, v_slots)
    out = pallas_attention.combine_splits(out, lse, t * rt, tiles.dtype, 1) if splits > 1 else out[:, :, 0]
    return out.reshape(b, g, t, rt, hd)


def _compiler_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"
