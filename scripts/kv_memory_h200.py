#!/usr/bin/env python3
"""The KV pool as a serving engine keeps it, measured on a GPU: one phase a call.

    python3 scripts/kv_memory_h200.py --phase throughput --out-dir "$OUT"
    python3 scripts/kv_memory_h200.py --phase chat --out-dir "$OUT"
    python3 scripts/kv_memory_h200.py --phase preemption --out-dir "$OUT"

SmolLM2-135M-Instruct with the shipped drafter, bf16.
throughput: the MT-bench first turns (chat template), --requests of them at once, max_tokens 2048:
  tok/s and rows running per step, every page reserved at admission on the pool of a formula
  (`page_reservation="whole"`, num_pages as the CPU's default) against pages on demand on the pool
  sized from free memory.
chat: --conversations conversations of 4 turns after a shared system prompt of about 1,500
  tokens, every conversation's turn sent at once: the p50 time to the first token per turn, with
  and without prefix caching.
preemption: the throughput workload on a pool of half the pages its replies end up holding (from a
  run on a pool sized from 0.4 of the free memory): preemptions, tok/s, and whether every greedy reply is unchanged.
Prints the figures and writes PHASE.json under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

FOLLOW_UPS = ("Now summarize your answer in two sentences.", "Give one more concrete example.")


def llm_for(args, **engine):
    """The default engine with these EngineConfig fields (`--batch-invariant`: its kernels too)."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    return LLM(engine_config=EngineConfig(batch_invariant=args.batch_invariant, **engine), progress=False)


def chat_ids(llm, messages) -> list[int]:
    return list(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))


def serve(llm, prompts, max_tokens: int) -> dict:
    """All prompts at once, greedy: tok/s, rows running per step, preemptions, the replies."""
    from eagle3_jax import SamplingParams

    engine = llm.engine
    engine.reset_stats()
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    rows, start = [], time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        rows.append(engine.num_running)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.output) for r in reqs)
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "rows_mean": statistics.mean(rows),
            "rows_max": max(rows), "preemptions": engine.stats.preemptions,
            "prefix_hit_rate": engine.stats.prefix_hit_rate, "pages": engine.cfg.pool.num_pages - 1,
            "replies": [r.output for r in reqs]}


def mtbench_prompts(llm, n: int) -> list[list[int]]:
    from eagle3_jax import assets

    questions = assets.user_turns()
    return [chat_ids(llm, [{"role": "user", "content": questions[i % len(questions)]}]) for i in range(n)]


def phase_throughput(args) -> dict:
    from eagle3_jax.config import BATCH_BUCKETS, EngineConfig
    from eagle3_jax.runner.kv_memory import pool_config

    # The pool a device reporting no memory gets: every one of the default 64 slots at 1024 tokens.
    formula = pool_config(EngineConfig(), BATCH_BUCKETS[-1], None, lambda: 0, free=None).num_pages
    out = {}
    for name, engine in (("reserved_formula_pool", dict(page_reservation="whole", num_pages=formula)),
                         ("on_demand_sized_pool", dict())):
        llm = llm_for(args, **engine)
        result = serve(llm, mtbench_prompts(llm, args.requests), args.max_tokens)
        out[name] = {k: v for k, v in result.items() if k != "replies"}
        print(name, json.dumps(out[name]))
    return out


def phase_chat(args) -> dict:
    from eagle3_jax import SamplingParams, assets

    questions = assets.mtbench_questions()
    out = {}
    for caching in (False, True):
        llm = llm_for(args, prefix_caching=caching, max_model_len=4096,
                      kv_memory_fraction=0.4)  # pools of one size, each far past the chats' need
        system = " ".join(q["turns"][0] for q in questions)
        ids = llm.tokenizer(system)["input_ids"][:1500]
        system = llm.tokenizer.decode(ids)
        chats = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
        ttft = []
        for turn in range(4):
            for i, chat in enumerate(chats):
                q = questions[i % len(questions)]["turns"]
                chat.append({"role": "user", "content": q[turn] if turn < len(q) else FOLLOW_UPS[turn - len(q)]})
            engine = llm.engine
            # Every conversation's template applied before the first arrives: each takes milliseconds
            # on the host, which would count in the TTFT of the requests added before it.
            prompts = [chat_ids(llm, chat) for chat in chats]
            reqs = [engine.add_request(ids, SamplingParams(max_tokens=args.chat_tokens)) for ids in prompts]
            engine.run(reqs)
            ttft.append(statistics.median(r.metrics.first_token_time - r.metrics.arrival_time for r in reqs))
            for chat, req in zip(chats, reqs):
                chat.append({"role": "assistant", "content": llm.decode(req.output)})
        out["caching" if caching else "no_caching"] = {"ttft_p50_s": ttft,
                                                        "prefix_hit_rate": llm.engine.stats.prefix_hit_rate}
        llm.close()  # its memory back before the next engine sizes its pool
        print("prefix caching" if caching else "no prefix caching", [f"{t * 1e3:.1f} ms" for t in ttft])
    return out


def phase_preemption(args) -> dict:
    sized = llm_for(args, kv_memory_fraction=0.4)  # room left for the second engine
    prompts = mtbench_prompts(sized, args.requests)
    reference = serve(sized, prompts, args.max_tokens)
    page = sized.engine.cfg.pool.page_size
    demand = sum(-(-(len(p) + len(r)) // page) for p, r in zip(prompts, reference["replies"]))
    most = max(sized.engine.scheduler.pages_needed(len(p), args.max_tokens) for p in prompts)  # one request's
    sized.close()  # its memory back before the second engine sizes anything
    half = llm_for(args, num_pages=max(demand // 2, most) + 1)
    result = serve(half, prompts, args.max_tokens)
    out = {"demand_pages": demand, **{k: v for k, v in result.items() if k != "replies"},
           "replies_unchanged": result["replies"] == reference["replies"],
           "reference_tok_s": reference["tok_s"]}
    print(json.dumps(out))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("throughput", "chat", "preemption"), required=True)
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--chat-tokens", type=int, default=256)
    p.add_argument("--batch-invariant", action="store_true", help="EngineConfig.batch_invariant for every engine")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = {"throughput": phase_throughput, "chat": phase_chat, "preemption": phase_preemption}[args.phase](args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.phase}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
