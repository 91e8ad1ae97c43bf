#!/usr/bin/env python3
"""Batch invariance on a GPU, checked and priced (EngineConfig.batch_invariant): the bitwise checks and costs
BENCHMARKS.md is to report, one phase a call.

    python3 scripts/invariance_h200.py --phase 8b --out-dir "$OUT"
    python3 scripts/invariance_h200.py --phase lossless --target T --out-dir "$OUT"
    python3 scripts/invariance_h200.py --phase speed --target T --out-dir "$OUT"

8b: Llama-3.1-8B shapes with random bf16 weights (near-uniform logits: every token a near-tie).
  After a 256-token prefill per row, for B = 1, 8, 64 rows: a verify of K + 1 = 4 tokens and a
  tree verify of 32 tokens against decodes of the same tokens (the tree: every row's deepest path,
  decoded node by node), logits compared bit for bit, and a 64-token prefill chunk against decoding
  the same tokens; with EngineConfig.batch_invariant's kernels and with the default ones. Then the
  target forward's time (the step's logits included) at B = 1, 8, 64 for 1, 4 and 32 tokens a row,
  both ways.
lossless: SmolLM2-135M-Instruct in bf16 with the shipped drafter, the 80 MT-bench first turns
  (chat template), 256 tokens: greedy replies of the target alone, the chain of 4, the tree (6, 8, 31)
  and prompt lookup (K = 4) (speculation "always"), each prompt alone and all 80 at once, compared
  with the target alone one prompt at a time; seeded sampling (T = 0.8, seed = the prompt's index)
  the same way. Each engine in a process of its own (`--phase replies`), the pool sized by default,
  prefix caching on; `--variants` reruns them with other pool settings. Invariant kernels; the
  default kernels on the same comparisons beside them.
speed: tok/s end to end, SmolLM2 with the shipped drafter, batch 1, 8 and 64 (up to --speed-waves
  waves of the batch: one prompt at a time, or in waves), target alone, chain of 4, tree and prompt
  lookup, with and without batch_invariant; a process a proposal, its two engines timed in turns
  --speed-repeats times each after a pass that compiled every shape it times (the median pass), and
  compared in tok/s (the median of the paired passes' ratios) and in rows x iterations a second
  (tok/s over the acceptance length: the two kinds' replies differ, and with them what a draft
  accepts).
pool: the target's forward alone on pools of 2,000 to 150,000 pages (SmolLM2's config, random
  weights): a decode against itself repeated and against a verify, bit for bit.
release: four engines one after another in one process, released by LLM.close(), by dropping the
  last reference, and (the third) not at all: each one's pool, the memory held elsewhere, its reply.
attribution: where the invariant kernels' cost lies on SmolLM2's shapes (its config, random bf16 weights,
  --layers of them, a 256-token context, block tables of --table-len positions): the target forward
  at B = --batches rows of 1, 5 and 32 causal tokens and of a (6, 8, 31) tree's verify (32 tokens, the
  window at the context's end) with each of attention and the projections in turn invariant or
  default (four combinations, ms a call); the tree's verify again with invariant attention at each
  of --window-tokens tokens a program of its window kernel; then each projection alone at the
  engine's row counts (TUNE_ROWS): XLA's dot against the invariant GEMM at candidate tiles, each
  bit-equal to DEFAULT_TILES or not, and the fastest bit-equal one per shape and row count written
  as a tile table, tiles.json (eagle3_jax/model/gemm_tiles.json's form; $EAGLE3_JAX_GEMM_TILES
  points an engine at one). --kernels: beside each figure of both kinds whole, the kernels a call
  launches by family and each family's device time (jax.profiler's trace of 10 calls). --attention-only:
  the default forward and the one with invariant attention, nothing else: one process a setting of
  $EAGLE3_JAX_INVARIANT_ATTENTION (invariant_attention.KernelSettings) sweeps the kernels' settings.
  --projections-only: the same for the invariant projections ($EAGLE3_JAX_GEMM_MIN_SPLIT_K sweeps
  the shortest part a reduction's K splits into).
gemm: the invariant GEMM's tiles (invariant_gemm.Tiles: output tile, launch, K columns a step) at
  Llama-3.1-8B's projection shapes and --gemm-rows rows: each tile's time against XLA's dot, and
  whether its rows equal the default tile's bit for bit (a tile that does may serve those rows: the
  sum's order is the weight's alone).
Prints a table per phase and writes PHASE.json under --out-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eagle3_jax import assets, presets  # noqa: E402
from eagle3_jax.model import llama  # noqa: E402
from eagle3_jax.runner.tree import tree_from_parents, verify_attention  # noqa: E402

KINDS = {"invariant": ("invariant", "invariant"), "default": ("pallas", "xla")}  # (attention, gemv)


def _step_fn(cfg, kind: str):
    attention, gemv = KINDS[kind]

    def step(params, tokens, positions, cache, table, tree=None):
        hidden, _, cache = llama.forward(params, cfg, tokens, positions, cache, table, attention, None, gemv,
                                         tree=tree)
        return llama.logits(params, hidden, gemv), cache

    return jax.jit(step, donate_argnums=3)


def phase_8b(out: dict, batches: tuple[int, ...]) -> None:
    full, _ = presets.llama31_8b()
    # Invariance is a property of each op's shapes, not of the depth: the checks run 4 of the 8B's
    # layers, the timings 8 (and lm_head), to keep the compiles of 40 programs inside one call.
    cfg_time = dataclasses.replace(full, num_layers=8, capture_layer_ids=(0,))
    cfg_check = dataclasses.replace(full, num_layers=4, capture_layer_ids=(0,))
    params_time = llama.fold_norm_gains(llama.init_params(cfg_time, jax.random.PRNGKey(0), jnp.bfloat16))
    params_check = params_time.replace(layers=params_time.layers[:4])
    ctx, page, max_b = 256, 16, max(batches)
    blocks = -(-(ctx + 128) // page)
    table_all = 1 + np.arange(max_b * blocks, dtype=np.int32).reshape(max_b, blocks)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, full.vocab_size, (max_b, ctx + 64), dtype=np.int32)
    steps, caches = {}, {}

    def run(cfg, params, kind, b, tokens, positions, tree=None):
        key = (cfg.num_layers, kind)  # one jitted step (it traces once per shape) and one cache each
        if key not in steps:
            steps[key] = _step_fn(cfg, kind)
            caches[key] = llama.KVCache.zeros(cfg.num_layers, max_b * blocks + 1, page, cfg.num_kv_heads,
                                              cfg.head_dim, jnp.bfloat16)
        logits, caches[key] = steps[key](params, jnp.asarray(tokens), jnp.asarray(positions), caches[key],
                                         jnp.asarray(table_all[:b]), tree)
        return logits

    rows = []
    for kind in KINDS:
        check = functools.partial(run, cfg_check, params_check, kind)
        for start in range(0, ctx, 64):  # every row's context, in chunks of 64
            check(max_b, prompt[:, start:start + 64], np.broadcast_to(np.arange(start, start + 64), (max_b, 64)))
        for b in batches:
            toks = prompt[:b, ctx:ctx + 4]  # a chain's verify of 4 against 4 decodes
            pos = np.broadcast_to(np.arange(ctx, ctx + 4), (b, 4))
            verify = np.asarray(check(b, toks, pos))
            decode = np.stack([np.asarray(check(b, toks[:, i:i + 1], pos[:, i:i + 1]))[:, 0] for i in range(4)], axis=1)
            chain_eq = int(np.sum(np.all(verify == decode, axis=(1, 2))))
            # A tree verify of 32 tokens (random trees) against decoding each row's deepest path.
            parent = np.full((b, 32), -1, np.int32)
            for i in range(1, 32):
                parent[:, i] = rng.integers(max(0, i - 6), i, b)
            ttoks = rng.integers(0, full.vocab_size, (b, 32), dtype=np.int32)
            tree = tree_from_parents(jnp.asarray(ttoks), jnp.asarray(parent), 32)
            stored, att = verify_attention(tree, jnp.full((b,), ctx, jnp.int32))
            tree_logits = np.asarray(check(b, ttoks, np.asarray(stored), att))
            leaf = np.asarray(tree.depth).argmax(axis=1)
            paths = []
            for r in range(b):
                path = [int(leaf[r])]
                while path[-1] != 0:
                    path.append(int(parent[r, path[-1]]))
                paths.append(path[::-1])
            tree_eq = tree_n = 0
            for d in range(max(len(p) for p in paths)):
                node = np.array([p[min(d, len(p) - 1)] for p in paths])
                got = np.asarray(check(b, ttoks[np.arange(b), node][:, None], np.full((b, 1), ctx + d)))[:, 0]
                for r in range(b):
                    if d < len(paths[r]):
                        tree_n += 1
                        tree_eq += int(np.array_equal(got[r], tree_logits[r, node[r]]))
            rows.append(dict(kind=kind, b=b, chain_rows_equal=f"{chain_eq}/{b}",
                             tree_nodes_equal=f"{tree_eq}/{tree_n}"))
            print(rows[-1], flush=True)
        # A 64-token prefill chunk of row 0 against decoding the same tokens.
        toks = prompt[:1, ctx:ctx + 64]
        chunk = np.asarray(check(1, toks, np.arange(ctx, ctx + 64)[None]))[0]
        dec = np.stack([np.asarray(check(1, toks[:, i:i + 1], np.array([[ctx + i]])))[0, 0] for i in range(64)])
        rows.append(dict(kind=kind, b=1, prefill_tokens_equal=f"{int(np.sum(np.all(chunk == dec, axis=-1)))}/64"))
        print(rows[-1], flush=True)
    out["equality"] = rows
    # Forward time per step (ms; 8 layers and the logits), donated cache, after a compile and a warm call.
    times = []
    for b in batches:
        for t in (1, 4, 32):
            for kind in KINDS:
                toks = prompt[:b, ctx:ctx + t]
                pos = np.broadcast_to(np.arange(ctx, ctx + t), (b, t))
                for _ in range(2):
                    run(cfg_time, params_time, kind, b, toks, pos).block_until_ready()
                n, t0 = 20, time.perf_counter()
                for _ in range(n):
                    logits = run(cfg_time, params_time, kind, b, toks, pos)
                logits.block_until_ready()
                times.append(dict(b=b, t=t, kind=kind, ms=round((time.perf_counter() - t0) / n * 1e3, 3)))
            inv, dft = times[-2]["ms"], times[-1]["ms"]
            print(f"8B (8 layers) forward b={b} t={t}: invariant {inv} ms, default {dft} ms, ratio {inv / dft:.3f}",
                  flush=True)
    out["forward_ms"] = times


GEMM_SHAPES = {"wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672), "w_down": (14336, 4096),
               "lm_head": (4096, 128256)}
# (block M, block N, warps, stages[, K columns a loop step]): the last four take 128 K columns a step.
GEMM_TILES = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 4, 3),
              (16, 64, 4, 3), (64, 64, 4, 3, 128), (64, 128, 4, 3, 128), (128, 128, 8, 3, 128), (128, 256, 8, 2, 128)]


def _time(fn, *args, calls: int = 30) -> float:
    """ms per call of a jitted fn, dispatched back to back after two warm calls."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e3


def _time_chained(fn, x, w, calls: int = 30) -> float:
    """ms per call of fn(x, w) [M, K] x W -> [M, N], `calls` calls unrolled in one program, each one's
    x perturbed by the last one's output times zero (XLA keeps a float x * 0: NaN): the kernels
    run back to back with no dispatch between them, which at these sizes is most of a lone call."""
    @jax.jit
    def chained(x, w):
        y = fn(x, w)
        for _ in range(calls - 1):
            y = fn(x + (y[:, :1] * 0).astype(x.dtype), w)
        return y

    jax.block_until_ready(chained(x, w))
    t0 = time.perf_counter()
    jax.block_until_ready(chained(x, w))
    return (time.perf_counter() - t0) / calls * 1e3


def phase_gemm(out: dict, rows: tuple[int, ...]) -> None:
    from eagle3_jax.model import invariant_gemm

    results = []
    key = jax.random.PRNGKey(0)
    for name, (k, n) in GEMM_SHAPES.items():
        w = (0.02 * jax.random.normal(key, (k, n), jnp.float32)).astype(jnp.bfloat16)
        xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
        for m in rows:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            row = dict(shape=name, k=k, n=n, m=m, xla_ms=round(_time(xla, x, w), 4))
            ref = None
            for tile in GEMM_TILES:
                tiles = invariant_gemm.Tiles(*tile)
                fn = jax.jit(functools.partial(invariant_gemm.matmul, tiles=tiles))
                label = "x".join(map(str, tile))
                try:
                    y = np.asarray(fn(x, w))
                    ms = _time(fn, x, w)
                except Exception as e:  # noqa: BLE001 - a tile that does not lower is a result, not a stop
                    row[label] = f"failed: {type(e).__name__}"
                    continue
                ref = y if ref is None else ref
                row[label] = dict(ms=round(ms, 4), equal=bool(np.array_equal(y, ref)))
            results.append(row)
            print(json.dumps(row), flush=True)
        del w
    out["gemm"] = results


# The engine's row counts on SmolLM2 (decode, verify of K + 1 = 5, tree of 32 nodes, prefill chunks at
# batch 1 to 64), each tuned row count serving every count up to it.
TUNE_ROWS = (1, 8, 40, 64, 256, 320, 1024, 2048)
FEW_ROW_TILES = [(64, 64, 4, 3), (64, 32, 4, 3), (64, 16, 4, 3), (64, 128, 4, 3), (64, 32, 4, 4), (16, 32, 4, 3)]
MANY_ROW_TILES = [(64, 64, 4, 3), (128, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 4, 3),
                  (64, 256, 4, 3), (64, 64, 4, 3, 128), (128, 128, 8, 3, 128), (128, 256, 8, 2, 128)]


def tune_projections(cfg, rows: tuple[int, ...], calls: int) -> tuple[list[dict], list]:
    """Each projection of `cfg` (the layout the engine runs: a tied lm_head transposed) at `rows` rows:
    XLA's dot, the engine's tile, and candidate tiles, each timed and compared with DEFAULT_TILES bit
    for bit. -> (a row per shape and row count, the fastest bit-equal tile per shape and row count as
    invariant_gemm.TunedTile: the engine's rule's tile unless another is 3% faster)."""
    from eagle3_jax.model import invariant_gemm

    d, hd = cfg.hidden_size, cfg.head_dim
    shapes = {"wqkv": (d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd, False), "wo": (cfg.num_heads * hd, d, False),
              "w_gate_up": (d, 2 * cfg.intermediate_size, False), "w_down": (cfg.intermediate_size, d, False),
              "lm_head": (d, cfg.vocab_size, cfg.tie_word_embeddings)}
    xla = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    xla_t = jax.jit(lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    results, tuned = [], []
    for name, (k, n, transposed) in shapes.items():
        shape = (n, k) if transposed else (k, n)
        w = (0.02 * jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)).astype(jnp.bfloat16)
        for m in rows:
            x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
            row = dict(shape=name, k=k, n=n, transposed=transposed, m=m,
                       xla_ms=round(_time_chained(xla_t if transposed else xla, x, w, calls=calls), 4))
            rule = invariant_gemm.untuned_tiles(m, n)
            candidates = [invariant_gemm.DEFAULT_TILES, rule] + [
                invariant_gemm.Tiles(*t) for t in (FEW_ROW_TILES if m <= 64 else MANY_ROW_TILES)]
            reference, timed = None, {}
            for tile in dict.fromkeys(candidates):  # DEFAULT_TILES first: the reference
                fn = jax.jit(functools.partial(invariant_gemm.matmul, transposed=transposed, tiles=tile))
                label = "x".join(map(str, dataclasses.astuple(tile)))
                try:
                    y = np.asarray(fn(x, w))
                except Exception as e:  # noqa: BLE001 - a tile that does not lower is a result, not a stop
                    row[label] = f"failed: {type(e).__name__}"
                    continue
                reference = y if reference is None else reference
                equal = bool(np.array_equal(y, reference))
                ms = _time_chained(fn, x, w, calls=calls)
                row[label] = dict(ms=round(ms, 4), equal=equal)
                if equal:
                    timed[tile] = ms
            best = min(timed, key=timed.get) if timed else None
            if rule in timed:
                chosen = best if timed[best] < 0.97 * timed[rule] else rule
                tuned.append(invariant_gemm.TunedTile(k, n, transposed, m, chosen))
                row["chosen"] = "x".join(map(str, dataclasses.astuple(chosen)))
            results.append(row)
            print(json.dumps(row), flush=True)
        del w
    return results, tuned


# The (6, 8, 31) tree's 31 nodes over its 6 levels below the root, as the draft's top-k commonly fills them.
TREE_LEVELS = (8, 8, 6, 4, 3, 2)


def _tree_verify(b: int, root: int, rng) -> tuple[np.ndarray, object]:
    """A verify of a draft tree of 1 + sum(TREE_LEVELS) tokens a row, level by level, each node's parent a
    random node of the level above, its root at position `root` -> (KV positions [B, T], TreeAttention)."""
    parents = np.full((b, 1 + sum(TREE_LEVELS)), -1, np.int32)
    above, first = np.array([0]), 1  # the level above's nodes; the first of this level
    for size in TREE_LEVELS:
        parents[:, first:first + size] = rng.choice(above, (b, size))
        above, first = np.arange(first, first + size), first + size
    tree = tree_from_parents(jnp.zeros(parents.shape, jnp.int32), jnp.asarray(parents), len(TREE_LEVELS))
    stored, attention = verify_attention(tree, jnp.full((b,), root, jnp.int32))
    return np.asarray(stored), attention


def kernel_times(run, calls: int) -> dict[str, list]:
    """The GPU kernels `calls` calls of run() launch, from jax.profiler's trace (its device plane's
    streams): {kernel family (the name less a trailing number): [launches a call, us a call]}, the
    longest first, and "all": the sum."""
    import collections
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                result = run()
            jax.block_until_ready(result)
        data = jax.profiler.ProfileData.from_file(str(next(Path(d).rglob("*.xplane.pb"))))
    totals = collections.defaultdict(lambda: [0, 0.0])
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):  # the derived lines ("XLA Ops", ...) repeat the kernels
                continue
            for event in line.events:
                family = totals[re.sub(r"[._]?\d+$", "", event.name)]
                family[0] += 1
                family[1] += event.duration_ns / 1e3
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    table = {name: [round(n / calls, 2), round(us / calls, 2)] for name, (n, us) in ranked}
    table["all"] = [round(sum(n for n, _ in totals.values()) / calls, 2),
                    round(sum(us for _, us in totals.values()) / calls, 2)]
    return table


def phase_attribution(out: dict, args, batches: tuple[int, ...]) -> None:
    """The forward's ms under each (attention, projections) pair, and each projection alone."""
    from eagle3_jax.config import ModelConfig
    from eagle3_jax.model import invariant_attention, invariant_gemm

    cfg = ModelConfig.from_json(Path(args.target) / "config.json")
    cfg = dataclasses.replace(cfg, num_layers=args.layers or cfg.num_layers, capture_layer_ids=(0,))
    params = llama.fold_norm_gains(llama.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    ctx, page, max_b = 256, 16, max(batches)
    blocks = -(-max(args.table_len, ctx + 32) // page)  # the attention kernels' splits span the table
    table = 1 + np.arange(max_b * blocks, dtype=np.int32).reshape(max_b, blocks)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (max_b, ctx + 32), dtype=np.int32)
    trees = {b: _tree_verify(b, ctx, np.random.default_rng(b)) for b in batches}
    combos = {"both default": ("pallas", "xla"), "attention invariant": ("invariant", "xla"),
              "projections invariant": ("pallas", "invariant"), "both invariant": ("invariant", "invariant")}
    # --attention-only / --projections-only: that kind's invariant kernels (a setting of theirs) against
    # the default forward, nothing else.
    only = "attention invariant" if args.attention_only else "projections invariant" if args.projections_only else None
    if only:
        combos = {label: combos[label] for label in ("both default", only)}
    profiled = ("both default", only or "both invariant")
    rows = []

    def time_forward(label: str, attention: str, gemv: str, causal: bool = True) -> None:
        def step(params, tokens, positions, cache, table, tree=None):
            hidden, _, cache = llama.forward(params, cfg, tokens, positions, cache, table, attention, None, gemv,
                                             tree=tree)
            return llama.logits(params, hidden, gemv), cache

        fn = jax.jit(step, donate_argnums=3)
        cache = llama.KVCache.zeros(cfg.num_layers, max_b * blocks + 1, page, cfg.num_kv_heads, cfg.head_dim,
                                    jnp.bfloat16)
        _, cache = fn(params, prompt[:, :ctx], np.broadcast_to(np.arange(ctx), (max_b, ctx)), cache, table)

        def timed(b, t, layout, positions, tree=None):
            nonlocal cache
            tokens = prompt[:b, ctx:ctx + t]
            for _ in range(2):
                logits, cache = fn(params, tokens, positions, cache, table[:b], tree)
            jax.block_until_ready(logits)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                logits, cache = fn(params, tokens, positions, cache, table[:b], tree)
            jax.block_until_ready(logits)
            rows.append(dict(kernels=label, b=b, t=t, layout=layout,
                             ms=round((time.perf_counter() - t0) / args.calls * 1e3, 3)))
            if args.kernels and label in profiled:

                def call():
                    nonlocal cache
                    logits, cache = fn(params, tokens, positions, cache, table[:b], tree)
                    return logits

                rows[-1]["kernel_us"] = kernel_times(call, 10)
            print(rows[-1], flush=True)

        for b in batches:
            for t in (1, 5, 32) if causal else ():
                timed(b, t, "causal", np.broadcast_to(np.arange(ctx, ctx + t), (b, t)))
            positions, tree = trees[b]
            timed(b, positions.shape[1], "tree", positions, tree)
        del cache

    for label, (attention, gemv) in combos.items():
        time_forward(label, attention, gemv)
    out.update(forward_ms=rows, layers=cfg.num_layers, table_positions=blocks * page,
               attention_settings=dataclasses.asdict(invariant_attention.SETTINGS),
               gemm_min_split_k=invariant_gemm.MIN_SPLIT_K)
    if only:
        return
    # The tree window kernel's tokens a program (the output's bits the same at each): its launch against
    # its parallelism, the engine's rule `invariant_attention.window_tokens` replaced for the timing.
    rule = invariant_attention.window_tokens
    for tokens in (int(k) for k in args.window_tokens.split(",") if k):
        invariant_attention.window_tokens = lambda b, g, t, tokens=tokens: tokens
        try:
            time_forward(f"attention invariant, {tokens} window tokens a program", "invariant", "xla", causal=False)
        finally:
            invariant_attention.window_tokens = rule
    tune_rows = tuple(int(m) for m in args.tune_rows.split(",") if m)
    if not tune_rows:
        return
    gemms, tuned = tune_projections(cfg, tune_rows, args.calls)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    tiles_path = Path(args.out_dir) / "tiles.json"
    tiles_path.write_text(json.dumps({jax.devices()[0].device_kind: [t.to_json() for t in tuned]}, indent=1))
    print(f"tuned tiles: {tiles_path} ({len(tuned)} entries)", flush=True)
    os.environ[invariant_gemm.TUNED_TILES_ENV] = str(tiles_path)  # the forward again, on the tuned tiles
    invariant_gemm.tuned_tiles.cache_clear()
    time_forward("both invariant, tuned tiles", "invariant", "invariant")
    time_forward("projections invariant, tuned tiles", "pallas", "invariant")
    out.update(forward_ms=rows, gemm_ms=gemms, tuned=[t.to_json() for t in tuned], layers=cfg.num_layers,
               table_positions=blocks * page,
               tree_levels=list(TREE_LEVELS), window_tokens_rule={
                   b: invariant_attention.window_tokens(b, cfg.num_kv_heads, 1 + sum(TREE_LEVELS)) for b in batches})


PROPOSALS = ("target", "chain", "tree", "ngram")
ENV_SETTING = re.compile(r"[A-Z_][A-Z0-9_]*=")  # a --variants word that sets the child's environment


def _llm(target: str, kind: str, proposal: str, kv_fraction: float = 0.9, prefix_caching: bool = True,
         warmup: bool = False, num_pages: int | None = None):
    """SmolLM2 in bf16 as `proposal` runs it (speculation "always"), the kernels of `kind`."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig, TreeSpec

    draft = str(assets.DEFAULT_DRAFT) if proposal in ("chain", "tree") else None
    tree = TreeSpec(6, 8, 31) if proposal == "tree" else None
    cfg = EngineConfig(speculation="always", batch_invariant=kind == "invariant", max_model_len=1024,
                       kv_memory_fraction=kv_fraction, prefix_caching=prefix_caching, num_pages=num_pages,
                       speculator="ngram" if proposal == "ngram" else "eagle3")
    return LLM(target=target, draft=draft, num_speculative_tokens=0 if proposal == "target" else 4,
               engine_config=cfg, dtype=jnp.bfloat16, warmup=warmup, progress=False, tree=tree)


def _same(replies: list, reference: list) -> int:
    return sum(a == b for a, b in zip(replies, reference))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where two replies differ (None: equal)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def phase_replies(out: dict, args, questions: list[list[dict]]) -> None:
    """One engine's replies (greedy, then seeded T = 0.8), each prompt alone and all at once."""
    from eagle3_jax.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = _llm(args.target, args.kind, args.proposal, args.kv_fraction, not args.no_prefix_caching, args.warmup,
               args.num_pages)
    llm.engine.overlap = not args.no_overlap
    out.update(start_s=round(time.perf_counter() - t0, 1), num_pages=llm.engine.cfg.pool.num_pages,
               free_bytes=llm.engine.device.free_bytes)
    greedy = SamplingParams(max_tokens=args.max_tokens)
    seeded = [SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i) for i in range(len(questions))]
    replies = {}
    for mode in args.modes.split(","):
        params = [greedy] * len(questions) if mode == "greedy" else seeded
        t0 = time.perf_counter()
        got = {"alone": [llm.chat(q, params[i])[0].token_ids for i, q in enumerate(questions)]}
        t1 = time.perf_counter()
        got["batch"] = [o.token_ids for o in llm.chat(questions, params)]
        t2 = time.perf_counter()
        if args.repeat:  # the same requests again, now past a warm prefix cache
            got["again"] = [llm.chat(q, params[i])[0].token_ids for i, q in enumerate(questions)]
        replies[mode] = got
        print(dict(proposal=args.proposal, kind=args.kind, mode=mode, alone_s=round(t1 - t0, 1),
                   batch_s=round(t2 - t1, 1), alone_vs_batch=_same(got["alone"], got["batch"])), flush=True)
    out.update(replies=replies, stats=dict(preemptions=llm.engine.stats.preemptions,
                                          prefix_hit_rate=round(llm.engine.stats.prefix_hit_rate, 3)))


def _child(args, phase: str, stem: str, options: list[str], env: dict | None = None) -> dict:
    """This script's `phase` in a process of its own (its engine's memory gone with it) -> the JSON
    it wrote under --out-dir as `stem`, or {"rc": its exit status} when it wrote none."""
    cmd = [sys.executable, __file__, "--phase", phase, "--target", args.target, "--out-dir", args.out_dir,
           "--out-name", stem, *options, *(["--questions", args.questions] if args.questions else [])]
    print("$", *(f"{k}={v}" for k, v in (env or {}).items()), " ".join(cmd[2:]), flush=True)
    rc = subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode
    path = Path(args.out_dir) / f"{stem}.json"
    return json.loads(path.read_text()) if rc == 0 and path.is_file() else {"rc": rc}


def phase_lossless(out: dict, args) -> None:
    """Every configuration's replies in a process of its own, compared with the target alone's
    replies one prompt at a time under the same kernels and pool settings."""
    runs = {}
    for kind in args.kinds.split(","):
        for variant in args.variants.split(";"):
            for proposal in args.proposals.split(","):
                name = f"{kind}|{proposal}|{variant.strip() or 'default'}"
                stem = "replies-" + "".join(c if c.isalnum() else "_" for c in name)
                env = dict(w.split("=", 1) for w in variant.split() if ENV_SETTING.match(w))
                options = ["--kind", kind, "--proposal", proposal, "--prompts", str(args.prompts),
                           "--max-tokens", str(args.max_tokens), "--modes", args.modes,
                           *[w for w in variant.split() if not ENV_SETTING.match(w)]]
                t0 = time.perf_counter()
                runs[name] = _child(args, "replies", stem, options, env)
                runs[name]["wall_s"] = round(time.perf_counter() - t0, 1)
    rows = []
    for name, run in runs.items():
        kind, proposal, variant = name.split("|")
        ref = runs.get(f"{kind}|target|{variant}", {}).get("replies", {})
        for mode, got in run.get("replies", {}).items():
            reference = ref.get(mode, {}).get("alone", [])
            n = len(got["alone"])
            row = dict(kind=kind, proposal=proposal, variant=variant, mode=mode, num_pages=run.get("num_pages"),
                       alone_vs_ref=f"{_same(got['alone'], reference)}/{n}",
                       batch_vs_ref=f"{_same(got['batch'], reference)}/{n}",
                       alone_vs_batch=f"{_same(got['alone'], got['batch'])}/{n}",
                       first_differences=[_first_difference(a, b) for a, b in zip(got["alone"], reference)])
            if "again" in got:
                row["again_vs_alone"] = f"{_same(got['again'], got['alone'])}/{n}"
            rows.append(row)
            print(row, flush=True)
    out["equality"] = rows
    out["runs"] = {name: {k: v for k, v in run.items() if k != "replies"} for name, run in runs.items()}


def phase_pool(out: dict, args) -> None:
    """The target's forward alone (SmolLM2's config, random bf16 weights, the invariant kernels) on
    pools of several sizes, its pages low or at the pool's end: a decode against itself repeated and
    against a verify of 5 tokens, bit for bit; the engine's programs aside."""
    from eagle3_jax.config import ModelConfig

    cfg = ModelConfig.from_json(Path(args.target) / "config.json")
    params = llama.fold_norm_gains(llama.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
    ctx, page = 40, 16
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, ctx + 5), dtype=np.int32)
    step = _step_fn(cfg, "invariant")
    rows = []
    for num_pages in (int(n) for n in args.pool_pages.split(",")):
        for at_end in (False, True):
            table = np.zeros((1, 68), np.int32)
            table[0, :8] = np.arange(num_pages - 9, num_pages - 1) if at_end else np.arange(1, 9)
            cache = llama.KVCache.zeros(cfg.num_layers, num_pages, page, cfg.num_kv_heads, cfg.head_dim, jnp.bfloat16)
            _, cache = step(params, tokens[:, :ctx], np.arange(ctx)[None], cache, table)
            logits = []
            for t in (1, 1, 5):  # decode, decode again, verify
                got, cache = step(params, tokens[:, ctx:ctx + t], np.arange(ctx, ctx + t)[None], cache, table)
                logits.append(np.asarray(got)[0, 0])
            del cache
            rows.append(dict(num_pages=num_pages, pages_at_end=at_end,
                             decode_repeats=bool(np.array_equal(logits[0], logits[1])),
                             decode_equals_verify=bool(np.array_equal(logits[0], logits[2])),
                             max_difference=float(np.abs(logits[0] - logits[2]).max())))
            print(rows[-1], flush=True)
    out["pool"] = rows


def phase_release(out: dict, args, questions: list[list[dict]]) -> None:
    """Engines built one after another in one process: one closed (`LLM.close`), one dropped, one
    kept while the fourth is built. The first three should size their pools from the same free
    memory; the fourth gets what the third left (its start-up line says so)."""
    import gc

    from eagle3_jax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=32)
    rows, reference = [], None
    kept = []
    for i, how in enumerate(("close", "last reference dropped", "kept", "none (built while the third is kept)")):
        llm = _llm(args.target, args.kind, "target")
        reply = llm.chat(questions[0], params)[0].token_ids
        reference = reference or reply
        gib = [None if b is None else round(b / 2**30, 2)
               for b in (llm.engine.device.free_bytes, llm.engine.device.held_elsewhere)]
        rows.append(dict(engine=i + 1, released_by=how, num_pages=llm.engine.cfg.pool.num_pages, free_gib=gib[0],
                         held_elsewhere_gib=gib[1], reply_equal=reply == reference))
        print(rows[-1], flush=True)
        if how == "close":
            llm.close()
        elif how == "kept":
            kept.append(llm)  # held while the next engine sizes its pool
        del llm
        gc.collect()
    out["release"] = rows


SPEED_PAGES = 16_384  # both kinds' engines on one card: 64 rows of a 128-token reply hold about 2,000


def phase_speed_engine(out: dict, args, questions: list[list[dict]], batches: tuple[int, ...]) -> None:
    """One proposal's tok/s under each kernel kind of --kinds, both engines in this process (a pool
    of --num-pages each, prefix caching off). At each batch size b: b x min(--speed-waves, prompts //
    b) prompts in waves of b; a pass of each engine that compiled every shape it times (at batch 1
    each prompt's prefill bucket); then --speed-repeats timed passes of each, the engines taking
    turns (A B, then B A) so that the host's or the card's drift falls on both alike. Per kind the
    median pass, the fastest and slowest beside it; `vs_default` the median over the repeats of a
    pass's tok/s over the default engine's pass beside it (runs of each kind in processes of their
    own moved the ratio by 0.1-0.3). Greedy passes repeat the same replies, so each pass does the same
    work; `row_iterations_s` (tok/s over the acceptance length: rows x iterations a second) is the
    figure the kernels decide, whatever replies the kind's rounding gave, and the median TTFT and
    time a token after the first (TPOT) put prefill and decoding apart."""
    from eagle3_jax.sampling_params import SamplingParams

    kinds = args.kinds.split(",")
    # No prefix caching: a warm cache would give the timed pass other (shorter) prefills than the
    # pass that compiled them.
    llms = {kind: _llm(args.target, kind, args.proposal, prefix_caching=False,
                       num_pages=args.num_pages or SPEED_PAGES) for kind in kinds}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in batches:
        prompts = questions[:b * max(1, min(args.speed_waves, len(questions) // b))]

        def run(kind, prompts=prompts, b=b):
            t0 = time.perf_counter()
            outs = [o for i in range(0, len(prompts), b) for o in llms[kind].chat(prompts[i:i + b], params)]
            return time.perf_counter() - t0, outs

        for kind in kinds:
            run(kind)  # warm-up: the same shapes
        passes = {kind: [] for kind in kinds}  # kind -> [(wall s, outputs)], in the order run
        for r in range(args.speed_repeats):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                passes[kind].append(run(kind))
        for kind in kinds:
            ordered = sorted(passes[kind], key=_tok_s)
            median = ordered[len(ordered) // 2]
            outs = median[1]
            acc = float(np.mean([o.metrics.acceptance_length for o in outs])) if args.proposal != "target" else 1.0
            # Prefill and decoding apart: a request's wait for its first token, then its time a token after it.
            ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
            tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
                    for o in outs if len(o.token_ids) > 1]
            rows.append(dict(proposal=args.proposal, kind=kind, b=b, requests=len(prompts),
                             tok_s=round(_tok_s(median), 1),
                             tok_s_range=[round(_tok_s(ordered[0]), 1), round(_tok_s(ordered[-1]), 1)],
                             acceptance=round(acc, 3), row_iterations_s=round(_tok_s(median) / acc, 1),
                             ttft_p50_ms=round(1e3 * float(np.median(ttft)), 2),
                             tpot_p50_ms=round(1e3 * float(np.median(tpot)), 3) if tpot else None,
                             passes=len(ordered)))
            if "default" in passes and kind != "default":
                pair = [_tok_s(p) / _tok_s(d) for p, d in zip(passes[kind], passes["default"])]
                rows[-1]["vs_default_pairs"] = [round(x, 3) for x in sorted(pair)]
            print(rows[-1], flush=True)
    out["speed"] = rows


def _tok_s(timed_pass: tuple[float, list]) -> float:
    """A pass's (wall s, outputs) -> its output tokens a second."""
    wall, outs = timed_pass
    return sum(len(o.token_ids) for o in outs) / wall


def phase_speed(out: dict, args) -> None:
    """tok/s of each proposal with each kernel kind, a process a proposal (its engines side by side:
    `phase_speed_engine`); each kind over the default kernels in tok/s (`vs_default`: the median of
    the paired passes' ratios), in rows x iterations a second (`vs_default_per_iteration`: the
    kernels' cost without the replies' acceptance) and in decoding alone (`vs_default_decoding`: the
    time a token after the first, prefill left out)."""
    rows = []
    for proposal in args.proposals.split(","):
        options = ["--kinds", args.kinds, "--proposal", proposal, "--max-tokens", str(args.max_tokens),
                   "--batches", args.batches, "--speed-waves", str(args.speed_waves),
                   "--speed-repeats", str(args.speed_repeats),
                   *(["--num-pages", str(args.num_pages)] if args.num_pages else [])]
        rows += _child(args, "speed-engine", f"speed-{proposal}", options).get("speed", [])
    for row in rows:
        base = next((r for r in rows if r["proposal"] == row["proposal"] and r["b"] == row["b"]
                     and r["kind"] == "default"), None)
        if base is None:
            continue
        pairs = row.get("vs_default_pairs", [1.0])
        row["vs_default"] = round(float(np.median(pairs)), 3)
        # Per iteration: the same ratio with each side's tok/s over its acceptance length.
        row["vs_default_per_iteration"] = round(row["vs_default"] * base["acceptance"] / row["acceptance"], 3)
        # Decoding alone, as a speed (the default's time a token over this one's): prefill left out.
        row["vs_default_decoding"] = (round(base["tpot_p50_ms"] / row["tpot_p50_ms"], 3)
                                      if base.get("tpot_p50_ms") and row.get("tpot_p50_ms") else None)
    out["speed"] = rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("8b", "lossless", "replies", "pool", "release", "speed", "speed-engine", "gemm",
                                            "attribution"),
                   required=True)
    p.add_argument("--target", help="converted SmolLM2 directory")
    p.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the cached asset)")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--batches", default="1,8,64", help="8b, speed: rows of the steps checked and timed")
    p.add_argument("--max-tokens", type=int, default=256, help="lossless, speed: tokens a reply")
    p.add_argument("--speed-waves", type=int, default=16,
                   help="speed: waves of the batch timed at each batch size (as many as the prompts allow)")
    p.add_argument("--speed-repeats", type=int, default=6,
                   help="speed: timed passes of each kind at each batch size (the median)")
    p.add_argument("--kinds", default="invariant,default")
    p.add_argument("--proposals", default=",".join(PROPOSALS), help="lossless: the engines compared")
    p.add_argument("--variants", default="",
                   help="lossless: ';'-separated replies options to run each engine with ('' the defaults; "
                        "NAME=value words set its environment)")
    p.add_argument("--modes", default="greedy,seeded")
    # replies: one engine, in this process
    p.add_argument("--kind", choices=tuple(KINDS), default="invariant")
    p.add_argument("--proposal", choices=PROPOSALS, default="target")
    p.add_argument("--kv-fraction", type=float, default=0.9)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--warmup", action="store_true")
    p.add_argument("--no-overlap", action="store_true", help="replies: the host waits for each step's results")
    p.add_argument("--repeat", action="store_true", help="replies: each prompt alone once more at the end")
    p.add_argument("--pool-pages", default="2000,60000,100000,150000", help="pool: the pool sizes tried")
    p.add_argument("--layers", type=int, default=None, help="attribution: the target's layers (default: all)")
    p.add_argument("--calls", type=int, default=30, help="attribution: timed calls a figure")
    p.add_argument("--table-len", type=int, default=2048,
                   help="attribution: the positions a row's block table spans (SmolLM2's max_model_len 2048: four "
                        "splits of the invariant attention; at most 288, the context and the step: one)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--attention-only", action="store_true",
                      help="attribution: the default forward and the one with invariant attention only (a sweep of "
                           "$EAGLE3_JAX_INVARIANT_ATTENTION's settings runs one process a setting)")
    only.add_argument("--projections-only", action="store_true",
                      help="attribution: the default forward and the one with invariant projections only (a sweep "
                           "of $EAGLE3_JAX_GEMM_MIN_SPLIT_K runs one process a value)")
    p.add_argument("--kernels", action="store_true",
                   help="attribution: each call's GPU kernels and their device time, both kinds (jax.profiler)")
    p.add_argument("--window-tokens", default="1,2,3,5",
                   help="attribution: the tree window kernel's tokens a program timed (SmolLM2: 5 a tile of 16 rows)")
    p.add_argument("--tune-rows", default=",".join(map(str, TUNE_ROWS)),
                   help="attribution: the row counts the projections' tiles are tuned at ('': no tuning)")
    p.add_argument("--gemm-rows", default="1,64,320,2048", help="gemm: the row counts each tile is timed at")
    p.add_argument("--out-dir", default=".")
    p.add_argument("--out-name", default=None, help="the JSON's name (default: the phase's)")
    args = p.parse_args()
    if args.speed_repeats < 1:
        p.error(f"--speed-repeats {args.speed_repeats}: at least one timed pass")
    out: dict = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.phase == "8b":
        phase_8b(out, batches)
    elif args.phase == "gemm":
        phase_gemm(out, tuple(int(m) for m in args.gemm_rows.split(",")))
    elif args.phase == "attribution":
        phase_attribution(out, args, batches)
    else:
        questions = [[{"role": "user", "content": turn}] for turn in assets.user_turns(questions=args.questions)]
        questions = questions[:args.prompts]
        if args.phase == "replies":
            phase_replies(out, args, questions)
        elif args.phase == "lossless":
            phase_lossless(out, args)
        elif args.phase == "pool":
            phase_pool(out, args)
        elif args.phase == "release":
            phase_release(out, args, questions)
        elif args.phase == "speed-engine":
            phase_speed_engine(out, args, questions, batches)
        else:
            phase_speed(out, args)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / f"{args.out_name or args.phase}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
