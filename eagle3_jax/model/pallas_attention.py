"""Paged GQA attention for steps of few tokens a row (T*R <= MAX_QUERY_ROWS) as Pallas (Triton)
kernels: `rope_and_write` (RoPE, the KV write and the query tiles in one launch), then `attend_tiles`
(online softmax over the pages a row has filled, as flash-decoding); the XLA form takes about a
dozen kernels a layer, in steps bound by their kernel count (BENCHMARKS.md, "Host overhead").

One program per (row, kv head g, split): its T*R queries are the tile's M rows (a power of two >= 16
for the tensor cores), row t*R + r being q head g*R + r of token t. Splits share a row's key blocks,
so one row still fills the SMs. The layer is an operand, not a block-spec constant, so a program
lowers each kernel once, not once a layer. A tree's window mask is packed to bits; its ancestors
are stored first, so the causal bound still holds.

Taller causal steps (prefill chunks) attend in tiles of t_q tokens, each its own tile row
(`attend_prefill`), after RoPE and the KV write as the XLA form: `rope_and_write` lays out one tile
a row and runs a program a token, for the one launch a step that matters only when steps are short.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_QUERY_ROWS = 128  # T*R of a tile: a tree verify of 32 tokens at R = 4
MAX_WINDOW = 64  # a verify's T or a draft level's (steps - 1) * top_k; each 32 one more mask word
TARGET_PROGRAMS = 256  # about two per SM of an H200 (132 SMs)
COMBINE_CHUNK = 32
COMBINE_ROWS = 16
MASKED = -1e30  # finite: a padded query row sees nothing and must not produce NaN


def supports(num_tokens: int, heads: int, kv_heads: int, page_size: int, window: int = 0) -> bool:
    """Whether a step fits the kernels; window: a token tree's W (0: no tree)."""
    rows = num_tokens * (heads // kv_heads)
    return (rows <= MAX_QUERY_ROWS and window <= MAX_WINDOW and page_size >= 16
            and page_size & (page_size - 1) == 0)


def supports_prefill(heads: int, kv_heads: int, page_size: int) -> bool:
    """Whether `attend_prefill` serves causal steps of any length: a tile of one token fits."""
    return supports(1, heads, kv_heads, page_size)


def _kernel(q_ref, qpos_ref, *refs, pages_per_block: int, scale: float, windowed: bool):
    # q_ref [M, hd]; qpos_ref [M] (-1: padding); win_ref [1 + nw, M] if windowed; table_ref [nb];
    # layer_ref [1]; k_ref, v_ref [L, P, page, hd] (this kv head); o_ref [M, hd]; lse_ref [M] f32.
    win_ref, (table_ref, layer_ref, k_ref, v_ref, o_ref, lse_ref) = (
        (refs[0], refs[1:]) if windowed else (None, refs))
    m, hd = q_ref.shape
    block_k = pages_per_block * k_ref.shape[2]
    layer = layer_ref[0]
    q = q_ref[...]
    qpos = qpos_ref[...]
    # The row's key blocks, shared between the splits; never past the table (padding rows' may).
    row_blocks = jnp.minimum(jnp.max(qpos) // block_k + 1, table_ref.shape[0] // pages_per_block)
    per_split = (row_blocks + pl.num_programs(2) - 1) // pl.num_programs(2)
    first = pl.program_id(2) * per_split
    end = jnp.minimum(first + per_split, row_blocks)

    def body(i, carry):
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]
        k = k_ref[layer, pages].reshape(block_k, hd)
        v = v_ref[layer, pages].reshape(block_k, hd)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        key_pos = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (m, block_k), 1)
        visible = key_pos <= qpos[:, None]
        if windowed:
            visible = visible & _in_window(win_ref, key_pos)
        return online_softmax_step(carry, jnp.where(visible, s, MASKED), v)

    write_split(jax.lax.fori_loop(first, end, body, online_softmax_init(m, hd)), o_ref, lse_ref)


def online_softmax_init(rows: int, hd: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An online softmax before its first key block: (output [rows, hd], row max, row sum) in f32."""
    return (jnp.zeros((rows, hd), jnp.float32), jnp.full((rows,), MASKED, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def online_softmax_step(carry, s: jax.Array, v: jax.Array):
    """One key block: carry, s [rows, block] f32 (MASKED: unseen), v [block, hd] -> carry; unchanged if all masked."""
    o, row_max, row_sum = carry
    new_max = jnp.maximum(row_max, s.max(axis=1))
    correction = jnp.exp(row_max - new_max)
    p = jnp.exp(s - new_max[:, None])
    row_sum = row_sum * correction + p.sum(axis=1)
    o = o * correction[:, None] + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return o, new_max, row_sum


def split_result(carry) -> tuple[jax.Array, jax.Array]:
    """A split's normalized output and log-sum-exp (near MASKED where it saw nothing: no weight in the combine)."""
    o, row_max, row_sum = carry
    return o / jnp.maximum(row_sum, 1e-30)[:, None], row_max + jnp.log(jnp.maximum(row_sum, 1e-30))


def write_split(carry, o_ref, lse_ref) -> None:
    """`split_result` into o_ref [rows, hd] (in its dtype), lse_ref [rows]."""
    o, lse = split_result(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


def _in_window(win_ref, key_pos: jax.Array) -> jax.Array:
    """key_pos [M, block_k] -> [M, block_k] bool: before the row's window, or its mask bit set."""
    rel = key_pos - win_ref[0][:, None]
    word, bit = jnp.right_shift(rel, 5), jnp.bitwise_and(rel, 31)
    seen = rel < 0
    for w in range(win_ref.shape[0] - 1):  # static: no gather from the row's words
        bits = jnp.right_shift(win_ref[1 + w][:, None], bit)
        seen = seen | ((word == w) & (jnp.bitwise_and(bits, 1) == 1))
    return seen


def window_rows(window_start: jax.Array, window_mask: jax.Array, heads_per_kv: int, m: int) -> jax.Array:
    """window_start [B], window_mask [B, T, W] -> [B, 1 + nw, M] i32: the start, then query row m's
    mask as nw = ceil(W / 32) words, which the kernel tests in registers instead of gathering."""
    b, t, w = window_mask.shape
    nw = -(-w // 32)
    bits = jnp.pad(window_mask, ((0, 0), (0, 0), (0, 32 * nw - w))).reshape(b, t, nw, 32).astype(jnp.uint32)
    words = jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)  # [B, T, nw]: OR of bits
    rows = jnp.concatenate([jnp.broadcast_to(window_start.astype(jnp.int32)[:, None, None], (b, t, 1)),
                            jax.lax.bitcast_convert_type(words, jnp.int32)], axis=2)
    rows = jnp.pad(jnp.repeat(rows, heads_per_kv, axis=1), ((0, 0), (0, m - t * heads_per_kv), (0, 0)))
    return rows.transpose(0, 2, 1)


def pages_per_block(num_blocks: int, page_size: int, block_keys: int = 64) -> int:
    """Pages per loop step: up to `block_keys` keys, and a divisor of the table width (no read past it)."""
    ppb = max(1, block_keys // page_size)
    while num_blocks % ppb:
        ppb //= 2
    return ppb


def num_splits(batch: int, kv_heads: int, key_blocks: int, programs: int = TARGET_PROGRAMS) -> int:
    """Splits of each row's keys: the largest power of two to `programs` in all and one per key block."""
    wanted = max(1, min(programs // (batch * kv_heads), key_blocks))
    return 1 << (wanted.bit_length() - 1)


def merge_split(acc: jax.Array, row_max: jax.Array, den: jax.Array, o: jax.Array, lse: jax.Array):
    """A combine's running sums (acc [rows, chunk], row max [rows], denominator [rows]) with one more
    split's normalized output o [rows, chunk] and log-sum-exp [rows] weighed in."""
    new_max = jnp.maximum(row_max, lse)
    correction, weight = jnp.exp(row_max - new_max), jnp.exp(lse - new_max)
    return acc * correction[:, None] + o * weight[:, None], new_max, den * correction + weight


def _combine_kernel(o_ref, lse_ref, out_ref):
    # o_ref [S, rows, chunk] f32, lse_ref [S, rows] -> out_ref [rows, chunk]; S unrolled: independent loads.
    acc, row_max = o_ref[0], lse_ref[0]
    den = jnp.ones_like(row_max)
    for s in range(1, o_ref.shape[0]):
        acc, row_max, den = merge_split(acc, row_max, den, o_ref[s], lse_ref[s])
    out_ref[...] = (acc / den[:, None]).astype(out_ref.dtype)


def _rope_write_kernel(qkv_ref, pos_ref, *refs, r: int, scratch_page: int, tree: bool, tile_tokens: int):
    # Program (row, kv head, token i). qkv_ref [T, R + 2, hd]; pos_ref, rope_ref [T]; table_ref [nb];
    # inv_freq_ref [hd/2]. Out: q_ref [n * M, hd], n tiles of M rows: row u*R + r of tile i // tile_tokens
    # is q head r of its token u = i % tile_tokens; k_ref, v_ref [L, P, page, hd], aliased to _k_in, _v_in.
    rope_ref, (table_ref, inv_freq_ref, layer_ref, _k_in, _v_in, q_ref, k_ref, v_ref) = (
        (refs[0], refs[1:]) if tree else (pos_ref, refs))
    i = pl.program_id(2)
    t, _, hd = qkv_ref.shape
    half, page_size, nb = hd // 2, k_ref.shape[2], table_ref.shape[0]
    tiles = -(-t // tile_tokens)
    m = q_ref.shape[0] // tiles
    layer = layer_ref[0]
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    position = pos_ref[i]
    # RoPE as layers.apply_rope: angles in f32, cos and sin rounded to the model's dtype.
    angle = rope_ref[i].astype(jnp.float32) * inv_freq_ref[...]
    cos, sin = jnp.cos(angle).astype(qkv_ref.dtype), jnp.sin(angle).astype(qkv_ref.dtype)
    block = position // page_size  # as layers.write_kv: past the table's end -> scratch page
    page = jnp.where(block < nb, table_ref[jnp.minimum(block, nb - 1)], scratch_page)
    slot = position % page_size
    first_row = i * r if tiles == 1 else (i // tile_tokens) * m + (i % tile_tokens) * r
    for j in range(r + 1):
        x1, x2 = qkv_ref[i, j, lo], qkv_ref[i, j, hi]
        y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        if j < r:
            q_ref[first_row + j, lo], q_ref[first_row + j, hi] = y1, y2
        else:
            k_ref[layer, page, slot, lo], k_ref[layer, page, slot, hi] = y1, y2
    v_ref[layer, page, slot, lo], v_ref[layer, page, slot, hi] = qkv_ref[i, r + 1, lo], qkv_ref[i, r + 1, hi]

    @pl.when(i == 0)
    def _():  # padding rows: defined values (their outputs are dropped)
        for tile in range(tiles):
            for row in range(min(t - tile * tile_tokens, tile_tokens) * r, m):
                q_ref[tile * m + row, :] = jnp.zeros((hd,), q_ref.dtype)


def query_tile_rows(num_tokens: int, heads_per_kv: int) -> int:
    """M, the rows of a (row, kv head) query tile: T*R padded to a power of two >= 16."""
    return max(16, 1 << (num_tokens * heads_per_kv - 1).bit_length())


def _kv_head_pages_spec(pages_shape: tuple[int, ...]) -> pl.BlockSpec:
    num_layers, num_pages, page_size, _, hd = pages_shape
    return pl.BlockSpec((num_layers, num_pages, page_size, None, hd), lambda i, j, n: (0, 0, 0, j, 0))


def _layer_operand(layer) -> jax.Array:
    return jnp.asarray(layer, jnp.int32).reshape(1)


def rope_and_write(qkv: jax.Array, positions: jax.Array, block_table: jax.Array, inv_freq, k_pages: jax.Array,
                   v_pages: jax.Array, layer, scratch_page: int,
                   rope_positions: jax.Array | None = None,
                   tile_rows: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotate q and k, write k and v into their pages in place, lay q out as tiles. qkv [B, T, G, R + 2, hd];
    positions [B, T] where k, v are stored; rope_positions [B, T] where q, k are rotated (a tree node:
    length + depth) -> (q tiles [B, G, M, hd]; k_pages, v_pages). tile_rows: n tiles of that many rows
    instead, tile_rows // R tokens each, the rest zero ([B, G, n * tile_rows, hd]: invariant_attention's)."""
    rope = None if rope_positions is None else rope_positions.astype(jnp.int32)
    return _rope_and_write(qkv, positions.astype(jnp.int32), rope, block_table.astype(jnp.int32),
                           jnp.asarray(inv_freq, jnp.float32), _layer_operand(layer), k_pages, v_pages,
                           scratch_page=scratch_page, tile_rows=tile_rows)


@functools.partial(jax.jit, static_argnames=("scratch_page", "tile_rows"))
def _rope_and_write(qkv, positions, rope_positions, block_table, inv_freq, layer, k_pages, v_pages, *,
                    scratch_page: int, tile_rows: int | None):
    b, t, g, r2, hd = qkv.shape
    r, nb = r2 - 2, block_table.shape[1]
    tree = rope_positions is not None
    if tile_rows is None:
        tile_tokens, q_rows = t, query_tile_rows(t, r)
    else:
        tile_tokens = tile_rows // r
        q_rows = -(-t // tile_tokens) * tile_rows
    # A program per token: one per row would serialize T chains of dependent loads.
    pages_spec = _kv_head_pages_spec(k_pages.shape)
    positions_spec = pl.BlockSpec((None, t), lambda i, j, n: (i, 0))
    rope = [rope_positions] if tree else []
    return pl.pallas_call(
        functools.partial(_rope_write_kernel, r=r, scratch_page=scratch_page, tree=tree, tile_tokens=tile_tokens),
        grid=(b, g, t),
        in_specs=[pl.BlockSpec((None, t, None, r2, hd), lambda i, j, n: (i, 0, j, 0, 0)),
                  positions_spec,
                  *[positions_spec] * len(rope),
                  pl.BlockSpec((None, nb), lambda i, j, n: (i, 0)),
                  pl.BlockSpec((hd // 2,), lambda i, j, n: (0,)),
                  pl.BlockSpec((1,), lambda i, j, n: (0,)),
                  pages_spec, pages_spec],
        out_specs=[pl.BlockSpec((None, None, q_rows, hd), lambda i, j, n: (i, j, 0, 0)), pages_spec, pages_spec],
        out_shape=[jax.ShapeDtypeStruct((b, g, q_rows, hd), qkv.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={5 + len(rope): 1, 6 + len(rope): 2},
        interpret=_interpret(),
        compiler_params=_compiler_params(1),
        name="eagle3_rope_write_kv",
    )(qkv, positions, *rope, block_table, inv_freq, layer, k_pages, v_pages)


def attend_tiles(q_tiles: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer, positions: jax.Array,
                 block_table: jax.Array, heads_per_kv: int, splits: int | None = None, block_keys: int = 64,
                 num_warps: int | None = None, num_stages: int = 1, window_start: jax.Array | None = None,
                 window_mask: jax.Array | None = None) -> jax.Array:
    """Query tiles [B, G, M, hd] over layer `layer` of the pages [L, P, page, G, hd]; positions [B, T] ->
    [B, T, G*R, hd]. num_stages 1: a split walks few blocks, and pipelining them was slower
    (BENCHMARKS.md, "Llama-3.1-8B step functions")."""
    b, g, m, hd = q_tiles.shape
    t, r = positions.shape[1], heads_per_kv
    rows = t * r
    # Outside the layer's jit: the same expressions every layer, computed once a program (CSE).
    qpos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), r, axis=1), ((0, 0), (0, m - rows)), constant_values=-1)
    window = None if window_mask is None else window_rows(window_start, window_mask, r, m)
    nb = block_table.shape[1]
    ppb = pages_per_block(nb, k_pages.shape[2], block_keys)
    key_blocks = nb // ppb
    splits = num_splits(b, g, key_blocks) if splits is None else num_splits(1, 1, key_blocks, splits)
    # 128 rows: the f32 accumulator alone is 128 registers a thread over 4 warps at hd 128.
    num_warps = (4 if m <= 64 else 8) if num_warps is None else num_warps
    out = _attend(q_tiles, qpos, window, block_table.astype(jnp.int32), _layer_operand(layer), k_pages, v_pages,
                  rows=rows, pages_per_block=ppb, splits=splits, num_warps=num_warps, num_stages=num_stages)
    return out[:, :, :rows].reshape(b, g, t, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, g * r, hd)


@functools.partial(jax.jit, static_argnames=("rows", "pages_per_block", "splits", "num_warps", "num_stages"))
def _attend(q_tiles, qpos, window, block_table, layer, k_pages, v_pages, *, rows: int, pages_per_block: int,
            splits: int, num_warps: int, num_stages: int) -> jax.Array:
    b, g, m, hd = q_tiles.shape
    windowed = window is not None
    kernel = functools.partial(_kernel, pages_per_block=pages_per_block, scale=1.0 / math.sqrt(hd),
                               windowed=windowed)
    interpret = _interpret()
    if interpret:  # the interpreter reads inputs whole per program: one layer only
        k_pages, v_pages, layer = k_pages[layer[0]][None], v_pages[layer[0]][None], jnp.zeros((1,), jnp.int32)
    pages_spec = _kv_head_pages_spec(k_pages.shape)
    window = [] if window is None else [window]
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, g, splits),
        in_specs=[
            pl.BlockSpec((None, None, m, hd), lambda i, j, s: (i, j, 0, 0)),
            pl.BlockSpec((None, m), lambda i, j, s: (i, 0)),
            *[pl.BlockSpec((None, w.shape[1], m), lambda i, j, s: (i, 0, 0)) for w in window],
            pl.BlockSpec((None, block_table.shape[1]), lambda i, j, s: (i, 0)),
            pl.BlockSpec((1,), lambda i, j, s: (0,)),
            pages_spec,
            pages_spec,
        ],
        out_specs=[pl.BlockSpec((None, None, None, m, hd), lambda i, j, s: (i, j, s, 0, 0)),
                   pl.BlockSpec((None, None, None, m), lambda i, j, s: (i, j, s, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, g, splits, m, hd), q_tiles.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((b, g, splits, m), jnp.float32)],
        interpret=interpret,
        compiler_params=_compiler_params(num_warps, num_stages),
        name="eagle3_paged_attention",
    )(q_tiles, qpos, *window, block_table, layer, k_pages, v_pages)
    return out[:, :, 0] if splits == 1 else combine_splits(out, lse, rows, q_tiles.dtype, num_stages)


def combine_splits(out: jax.Array, lse: jax.Array, rows: int, dtype, num_stages: int) -> jax.Array:
    """out [B, G, S, M, hd] f32, lse [B, G, S, M] -> [B, G, M, hd], splits weighted by softmax mass; rows: T*R."""
    b, g, splits, m, hd = out.shape
    # Chunks of rows and of the head dim: (row, kv head) programs alone are too few to hide loads.
    chunk, row_chunk = min(COMBINE_CHUNK, hd), min(COMBINE_ROWS, m)
    return pl.pallas_call(
        _combine_kernel,
        grid=(b, g, -(-rows // row_chunk), hd // chunk),
        in_specs=[pl.BlockSpec((None, None, splits, row_chunk, chunk), lambda i, j, q, c: (i, j, 0, q, c)),
                  pl.BlockSpec((None, None, splits, row_chunk), lambda i, j, q, c: (i, j, 0, q))],
        out_specs=pl.BlockSpec((None, None, row_chunk, chunk), lambda i, j, q, c: (i, j, q, c)),
        out_shape=jax.ShapeDtypeStruct((b, g, m, hd), dtype),
        interpret=_interpret(),
        compiler_params=_compiler_params(4, num_stages),
        name="eagle3_attention_combine",
    )(out, lse)


def prefill_tile_tokens(heads_per_kv: int) -> int:
    """t_q, the tokens of a prefill query tile: the most, a power of two, whose R heads fit one tile."""
    return 1 << ((MAX_QUERY_ROWS // heads_per_kv).bit_length() - 1)


def attend_prefill(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer, positions: jax.Array,
                   block_table: jax.Array, heads_per_kv: int) -> jax.Array:
    """Causal attention of steps too tall for one tile (prefill chunks): q [B, T, G*R, hd] rotated, its
    keys already in layer `layer` of the pages [L, P, page, G, hd]; positions [B, T] -> [B, T, G*R, hd].

    Each t_q tokens of a row are a tile row of `attend_tiles`, with the row's block table, so a tile
    walks only the key blocks up to its last position: a chunk reads about T/t_q times its context
    from L2, the context once from memory, where the XLA form reads every row's whole table and
    writes [B, G, R, T, S] f32 scores. Tokens padding T to tiles sit at position -1: they see
    nothing, and a tile of them reads nothing. Splits as for the B = 1 call of the same T, so a
    prompt's attention (and the KV its later layers write) does not depend on the rows beside it."""
    b, t, h, hd = q.shape
    g, r = h // heads_per_kv, heads_per_kv
    tq = prefill_tile_tokens(r)
    n = -(-t // tq)  # tiles a row
    pad = n * tq - t
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    positions = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    m = query_tile_rows(tq, r)
    # [B, n*tq, G*R, hd] -> [B, n, G, tq*R, hd] (row t*R + rr: q head g*R + rr of the tile's token t) -> [B*n, G, M, hd]
    tiles = q.reshape(b, n, tq, g, r, hd).transpose(0, 1, 3, 2, 4, 5).reshape(b * n, g, tq * r, hd)
    tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, m - tq * r), (0, 0)))
    nb = block_table.shape[1]
    splits = num_splits(n, g, nb // pages_per_block(nb, k_pages.shape[2]))
    out = attend_tiles(tiles, k_pages, v_pages, layer, positions.reshape(b * n, tq),
                       jnp.repeat(block_table, n, axis=0), r, splits)  # [B*n, tq, G*R, hd]
    return out.reshape(b, n * tq, h, hd)[:, :t]


@functools.partial(jax.jit, static_argnames=("splits", "block_keys", "num_warps", "num_stages"))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                    block_table: jax.Array, splits: int | None = None, block_keys: int = 64,
                    num_warps: int | None = None, num_stages: int = 1, window_start: jax.Array | None = None,
                    window_mask: jax.Array | None = None) -> jax.Array:
    """`layers.paged_attention`'s contract on these kernels, for tests (the steps call `attend_tiles`)."""
    b, t, h, hd = q.shape
    g = k_pages.shape[2]
    r = h // g
    m = query_tile_rows(t, r)
    tiles = q.reshape(b, t, g, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, g, t * r, hd)
    tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, m - t * r), (0, 0)))
    return attend_tiles(tiles, k_pages[None], v_pages[None], 0, positions, block_table, r, splits, block_keys,
                        num_warps, num_stages, window_start, window_mask)


def _interpret() -> bool:
    """Pallas' interpreter off the GPU (tests that lower for CUDA on a CPU patch this)."""
    return jax.default_backend() != "gpu"


def _compiler_params(num_warps: int, num_stages: int = 2):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
