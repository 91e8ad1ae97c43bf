"""model/pallas_attention.py under a token tree: RoPE at positions apart from the storage ones,
and a query row that sees, of its window, only what its mask bits mark.

Pallas' interpreter runs the kernels here, against the XLA form (`layers.paged_attention`,
`layers.attention_block` with attention="xla") on the layouts runner/tree.py builds; the shapes
the engine serves are lowered for CUDA (Triton) from this CPU machine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.config import TreeSpec
from eagle3_jax.model import layers, pallas_attention
from eagle3_jax.runner import tree as T

PAGE, BLOCKS = 16, 6  # 96 positions a row, over pages scattered through the pool


def _pool(rng, b, g, hd):
    """k, v pages [P, page, G, hd] of random values everywhere (a key wrongly seen changes the
    output), and each row's table [B, BLOCKS] of distinct pages past the scratch page."""
    num_pages = b * BLOCKS + 1
    k, v = (jnp.asarray(rng.standard_normal((num_pages, PAGE, g, hd)), jnp.float32) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, BLOCKS), jnp.int32)
    return k, v, table


def _verify_layout(rng, lengths, nodes):
    """A random tree per row (nodes + 1 tokens, root first, each node's parent before it) in the
    target's verify layout -> (stored positions [B, T], TreeAttention)."""
    b = len(lengths)
    parent = np.full((b, nodes + 1), -1, np.int32)
    for i in range(1, nodes + 1):
        parent[:, i] = rng.integers(0, i, b)
    tree = T.tree_from_parents(jnp.zeros((b, nodes + 1), jnp.int32), jnp.asarray(parent), nodes)
    assert int(tree.depth.max()) >= 3  # deep enough that depth and index part ways
    return T.verify_attention(tree, jnp.asarray(lengths, jnp.int32))


def _draft_layout(rng, spec, level, verified):
    """The draft forward on the beams of depth `level`, the levels before it drafted from random
    log-probs -> (stored positions [B, k], TreeAttention)."""
    b, vocab = len(verified), 3 * spec.top_k

    def logp(*shape):
        x = rng.standard_normal((*shape, vocab))
        return jnp.asarray(x - np.log(np.exp(x).sum(-1, keepdims=True)), jnp.float32)

    cand = T.first_level(spec, T.top_children(logp(b), spec.top_k))
    for lvl in range(2, level + 1):
        cand = T.next_level(spec, cand, lvl, T.top_children(logp(b, spec.top_k), spec.top_k))
    _, stored, attention = T.draft_attention(spec, cand, level, jnp.asarray(verified, jnp.int32))
    return stored, attention


LAYOUTS = {
    # 12 nodes + root; one row with no context (window at 0), one whose window straddles pages
    "verify": lambda rng: _verify_layout(rng, [0, 9, 52], 12),
    # W = 4 x 9 = 36: the deepest beams' own slots sit in the second mask word
    "draft": lambda rng: _draft_layout(rng, TreeSpec(5, 9, 20), 4, [2, 17, 44]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_tree_attention_matches_the_xla_form(layout):
    """attend_tiles under a tree window against layers.paged_attention with the same
    TreeAttention: three rows at different lengths, keys over several blocks of 32 walked by two
    splits, 3 q heads a kv head (SmolLM2's grouping). The window is no causal one: some query
    has an earlier window position hidden, so a kernel ignoring the mask fails here."""
    rng = np.random.default_rng(len(layout))
    stored, tree = LAYOUTS[layout](rng)
    b, t, w = tree.window_mask.shape
    offset = np.asarray(stored - tree.window_start[:, None])  # [B, T] each query's own window slot
    assert np.any(~np.asarray(tree.window_mask) & (np.arange(w) < offset[:, :, None]))
    g, r, hd = 2, 3, 32
    assert pallas_attention.supports(t, g * r, g, PAGE, w)
    k_pages, v_pages, table = _pool(rng, b, g, hd)
    q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), jnp.float32)
    assert pallas_attention.pages_per_block(BLOCKS, PAGE, 32) == 2  # 3 key blocks a row, 2 splits
    got = pallas_attention.paged_attention(q, k_pages, v_pages, stored, table, splits=2, block_keys=32,
                                           window_start=tree.window_start, window_mask=tree.window_mask)
    want = jax.jit(layers.paged_attention)(q, k_pages, v_pages, stored, table, tree)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_window_rows_packs_each_query_rows_mask():
    """Bit j of word w of query row t*R + r is window_mask[b, t, 32 w + j]; row 0 holds the window
    start; padding rows are clear."""
    rng = np.random.default_rng(3)
    b, t, w, r, m = 2, 5, 40, 3, 16
    mask = rng.random((b, t, w)) < 0.5
    start = np.array([7, 30])
    rows = np.asarray(jax.jit(pallas_attention.window_rows, static_argnums=(2, 3))(start, mask, r, m))
    assert rows.shape == (b, 3, m) and rows.dtype == np.int32
    np.testing.assert_array_equal(rows[:, 0, :t * r], np.repeat(start[:, None], t * r, axis=1))
    words = rows[:, 1:].astype(np.int64) & 0xFFFFFFFF  # [B, nw, M] as unsigned
    bits = (words[:, :, :, None] >> np.arange(32)) & 1  # [B, nw, M, 32]
    unpacked = bits.transpose(0, 2, 1, 3).reshape(b, m, 64).astype(bool)  # [B, M, 32 nw]
    np.testing.assert_array_equal(unpacked[:, :t * r, :w], np.repeat(mask, r, axis=1))
    assert not unpacked[:, :t * r, w:].any() and not rows[:, :, t * r:].any()


def test_tree_attention_block_matches_the_xla_form():
    """attention_block over a tree verify with attention="pallas" (RoPE at length + depth, keys
    stored at length + i, then windowed attention) against attention="xla": the same output and
    the same pages in layer 1 of two, layer 0 untouched."""
    rng = np.random.default_rng(4)
    stored, tree = _verify_layout(rng, [0, 9, 52], 12)
    b, t, _ = tree.window_mask.shape
    g, r, hd, d = 2, 3, 32, 40
    k_pages, v_pages, table = _pool(rng, b, g, hd)
    k_pages, v_pages = jnp.stack([k_pages, -k_pages]), jnp.stack([v_pages, -v_pages])  # [2, P, page, G, hd]
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    wqkv = jnp.asarray(rng.standard_normal((d, g, r + 2, hd)) / np.sqrt(d), jnp.float32)
    wo = jnp.asarray(rng.standard_normal((g * r * hd, d)) / np.sqrt(g * r * hd), jnp.float32)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)

    @functools.partial(jax.jit, static_argnums=0)
    def block(attention, tree):
        return layers.attention_block(h, wqkv, wo, stored, k_pages, v_pages, 1, table, inv_freq=inv_freq,
                                      attention=attention, tree=tree)

    want, got = block("xla", tree), block("pallas", tree)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=2e-5, rtol=2e-5)
    for pages_got, pages_want, before in zip(got[1:], want[1:], (k_pages, v_pages)):
        np.testing.assert_allclose(np.asarray(pages_got), np.asarray(pages_want), atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(pages_got[0]), np.asarray(before[0]))
    # Rotated at the storage positions instead, the keys written differ: the RoPE positions reached the kernel.
    flat = block("pallas", tree._replace(rope_positions=stored))
    assert np.abs(np.asarray(flat[1]) - np.asarray(got[1])).max() > 0.1


@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (32, 8, 128)])  # SmolLM2, Llama-3.1-8B
def test_tree_verify_of_32_tokens_lowers_for_cuda(monkeypatch, heads, kv_heads, hd):
    """attention_block with attention="pallas" over a tree verify of 32 tokens (96 query rows a
    kv head for SmolLM2, 128 for the 8B: tiles of 128) takes the kernels, and they lower to Triton
    for CUDA here; 33 tokens of the 8B (132 rows) take the XLA form. Lowering builds the Triton
    module, not its machine code: registers and shared memory are only checked on a GPU."""
    monkeypatch.setattr(pallas_attention, "_interpret", lambda: False)  # the Triton kernels, not the interpreter
    b, d, page = 2, 256, 16
    r = heads // kv_heads
    pages = jax.ShapeDtypeStruct((2, 33, page, kv_heads, hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)

    def lowered(t):
        s = jax.ShapeDtypeStruct
        tree = layers.TreeAttention(s((b, t), jnp.int32), s((b,), jnp.int32), s((b, t, t), jnp.bool_))
        f = lambda h, wqkv, wo, positions, k, v, table, tree: layers.attention_block(
            h, wqkv, wo, positions, k, v, 1, table, inv_freq=inv_freq, attention="pallas", tree=tree)
        return jax.jit(f).trace(s((b, t, d), jnp.bfloat16), s((d, kv_heads, r + 2, hd), jnp.bfloat16),
                                s((heads * hd, d), jnp.bfloat16), s((b, t), jnp.int32), pages, pages,
                                s((b, 16), jnp.int32), tree).lower(lowering_platforms=("cuda",)).as_text()

    assert pallas_attention.supports(32, heads, kv_heads, page, 32)
    assert pallas_attention.query_tile_rows(32, r) == 128
    text = lowered(32)
    assert text.count("xla.gpu.triton") == 3  # RoPE + KV write, attention, the splits' combine
    for name in ("eagle3_rope_write_kv", "eagle3_paged_attention", "eagle3_attention_combine"):
        assert name in text
    if r == 4:
        assert not pallas_attention.supports(33, heads, kv_heads, page, 33)
        assert "xla.gpu.triton" not in lowered(33)


@pytest.mark.parametrize("r", [3, 4, 8])  # SmolLM2's grouping, Llama-3.1-8B's (tiles of 32 tokens), 16-token tiles
def test_prefill_tiles_match_the_xla_form(r):
    """attend_prefill over a 70-token chunk (not a whole number of tiles: the last padded) against
    layers.paged_attention: a row whose chunk starts mid-context (keys of an earlier chunk in its
    pages, random values past them: a key seen past a query's position changes its output), one
    starting at 0, and a padding row as the runner makes them (its table all scratch). Each tile
    row's keys split between programs."""
    rng = np.random.default_rng(r)
    b, t, g, hd, blocks = 3, 70, 2, 32, 8  # 128 positions a row
    num_pages = b * blocks + 1
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, PAGE, g, hd)), jnp.float32) for _ in range(2))
    table = np.asarray(1 + rng.permutation(num_pages - 1).reshape(b, blocks), np.int32)
    table[2] = layers.SCRATCH_PAGE
    positions = jnp.asarray(np.array([45, 0, 0])[:, None] + np.arange(t), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), jnp.float32)
    tq = pallas_attention.prefill_tile_tokens(r)
    assert tq * r <= pallas_attention.MAX_QUERY_ROWS < 2 * tq * r and t % tq
    assert not pallas_attention.supports(t, g * r, g, PAGE) and pallas_attention.supports_prefill(g * r, g, PAGE)
    got = jax.jit(pallas_attention.attend_prefill, static_argnums=6)(q, k_pages[None], v_pages[None], 0, positions,
                                                                     jnp.asarray(table), r)
    want = jax.jit(layers.paged_attention)(q, k_pages, v_pages, positions, jnp.asarray(table))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    # Alone in its call, a row attends exactly as beside others (the same splits).
    alone = jax.jit(pallas_attention.attend_prefill, static_argnums=6)(q[:1], k_pages[None], v_pages[None], 0,
                                                                       positions[:1], jnp.asarray(table[:1]), r)
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(got[:1]))


@pytest.mark.parametrize("r", [3, 4])
def test_prefill_attention_block_matches_the_xla_form(monkeypatch, r):
    """attention_block with attention="pallas" over a 70-token chunk (query tiles, `attend_prefill`)
    against attention="xla" in bf16: the same output and the same pages in layer 1 of two, layer 0
    untouched. One row continues its context from position 40; the other's chunk runs past its
    table from position 128 on, as a chunk's padded tokens may (written to scratch, never read)."""
    tiled = []
    attend_prefill = pallas_attention.attend_prefill
    monkeypatch.setattr(pallas_attention, "attend_prefill", lambda *a: tiled.append(1) or attend_prefill(*a))
    rng = np.random.default_rng(10 + r)
    b, t, g, hd, d, blocks = 2, 70, 2, 32, 40, 8
    num_pages = b * blocks + 1
    k_pages, v_pages = (jnp.asarray(rng.standard_normal((2, num_pages, PAGE, g, hd)), jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, blocks), jnp.int32)
    positions = jnp.asarray(np.array([40, 100])[:, None] + np.arange(t), jnp.int32)
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16)
    wqkv = jnp.asarray(rng.standard_normal((d, g, r + 2, hd)) / np.sqrt(d), jnp.bfloat16)
    wo = jnp.asarray(rng.standard_normal((g * r * hd, d)) / np.sqrt(g * r * hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)

    @functools.partial(jax.jit, static_argnums=0)
    def block(attention):
        return layers.attention_block(h, wqkv, wo, positions, k_pages, v_pages, 1, table, inv_freq=inv_freq,
                                      attention=attention)

    want, got = block("xla"), block("pallas")
    assert tiled
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), atol=1e-2, rtol=1e-2)
    for pages_got, pages_want, before in zip(got[1:], want[1:], (k_pages, v_pages)):
        np.testing.assert_array_equal(np.asarray(pages_got[1, 1:]), np.asarray(pages_want[1, 1:]))
        np.testing.assert_array_equal(np.asarray(pages_got[0]), np.asarray(before[0]))
    assert not np.array_equal(np.asarray(got[1][1, 1:]), np.asarray(k_pages[1, 1:]))  # the write happened


@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (32, 8, 128)])  # SmolLM2, Llama-3.1-8B
def test_prefill_chunk_lowers_for_cuda(monkeypatch, heads, kv_heads, hd):
    """attention_block with attention="pallas" over a prefill chunk of 512 tokens, a table of
    8,192 keys, attends in query tiles (128 rows: 32 tokens at R = 3 or 4) that lower to Triton
    for CUDA here: the attention and the splits' combine; RoPE and the KV write in XLA."""
    monkeypatch.setattr(pallas_attention, "_interpret", lambda: False)
    b, t, d, page = 2, 512, 256, 16
    r = heads // kv_heads
    s = jax.ShapeDtypeStruct
    pages = s((2, 65, page, kv_heads, hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    f = lambda h, wqkv, wo, positions, k, v, table: layers.attention_block(
        h, wqkv, wo, positions, k, v, 1, table, inv_freq=inv_freq, attention="pallas")
    text = jax.jit(f).trace(s((b, t, d), jnp.bfloat16), s((d, kv_heads, r + 2, hd), jnp.bfloat16),
                            s((heads * hd, d), jnp.bfloat16), s((b, t), jnp.int32), pages, pages,
                            s((b, 512), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert pallas_attention.query_tile_rows(pallas_attention.prefill_tile_tokens(r), r) == 128
    assert text.count("xla.gpu.triton") == 2
    assert "eagle3_paged_attention" in text and "eagle3_attention_combine" in text
    assert "eagle3_rope_write_kv" not in text


def _lower_layers_for_cuda(monkeypatch, num_layers: int) -> str:
    """`num_layers` SmolLM2-shaped attention layers of a 2 x 16-token verify (enough cached pages
    for split keys) in one program, lowered for CUDA: the lowered module's text."""
    monkeypatch.setattr(pallas_attention, "_interpret", lambda: False)
    b, t, d, heads, kv_heads, hd, page = 2, 16, 576, 9, 3, 64, 16
    s = jax.ShapeDtypeStruct
    pages = s((num_layers, 65, page, kv_heads, hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)

    def f(h, wqkv, wo, positions, k, v, table):
        for layer in range(num_layers):
            out, k, v = layers.attention_block(h, wqkv, wo, positions, k, v, layer, table, inv_freq=inv_freq,
                                               attention="pallas")
            h = h + out
        return h, k, v

    return jax.jit(f).trace(s((b, t, d), jnp.bfloat16), s((d, kv_heads, heads // kv_heads + 2, hd), jnp.bfloat16),
                            s((heads * hd, d), jnp.bfloat16), s((b, t), jnp.int32), pages, pages,
                            s((b, 32), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()


def test_lowering_finds_the_triton_dialect_module(monkeypatch):
    """Lowering the kernels to Triton asks MLIR's bindings for the Triton dialect's module under
    their search prefix; without `triton_dialect.register` (run when `eagle3_jax.model` is imported)
    every value built searched sys.path for it again, about 22,000 failed imports a SmolLM2
    program, half its lowering time."""
    import importlib.abc
    import sys

    searched = []

    class Recorder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            searched.append(name)  # reached only for names not already in sys.modules

    monkeypatch.setattr(sys, "meta_path", [Recorder(), *sys.meta_path])
    text = _lower_layers_for_cuda(monkeypatch, 1)
    assert "eagle3_paged_attention" in text
    assert not [name for name in searched if name.endswith(".tt")]


def test_a_program_lowers_each_kernel_once():
    """The kernels take their layer as an operand, not in their block specs, so a program of
    several layers lowers each kernel once and calls it from every layer (XLA inlines the calls):
    lowering is most of a warm-up's host time."""
    with pytest.MonkeyPatch.context() as mp:
        text = _lower_layers_for_cuda(mp, 3)
    assert text.count("xla.gpu.triton") == 3  # RoPE + KV write, attention, the splits' combine
    assert text.count("call @_rope_and_write") == 3
    assert text.count("call @_attend") == 3
