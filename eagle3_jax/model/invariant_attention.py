"""Batch-invariant paged attention: a token's output is bit for bit the same in a decode, a chain's or
a tree's verify, or a prefill chunk, at any batch size (pallas_attention's step-sized tiles and
batch-sized splits make its sums' order depend on the neighbours).

One program per (row, kv head, query tile, split). A query tile is always `tile_rows(R)` rows, the R
q heads of `tile_tokens(R)` tokens and masked padding (a decode's R rows too), so every step's
products are the same MMA shape and its row sums the same layout: a row's arithmetic does not depend
on the rows beside it, as invariant_gemm's fixed BLOCK_M. Keys are walked in BLOCK_KEYS blocks by
position in the token's own sequence, in fixed splits of BLOCKS_PER_SPLIT blocks, so every sum's
order is fixed by positions alone. A tile walks to its last token's position: a block a row sees
nothing of leaves its carry unchanged (p = exp(MASKED - max) = 0, correction 1), and a split it sees
nothing of is written as if it had walked no block. The combine takes each row's splits in order up to
its own position's and no further, so its sums too are fixed by the row's position; a split past the
tile's last position is never read, and not written: small splits shorten a decode's walk without a
long table's empty splits costing writes and reads. Where a causal step's tiles are many
(`KernelSettings.walk_splits_from`; off as shipped), a program a tile walks its splits in turn and
combines them itself (`_walk_kernel`): the same sums, no split's output written and read back. On an
H100 it spared a 32-token step at 64 rows 7-24% of its attention but the whole forward 1%, and the
8B steps kept their bits with it (BENCHMARKS.md, "Batch invariance: the cost"). Where a row's kv
head has several query tiles (a long chunk, a tree), a program may take a group of them
(`KernelSettings.tiles_per_program`, 4 as shipped): each key block is loaded once for the group,
each tile's MMAs and sums its own, so every tile's arithmetic is a lone tile's. On an H100 it spared
a 32-token step at 64 rows 16% of its attention and the tree's verify there 9%, and the 8B bits held
(BENCHMARKS.md, "Batch invariance: the cost").

A tree node reads its ancestors as at root + depth, where decode would have stored them, gathered
from where the verify did, so its logits equal decode's. The blocks before the window's (context
every node shares) are multiplied once a tile; the split the window starts in leaves its carry (f32,
exact) to a second kernel, which walks each token's blocks from the window's on, its ancestors
gathered: the whole tile's MMA shape with only the token's rows loaded and kept, so the same
arithmetic for them as a decode's tile-wide step. A node sits at most W - 1 positions past the
window's start, so that kernel's grid spans only the splits a window of W can touch (two when W is
within a split), the first the window's own, found in the kernel: its outputs are whole rows of
splits, indexed there. A program walks several tokens of one tile in turn (`window_tokens`), each
token's steps exactly its own program's. The rest of the splits, and the rows of a later split
than the window's first that a token does not reach, are `_tile_kernel`'s to write (nothing seen).
RoPE and the KV write: `pallas_attention.rope_and_write` with tile_rows=`tile_rows(R)`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle3_jax.model import pallas_attention
from eagle3_jax.model.pallas_attention import MASKED


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """What may be tuned per GPU without giving up invariance, since every step of a process uses the
    same: the key block (each sum's order), a split's blocks, the query tile's rows, the kernels' warps
    and pipeline stages, and whether keys no row sees are read. As shipped, swept on an H100
    (BENCHMARKS.md, "Batch invariance: the cost"): the key block, splits, warps and stages the fastest
    with 64-row tiles, then 16 rows the fastest tile with them; with the combine by position 2 blocks
    a split win at one or five tokens a row and lose at 32 or a tree's window; 4 query tiles a program
    where a step has many."""

    block_keys: int = 64
    blocks_per_split: int = 8  # a split's fixed range: 512 key positions
    # A query tile's rows, at least (`tile_rows`): 16 waste fewer rows than a Hopper warpgroup MMA's 64
    # on a decode's R q heads and on the tree window's per-token walks; 64 read a long chunk's keys
    # fewer times.
    query_tile_rows: int = 16
    num_warps: int = 4
    num_stages: int = 1
    window_warps: int = 4
    window_stages: int = 1
    # 1: a block's keys past every position its rows see are not read (masked loads, zeros): they get
    # p = 0 (or are dropped with the carry they were added to), so no output bit moves; a decode's last
    # block and a tree token's window block read only what it sees. 0: every key of a walked block read.
    skip_unseen_keys: int = 0
    # From this many (row, kv head, query tile) programs, a causal step's tile walks its splits in turn
    # and combines them itself, as `_combine_kernel` would (the same sums: `_walk_kernel`), writing no
    # split's output: many tiles fill the SMs without splits. 0: splits always run as programs.
    walk_splits_from: int = 0
    # A causal step's or a tree's context program takes up to this many query tiles of a row's kv head
    # (a power of two), each block of keys loaded once for them all, each tile's MMAs and sums its own:
    # a long chunk's or a tree's tiles read the keys fewer times. 1: a program a tile. Taken only
    # while the programs stay at least GROUPED_MIN_PROGRAMS (`tile_group`). 4 and 8 timed alike on an H100.
    tiles_per_program: int = 4

    @classmethod
    def parse(cls, text: str) -> KernelSettings:
        """"block_keys=128,num_stages=2" -> the defaults with those replaced."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, value = item.partition("=")
            valid = (value in ("0", "1") if name in SWITCHES
                     else value.isdigit() and (name in COUNTS or int(value) >= 1))
            if name not in fields or not valid:
                raise ValueError(f"${SETTINGS_ENV}: {item!r} is not one of {sorted(fields)} set to a positive integer"
                                 f" (0 or 1 for {', '.join(SWITCHES)}; 0 or more for {', '.join(COUNTS)})")
            values[name] = int(value)
        settings = cls(**values)
        # An MMA's side; a group of tiles' rows, a block's.
        for name, least in (("block_keys", 16), ("query_tile_rows", 16), ("tiles_per_program", 1)):
            value = getattr(settings, name)
            if value < least or value & (value - 1):
                raise ValueError(f"${SETTINGS_ENV}: {name} must be a power of two >= {least}, not {value}")
        return settings


SWITCHES = ("skip_unseen_keys",)  # KernelSettings' fields that are 0 or 1
COUNTS = ("walk_splits_from",)  # and those that may be 0
SETTINGS_ENV = "EAGLE3_JAX_INVARIANT_ATTENTION"  # KernelSettings.parse's form, read over the defaults at import
SETTINGS = KernelSettings.parse(os.environ.get(SETTINGS_ENV, ""))
BLOCK_KEYS = SETTINGS.block_keys
BLOCKS_PER_SPLIT = SETTINGS.blocks_per_split
QUERY_TILE_ROWS = SETTINGS.query_tile_rows  # a tile's rows at least, whatever the step (`tile_rows`)
# The tree window kernel's programs over its first split to aim at: enough to fill an H100's SMs a few
# times over; a program walks more tokens in turn as the batch grows past it (`window_tokens`).
WINDOW_PROGRAMS = 1024
# Tiles grouped into one program (`KernelSettings.tiles_per_program`) only while the programs stay this
# many: about two an H100 SM.
GROUPED_MIN_PROGRAMS = 256


def _keys(i, table_ref, layer, k_ref, v_ref, path_ref=None, token=None, *, last_pos, page_size: int,
          skip_unseen_keys: bool):
    """Key block i (BLOCK_KEYS positions) as `token` sees it, its ancestors gathered from where the verify
    stored them (None: as every row does) -> (positions [BLOCK_KEYS], k, v [BLOCK_KEYS, hd]).
    last_pos: the last position a row of interest sees (with skip_unseen_keys, keys past it are not read)."""
    nb = table_ref.shape[0]
    key_pos = i * BLOCK_KEYS + jax.lax.iota(jnp.int32, BLOCK_KEYS)
    stored = key_pos
    if token is not None:
        start = path_ref[token, 0]
        depth = key_pos - start
        offset = path_ref[token, 1 + jnp.clip(depth, 0, path_ref.shape[1] - 2)]
        stored = jnp.where(depth >= 0, start + offset, key_pos)
    page = table_ref[jnp.clip(stored // page_size, 0, nb - 1)]
    slot = page * page_size + stored % page_size
    if skip_unseen_keys:
        hd = k_ref.shape[-1]
        read = jnp.broadcast_to((key_pos <= last_pos)[:, None], (BLOCK_KEYS, hd))
        at = (layer, slot[:, None], jax.lax.iota(jnp.int32, hd)[None, :])  # [BLOCK_KEYS, hd] element indices
        k, v = (plgpu.load(ref.at[at], mask=read, other=0) for ref in (k_ref, v_ref))
    else:
        k, v = k_ref[layer, slot], v_ref[layer, slot]
    return key_pos, k, v


def _update(carry, q, vpos, key_pos, k, v, scale: float):
    """A query tile q [QT, hd], rows at positions vpos [QT], over one key block: its online softmax carry
    on. Every tile's the same MMA shape, whatever program runs it and whatever tiles beside it."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    return pallas_attention.online_softmax_step(carry, jnp.where(key_pos[None, :] <= vpos[:, None], s, MASKED), v)


def _step(i, carry, q, vpos, table_ref, layer, k_ref, v_ref, path_ref=None, token=None, *, last_pos, page_size: int,
          scale: float, skip_unseen_keys: bool):
    """`_update` over key block i (`_keys`)."""
    keys = _keys(i, table_ref, layer, k_ref, v_ref, path_ref, token, last_pos=last_pos, page_size=page_size,
                 skip_unseen_keys=skip_unseen_keys)
    return _update(carry, q, vpos, *keys, scale)


def _bounds(nb: int, page_size: int, blocks_per_split: int, split):
    """A split's first block and the end of its range, never past the table (a padding row's position
    can run past it)."""
    capacity = -(-nb * page_size // BLOCK_KEYS)
    first = split * blocks_per_split
    return first, jnp.minimum(first + blocks_per_split, capacity), capacity


def _tile_keys(table_ref, layer_ref, k_ref, v_ref, last_pos, *, page_size: int, skip_unseen_keys: bool):
    """`_keys` of block i as every row of the tiles sees them, to `last_pos`, their last row's position."""
    return functools.partial(_keys, table_ref=table_ref, layer=layer_ref[0], k_ref=k_ref, v_ref=v_ref,
                             last_pos=last_pos, page_size=page_size, skip_unseen_keys=skip_unseen_keys)


def _combine_in_order(split_result, vpos, split_keys: int, num_splits: int) -> jax.Array:
    """Split 0's (o, lse), then each row's next splits' to its own position's and no further, in order:
    -> acc / den [rows, chunk] f32. split_result(s) -> (o [rows, chunk] f32, lse [rows]): read where
    `_combine_kernel` combines splits written apart, computed where `_walk_kernel` walks them."""
    row_splits = vpos // split_keys + 1  # [rows]; padding rows: split 0 alone (the init)
    splits = jnp.clip(jnp.max(row_splits), 1, num_splits)

    def add(split, carry):
        acc, row_max, den = carry
        o, lse = split_result(split)
        merged = pallas_attention.merge_split(acc, row_max, den, o, lse)
        mine = split < row_splits
        return (jnp.where(mine[:, None], merged[0], acc), jnp.where(mine, merged[1], row_max),
                jnp.where(mine, merged[2], den))

    o, lse = split_result(0)
    acc, _, den = jax.lax.fori_loop(1, splits, add, (o, lse, jnp.ones_like(lse)))
    return acc / den[:, None]


def _split_carries(keys, tiles, first, last, scale: float) -> list:
    """The online softmax of each query tile of `tiles` [(q [QT, hd], vpos [QT])] over key blocks
    [first, last) of a split, to their last row's position, each block's keys loaded once (`keys(i)`):
    [(output [QT, hd], row max, row sum)] in f32, each row's init where it sees nothing of the split.
    A tile walked past its own last row's block is left as it was (p = 0, correction 1)."""
    end = jnp.minimum(last, functools.reduce(jnp.maximum, [jnp.max(vpos) for _, vpos in tiles]) // BLOCK_KEYS + 1)
    inits = tuple(pallas_attention.online_softmax_init(*q.shape) for q, _ in tiles)

    def block(i, carries):
        key_pos, k, v = keys(i)
        return tuple(_update(c, q, vpos, key_pos, k, v, scale) for c, (q, vpos) in zip(carries, tiles))

    carries = jax.lax.fori_loop(first, end, block, inits)
    # A row sees key `first * BLOCK_KEYS` if it sees anything of the split: else no block happened to it
    # (blocks it saw nothing of left p = 1 where its max was still MASKED).
    out = []
    for carry, init, (_, vpos) in zip(carries, inits, tiles):
        seen = vpos >= first * BLOCK_KEYS
        out.append(tuple(jnp.where(seen.reshape((-1,) + (1,) * (a.ndim - 1)), a, b) for a, b in zip(carry, init)))
    return out


def _walk_kernel(q_ref, vpos_ref, table_ref, layer_ref, k_ref, v_ref, o_ref, *, page_size: int, scale: float,
                 blocks_per_split: int, skip_unseen_keys: bool, num_splits: int):
    # Program (row, kv head, tile) of a causal step: refs as `_tile_kernel`'s, o_ref [QT, hd] the output.
    # The tile's splits in turn, each as `_tile_kernel` walks it, combined as `_combine_kernel` combines
    # them (split 0, then each row's next ones to its own position's): the same f32 sums, none written.
    q, vpos = q_ref[...], vpos_ref[...]
    keys = _tile_keys(table_ref, layer_ref, k_ref, v_ref, jnp.max(vpos), page_size=page_size,
                      skip_unseen_keys=skip_unseen_keys)

    def split_result(split):
        first, last, _ = _bounds(table_ref.shape[0], page_size, blocks_per_split, split)
        return pallas_attention.split_result(_split_carries(keys, [(q, vpos)], first, last, scale)[0])

    out = _combine_in_order(split_result, vpos, BLOCK_KEYS * blocks_per_split, num_splits)
    o_ref[...] = out.astype(o_ref.dtype)


def _tile_kernel(q_ref, vpos_ref, *refs, page_size: int, scale: float, windowed: bool, blocks_per_split: int,
                 skip_unseen_keys: bool, group: int):
    # Program (row, kv head, group of tiles, split): the blocks every row of the tiles sees alike, to their
    # last position or a tree window's block, each block's keys loaded once for the `group` tiles. q_ref
    # [group * QT, hd], row u*R + h of a tile: q head h of its token u; vpos_ref [group * QT] own-sequence
    # positions (-1: padding); path_ref [T, 1 + W] the row's `ancestor_paths`; table_ref [nb]; k_ref,
    # v_ref [L, P * page, hd] -> o_ref [group * QT, hd], lse_ref [group * QT]. A tree's split the window
    # starts in leaves its carry to `_window_kernel` instead, carry_refs [group * QT, hd], [group * QT],
    # [group * QT] f32 (exact).
    if windowed:
        path_ref, table_ref, layer_ref, k_ref, v_ref, o_ref, lse_ref, *carry_refs = refs
    else:
        (table_ref, layer_ref, k_ref, v_ref, o_ref, lse_ref), path_ref = refs, None
    qt = q_ref.shape[0] // group
    vpos = vpos_ref[...]
    split = pl.program_id(3)
    first, last, capacity = _bounds(table_ref.shape[0], page_size, blocks_per_split, split)
    shared_end = path_ref[0, 0] // BLOCK_KEYS if windowed else capacity
    # A tree's split the window starts in: its carry goes on in `_window_kernel`.
    carried = (first <= shared_end) & (shared_end < last) if windowed else False
    # A split past the tiles' last position is neither walked, written nor read (`_combine_kernel` stops
    # each row at its own position's split): small splits cost a long table nothing past the context.
    # Split 0 is written whatever the tile (padding's included).
    reached = (split == 0) | (first * BLOCK_KEYS <= jnp.max(vpos))
    rows = [pl.ds(i * qt, qt) for i in range(group)]  # each tile's rows of the blocks

    def write(carries):
        for at, carry in zip(rows, carries):
            pallas_attention.write_split(carry, o_ref.at[at], lse_ref.at[at])

    @pl.when(reached | carried)
    def _():
        keys = _tile_keys(table_ref, layer_ref, k_ref, v_ref, jnp.max(vpos), page_size=page_size,
                          skip_unseen_keys=skip_unseen_keys)
        tiles = [(q_ref[at], vpos_ref[at]) for at in rows]
        carries = _split_carries(keys, tiles, first, jnp.minimum(last, shared_end), scale)
        if not windowed:
            write(carries)
            return
        # Splits past the window's start are written here too, every row's carry init (nothing of them
        # seen yet): what the window kernel's walk leaves a row it does not reach, so it skips those rows.

        @pl.when(jnp.logical_not(carried))
        def _():
            write(carries)

        @pl.when(carried)
        def _():
            for at, carry in zip(rows, carries):
                for ref, value in zip(carry_refs, carry):
                    ref[at] = value


def _window_kernel(q_ref, vpos_ref, path_ref, table_ref, layer_ref, k_ref, v_ref, carry_o_ref, carry_max_ref,
                   carry_sum_ref, _o_in, _lse_in, o_ref, lse_ref, *, r: int, page_size: int, scale: float,
                   blocks_per_split: int, window_tokens: int, skip_unseen_keys: bool):
    # Program (row, kv head, tile * chunks + c, k) of a tree verify: the tile's tokens c * window_tokens
    # on, one after another, over the k-th split from the one the window starts in; each token from
    # `_tile_kernel`'s carry (k = 0; init after), its blocks from the window's on, its ancestors
    # gathered. Refs as `_tile_kernel`'s, of the tile; o_ref [S, QT, hd], lse_ref [S, QT] every split
    # of the tile, aliased to _o_in, _lse_in: only the tokens' rows of split k are written (token 0 of
    # a tile also writes the tile's padding rows in split 0), past split 0 only those of tokens that
    # reach it (`_tile_kernel` wrote the rest as nothing seen).
    rows, hd = q_ref.shape
    tokens = rows // r
    chunks = -(-tokens // window_tokens)
    tile, chunk = pl.program_id(2) // chunks, pl.program_id(2) % chunks
    in_tile = jnp.minimum(path_ref.shape[0] - tile * tokens, tokens)  # the tile's tokens
    shared_end = path_ref[0, 0] // BLOCK_KEYS
    split = shared_end // blocks_per_split + pl.program_id(3)
    first, last, _ = _bounds(table_ref.shape[0], page_size, blocks_per_split, split)
    from_carry = pl.program_id(3) == 0  # a later split's blocks all lie past shared_end

    @pl.when((split < o_ref.shape[0]) & (last > shared_end))
    def _():
        row_token = jax.lax.iota(jnp.int32, rows) // r
        vpos = vpos_ref[...]
        o_split, lse_split = o_ref.at[split], lse_ref.at[split]

        def token_walk(u, _):
            @pl.when(from_carry | (vpos_ref[u * r] >= first * BLOCK_KEYS))  # later splits: tokens that reach them
            def _():
                own = (row_token == u) | ((u == 0) & (row_token >= in_tile))
                own2 = jnp.broadcast_to(own[:, None], (rows, hd))
                # The whole tile's MMA shape, only the token's rows loaded: the same arithmetic for them as
                # `_tile_kernel`'s (a decode's) step over the same block.
                q = plgpu.load(q_ref, mask=own2, other=0)
                carry = (plgpu.load(carry_o_ref, mask=own2 & from_carry, other=0.0),
                         plgpu.load(carry_max_ref, mask=own & from_carry, other=MASKED),
                         plgpu.load(carry_sum_ref, mask=own & from_carry, other=0.0))
                step = functools.partial(_step, q=q, vpos=vpos, table_ref=table_ref, layer=layer_ref[0], k_ref=k_ref,
                                         v_ref=v_ref, path_ref=path_ref, token=tile * tokens + u,
                                         last_pos=vpos_ref[u * r], page_size=page_size, scale=scale,
                                         skip_unseen_keys=skip_unseen_keys)
                end = jnp.minimum(last, vpos_ref[u * r] // BLOCK_KEYS + 1)
                o, lse = pallas_attention.split_result(
                    jax.lax.fori_loop(jnp.maximum(first, shared_end), end, step, carry))
                plgpu.store(o_split, o.astype(o_split.dtype), mask=own2)
                plgpu.store(lse_split, lse, mask=own)

        jax.lax.fori_loop(chunk * window_tokens, jnp.minimum((chunk + 1) * window_tokens, in_tile), token_walk,
                          None)


def _combine_kernel(vpos_ref, o_ref, lse_ref, out_ref, *, split_keys: int):
    # Program (row, kv head, row chunk, hd chunk): vpos_ref [rows] positions (-1: padding), o_ref
    # [S, rows, chunk] f32, lse_ref [S, rows] -> out_ref [rows, chunk]. A row takes the splits to its own
    # position's, in order, and no further: those past it saw nothing (and a tile does not write those
    # past its last position), so a row's sums depend on its position alone, not on the tile's rows.
    out = _combine_in_order(lambda s: (o_ref[s], lse_ref[s]), vpos_ref[...], split_keys, o_ref.shape[0])
    out_ref[...] = out.astype(out_ref.dtype)


def combine_splits(out: jax.Array, lse: jax.Array, row_vpos: jax.Array, dtype, split_keys: int) -> jax.Array:
    """out [B, G, S, M, hd] f32, lse [B, G, S, M], row_vpos [B, M] -> [B, G, M, hd]: each row's splits to
    its own position's, weighted by softmax mass (`_combine_kernel`)."""
    b, g, splits, m, hd = out.shape
    chunk, row_chunk = min(pallas_attention.COMBINE_CHUNK, hd), min(pallas_attention.COMBINE_ROWS, m)
    return pl.pallas_call(
        functools.partial(_combine_kernel, split_keys=split_keys),
        grid=(b, g, m // row_chunk, hd // chunk),
        in_specs=[pl.BlockSpec((None, row_chunk), lambda i, j, q, c: (i, q)),
                  pl.BlockSpec((None, None, splits, row_chunk, chunk), lambda i, j, q, c: (i, j, 0, q, c)),
                  pl.BlockSpec((None, None, splits, row_chunk), lambda i, j, q, c: (i, j, 0, q))],
        out_specs=pl.BlockSpec((None, None, row_chunk, chunk), lambda i, j, q, c: (i, j, q, c)),
        out_shape=jax.ShapeDtypeStruct((b, g, m, hd), dtype),
        interpret=_interpret(),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="eagle3_invariant_attention_combine",
    )(row_vpos, out, lse)


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


def window_splits(width: int, splits: int, blocks_per_split: int = BLOCKS_PER_SPLIT) -> int:
    """The splits a tree window of `width` positions can touch (its nodes sit at most width - 1 past
    its start), of a table's `splits`."""
    return min(splits, (width - 2) // (BLOCK_KEYS * blocks_per_split) + 2)


def window_tokens(batch: int, kv_heads: int, tokens: int) -> int:
    """The tokens a window program walks in turn: one until the batch's tokens fill WINDOW_PROGRAMS
    programs, more as it grows, at most a tile's."""
    return max(1, min(batch * kv_heads * tokens // WINDOW_PROGRAMS, QUERY_TILE_ROWS))


def tile_group(batch: int, kv_heads: int, tiles: int) -> int:
    """The query tiles of a row's kv head a causal or context program takes: the most, a power of two up
    to `KernelSettings.tiles_per_program` and to the tiles there are, that leaves GROUPED_MIN_PROGRAMS
    programs a split."""
    group = 1
    while (group < SETTINGS.tiles_per_program and group < tiles
           and batch * kv_heads * -(-tiles // (2 * group)) >= GROUPED_MIN_PROGRAMS):
        group *= 2
    return group


def tile_rows(heads_per_kv: int) -> int:
    """A query tile's rows for a model of R q heads a kv head: QUERY_TILE_ROWS, or the power of two
    that holds one token's R rows where that is more. Fixed by the model, so by every step alike."""
    if heads_per_kv < 1:
        raise ValueError(f"invariant attention takes at least one q head a kv head, not {heads_per_kv}")
    return max(QUERY_TILE_ROWS, 1 << (heads_per_kv - 1).bit_length())


def tile_tokens(heads_per_kv: int) -> int:
    """The tokens of one query tile: as many whose R q heads fit `tile_rows(R)` rows."""
    return tile_rows(heads_per_kv) // heads_per_kv


def query_tiles(q: jax.Array, kv_heads: int) -> jax.Array:
    """Rotated q [B, T, G*R, hd] -> [B, G, n * M, hd], M = `tile_rows(R)`: the layout `rope_and_write`
    writes with tile_rows=M (row u*R + h of tile k: q head g*R + h of token k * tile_tokens + u)."""
    b, t, h, hd = q.shape
    r = h // kv_heads
    m, tt = tile_rows(r), tile_tokens(r)
    n = -(-t // tt)
    q = jnp.pad(q, ((0, 0), (0, n * tt - t), (0, 0), (0, 0))).reshape(b, n, tt, kv_heads, r, hd)
    q = q.transpose(0, 3, 1, 2, 4, 5).reshape(b, kv_heads, n, tt * r, hd)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, m - tt * r), (0, 0)))
    return q.reshape(b, kv_heads, n * m, hd)


def attention(qkv: jax.Array, positions: jax.Array, block_table: jax.Array, inv_freq, k_pages: jax.Array,
              v_pages: jax.Array, layer, scratch_page: int, tree=None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """RoPE, the KV write and attention for any tokens a row: qkv [B, T, G, R + 2, hd], positions
    [B, T] (where stored) -> (out [B, T, G*R, hd], k_pages, v_pages)."""
    r = qkv.shape[3] - 2
    rope = None if tree is None else tree.rope_positions
    tiles, k_pages, v_pages = pallas_attention.rope_and_write(
        qkv, positions, block_table, inv_freq, k_pages, v_pages, layer, scratch_page, rope,
        tile_rows=tile_rows(r))
    vpos = positions if tree is None else tree.rope_positions
    paths = None if tree is None else ancestor_paths(tree.window_start, tree.window_mask)
    return attend(tiles, vpos, paths, block_table, layer, k_pages, v_pages, r), k_pages, v_pages


def attend(tiles: jax.Array, vpos: jax.Array, paths: jax.Array | None, block_table: jax.Array, layer,
           k_pages: jax.Array, v_pages: jax.Array, heads_per_kv: int,
           blocks_per_split: int = BLOCKS_PER_SPLIT, tokens_per_program: int | None = None,
           skip_unseen_keys: bool = bool(SETTINGS.skip_unseen_keys), walk_splits: bool | None = None,
           tiles_per_program: int | None = None) -> jax.Array:
    """Query tiles [B, G, n * tile_rows(R), hd] (`query_tiles`' layout) over layer `layer` of the pages
    [L, P, page, G, hd]; vpos [B, T] each token's position in its own sequence (a tree node's: root +
    depth); paths [B, T, 1 + W] a tree's `ancestor_paths` or None -> [B, T, G*R, hd]. tokens_per_program:
    a tree window program's tokens (None: `window_tokens`'); walk_splits: a causal step's tiles walk their
    splits in turn (None: from `KernelSettings.walk_splits_from` programs); tiles_per_program: the query
    tiles a causal or context program takes, a power of two (None: `tile_group`'s); the output's bits
    depend on none of these, nor on skip_unseen_keys (`KernelSettings`)."""
    b, g, _, hd = tiles.shape
    t, r = vpos.shape[1], heads_per_kv
    m, tt = tile_rows(r), tile_tokens(r)
    tokens_per_program = 1 if paths is None else min(tokens_per_program or window_tokens(b, g, t), tt)
    n = -(-t // tt)
    # Per row of a tile: its token's position, -1 on padding rows (they see nothing).
    vpos = jnp.pad(vpos.astype(jnp.int32), ((0, 0), (0, n * tt - t)), constant_values=-1)
    row_vpos = jnp.pad(jnp.repeat(vpos.reshape(b, n, tt), r, axis=2), ((0, 0), (0, 0), (0, m - tt * r)),
                       constant_values=-1).reshape(b, n * m)
    paths = None if paths is None else paths.astype(jnp.int32)
    if walk_splits is None:
        walk_splits = 0 < SETTINGS.walk_splits_from <= b * g * n
    walk_splits = walk_splits and paths is None
    group = 1 if walk_splits else tiles_per_program or tile_group(b, g, n)
    if group & (group - 1):
        raise ValueError(f"invariant attention: tiles_per_program must be a power of two, not {group}")
    out = _attend(tiles, row_vpos, paths, block_table.astype(jnp.int32), jnp.asarray(layer, jnp.int32).reshape(1),
                  k_pages, v_pages, r=r, blocks_per_split=blocks_per_split, window_tokens=tokens_per_program,
                  skip_unseen_keys=skip_unseen_keys, walk_splits=walk_splits, group=group)
    out = out.reshape(b, g, n, m, hd)[:, :, :, :tt * r].reshape(b, g, n * tt, r, hd)[:, :, :t]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, g * r, hd)


@functools.partial(jax.jit, static_argnames=("r", "blocks_per_split", "window_tokens", "skip_unseen_keys",
                                             "walk_splits", "group"))
def _attend(tiles, row_vpos, paths, block_table, layer, k_pages, v_pages, *, r: int, blocks_per_split: int,
            window_tokens: int, skip_unseen_keys: bool, walk_splits: bool, group: int) -> jax.Array:
    b, g, rows, hd = tiles.shape
    qt = tile_rows(r)
    n = rows // qt
    # Whole groups of tiles: padding tiles (positions -1) see nothing, and their rows are dropped.
    n_grouped = -(-n // group) * group
    if n_grouped > n:
        tiles = jnp.pad(tiles, ((0, 0), (0, 0), (0, (n_grouped - n) * qt), (0, 0)))
        row_vpos = jnp.pad(row_vpos, ((0, 0), (0, (n_grouped - n) * qt)), constant_values=-1)
    num_layers, num_pages, page_size = k_pages.shape[:3]
    splits = num_splits(block_table.shape[1], page_size, blocks_per_split)
    interpret = _interpret()
    if interpret:  # the interpreter reads inputs whole per program: one layer only
        k_pages, v_pages, layer = k_pages[layer[0]][None], v_pages[layer[0]][None], jnp.zeros((1,), jnp.int32)
        num_layers = 1
    # Slots rather than pages: a key is gathered by its own slot (a tree's ancestors are not contiguous).
    k_slots = k_pages.reshape(num_layers, num_pages * page_size, g, hd)
    v_slots = v_pages.reshape(num_layers, num_pages * page_size, g, hd)
    windowed = paths is not None
    kernel_args = dict(page_size=page_size, scale=1.0 / math.sqrt(hd), blocks_per_split=blocks_per_split,
                       skip_unseen_keys=skip_unseen_keys)

    def specs(tile_of, block_rows: int = qt) -> tuple[list[pl.BlockSpec], pl.BlockSpec, pl.BlockSpec]:
        """(inputs, an output tile's spec, its lse's) for a grid whose third index n is in block tile_of(n)
        of block_rows rows (a tile's, or a group of tiles')."""
        inputs = [pl.BlockSpec((None, None, block_rows, hd), lambda i, j, n, s: (i, j, tile_of(n), 0)),
                  pl.BlockSpec((None, block_rows), lambda i, j, n, s: (i, tile_of(n))),
                  *([pl.BlockSpec((None, *paths.shape[1:]), lambda i, j, n, s: (i, 0, 0))] if windowed else []),
                  pl.BlockSpec((None, block_table.shape[1]), lambda i, j, n, s: (i, 0)),
                  pl.BlockSpec((1,), lambda i, j, n, s: (0,)),
                  *[pl.BlockSpec((num_layers, num_pages * page_size, None, hd), lambda i, j, n, s: (0, 0, j, 0))] * 2]
        return (inputs, pl.BlockSpec((None, None, None, block_rows, hd), lambda i, j, n, s: (i, j, s, tile_of(n), 0)),
                pl.BlockSpec((None, None, None, block_rows), lambda i, j, n, s: (i, j, s, tile_of(n))))

    def carry_specs(tile_of, block_rows: int = qt) -> list[pl.BlockSpec]:
        """A tree's carry (output, max, sum in f32, one split's) of block tile_of(n), as `specs`."""
        return [pl.BlockSpec((None, None, block_rows, hd), lambda i, j, n, s: (i, j, tile_of(n), 0)),
                *[pl.BlockSpec((None, None, block_rows), lambda i, j, n, s: (i, j, tile_of(n)))] * 2]

    if walk_splits and splits > 1:  # a program a tile, its splits walked and combined there
        inputs, _, _ = specs(lambda n: n)
        return pl.pallas_call(
            functools.partial(_walk_kernel, num_splits=splits, **kernel_args),
            grid=(b, g, n, 1),
            in_specs=inputs,
            out_specs=pl.BlockSpec((None, None, qt, hd), lambda i, j, n, s: (i, j, n, 0)),
            out_shape=jax.ShapeDtypeStruct((b, g, rows, hd), tiles.dtype),
            interpret=interpret,
            compiler_params=_compiler_params(),
            name="eagle3_invariant_attention_walk",
        )(tiles, row_vpos, block_table, layer, k_slots, v_slots)
    rows = n_grouped * qt
    o_shape, lse_shape = (b, g, splits, rows, hd), jax.ShapeDtypeStruct((b, g, splits, rows), jnp.float32)
    out_shapes = [jax.ShapeDtypeStruct(o_shape, tiles.dtype if splits == 1 else jnp.float32), lse_shape]
    operands = (tiles, row_vpos, *([paths] if windowed else []), block_table, layer, k_slots, v_slots)
    inputs, o_spec, lse_spec = specs(lambda n: n, group * qt)
    # A tree's window goes on in `_window_kernel`: the carry of the split it starts in, output, max and
    # sum in f32; the window kernel's outputs are a tile's every split, the one it writes found there.
    touched = window_splits(paths.shape[2] - 1, splits, blocks_per_split) if windowed else 0
    carry_shapes = [jax.ShapeDtypeStruct((b, g, rows, hd), jnp.float32),
                    *[jax.ShapeDtypeStruct((b, g, rows), jnp.float32)] * 2]
    outs = pl.pallas_call(
        functools.partial(_tile_kernel, windowed=windowed, group=group, **kernel_args),
        grid=(b, g, n_grouped // group, splits),
        in_specs=inputs,
        out_specs=[o_spec, lse_spec, *(carry_specs(lambda n: n, group * qt) if windowed else [])],
        out_shape=out_shapes + (carry_shapes if windowed else []),
        interpret=interpret,
        compiler_params=_compiler_params(),
        name="eagle3_invariant_attention",
    )(*operands)
    if windowed:  # programs of window_tokens tokens over the splits the window touches, into the same outputs
        chunks = -(-(qt // r) // window_tokens)
        inputs, _, _ = specs(lambda p: p // chunks)
        o_spec = pl.BlockSpec((None, None, splits, qt, hd), lambda i, j, p, k: (i, j, 0, p // chunks, 0))
        lse_spec = pl.BlockSpec((None, None, splits, qt), lambda i, j, p, k: (i, j, 0, p // chunks))
        outs = pl.pallas_call(
            functools.partial(_window_kernel, r=r, window_tokens=window_tokens, **kernel_args),
            grid=(b, g, n * chunks, touched),
            in_specs=[*inputs, *carry_specs(lambda p: p // chunks), o_spec, lse_spec],
            out_specs=[o_spec, lse_spec],
            out_shape=out_shapes,
            input_output_aliases={len(operands) + 3: 0, len(operands) + 4: 1},
            interpret=interpret,
            compiler_params=_compiler_params(window=True),
            name="eagle3_invariant_attention_tree",
        )(*operands, *outs[2:], *outs[:2])
    out, lse = outs[:2]
    out = out[:, :, 0] if splits == 1 else combine_splits(out, lse, row_vpos, tiles.dtype,
                                                         BLOCK_KEYS * blocks_per_split)
    return out[:, :, :n * qt]


def _compiler_params(window: bool = False):
    if window:
        return plgpu.CompilerParams(num_warps=SETTINGS.window_warps, num_stages=SETTINGS.window_stages)
    return plgpu.CompilerParams(num_warps=SETTINGS.num_warps, num_stages=SETTINGS.num_stages)


def _interpret() -> bool:
    return jax.default_backend() != "gpu"
