#!/usr/bin/env python3
"""Where does the drafter lose acceptance on MT-bench: prompts unlike its training data, its fit
to the data it saw, bf16's rounding, or where the engine starts its iterations?

Three prompt sets, each answered greedily by the engine (a chain of --k, speculation always),
on any backend (the CPU's f32: about an hour for three sets of 80 on 2 cores):
  mtbench   the evaluation's first turns, by category
  sharegpt  ShareGPT first turns the shipped drafter trained on (their greedy replies were rows)
  magpie    requests the target writes itself (the training recipe's Magpie prompts), with
            --magpie-seed 7 drawn by no training stage (the training distribution, never seen),
            with 0 the shipped drafter's own
For each set and dtype: the engine's acceptance length and rates. On the f32 replies: the training
objective's teacher-forced proxy (`objective.chain_acceptance`, over every base), the engine's
iterations walked over the same hits (`objective.chain_walk`), top-1 by TTT step, and step 0's
hits binned by the target's own top-1 probability. `--texts` reruns that part on a run's replies.

    python3 experiments/drafter_gap_probe.py --prompts 80 --out gap.json

Measured (the shipped drafter, K = 4, the CPU in f32; BENCHMARKS.md, "Where acceptance is
lost"): engine / walk / proxy 2.724 / 2.713 / 3.032 on MT-bench, 3.044 / 3.031 / 3.458 on the
ShareGPT prompts it trained on, 2.905 / 2.895 / 3.267 on the Magpie requests it trained on
(seed 0), 2.799 / 2.793 / 3.137 on new ones (seed 7). Verdict: the walk is the engine's figure
and the proxy overstates it by 0.3-0.4, so training now reports the walk; bf16 is not the limit
(2.688-2.702 on the H200); the drafter matches the target less often on requests it has not
seen at every level of the target's confidence, and MT-bench's prompts draw less predictable
replies than ShareGPT's first turns.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_jax import LLM, SamplingParams, assets
from eagle3_jax.config import EngineConfig
from eagle3_jax.train import data as D
from eagle3_jax.train import loop
from eagle3_jax.train import objective as O
from eagle3_jax.train import prompts as P
from eagle3_jax.train import regenerate as R
from eagle3_jax.weights.llama import load_llama

MAX_PROMPT_TOKENS = 448  # with 256 new tokens, inside the engine's 512-token prefill bucket and 1,024 context
ROW_BUCKETS = (384, 512, 640, 768)  # teacher-forced rows padded to these lengths (few compiled shapes)
CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-6)  # bins of the target's top-1 probability


Prompts = list[tuple[str, list[dict]]]  # (label, chat messages)


def read_questions(path: str | None) -> list[dict]:
    """MT-bench's questions: from `path` (question.jsonl), or the PyPI asset."""
    if path is None:
        return assets.mtbench_questions()
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def mtbench_set(questions: list[dict], n: int) -> Prompts:
    return [(q["category"], [{"role": "user", "content": q["turns"][0]}]) for q in questions[:n]]


def sharegpt_set(n: int, mtbench: list[dict], stride: int) -> Prompts:
    """Every `stride`-th kept ShareGPT first turn, in file order."""
    convs = D.sharegpt_conversations(assets.fetch(assets.SHAREGPT), mtbench=mtbench, log=lambda *_: None)
    guard = P.MTBenchGuard(mtbench)
    kept, _ = P.select_prompts(P.sharegpt_prompts(convs, 1), P.PromptFilters(), guard)
    return [("sharegpt", m) for _, m in kept[::stride]][:4 * n]  # over-long ones dropped later


def magpie_set(target: str, engine: EngineConfig, n: int, seed: int, mtbench: list[dict]) -> Prompts:
    """Requests 0..2n-1 of Magpie seed `seed`, filtered; the target alone writes them, as it wrote
    the training data's."""
    llm = LLM(target, None, num_speculative_tokens=0, engine_config=engine, warmup=False, progress=False, tree=None)
    records = R.magpie_requests(llm, P.magpie_prefix_ids(llm.tokenizer), range(2 * n), seed=seed, progress=False)
    candidates = [("magpie", [{"role": "user", "content": r["request"]}]) for r in records if r["request"]]
    kept, _ = P.select_prompts(candidates, P.PromptFilters(), P.MTBenchGuard(mtbench))
    return [("magpie", m) for _, m in kept]


def draw_prompts(llm, engine: EngineConfig, a, mtbench: list[dict], log) -> dict[str, tuple[list, list]]:
    """Each asked set's (labels, prompt ids)."""
    out = {}
    for name in a.sets.split(","):
        if name == "mtbench":
            cands = mtbench_set(mtbench, a.prompts)
        elif name == "sharegpt":
            cands = sharegpt_set(a.prompts, mtbench, a.sharegpt_stride)
        elif name == "magpie":
            cands = magpie_set(a.target, engine, a.prompts, a.magpie_seed, mtbench)
        else:
            raise SystemExit(f"--sets: unknown set {name!r} (mtbench, sharegpt, magpie)")
        out[name] = fit(llm, cands, a.prompts)
        log(f"{name}: {len(out[name][1])} prompts")
    return out


def fit(llm, prompts: Prompts, n: int) -> tuple[list[str], list[list[int]]]:
    """The first n prompts of at most MAX_PROMPT_TOKENS tokens -> (their labels, their ids)."""
    ids = R.encode_prompts(llm.tokenizer, [m for _, m in prompts], MAX_PROMPT_TOKENS)
    pairs = [(label, x) for (label, _), x in zip(prompts, ids) if x is not None][:n]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def engine_acceptance(outputs, labels: list[str]) -> dict:
    """Tokens per target pass and the rates by position, over all outputs and per label."""
    groups = defaultdict(list)
    for o, label in zip(outputs, labels):
        groups["all"].append(o)
        groups[label].append(o)
    out = {}
    for label, outs in groups.items():
        iterations = sum(o.metrics.iterations for o in outs)
        k = len(outs[0].metrics.accepted_at)
        out[label] = {"acceptance_length": sum(o.metrics.emitted for o in outs) / iterations,
                      "rates": [sum(o.metrics.accepted_at[j] for o in outs) / iterations for j in range(k)],
                      "requests": len(outs)}
    return out


def target_confidence(tcfg):
    """-> jitted f(target, tokens [B, T]) -> [B, T]: the target's own top-1 probability of the token
    step 0 predicts at each base (x_{t+2}, from its distribution at t + 1: `objective.step_targets`)."""

    def f(target, tokens):
        _, logits = O.target_pass(target, tcfg, tokens)
        return O.shift_left(jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1), 1)

    return jax.jit(f)


def teacher_forced(target_dir: str, draft_dir: str, sets: dict[str, list[tuple[np.ndarray, np.ndarray]]],
                   steps: int, k: int, batch: int, log=print) -> dict[str, dict]:
    """Per set of rows (tokens, loss mask), f32: the training objective's evaluation (its means
    weighted by the batches' reply tokens), `objective.chain_walk` of a chain of k over the same
    hits, and step 0's hits binned by the target's own top-1 probability (`CONFIDENCE_EDGES`):
    how much of a miss is the target's uncertainty."""
    tcfg, target = load_llama(target_dir, dtype=jnp.float32)
    dcfg, trainable, d2t = loop.load_init_drafter(draft_dir, tcfg)
    if dcfg.capture_layer_ids is not None:
        tcfg = tcfg.with_capture_layers(dcfg.capture_layer_ids)
    vocab = loop.device_vocab(D.vocab_from_d2t(d2t, np.zeros(tcfg.vocab_size)))
    hp = loop.HParams(steps=1, batch_size=batch, seq_len=ROW_BUCKETS[-1], ttt_steps=steps)
    evaluate = loop.make_eval_step(tcfg, dcfg, hp, jnp.float32)
    confidence_of = target_confidence(tcfg)
    out = {}
    for name, rows in sets.items():
        out[name] = tf = _teacher_forced(evaluate, confidence_of, trainable, target, vocab, rows, k, batch)
        bins = " ".join(f"{b['target_top1'][0]:.1f}+: {b['share']:.2f} at {b['draft_top1']:.3f}"
                        for b in tf["confidence_bins"])
        log(f"{name} teacher-forced: top-1 by step {' '.join(f'{x:.3f}' for x in tf['acc_steps'])}; every base "
            f"(the training's proxy): K={k} {loop.acceptance_length(tf['accept_steps'], k):.3f}, rates "
            f"{' '.join(f'{x:.3f}' for x in tf['accept_steps'][:k])}; the engine's walk: "
            f"{tf['walk']['acceptance_length']:.3f}, rates {' '.join(f'{x:.3f}' for x in tf['walk']['rates'])}; "
            f"step 0 by the target's top-1 probability (share of tokens at draft top-1): {bins}")
    return out


def _teacher_forced(evaluate, confidence_of, trainable, target, vocab, rows, k: int, batch: int) -> dict:
    rows = sorted(rows, key=lambda r: len(r[0]))
    sums, weight = defaultdict(float), 0.0
    iterations, emitted, accepted_at = 0, 0, np.zeros(k)
    confidence, step0 = [], []
    for lo in range(0, len(rows), batch):
        real = len(rows[lo:lo + batch])
        chunk = rows[lo:lo + batch]
        chunk += [chunk[-1]] * (batch - real)  # a full batch: one compiled shape per row bucket
        length = next(b for b in ROW_BUCKETS if b >= max(len(t) for t, _ in chunk))
        ex = D.pad_examples(chunk, length, 0)
        ex.loss_mask[real:] = False  # the repeats count nowhere
        m = jax.device_get(evaluate(trainable, target, vocab, {"tokens": ex.tokens, "loss_mask": ex.loss_mask}))
        w = float(ex.loss_mask.sum())
        for key in ("acc_steps", "accept_steps"):
            sums[key] = sums[key] + w * np.asarray(m[key])
        weight += w
        hits, valid = m["hits"], m["valid"]
        n, e, at = O.chain_walk(hits, valid, k)
        conf = jax.device_get(confidence_of(target, ex.tokens))
        iterations, emitted, accepted_at = iterations + n, emitted + e, accepted_at + at
        confidence.append(conf[valid])
        step0.append(hits[0][valid])
    out = {key: (sums[key] / weight).tolist() for key in ("acc_steps", "accept_steps")}
    out["walk"] = {"acceptance_length": emitted / iterations, "rates": (accepted_at / iterations).tolist(),
                   "iterations": iterations}
    confidence, step0 = np.concatenate(confidence), np.concatenate(step0)
    bins = np.clip(np.searchsorted(CONFIDENCE_EDGES, confidence, side="right") - 1, 0, len(CONFIDENCE_EDGES) - 2)
    out["confidence_bins"] = [{"target_top1": [CONFIDENCE_EDGES[i], min(CONFIDENCE_EDGES[i + 1], 1.0)],
                               "share": float(np.mean(bins == i)), "draft_top1": float(np.mean(step0[bins == i]))}
                              for i in range(len(CONFIDENCE_EDGES) - 1)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(assets.DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(assets.DEFAULT_DRAFT))
    ap.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the PyPI asset)")
    ap.add_argument("--prompts", type=int, default=80, help="prompts per set")
    ap.add_argument("--sets", default="mtbench,sharegpt,magpie")
    ap.add_argument("--dtypes", default="float32", help="engine dtypes to compare, e.g. float32,bfloat16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--magpie-seed", type=int, default=7,
                    help="7: a seed no training stage drew requests with; 0: the shipped drafter's (stages 3 and 4)")
    ap.add_argument("--sharegpt-stride", type=int, default=150)
    ap.add_argument("--tf-steps", type=int, default=6, help="TTT steps of the teacher-forced proxy (0: none)")
    ap.add_argument("--tf-batch", type=int, default=8)
    ap.add_argument("--texts", default=None,
                    help="an earlier run's OUT.texts.json: its f32 replies, teacher-forced only (no engine)")
    ap.add_argument("--out", default="gap.json", help="results; the f32 replies go to OUT.texts.json")
    a = ap.parse_args(argv)
    if 0 < a.tf_steps < a.k:
        ap.error(f"--tf-steps {a.tf_steps}: the walk of a chain of --k {a.k} needs at least {a.k} steps")
    t0 = time.perf_counter()
    mtbench = read_questions(a.questions)
    log = lambda x: print(f"{x} ({time.perf_counter() - t0:.0f} s)", flush=True)
    result = {"args": vars(a), "backend": jax.default_backend(), "engine": {}, "teacher_forced": {}}
    save = lambda: Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    cfg = EngineConfig(batch_buckets=(a.prompts,), prefill_buckets=(512,), max_model_len=1024, speculation="always")
    texts = {}  # set -> [(tokens, loss mask)] of the f32 engine's replies
    if a.texts:  # an earlier run's replies: the teacher-forced part alone
        texts = {name: [R.reply_example(p, r) for p, r in pairs] for name, pairs in json.loads(
            Path(a.texts).read_text()).items()}
    prompts, saved = None, {}
    for dtype in a.dtypes.split(",") if not a.texts else ():
        llm = LLM(a.target, a.draft, num_speculative_tokens=a.k, dtype=jnp.dtype(dtype), engine_config=cfg,
                  warmup=False, progress=False, tree=None)
        prompts = prompts or draw_prompts(llm, cfg, a, mtbench, log)  # the same for every dtype
        for name, (labels, ids) in prompts.items():
            outs = llm.generate(ids, SamplingParams(max_tokens=a.max_tokens))
            acc = engine_acceptance(outs, labels)
            result["engine"].setdefault(name, {})[dtype] = acc
            if dtype == "float32":
                texts[name] = [R.reply_example(p, o.token_ids) for p, o in zip(ids, outs)]
                saved[name] = [[p, list(o.token_ids)] for p, o in zip(ids, outs)]
                Path(a.out).with_suffix(".texts.json").write_text(json.dumps(saved))
            log(f"{name} {dtype}: acceptance {acc['all']['acceptance_length']:.3f}, rates "
                f"{' '.join(f'{r:.3f}' for r in acc['all']['rates'])}")
            save()
        del llm
    if a.tf_steps and texts:
        result["teacher_forced"] = teacher_forced(a.target, a.draft, texts, a.tf_steps, a.k, a.tf_batch, log)
        save()
    for name in result["engine"]:
        for dtype, acc in result["engine"][name].items():
            per = ", ".join(f"{c} {v['acceptance_length']:.2f}" for c, v in acc.items() if c not in ("all", name))
            if per:
                print(f"{name} {dtype} by category: {per}")
    result["seconds"] = time.perf_counter() - t0
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
