#!/usr/bin/env python3
"""Acceptance length of a drafter on the 80 MT-bench prompts (chat template, greedy, 256 new
tokens) for chains of K = 1..6 and any dynamic trees asked for, and single-request speed of
target-only, the chain of --speed-k and each tree, in one run.

    python3 scripts/eval_drafter.py --draft checkpoints/smollm2-135m-eagle3 --out runs/eval.json
    python3 scripts/eval_drafter.py --ks 3,4 --tree 4,4,8 --tree 6,8,31 --speed-prompts 0

Acceptance runs all 80 prompts together in one batch bucket (acceptance does not depend on the
batch); speed runs prompts one at a time. A tree is reported as "tree STEPS,TOPK,TOKENS" beside
the chains' K, with its acceptance rates by depth; on a tree draft_q and one_hot are the same
rule (the point mass), run once, and coupled is its own. Stops adding proposals when
--time-budget-s is spent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle3_jax import LLM, SamplingParams, assets
from eagle3_jax.arguments import tree_spec
from eagle3_jax.config import EngineConfig, default_batch_buckets


def mean_acceptance(outputs) -> tuple[float, list[float]]:
    """Tokens per target forward over all requests, and the per-position acceptance rates."""
    iterations = sum(o.metrics.iterations for o in outputs)
    emitted = sum(o.metrics.emitted for o in outputs)
    k = len(outputs[0].metrics.accepted_at)
    rates = [sum(o.metrics.accepted_at[j] for o in outputs) / iterations for j in range(k)]
    return emitted / iterations, rates


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", default=str(assets.DEFAULT_TARGET))
    ap.add_argument("--draft", default=str(assets.DEFAULT_DRAFT))
    ap.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the PyPI asset)")
    ap.add_argument("--ks", default="1,2,3,4,5,6", help="chains of K proposals to measure ('' for none)")
    ap.add_argument("--tree", action="append", type=tree_spec, default=[], metavar="STEPS,TOPK,TOKENS",
                    help="a dynamic tree to measure too (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=80, help="the first N MT-bench questions")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--draft-acceptance", default="draft_q",
                    help="the sampled rows' rule (SamplingParams.draft_acceptance: draft_q, one_hot, coupled), or "
                         "several to compare on the same requests: draft_q,coupled")
    ap.add_argument("--speed-k", type=int, default=4, help="K for the single-request speed comparison")
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--time-budget-s", type=float, default=1e9)
    ap.add_argument("--out", default="eval.json")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    questions = assets.user_turns(questions=a.questions)
    questions = [[{"role": "user", "content": q}] for q in questions[:a.prompts]]  # chat-templated
    params = SamplingParams(max_tokens=a.max_tokens)
    modes = a.draft_acceptance.split(",")
    result = {"prompts": len(questions), "max_tokens": a.max_tokens, "temperature": a.temperature,
              "acceptance": {}, "speed": {}}

    def save():
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")

    all_at_once = EngineConfig(batch_buckets=(len(questions),), prefill_buckets=(512,), max_model_len=1024,
                               speculation="always")  # measuring the drafter: never switch it off
    # (result key, label, LLM arguments, acceptance modes): the chains, then the trees.
    runs = [(str(k), f"K={k}", {"num_speculative_tokens": k}, modes)
            for k in (int(x) for x in a.ks.split(",") if x.strip())]
    # On a tree, draft_q and one_hot are the same rule (the point mass: its children are not drawn
    # from q): one run for both.
    tree_modes = list(dict.fromkeys("draft_q" if m == "one_hot" else m for m in modes))
    for t in a.tree:
        name = f"tree {t.steps},{t.top_k},{t.tokens}"
        runs.append((name, name, {"tree": t}, tree_modes))
    for name, label, proposal, run_modes in runs:
        if time.perf_counter() - start > a.time_budget_s:
            print(f"time budget spent: stopping before {label}", flush=True)
            break
        llm = LLM(a.target, a.draft, engine_config=all_at_once, warmup=False, progress=False, **proposal)
        llm.engine.warmup(progress=False, greedy=a.temperature == 0)  # only the programs this run uses
        for mode in run_modes:
            # Seeded per prompt, so the two acceptance rules see the same requests.
            sampled = [SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, seed=i,
                                      draft_acceptance=mode) for i in range(len(questions))]
            outputs = llm.generate(questions, sampled)
            length, rates = mean_acceptance(outputs)
            key, shown = (name, label) if len(run_modes) == 1 else (f"{name} {mode}", f"{label} {mode}")
            result["acceptance"][key] = {"acceptance_length": length, "rates": rates,
                                         "tokens": sum(len(o.token_ids) for o in outputs)}
            print(f"{shown}: acceptance length {length:.3f}, rates {' '.join(f'{r:.3f}' for r in rates)}",
                  flush=True)
            save()

    # (label, drafter, LLM arguments): the target alone, the chain of --speed-k, each --tree; each
    # compiles only the bucket the engine's default buckets run a lone request in.
    speed_runs = [("target-only", None, {"num_speculative_tokens": 0}),
                  (f"EAGLE-3 K={a.speed_k}", a.draft, {"num_speculative_tokens": a.speed_k})]
    speed_runs += [(f"EAGLE-3 tree {t.steps},{t.top_k},{t.tokens}", a.draft, {"tree": t}) for t in a.tree]
    for mode, draft, proposal in speed_runs if a.speed_prompts > 0 else ():
        one = EngineConfig(prefill_buckets=(512,), max_model_len=1024, speculation="always", **proposal)
        one = dataclasses.replace(one, batch_buckets=default_batch_buckets(one.speculative_proposals)[:1])
        llm = LLM(a.target, draft, engine_config=one, progress=False, **proposal)
        llm.generate(questions[:1], SamplingParams(max_tokens=16))  # first-call effects out of the timing
        tokens, seconds = 0, 0.0
        for q in questions[:a.speed_prompts]:
            t = time.perf_counter()
            out = llm.generate([q], params)[0]
            seconds += time.perf_counter() - t
            tokens += len(out.token_ids)
        result["speed"][mode] = {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds}
        print(f"{mode}: {tokens / seconds:.1f} tok/s over {a.speed_prompts} prompts, one at a time", flush=True)
        save()
    result["seconds"] = time.perf_counter() - start
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
