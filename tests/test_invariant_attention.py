"""model/invariant_attention.py's fixed query tiles: every row of a tile gets bit for bit what a
program of its token alone gets, walking the same key blocks in the same fixed splits, however far
apart the positions of the tile's rows are and whatever tree window they read. The reference here
is the kernel the tiles replaced: a program per (row, kv head, token, split), each token's R rows a
tile of their own, at the tiles' MMA shape (its former 16-row tile differs in an ulp now and then even
here: XLA's CPU dot, like a GPU's MMA, does not round a row the same at every row count).

Pallas' interpreter runs both in bf16 on the CPU; the shapes the engine serves lower for CUDA."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from eagle3_jax.model import invariant_attention as IA
from eagle3_jax.model import layers, pallas_attention
from eagle3_jax.model.pallas_attention import MASKED, online_softmax_init, online_softmax_step, write_split
from eagle3_jax.runner.tree import tree_from_parents

PAGE, PAGES = 16, 16  # 256 positions a row: 4 key blocks
G, R, HD = 2, 3, 32  # SmolLM2's grouping: a tile of 16 rows holds 5 tokens, its last row padding


def _per_token_kernel(q_ref, vpos_ref, *refs, page_size: int, scale: float, windowed: bool, blocks_per_split: int):
    # Program (row, kv head, token, split): q_ref [RT, hd]; vpos_ref [T]; path_ref [1 + W].
    path_ref, (table_ref, k_ref, v_ref, o_ref, lse_ref) = (refs[0], refs[1:]) if windowed else (None, refs)
    rows, hd = q_ref.shape
    nb = table_ref.shape[0]
    q, vpos = q_ref[...], vpos_ref[pl.program_id(2)]
    capacity = -(-nb * page_size // IA.BLOCK_KEYS)
    first = pl.program_id(3) * blocks_per_split
    end = jnp.minimum(jnp.minimum(first + blocks_per_split, vpos // IA.BLOCK_KEYS + 1), capacity)

    def body(i, carry):
        key_pos = i * IA.BLOCK_KEYS + jax.lax.iota(jnp.int32, IA.BLOCK_KEYS)
        stored = key_pos
        if windowed:
            start = path_ref[0]
            depth = key_pos - start
            stored = jnp.where(depth >= 0, start + path_ref[1 + jnp.clip(depth, 0, path_ref.shape[0] - 2)], key_pos)
        page = table_ref[jnp.clip(stored // page_size, 0, nb - 1)]
        slot = page * page_size + stored % page_size
        k, v = k_ref[slot], v_ref[slot]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return online_softmax_step(carry, jnp.where((key_pos <= vpos)[None, :], s, MASKED), v)

    write_split(jax.lax.fori_loop(first, end, body, online_softmax_init(rows, hd)), o_ref, lse_ref)


@functools.partial(jax.jit, static_argnames=("blocks_per_split",))
def _per_token(q, vpos, paths, table, k_pages, v_pages, blocks_per_split):
    """q [B, T, G*R, hd] rotated; k_pages, v_pages [P, page, G, hd] -> [B, T, G*R, hd]."""
    b, t, h, hd = q.shape
    num_pages, page_size, g = k_pages.shape[:3]
    r = h // g
    rt = IA.tile_rows(r)
    tiles = jnp.pad(q.reshape(b, t, g, r, hd).transpose(0, 2, 1, 3, 4), ((0, 0),) * 3 + ((0, rt - r), (0, 0)))
    splits = IA.num_splits(table.shape[1], page_size, blocks_per_split)
    slots_spec = pl.BlockSpec((num_pages * page_size, None, hd), lambda i, j, n, s: (0, j, 0))
    path = [] if paths is None else [paths]
    out, lse = pl.pallas_call(
        functools.partial(_per_token_kernel, page_size=page_size, scale=1.0 / math.sqrt(hd), windowed=bool(path),
                          blocks_per_split=blocks_per_split),
        grid=(b, g, t, splits),
        in_specs=[pl.BlockSpec((None, None, None, rt, hd), lambda i, j, n, s: (i, j, n, 0, 0)),
                  pl.BlockSpec((None, t), lambda i, j, n, s: (i, 0)),
                  *[pl.BlockSpec((None, None, p.shape[2]), lambda i, j, n, s: (i, n, 0)) for p in path],
                  pl.BlockSpec((None, table.shape[1]), lambda i, j, n, s: (i, 0)),
                  slots_spec, slots_spec],
        out_specs=[pl.BlockSpec((None, None, None, rt, hd), lambda i, j, n, s: (i, j, s, n, 0)),
                   pl.BlockSpec((None, None, None, rt), lambda i, j, n, s: (i, j, s, n))],
        out_shape=[jax.ShapeDtypeStruct((b, g, splits, t * rt, hd), q.dtype if splits == 1 else jnp.float32),
                   jax.ShapeDtypeStruct((b, g, splits, t * rt), jnp.float32)],
        interpret=True,
    )(tiles, vpos, *path, table, k_pages.reshape(-1, g, hd), v_pages.reshape(-1, g, hd))
    out = pallas_attention.combine_splits(out, lse, t * rt, q.dtype, 1) if splits > 1 else out[:, :, 0]
    return out.reshape(b, g, t, rt, hd)[:, :, :, :r].transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd)


def _inputs(seed, b, t):
    """bf16 q [B, T, G*R, hd], pages [P, page, G, hd] random everywhere (a key wrongly seen changes
    a row), each row's table [B, PAGES] of distinct pages past the scratch page."""
    rng = np.random.default_rng(seed)
    num_pages = b * PAGES + 1
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
               for shape in ((b, t, G * R, HD), (num_pages, PAGE, G, HD), (num_pages, PAGE, G, HD)))
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, PAGES), jnp.int32)
    return rng, q, k, v, table


def _assert_tiles_equal_per_token(q, vpos, paths, table, k, v, blocks_per_split):
    """The tiles' output equals a program per token's, bit for bit, reading every key of a walked block
    or only those some row of interest sees (skip_unseen_keys), a program a tile or a group of 2, 4 or 8
    tiles sharing each block's keys (tiles_per_program: the last group padded with tiles of nothing);
    a causal step's also with each tile walking its splits in turn and combining them itself
    (walk_splits)."""
    want = _per_token(q, vpos, paths, table, k, v, blocks_per_split)
    variants = [(False, False, 1), (True, False, 1), (False, False, 2), (True, False, 4), (False, False, 8)]
    variants += [(False, True, 1)] if paths is None else []
    for skip_unseen_keys, walk_splits, tiles_per_program in variants:
        got = IA.attend(IA.query_tiles(q, G), vpos, paths, table, 0, k[None], v[None], R, blocks_per_split,
                        skip_unseen_keys=skip_unseen_keys, walk_splits=walk_splits,
                        tiles_per_program=tiles_per_program)
        assert got.dtype == want.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                      err_msg=f"skip_unseen_keys={skip_unseen_keys}, walk_splits={walk_splits}, "
                                              f"tiles_per_program={tiles_per_program}")
    return np.asarray(got, np.float32)


STEPS = {
    # rows at different lengths; the last a padding row whose position runs past its table
    "decode": (1, [0, 70, 200, 400], 2),
    "chain of 5": (5, [0, 59, 126, 251], 2),  # 126..130: one tile's tokens in two splits
    # 40 tokens (two tiles, 21 + 19) across the split boundary at 128 with one block a split
    "prefill chunk of 40": (40, [100, 10], 1),
}


@pytest.mark.parametrize("step", STEPS)
def test_causal_tiles_equal_a_program_per_token_bit_for_bit(step):
    """Decode, a chain's verify and a prefill chunk: each token's rows of its tile equal its own
    program's, over splits of one or two blocks (several a row)."""
    t, starts, blocks_per_split = STEPS[step]
    _, q, k, v, table = _inputs(len(step), len(starts), t)
    vpos = jnp.asarray(np.array(starts)[:, None] + np.arange(t), jnp.int32)
    got = _assert_tiles_equal_per_token(q, vpos, None, table, k, v, blocks_per_split)
    assert np.isfinite(got).all()


def test_the_combine_takes_each_rows_splits_to_its_own_position_and_reads_none_past_it():
    """Splits past a row's position's are garbage (NaN, as if never written) and change nothing: each
    row equals its combine where they saw nothing (no weight), bit for bit, and the every-split
    combine to rounding."""
    rng = np.random.default_rng(3)
    b, g, splits, m, hd, split_keys = 2, 2, 4, 16, 32, 128
    vpos = rng.integers(-1, splits * split_keys, (b, m)).astype(np.int32)
    vpos[1] = -1  # a tile of padding alone
    out = rng.standard_normal((b, g, splits, m, hd)).astype(np.float32)
    lse = rng.standard_normal((b, g, splits, m)).astype(np.float32)
    past = np.arange(splits)[None, None, :, None] > (vpos // split_keys)[:, None, None, :]  # [b, 1, S, m]
    past[:, :, 0] = False  # split 0 is always written
    out_seen, lse_seen = jnp.asarray(np.where(past[..., None], 0.0, out)), jnp.asarray(np.where(past, MASKED, lse))
    every_split = pallas_attention.combine_splits(out_seen, lse_seen, m, jnp.float32, 1)
    seen_nothing = IA.combine_splits(out_seen, lse_seen, jnp.asarray(vpos), jnp.float32, split_keys)
    out_nan, lse_nan = jnp.asarray(np.where(past[..., None], np.nan, out)), jnp.asarray(np.where(past, np.nan, lse))
    got = IA.combine_splits(out_nan, lse_nan, jnp.asarray(vpos), jnp.float32, split_keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(seen_nothing))
    np.testing.assert_allclose(np.asarray(got), np.asarray(every_split), rtol=1e-5, atol=1e-6)


def test_tree_tiles_equal_a_program_per_token_bit_for_bit():
    """A tree verify of 32 tokens (seven tiles): each node reads its ancestors at root + depth from
    root + index. Splits of two blocks; windows at 0 (no shared context), at 60 (nodes past depth 3
    in the next block) and at 120 (block 0 shared, block 1 a node's own, nodes past depth 7 in the
    next split)."""
    b, t = 3, 32
    rng, q, k, v, table = _inputs(7, b, t)
    parent = np.full((b, t), -1, np.int32)
    for i in range(1, t):
        parent[:, i] = rng.integers(max(0, i - 4), i, b)
    tree = tree_from_parents(jnp.zeros((b, t), jnp.int32), jnp.asarray(parent), t)
    assert int(tree.depth.min(axis=1).min()) == 0 and int(tree.depth.max(axis=1).min()) >= 8
    start = jnp.asarray([0, 60, 120], jnp.int32)
    vpos = start[:, None] + tree.depth
    _assert_tiles_equal_per_token(q, vpos, IA.ancestor_paths(start, tree.mask), table, k, v, 2)


def test_rows_far_apart_in_one_tile_are_untouched_by_the_blocks_they_cannot_see():
    """One tile of tokens at positions from 0 to 255 in random order: the tile walks every block,
    most of them unseen by most rows, and each row still equals its token's program alone; within
    one split and across four."""
    t = 12
    rng, q, k, v, table = _inputs(11, 2, t)
    vpos = jnp.asarray(np.stack([rng.permutation(256)[:t] for _ in range(2)]), jnp.int32).at[:, :2].set(
        jnp.array([0, 255]))
    for blocks_per_split in (8, 1):
        _assert_tiles_equal_per_token(q, vpos, None, table, k, v, blocks_per_split)


def test_a_block_a_row_cannot_see_leaves_its_carry_unchanged():
    """online_softmax_step after a row has seen keys, on a block it sees none of: its output, max
    and sum stay bit for bit (p = exp(MASKED - max) = 0, correction 1) while a row that sees it moves."""
    rng = np.random.default_rng(5)
    s = jnp.asarray(rng.standard_normal((2, 64)) * 8, jnp.float32)
    v = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    carry = online_softmax_step(online_softmax_init(2, 32), s, v)
    unseen = jnp.asarray(rng.standard_normal((2, 64)) * 8, jnp.float32).at[0].set(MASKED)
    after = online_softmax_step(carry, unseen, jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16))
    for before, now in zip(carry, after):
        assert np.array_equal(np.asarray(before[0]), np.asarray(now[0]))
    assert np.asarray(after[2][1]) != np.asarray(carry[2][1])


def test_rope_and_write_lays_out_the_fixed_tiles():
    """rope_and_write(tile_rows=tile_rows(R)) writes `query_tiles`' layout of the rotated q (25 tokens
    in tiles of tile_tokens(R), the last tile's padding rows zero)."""
    b, t, hd = 2, 25, 32
    rng = np.random.default_rng(2)
    qkv = jnp.asarray(rng.standard_normal((b, t, G, R + 2, hd)), jnp.float32)
    positions = jnp.asarray(np.arange(t) + np.array([[3], [40]]), jnp.int32)
    pages = jnp.zeros((1, 2 * 4 + 1, PAGE, G, hd), jnp.float32)
    table = jnp.arange(1, 9, dtype=jnp.int32).reshape(2, 4)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    tiles, _, _ = pallas_attention.rope_and_write(qkv, positions, table, inv_freq, pages, pages, 0, 0,
                                                  tile_rows=IA.tile_rows(R))
    q = layers.apply_rope(qkv[:, :, :, :R].reshape(b, t, G * R, hd), positions, inv_freq)
    tt = IA.tile_tokens(R)
    n = -(-t // tt)
    assert tiles.shape == (b, G, n * IA.tile_rows(R), hd)
    np.testing.assert_allclose(np.asarray(tiles), np.asarray(IA.query_tiles(q, G)), atol=1e-6)
    assert not np.asarray(tiles).reshape(b, G, n, -1, hd)[:, :, -1, (t - (n - 1) * tt) * R:].any()


@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (32, 8, 128)])  # SmolLM2, Llama-3.1-8B
def test_tiles_walking_their_splits_lower_for_cuda(monkeypatch, heads, kv_heads, hd):
    """A causal chunk of 40 tokens over a table of 1,024 positions (two splits), each tile walking its
    splits and combining them itself, lowers to one Triton program for the attention: no combine."""
    monkeypatch.setattr(IA, "_interpret", lambda: False)
    b, t, s = 2, 40, jax.ShapeDtypeStruct
    r = heads // kv_heads
    n = -(-t // IA.tile_tokens(r))
    f = lambda tiles, vpos, k, v, table: IA.attend(tiles, vpos, None, table, 1, k, v, r, walk_splits=True)
    pages = s((2, 65, PAGE, kv_heads, hd), jnp.bfloat16)
    text = jax.jit(f).trace(s((b, kv_heads, n * IA.tile_rows(r), hd), jnp.bfloat16), s((b, t), jnp.int32), pages,
                            pages, s((b, 64), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 1 and "eagle3_invariant_attention_walk" in text


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (32, 8, 128)])  # SmolLM2, Llama-3.1-8B
def test_tiles_lower_for_cuda(monkeypatch, heads, kv_heads, hd, grouped):
    """The tile kernels under a tree verify of 32 tokens and a causal chunk of 40, split over a table
    of 1,024 positions, lower to Triton for CUDA: the tiled RoPE write, the attention (a tree's
    window blocks a program a token after it), the combine; a program a tile, or up to 4 tiles a
    program (`KernelSettings.tiles_per_program`)."""
    monkeypatch.setattr(pallas_attention, "_interpret", lambda: False)
    monkeypatch.setattr(IA, "_interpret", lambda: False)
    if grouped:
        monkeypatch.setattr(IA, "SETTINGS", IA.KernelSettings(tiles_per_program=4))
        monkeypatch.setattr(IA, "GROUPED_MIN_PROGRAMS", 1)
        assert IA.tile_group(2, kv_heads, 7) == 4 and IA.tile_group(2, kv_heads, 2) == 2
    b, s = 2, jax.ShapeDtypeStruct
    pages = s((2, 65, PAGE, kv_heads, hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    r = heads // kv_heads
    kernels = ["eagle3_rope_write_kv", "eagle3_invariant_attention", "eagle3_invariant_attention_combine"]
    for t, tree in ((32, layers.TreeAttention(s((b, 32), jnp.int32), s((b,), jnp.int32), s((b, 32, 32), jnp.bool_))),
                    (40, None)):
        f = lambda qkv, positions, k, v, table, tree: IA.attention(qkv, positions, table, inv_freq, k, v, 1, 0, tree)
        text = jax.jit(f).trace(s((b, t, kv_heads, r + 2, hd), jnp.bfloat16), s((b, t), jnp.int32), pages, pages,
                                s((b, 64), jnp.int32), tree).lower(lowering_platforms=("cuda",)).as_text()
        names = kernels + (["eagle3_invariant_attention_tree"] if tree else [])
        assert text.count("xla.gpu.triton") == len(names), t
        for name in names:
            assert name in text, (t, name)
        assert ("eagle3_invariant_attention_tree" in text) == (tree is not None)


def test_a_window_touches_no_more_splits_than_window_splits():
    """Every start and width: a window's positions (start .. start + width - 1) lie within
    `window_splits` splits from the one its start is in, never more than the table's."""
    for blocks_per_split in (1, 2):
        span = IA.BLOCK_KEYS * blocks_per_split
        for width in (1, 2, 32, span, span + 1, span + 2, 3 * span):
            touched = IA.window_splits(width, 99, blocks_per_split)
            assert max((start + width - 1) // span - start // span + 1 for start in range(4 * span)) == touched
    assert IA.window_splits(32, 4) == 2 and IA.window_splits(32, 1) == 1


def _tree_step(seed, starts):
    """A tree verify of 32 nodes (seven tiles, the last of two nodes) a row: random parents at most 4 back, so depths
    past 8; row r's root at starts[r]. -> (q, k, v, table, vpos, paths, tree)."""
    b, t = len(starts), 32
    rng, q, k, v, table = _inputs(seed, b, t)
    parent = np.full((b, t), -1, np.int32)
    for i in range(1, t):
        parent[:, i] = rng.integers(max(0, i - 4), i, b)
    tree = tree_from_parents(jnp.zeros((b, t), jnp.int32), jnp.asarray(parent), t)
    assert int(tree.depth.max(axis=1).min()) >= 8
    start = jnp.asarray(starts, jnp.int32)
    return q, k, v, table, start[:, None] + tree.depth, IA.ancestor_paths(start, tree.mask), tree


# Splits of one block (64 positions): windows from 60 and 120 cross into the next split (depths past
# 8), 140 stays in its own; a padding row's (its table all the scratch page) runs past its table.
WINDOWS = [60, 120, 140]
PADDING_ROOT = 250


def test_tree_windows_across_splits_equal_decoding_each_node_bit_for_bit():
    """Each node of a tree verify equals a decode of it alone, bit for bit (its ancestors stored at
    root + depth, where decode stores them): rows with different roots, windows that cross a split
    boundary, beside a padding row."""
    q, k, v, table, vpos, paths, tree = _tree_step(13, WINDOWS + [PADDING_ROOT])
    b, t = vpos.shape
    tiles = IA.query_tiles(q, G)
    got = np.asarray(IA.attend(tiles, vpos, paths, table.at[-1].set(0), 0, k[None], v[None], R, 1), np.float32)
    # Decode: a row per node of the windowed rows, its table its row's but for fresh pages over the
    # window, where the node's ancestors are moved to root + depth (positions past it as they were: unseen).
    paths, depths = np.asarray(paths), np.asarray(tree.depth)
    slots_k, slots_v = k.reshape(-1, G, HD), v.reshape(-1, G, HD)
    pages_k, pages_v, tables = [k], [v], []
    for r, n in np.ndindex(b - 1, t):
        root, depth = paths[r, n, 0], depths[r, n]
        stored = np.arange(PAGES * PAGE)
        stored[root:root + depth + 1] = root + paths[r, n, 1:depth + 2]
        window = np.arange(root // PAGE, (root + depth) // PAGE + 1)  # the pages decode would have written
        at = (window[:, None] * PAGE + np.arange(PAGE)).reshape(-1)
        slot = np.asarray(table[r])[stored[at] // PAGE] * PAGE + stored[at] % PAGE
        tables.append(np.asarray(table[r]).copy())
        tables[-1][window] = sum(len(p) for p in pages_k) + np.arange(len(window))
        pages_k.append(slots_k[slot].reshape(-1, PAGE, G, HD))
        pages_v.append(slots_v[slot].reshape(-1, PAGE, G, HD))
    decode = IA.attend(IA.query_tiles(q[:b - 1].reshape(-1, 1, G * R, HD), G), vpos[:b - 1].reshape(-1, 1), None,
                       jnp.asarray(np.stack(tables), jnp.int32), 0, jnp.concatenate(pages_k)[None],
                       jnp.concatenate(pages_v)[None], R, 1)
    np.testing.assert_array_equal(np.asarray(decode, np.float32).reshape(b - 1, t, G * R, HD), got[:b - 1])


def test_a_window_programs_tokens_do_not_change_their_bits():
    """The window kernel's programs of one token, of 8 (a tile's 21 in three programs, the 11 of the
    second in two) and of a whole tile give the same bits, each a program per token's of the
    reference. Splits of two blocks: a window from 120 goes on from block 0's carry into the next
    split, one from 60 stays in its split; a padding row past its table."""
    q, k, v, table, vpos, paths, _ = _tree_step(17, [120, 60, PADDING_ROOT])
    table = table.at[-1].set(0)
    want = np.asarray(_per_token(q, vpos, paths, table, k, v, 2), np.float32)
    tiles = IA.query_tiles(q, G)
    for tokens in (1, 8, IA.tile_tokens(R)):
        got = IA.attend(tiles, vpos, paths, table, 0, k[None], v[None], R, 2, tokens)
        np.testing.assert_array_equal(np.asarray(got, np.float32), want, err_msg=f"{tokens} tokens a program")


@pytest.mark.parametrize("skip_unseen_keys", [False, True])
def test_window_programs_of_several_tokens_lower_for_cuda(monkeypatch, skip_unseen_keys):
    """A tree verify's window kernel of a tile's tokens a program, over a table of three splits (its
    outputs' split axis not a power of two), lowers to Triton for CUDA at SmolLM2's shapes, its key
    blocks read whole or only as far as they are seen."""
    monkeypatch.setattr(pallas_attention, "_interpret", lambda: False)
    monkeypatch.setattr(IA, "_interpret", lambda: False)
    b, t, g, r, hd, s = 4, 32, 3, 3, 64, jax.ShapeDtypeStruct
    pages = s((2, 97, PAGE, g, hd), jnp.bfloat16)
    f = lambda tiles, vpos, paths, table, k, v: IA.attend(tiles, vpos, paths, table, 1, k, v, r,
                                                          tokens_per_program=IA.tile_tokens(r),
                                                          skip_unseen_keys=skip_unseen_keys)
    tiles = -(-t // IA.tile_tokens(r))
    text = jax.jit(f).trace(s((b, g, tiles * IA.tile_rows(r), hd), jnp.bfloat16), s((b, t), jnp.int32),
                            s((b, t, 1 + t), jnp.int32), s((b, 96), jnp.int32), pages,
                            pages).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3 and "eagle3_invariant_attention_tree" in text


def test_a_tile_holds_at_least_one_tokens_q_heads():
    """A model with more q heads a kv head than QUERY_TILE_ROWS gets tiles of the next power of two."""
    assert [IA.tile_rows(r) for r in (1, 3, 4, 8)] == [IA.QUERY_TILE_ROWS] * 4
    assert [IA.tile_tokens(r) for r in (1, 3, 4, 8)] == [IA.QUERY_TILE_ROWS // r for r in (1, 3, 4, 8)]
    assert [IA.tile_rows(r) for r in (20, 32, 48)] == [max(IA.QUERY_TILE_ROWS, m) for m in (32, 32, 64)]
    assert IA.tile_tokens(48) == max(IA.QUERY_TILE_ROWS, 64) // 48
    with pytest.raises(ValueError, match="at least one q head"):
        IA.tile_rows(0)


def test_kernel_settings_parse_the_tuning_override_and_name_what_is_wrong():
    settings = IA.KernelSettings.parse("block_keys=128, num_stages=2")
    assert (settings.block_keys, settings.num_stages, settings.blocks_per_split) == (128, 2, 8)
    assert IA.KernelSettings.parse("") == IA.KernelSettings()
    assert IA.KernelSettings.parse("skip_unseen_keys=1").skip_unseen_keys == 1
    assert [IA.KernelSettings.parse(f"walk_splits_from={v}").walk_splits_from for v in (0, 512)] == [0, 512]
    assert IA.KernelSettings.parse("tiles_per_program=8").tiles_per_program == 8
    for text, named in (("block_key=64", "block_key=64"), ("num_warps=0", "num_warps=0"),
                        ("walk_splits_from=-1", "0 or more for walk_splits_from"),
                        ("num_stages=two", "num_stages=two"), ("block_keys=48", "block_keys must be a power of two"),
                        ("query_tile_rows=8", "query_tile_rows must be a power of two >= 16"),
                        ("skip_unseen_keys=2", "0 or 1 for skip_unseen_keys"),
                        ("tiles_per_program=3", "tiles_per_program must be a power of two"),
                        ("tiles_per_program=0", "tiles_per_program=0")):
        with pytest.raises(ValueError, match=named):
            IA.KernelSettings.parse(text)


def test_tiles_group_only_while_the_programs_fill_the_gpu(monkeypatch):
    """`tile_group`: up to tiles_per_program tiles a program, never more than the tiles (rounded up to
    a power of two), and only while the programs stay GROUPED_MIN_PROGRAMS; 4 as shipped."""
    assert IA.KernelSettings().tiles_per_program == 4 and IA.tile_group(64, 8, 8) == 4
    assert IA.tile_group(64, 3, 7) == 4 and IA.tile_group(8, 3, 7) == 1
    monkeypatch.setattr(IA, "SETTINGS", IA.KernelSettings(tiles_per_program=8))
    assert IA.GROUPED_MIN_PROGRAMS == 256
    # SmolLM2's tree of 32 nodes (7 tiles, 3 kv heads) at 64 rows: 4 a program (2 programs a row's head).
    assert [IA.tile_group(b, 3, 7) for b in (1, 8, 64, 128)] == [1, 1, 4, 8]
    # Llama-3.1-8B's 32 tokens a row (8 tiles, 8 kv heads); a decode's one tile stays one.
    assert [IA.tile_group(b, 8, 8) for b in (4, 8, 16, 32)] == [1, 2, 4, 8]
    assert IA.tile_group(64, 8, 1) == 1 and IA.tile_group(64, 8, 2) == 2
    _, q, k, v, table = _inputs(1, 1, 5)
    with pytest.raises(ValueError, match="power of two"):
        IA.attend(IA.query_tiles(q, G), jnp.zeros((1, 5), jnp.int32), None, table, 0, k[None], v[None], R,
                  tiles_per_program=3)
