#!/usr/bin/env python3
"""Batch invariance on a GPU, checked and priced (EngineConfig.batch_invariant): the bitwise checks and costs
BENCHMARKS.md is to report, one phase a call.

    python3 scripts/invariance_h200.py --phase 8b --out-dir "$OUT"
    python3 scripts/invariance_h200.py --phase smollm2 --target T --out-dir "$OUT"
    python3 scripts/invariance_h200.py --phase speed --target T --out-dir "$OUT"

8b: Llama-3.1-8B shapes with random bf16 weights (near-uniform logits: every token a near-tie).
  After a 256-token prefill per row, for B = 1, 8, 64 rows: a verify of K + 1 = 4 tokens and a
  tree verify of 32 tokens against decodes of the same tokens (the tree: every row's deepest path,
  decoded node by node), logits compared bit for bit, and a 64-token prefill chunk against decoding
  the same tokens; with EngineConfig.batch_invariant's kernels and with the default ones. Then the
  target forward's time (the step's logits included) at B = 1, 8, 64 for 1, 4 and 32 tokens a row,
  both ways.
smollm2: SmolLM2-135M-Instruct in bf16 with the shipped drafter, the 80 MT-bench first turns
  (chat template), 256 tokens: greedy replies of the target alone, the chain of 4 and the tree
  (6, 8, 31) (speculation "always"), each prompt alone and all 80 at once, compared with the target
  alone one prompt at a time; seeded sampling (T = 0.8, seed = the prompt's index) the same way.
  Invariant kernels; the default kernels on the same comparisons beside them.
speed: tok/s end to end, SmolLM2 with the shipped drafter, batch 1 (8 prompts one by one), 8 and
  64 (one round), target alone, chain of 4 and tree, with and without batch_invariant.
Prints a table per phase and writes PHASE.json under --out-dir.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
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


def _llm(target: str, kind: str, proposal: str):
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig, TreeSpec

    draft = None if proposal == "target" else str(assets.DEFAULT_DRAFT)
    tree = TreeSpec(6, 8, 31) if proposal == "tree" else None
    cfg = EngineConfig(speculation="always", batch_invariant=kind == "invariant", max_model_len=1024)
    return LLM(target=target, draft=draft, num_speculative_tokens=4 if draft else 0, engine_config=cfg,
               dtype=jnp.bfloat16, warmup=False, progress=False, tree=tree)


def _same(replies: list, reference: list) -> int:
    return sum(a == b for a, b in zip(replies, reference))


def phase_smollm2(out: dict, target: str, questions: list[list[dict]], kinds: list[str], max_tokens: int) -> None:
    from eagle3_jax.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=max_tokens)
    sampled = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i) for i in range(len(questions))]
    rows = []
    for kind in kinds:
        ref = {}
        for proposal in ("target", "chain", "tree"):
            llm = _llm(target, kind, proposal)
            for mode, params in (("greedy", greedy), ("seeded T=0.8", sampled)):
                t0 = time.perf_counter()
                alone = [llm.generate([q], params if mode == "greedy" else params[i])[0].token_ids
                         for i, q in enumerate(questions)]
                t1 = time.perf_counter()
                batch = [o.token_ids for o in llm.generate(questions, params)]
                t2 = time.perf_counter()
                if proposal == "target":
                    ref[mode] = alone
                n = len(questions)
                rows.append(dict(kind=kind, proposal=proposal, mode=mode,
                                 alone_vs_ref=f"{_same(alone, ref[mode])}/{n}",
                                 batch_vs_ref=f"{_same(batch, ref[mode])}/{n}",
                                 alone_vs_batch=f"{_same(alone, batch)}/{n}",
                                 alone_s=round(t1 - t0, 1), batch_s=round(t2 - t1, 1)))
                print(rows[-1], flush=True)
            del llm
    out["equality"] = rows


def phase_speed(out: dict, target: str, questions: list[list[dict]], max_tokens: int, batches: tuple[int, ...]) -> None:
    from eagle3_jax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for proposal in ("target", "chain", "tree"):
        for kind in ("default", "invariant"):
            llm = _llm(target, kind, proposal)
            for b in batches:
                prompts = questions[:8] if b == 1 else questions[:b]
                warm = [llm.generate(prompts[:1] if b == 1 else prompts, params)]  # compiles these shapes
                del warm
                t0 = time.perf_counter()
                outs = ([llm.generate([q], params)[0] for q in prompts] if b == 1 else llm.generate(prompts, params))
                wall = time.perf_counter() - t0
                tokens = sum(len(o.token_ids) for o in outs)
                acc = np.mean([o.metrics.acceptance_length for o in outs]) if proposal != "target" else 1.0
                rows.append(dict(proposal=proposal, kind=kind, b=b, tok_s=round(tokens / wall),
                                 acceptance=round(acc, 3)))
                print(rows[-1], flush=True)
            del llm
    out["speed"] = rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=("8b", "smollm2", "speed"), required=True)
    p.add_argument("--target", help="converted SmolLM2 directory")
    p.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the cached asset)")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--batches", default="1,8,64", help="8b, speed: rows of the steps checked and timed")
    p.add_argument("--max-tokens", type=int, default=256, help="smollm2, speed: tokens a reply")
    p.add_argument("--kinds", default="invariant,default")
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    out: dict = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    batches = tuple(int(b) for b in args.batches.split(","))
    if args.phase == "8b":
        phase_8b(out, batches)
    else:
        path = Path(args.questions) if args.questions else assets.fetch(assets.MTBENCH)
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        questions = [[{"role": "user", "content": json.loads(line)["turns"][0]}] for line in lines][:args.prompts]
        if args.phase == "smollm2":
            phase_smollm2(out, args.target, questions, args.kinds.split(","), args.max_tokens)
        else:
            phase_speed(out, args.target, questions, args.max_tokens, batches)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / f"{args.phase}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
