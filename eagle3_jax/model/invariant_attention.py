"""Batch-invariant paged attention: a token's output is bit for bit the same in a decode, a chain's or
a tree's verify, or a prefill chunk, at any batch size (pallas_attention's step-sized tiles and
batch-sized splits make its sums' order depend on the neighbours).

One program per (row, kv head, query tile, split). A query tile is always QUERY_TILE_ROWS rows, the R
q heads of QUERY_TILE_ROWS // R tokens and masked padding (a decode's R rows too), so every step's
products are the same MMA shape and its row sums the same layout: a row's arithmetic does not depend
on the rows beside it, as invariant_gemm's fixed BLOCK_M. Keys are walked in BLOCK_KEYS blocks by
position in the token's own sequence, in fixed splits of BLOCKS_PER_SPLIT blocks, so every sum's
order is fixed by positions alone. A tile walks to its last token's position: a block a row sees
nothing of leaves its carry unchanged (p = exp(MASKED - max) = 0, correction 1), and a split it sees
nothing of is written as if it had walked no block (no weight in the combine).

A tree node reads its ancestors as at root + depth, where decode would have stored them, gathered
from where the verify did, so its logits equal decode's. The blocks before the window's (context
every node shares) are multiplied once for the tile; from the window's block on, each token gathers
its own block and multiplies the whole tile by it, keeping only its own rows: the same arithmetic
for its rows as a decode's tile-wide step. RoPE and the KV write: `pallas_attention.rope_and_write`
with tile_rows=QUERY_TILE_ROWS.
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
QUERY_TILE_ROWS = 64  # one Hopper warpgroup MMA's rows, whatever the step


def _kernel(q_ref, vpos_ref, *refs, r: int, page_size: int, scale: float, windowed: bool, blocks_per_split: int):
    # Program (row, kv head, tile, split). q_ref [QT, hd], row u*R + h: q head h of the tile's token u;
    # vpos_ref [QT] own-sequence positions (-1: padding); path_ref [n * QT // R, 1 + W] the row's tokens'
    # `ancestor_paths`; table_ref [nb]; k_ref, v_ref [L, P * page, hd] -> o_ref [QT, hd], lse_ref [QT].
    path_ref, (table_ref, layer_ref, k_ref, v_ref, o_ref, lse_ref) = (
        (refs[0], refs[1:]) if windowed else (None, refs))
    rows, hd = q_ref.shape
    tokens = rows // r
    nb = table_ref.shape[0]
    q, layer, vpos = q_ref[...], layer_ref[0], vpos_ref[...]
    capacity = -(-nb * page_size // BLOCK_KEYS)  # a padding row's position can run past the table
    first = pl.program_id(3) * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, capacity)
    first_token = pl.program_id(2) * tokens

    def step(i, carry, token=None):
        # Key block i as `token` sees it (None: as every token does, before any tree window).
        key_pos = i * BLOCK_KEYS + jax.lax.iota(jnp.int32, BLOCK_KEYS)
        stored = key_pos
        if token is not None:
            start = path_ref[token, 0]
            depth = key_pos - start
            offset = path_ref[token, 1 + jnp.clip(depth, 0, path_ref.shape[1] - 2)]
            stored = jnp.where(depth >= 0, start + offset, key_pos)
        page = table_ref[jnp.clip(stored // page_size, 0, nb - 1)]
        slot = page * page_size + stored % page_size
        k, v = k_ref[layer, slot], v_ref[layer, slot]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return pallas_attention.online_softmax_step(carry, jnp.where(key_pos[None, :] <= vpos[:, None], s, MASKED), v)

    # Shared blocks: all of a causal step's, a tree's up to its window's block; to the tile's last position.
    shared_end = path_ref[first_token, 0] // BLOCK_KEYS if windowed else capacity
    tile_end = jnp.max(vpos) // BLOCK_KEYS + 1
    init = pallas_attention.online_softmax_init(rows, hd)
    carry = jax.lax.fori_loop(first, jnp.minimum(jnp.minimum(last, shared_end), tile_end), step, init)
    if windowed:
        token_of_row = jax.lax.iota(jnp.int32, rows) // r

        def token_blocks(u, carry):
            # Token u's blocks from the window's on: the whole tile times its keys, its own rows kept.
            own = token_of_row == u

            def body(i, carry):
                new = step(i, carry, first_token + u)
                return tuple(jnp.where(own.reshape((rows,) + (1,) * (a.ndim - 1)), b, a) for a, b in zip(carry, new))

            end = jnp.minimum(last, vpos_ref[u * r] // BLOCK_KEYS + 1)
            return jax.lax.fori_loop(jnp.maximum(first, shared_end), end, body, carry)

        carry = jax.lax.fori_loop(0, tokens, token_blocks, carry)
    # A row sees key `first * BLOCK_KEYS` if it sees anything of the split: else no block happened.
    seen = vpos >= first * BLOCK_KEYS
    carry = tuple(jnp.where(seen.reshape((rows,) + (1,) * (a.ndim - 1)), a, b) for a, b in zip(carry, init))
    pallas_attention.write_split(carry, o_ref, lse_ref)


def ancestor_paths(window_start: jax.Array, window_mask: jax.Array) -> jax.Array:
    """window_start [B], window_mask [B, T, W] -> [B, T, 1 + W] i32: the start, then the offset of
    node t's ancestor at depth d for d = 0 .. depth(t) (0 past it, masked by t's position)."""
    b, t, w = window_mask.shape
    rank = jnp.cumsum(window_mask, axis=-1, dtype=jnp.int32)
    at_depth = window_mask[:, :, None, :] & (rank[:, :, None, :] == jnp.arange(1, w + 1)[:, None])  # [B, T, d, j]
    offsets = jnp.sum(jnp.where(at_depth, jnp.arange(w), 0), axis=-1, dtype=jnp.int32)
    start = jnp.broadcast_to(window_start.astype(jnp.int32)[:, None, None], (b, t, 1))
    return jnp.concatenate([start, offsets], axis=-1)


def num_splits(num_blocks: int, page_size: int, blocks_per_split: int = BLOCKS_PER_SPLIT) -> int:
    """Splits over a table of num_blocks pages: the same for every step of an engine."""
    return -(-num_blocks * page_size // (BLOCK_KEYS * blocks_per_split))


def tile_tokens(heads_per_kv: int) -> int:
    """The tokens of one query tile: as many whose R q heads fit QUERY_TILE_ROWS rows."""
    if not 1 <= heads_per_kv <= QUERY_TILE_ROWS:
        raise ValueError(f"invariant attention takes 1 to {QUERY_TILE_ROWS} q heads a kv head, not {heads_per_kv}")
    return QUERY_TILE_ROWS // heads_per_kv


def query_tiles(q: jax.Array, kv_heads: int) -> jax.Array:
    """Rotated q [B, T, G*R, hd] -> [B, G, n * QUERY_TILE_ROWS, hd]: the layout `rope_and_write` writes
    with tile_rows=QUERY_TILE_ROWS (row u*R + h of tile k: q head g*R + h of token k * tile_tokens + u)."""
    b, t, h, hd = q.shape
    r = h // kv_heads
    tt = tile_tokens(r)
    n = -(-t // tt)
    q = jnp.pad(q, ((0, 0), (0, n * tt - t), (0, 0), (0, 0))).reshape(b, n, tt, kv_heads, r, hd)
    q = q.transpose(0, 3, 1, 2, 4, 5).reshape(b, kv_heads, n, tt * r, hd)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, QUERY_TILE_ROWS - tt * r), (0, 0)))
    return q.reshape(b, kv_heads, n * QUERY_TILE_ROWS, hd)


def attention(qkv: jax.Array, positions: jax.Array, block_table: jax.Array, inv_freq, k_pages: jax.Array,
              v_pages: jax.Array, layer, scratch_page: int, tree=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE, the KV write and attention for any tokens a row: qkv [B, T, G, R + 2, hd], positions
    [B, T] (where stored) -> (out [B, T, G*R, hd], k_pages, v_pages)."""
    r = qkv.shape[3] - 2
    rope = None if tree is None else tree.rope_positions
    tiles, k_pages, v_pages = pallas_attention.rope_and_write(
        qkv, positions, block_table, inv_freq, k_pages, v_pages, layer, scratch_page, rope,
        tile_rows=QUERY_TILE_ROWS)
    vpos = positions if tree is None else tree.rope_positions
    paths = None if tree is None else ancestor_paths(tree.window_start, tree.window_mask)
    return attend(tiles, vpos, paths, block_table, layer, k_pages, v_pages, r), k_pages, v_pages


def attend(tiles: jax.Array, vpos: jax.Array, paths: jax.Array | None, block_table: jax.Array, layer,
           k_pages: jax.Array, v_pages: jax.Array, heads_per_kv: int,
           blocks_per_split: int = BLOCKS_PER_SPLIT) -> jax.Array:
    """Query tiles [B, G, n * QUERY_TILE_ROWS, hd] (`query_tiles`' layout) over layer `layer` of the pages
    [L, P, page, G, hd]; vpos [B, T] each token's position in its own sequence (a tree node's: root +
    depth); paths [B, T, 1 + W] a tree's `ancestor_paths` or None -> [B, T, G*R, hd]."""
    b, g, _, hd = tiles.shape
    t, r = vpos.shape[1], heads_per_kv
    tt = tile_tokens(r)
    n = -(-t // tt)
    # Per row of a tile: its token's position, -1 on padding rows (they see nothing).
    vpos = jnp.pad(vpos.astype(jnp.int32), ((0, 0), (0, n * tt - t)), constant_values=-1)
    row_vpos = jnp.pad(jnp.repeat(vpos.reshape(b, n, tt), r, axis=2), ((0, 0), (0, 0), (0, QUERY_TILE_ROWS - tt * r)),
                       constant_values=-1).reshape(b, n * QUERY_TILE_ROWS)
    if paths is not None:
        paths = jnp.pad(paths.astype(jnp.int32), ((0, 0), (0, n * tt - t), (0, 0)), mode="edge")
    out = _attend(tiles, row_vpos, paths, block_table.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
                  k_pages, v_pages, r=r, blocks_per_split=blocks_per_split)
    out = out.reshape(b, g, n, QUERY_TILE_ROWS, hd)[:, :, :, :tt * r].reshape(b, g, n * tt, r, hd)[:, :, :t]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, g * r, hd)


@functools.partial(jax.jit, static_argnames=("r", "blocks_per_split"))
def _attend(tiles, row_vpos, paths, block_table, layer, k_pages, v_pages, *, r: int,
            blocks_per_split: int) -> jax.Array:
    b, g, rows, hd = tiles.shape
    qt = QUERY_TILE_ROWS
    num_layers, num_pages, page_size = k_pages.shape[:3]
    splits = num_splits(block_table.shape[1], page_size, blocks_per_split)
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
        functools.partial(_kernel, r=r, page_size=page_size, scale=1.0 / math.sqrt(hd), windowed=windowed,
                          blocks_per_split=blocks_per_split),
        grid=(b, g, rows // qt, splits),
        in_specs=[
            pl.BlockSpec((None, None, qt, hd), lambda i, j, n, s: (i, j, n, 0)),
            pl.BlockSpec((None, qt), lambda i, j, n, s: (i, n)),
            *[pl.BlockSpec((None, *p.shape[1:]), lambda i, j, n, s: (i, 0, 0)) for p in path],
            pl.BlockSpec((None, block_table.shape[1]), lambda i, j, n, s: (i, 0)),
            pl.BlockSpec((1,), lambda i, j, n, s: (0,)),
            slots_spec, slots_spec,
        ],
        out_specs=[pl.BlockSpec((None, None, None, qt, hd), lambda i, j, n, s: (i, j, s, n, 0)),
                   pl.BlockSpec((None, None, None, qt), lambda i, j, n, s: (i, j, s, n))],
        out_shape=[jax.ShapeDtypeStruct((b, g, splits, rows, hd), tiles.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((b, g, splits, rows), jnp.float32)],
        interpret=interpret,
        compiler_params=_compiler_params(),
        name="eagle3_invariant_attention",
    )(tiles, row_vpos, *path, block_table, layer, k_slots, v_slots)
    return pallas_attention.combine_splits(out, lse, rows, tiles.dtype, 1) if splits > 1 else out[:, :, 0]


def _compiler_params():
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=4, num_stages=1)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"
