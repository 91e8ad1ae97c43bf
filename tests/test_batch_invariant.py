"""Batch invariance (EngineConfig.batch_invariant): each token's logits are bit for bit the same
whatever the rows beside it, the tokens per row and the program (decode, chain or tree verify,
prefill chunk). The kernels run in Pallas' interpreter here, with the same fixed blocks as on a GPU;
the last test lowers them for CUDA."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TEST_ENGINE, TINY

from eagle3_jax.config import ConfigError, EngineConfig, KernelConfig, TreeSpec
from eagle3_jax.model import invariant_attention, invariant_gemm, layers, llama, pallas_attention
from eagle3_jax.runner.served import DeviceFacts, untuned_tiles_line
from eagle3_jax.runner.tree import tree_from_parents, verify_attention

INVARIANT = dict(attention="invariant", gemv="invariant")


@pytest.mark.parametrize("k, n, transposed, min_split_k, splits", [
    (96, 192, False, 1024, 1), (32, 12, True, 1024, 1), (2048, 64, False, 1024, 2), (192, 48, False, 64, 3)])
def test_gemm_rows_do_not_depend_on_the_rows_beside_them(k, n, transposed, min_split_k, splits, monkeypatch):
    """Every row of x[:m] @ w equals the same row of the 64-row product, m = 1..64, in bf16. The
    second shape pads a tiny vocabulary; the third splits K in two (its 64 columns are one tile); the
    last, under a shortest part of 64 ($EAGLE3_JAX_GEMM_MIN_SPLIT_K), splits K into three: any whole
    number of its blocks, not only powers of two."""
    monkeypatch.setattr(invariant_gemm, "MIN_SPLIT_K", min_split_k)
    assert invariant_gemm.k_splits(k, n) == splits
    x = jax.random.normal(jax.random.PRNGKey(0), (64, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(1), (n, k) if transposed else (k, n))).astype(jnp.bfloat16)
    full = np.asarray(invariant_gemm.matmul(x, w, out_dtype=jnp.float32, transposed=transposed))
    ref = np.asarray(x, np.float32) @ np.asarray(w.T if transposed else w, np.float32)
    np.testing.assert_allclose(full, ref, rtol=1e-4, atol=1e-4)
    for m in range(1, 65):
        part = np.asarray(invariant_gemm.matmul(x[:m], w, out_dtype=jnp.float32, transposed=transposed))
        assert np.array_equal(part, full[:m]), m


def test_k_parts_in_one_program_give_the_sums_of_parts_written_apart(monkeypatch):
    """Where the M x N tiles fill the SMs alone, one program walks K's parts in turn: each row equals
    the row computed at few rows, whose parts run as programs of their own and are added after,
    bit for bit. (MIN_PROGRAMS of 4 here: three 64-row tiles or fewer split across the grid.)"""
    monkeypatch.setattr(invariant_gemm, "MIN_PROGRAMS", 4)
    monkeypatch.setattr(invariant_gemm, "MIN_SPLIT_K", 128)
    k, n = 384, 48  # six K blocks, one N tile: three parts of two blocks
    assert invariant_gemm.k_splits(k, n) == 3
    tiles = invariant_gemm.DEFAULT_TILES
    assert [invariant_gemm.splits_across_grid(m, n, tiles, 3) for m in (1, 192, 193, 256)] == [3, 3, 1, 1]
    # The wide tile's two sums would take 256 registers a thread: its parts stay apart.
    assert invariant_gemm.splits_across_grid(4096, 4096, invariant_gemm.WIDE_TILES, 2) == 2
    x = jax.random.normal(jax.random.PRNGKey(6), (256, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(7), (k, n))).astype(jnp.bfloat16)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        walked = np.asarray(invariant_gemm.matmul(x, w, out_dtype=out_dtype).astype(jnp.float32))
        for m in (1, 7, 64, 192):
            apart = np.asarray(invariant_gemm.matmul(x[:m], w, out_dtype=out_dtype).astype(jnp.float32))
            assert np.array_equal(apart, walked[:m]), (out_dtype, m)


def test_k_splits_keep_the_shipped_shapes_and_name_a_bad_shortest_part(monkeypatch):
    """The shipped shortest part (1,024) keeps the 8B shapes' splits and leaves SmolLM2's alone; at
    192 SmolLM2's K of 576 (nine blocks) splits into three and its lm_head, already many tiles, not at
    all; a bad $EAGLE3_JAX_GEMM_MIN_SPLIT_K is named."""
    assert [invariant_gemm.k_splits(k, n) for k, n in ((4096, 6144), (14336, 4096), (576, 960))] == [2, 2, 1]
    monkeypatch.setattr(invariant_gemm, "MIN_SPLIT_K", 192)
    assert [invariant_gemm.k_splits(k, n) for k, n in ((576, 960), (1536, 576), (576, 49152))] == [3, 8, 1]
    assert invariant_gemm.parse_min_split_k("") == 1024 and invariant_gemm.parse_min_split_k("128") == 128
    for bad in ("8", "-64", "1k"):
        with pytest.raises(ValueError, match=invariant_gemm.MIN_SPLIT_K_ENV):
            invariant_gemm.parse_min_split_k(bad)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_wide_tile_from_many_rows_gives_the_rows_of_few(transposed):
    """`project` switches to the wide tile at WIDE_ROWS rows (N dividing it): each row of that
    product equals the row computed alone with the default tile, bit for bit."""
    m, k, n = invariant_gemm.WIDE_ROWS, 64, invariant_gemm.WIDE_TILES.block_n * 2
    assert invariant_gemm.tiles_for(m, k, n) == invariant_gemm.WIDE_TILES
    assert (invariant_gemm.tiles_for(m - 1, k, n) == invariant_gemm.tiles_for(m, k, n + 64)
            == invariant_gemm.DEFAULT_TILES)
    x = jax.random.normal(jax.random.PRNGKey(2), (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (0.05 * jax.random.normal(jax.random.PRNGKey(3), (n, k) if transposed else (k, n))).astype(jnp.bfloat16)
    wide = np.asarray(invariant_gemm.project(x, w, jnp.float32, transposed=transposed))
    for rows in (slice(0, 1), slice(100, 103), slice(m - 5, m)):
        alone = np.asarray(invariant_gemm.project(x[rows], w, jnp.float32, transposed=transposed))
        assert np.array_equal(alone, wide[rows]), rows


def test_a_tuned_tile_serves_up_to_its_rows_on_its_gpu_kind_only(tmp_path, monkeypatch):
    """`tiles_for` takes a tuned table's tile for the fewest tuned rows >= m of its (K, N, layout) on
    its GPU kind, $EAGLE3_JAX_GEMM_TILES over the shipped table, and the rule elsewhere; a table that is
    not one is named in the error."""
    narrow, mid = invariant_gemm.Tiles(64, 16, 4, 3), invariant_gemm.Tiles(64, 32, 4, 4)
    table = {"GPU X": [invariant_gemm.TunedTile(576, 960, False, 64, mid).to_json(),
                       invariant_gemm.TunedTile(576, 960, False, 8, narrow).to_json()]}
    path = tmp_path / "tiles.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv(invariant_gemm.TUNED_TILES_ENV, str(path))
    invariant_gemm.tuned_tiles.cache_clear()
    try:
        monkeypatch.setattr(invariant_gemm, "_device_kind", lambda: "GPU X")
        assert [invariant_gemm.tiles_for(m, 576, 960) for m in (1, 8, 9, 64)] == [narrow, narrow, mid, mid]
        assert invariant_gemm.tiles_for(65, 576, 960) == invariant_gemm.DEFAULT_TILES  # past the tuned rows
        assert invariant_gemm.tiles_for(8, 576, 960, transposed=True) == invariant_gemm.DEFAULT_TILES
        assert invariant_gemm.tiles_for(8, 576, 1024) == invariant_gemm.DEFAULT_TILES
        monkeypatch.setattr(invariant_gemm, "_device_kind", lambda: "GPU Y")
        assert invariant_gemm.tiles_for(8, 576, 960) == invariant_gemm.DEFAULT_TILES
        for bad, named in (('[{"k": 576}]', "'n'"), ('[{"k": 576, "n": 960, "transposed": false, "rows": 8, '
                                                        '"tile": [64, 64, 4, 3, 48]}]', "block_k=48")):
            path.write_text(f'{{"GPU X": {bad}}}')
            invariant_gemm.tuned_tiles.cache_clear()
            with pytest.raises(ValueError, match=rf"tiles\.json: not a table of tuned tiles .*{named}"):
                invariant_gemm.tiles_for(8, 576, 960)
    finally:
        monkeypatch.delenv(invariant_gemm.TUNED_TILES_ENV)
        invariant_gemm.tuned_tiles.cache_clear()


def test_an_engine_on_a_gpu_kind_without_tuned_tiles_says_so():
    """The start-up warning names a GPU kind the tile table lacks, only for batch-invariant kernels
    on a GPU."""
    def line(batch_invariant: bool, backend: str, kind: str):
        device = DeviceFacts(backend=backend, name=kind, hopper=backend == "gpu", tp=None)
        return untuned_tiles_line(KernelConfig("pallas", "xla", "auto", batch_invariant), device)

    shipped = next(iter(invariant_gemm.read_tuned_tiles(invariant_gemm.TUNED_TILES_FILE)))
    assert "no tuned tiles for 'GPU Z' in gemm_tiles.json" in line(True, "gpu", "GPU Z")
    assert line(True, "gpu", shipped) is None
    assert line(False, "gpu", "GPU Z") is None and line(True, "cpu", "cpu") is None


def _tiny(dtype, tied: bool):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=tied)
    params = llama.init_params(cfg, jax.random.PRNGKey(0), dtype)
    # Weights 10x the init's: logits spread over several units, where bf16's ulps are coarse.
    return cfg, jax.tree.map(lambda a: (a * 10).astype(a.dtype) if a.ndim > 1 else a, params)


def _run(cfg, params, tokens, chunks, kinds, cache=None, start=0, table=None):
    """Logits [B, sum(chunks), V] of `tokens` fed in chunks of these sizes from position `start`."""
    b = tokens.shape[0]
    table = jnp.arange(1, 1 + b * 8, dtype=jnp.int32).reshape(b, 8) if table is None else table
    if cache is None:
        cache = llama.KVCache.zeros(cfg.num_layers, 1 + b * 8, 16, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    outs, p = [], start
    for c in chunks:
        pos = jnp.broadcast_to(jnp.arange(p, p + c), (b, c))
        hidden, _, cache = llama.forward(params, cfg, tokens[:, p - start:p - start + c], pos, cache, table,
                                         kinds["attention"], None, kinds["gemv"])
        outs.append(llama.logits(params, hidden, kinds["gemv"]))
        p += c
    return np.asarray(jnp.concatenate(outs, axis=1)), cache


@pytest.mark.parametrize("tied", [True, False])
def test_decode_verify_and_prefill_chunks_give_the_same_logits_in_bf16(tied):
    """One prompt fed as one prefill, in uneven chunks (verifies of several tokens) and token by
    token (decode): the same bf16 logits bit for bit, in a batch of 2 and alone; and close to the
    XLA kernels' (which round differently, so not equal)."""
    cfg, params = _tiny(jnp.bfloat16, tied)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 20), 0, cfg.vocab_size)
    prefill, _ = _run(cfg, params, tokens, [20], INVARIANT)
    decode, _ = _run(cfg, params, tokens, [1] * 20, INVARIANT)
    chunks, _ = _run(cfg, params, tokens, [5, 4, 3, 8], INVARIANT)
    alone, _ = _run(cfg, params, tokens[1:], [7, 13], INVARIANT)
    assert np.array_equal(prefill, decode) and np.array_equal(chunks, decode)
    assert np.array_equal(alone[0], decode[1])
    xla, _ = _run(cfg, params, tokens, [20], dict(attention="xla", gemv="xla"))
    assert np.abs(xla - prefill).max() < 0.1 * np.abs(xla).max()


def test_tree_verify_equals_decoding_each_path():
    """A tree verify (nodes stored at length + index, rotated at length + depth) gives every node
    the logits a decode of its root-to-node path gives, bit for bit in bf16: the kernel reads a
    node's ancestors where decode stores them. Checked on three paths of one tree, two rows."""
    cfg, params = _tiny(jnp.bfloat16, tied=False)
    context = jax.random.randint(jax.random.PRNGKey(4), (2, 10), 0, cfg.vocab_size)
    _, cache = _run(cfg, params, context, [10], INVARIANT)
    parent = jnp.array([[-1, 0, 0, 1, 2, 3, 1]] * 2, jnp.int32)
    tokens = jax.random.randint(jax.random.PRNGKey(7), (2, 7), 0, cfg.vocab_size)
    tree = tree_from_parents(tokens, parent, 4)
    stored, attention = verify_attention(tree, jnp.full((2,), 10, jnp.int32))
    table = jnp.arange(1, 17, dtype=jnp.int32).reshape(2, 8)
    hidden, _, _ = llama.forward(params, cfg, tokens, stored, cache, table, tree=attention, **INVARIANT)
    verified = np.asarray(llama.logits(params, hidden, "invariant"))
    for path in ([0, 1, 3, 5], [0, 2, 4], [0, 1, 6]):
        decoded, _ = _run(cfg, params, tokens[:, path], [1] * len(path), INVARIANT, cache=cache, start=10)
        assert np.array_equal(decoded, verified[:, path]), path


def test_ancestor_paths_list_each_nodes_ancestors_by_depth():
    parent = jnp.array([[-1, 0, 0, 1, 2, 3]], jnp.int32)
    tree = tree_from_parents(jnp.zeros((1, 6), jnp.int32), parent, 4)
    paths = np.asarray(invariant_attention.ancestor_paths(jnp.array([30]), tree.mask))
    assert paths[0, :, 0].tolist() == [30] * 6  # the window's start
    assert paths[0, 5, 1:5].tolist() == [0, 1, 3, 5]  # node 5: root, 1, 3, itself
    assert paths[0, 4, 1:4].tolist() == [0, 2, 4]
    assert paths[0, 0, 1] == 0


def test_invariant_kernels_lower_for_cuda(monkeypatch):
    """A SmolLM2-shaped layer of a tree verify of 32 tokens in the invariant kernels lowers to
    Triton for CUDA: RoPE + KV write, the attention and the three projections' GEMMs, no XLA dot."""
    for module in (pallas_attention, invariant_attention, invariant_gemm):
        monkeypatch.setattr(module, "_interpret", lambda: False)
    b, t, d, heads, kv_heads, hd = 2, 32, 576, 9, 3, 64
    s = jax.ShapeDtypeStruct
    pages = s((2, 65, 16, kv_heads, hd), jnp.bfloat16)
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    tree = layers.TreeAttention(s((b, t), jnp.int32), s((b,), jnp.int32), s((b, t, t), jnp.bool_))

    def f(h, wqkv, wo, positions, k, v, table, tree):
        return layers.attention_block(h, wqkv, wo, positions, k, v, 1, table, inv_freq=inv_freq, tree=tree,
                                      **INVARIANT)

    text = jax.jit(f).trace(s((b, t, d), jnp.bfloat16), s((d, kv_heads, heads // kv_heads + 2, hd), jnp.bfloat16),
                            s((heads * hd, d), jnp.bfloat16), s((b, t), jnp.int32), pages, pages,
                            s((b, 64), jnp.int32), tree).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("eagle3_rope_write_kv", "eagle3_invariant_attention", "eagle3_invariant_attention_combine",
                 "eagle3_invariant_gemm"):
        assert name in text, name
    assert "stablehlo.dot_general" not in text


@pytest.mark.parametrize("m, grid_splits, block_k", [(64, 2, 64), (2048, 1, 64), (320, 1, 128)])
def test_k_parts_lower_for_cuda_across_the_grid_and_in_one_program(monkeypatch, m, grid_splits, block_k):
    """Llama-3.1-8B's qkv projection (K 4,096 in two parts) lowers to Triton for CUDA both ways: at a
    decode's 64 rows the parts as programs of their own, from 320 rows walked in turn (there in 128
    K columns a step too)."""
    monkeypatch.setattr(invariant_gemm, "_interpret", lambda: False)
    k, n = 4096, 6144
    tiles = dataclasses.replace(invariant_gemm.DEFAULT_TILES, block_k=block_k)
    assert invariant_gemm.splits_across_grid(m, n, tiles, invariant_gemm.k_splits(k, n)) == grid_splits
    s = jax.ShapeDtypeStruct
    text = jax.jit(functools.partial(invariant_gemm.matmul, tiles=tiles)).trace(
        s((m, k), jnp.bfloat16), s((k, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.dot_general" not in text
    assert text.count("stablehlo.add") == grid_splits - 1  # the parts written apart, added after


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(ConfigError, match="batch_invariant must be True or False"):
        EngineConfig(batch_invariant="yes")


@pytest.mark.slow
def test_engine_greedy_and_seeded_outputs_alone_and_batched_in_bf16(tiny_models):
    """The engine in bf16 with batch_invariant: every request's reply, greedy or seeded, is the same
    alone as in a batch of greedy and seeded rows, and the chain's and the tree's replies are the
    target alone's (seeded too: the seed-coupled noise draws each position's token alike)."""
    from eagle3_jax.api import LLM
    from eagle3_jax.sampling_params import SamplingParams

    target, drafts = tiny_models
    prompts = [[1, 5, 7, 3, 9], [4, 4, 8, 1, 6, 2, 11, 3], [7, 1], [3, 9, 10, 5, 5, 1]]
    # 10 tokens: several verify steps a reply; the kernels run in Pallas' interpreter, about 0.7 s a step.
    # Each prompt greedy and seeded: 8 rows, the test engine's widest bucket, in one batch.
    params = ([SamplingParams(max_tokens=10, ignore_eos=True)] * len(prompts)
              + [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=i) for i in range(len(prompts))])
    requests = prompts * 2
    replies = {}
    for name, draft, tree in (("target", None, None), ("chain", drafts["shared"], None),
                              ("tree", drafts["shared"], TreeSpec(3, 2, 5))):
        llm = LLM(target=target, draft=draft, num_speculative_tokens=3, dtype=jnp.bfloat16, warmup=False,
                  engine_config=EngineConfig(**{**TEST_ENGINE, "batch_invariant": True}), progress=False, tree=tree)
        batch = [o.token_ids for o in llm.generate(requests, params)]
        alone = [llm.generate([p], q)[0].token_ids for p, q in zip(requests, params)]
        assert alone == batch, name
        replies[name] = batch
    assert replies["chain"] == replies["target"] == replies["tree"]
    assert replies["target"][:len(prompts)] != replies["target"][len(prompts):]  # the seeded rows sampled
