#!/usr/bin/env python3
"""Prompt lookup (EngineConfig.speculator "ngram") against the target alone and EAGLE-3 on a GPU:
acceptance and tok/s on MT-bench first turns and on HumanEval code completions.

    python3 scripts/ngram_h200.py --target T --out-dir "$OUT" [--questions question.jsonl]
        [--humaneval HumanEval.jsonl.gz] [--prompts 32] [--batches 1,8] [--max-tokens 256]

SmolLM2-135M-Instruct in bf16, greedy, chat template, speculation "always": the target alone,
prompt lookup with K = 4 and 8, the shipped drafter's chain of 4 and its tree (6, 8, 31). Batch 1
runs the prompts one at a time, batch B the first B at once (both after an untimed pass over the
same prompts, so no compile is timed), each engine closed before the next is built. Every
reply is compared with the target alone's. Prints a table and writes ngram.json under --out-dir.
"""

from __future__ import annotations

import argparse
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

from eagle3_jax import assets  # noqa: E402

# label -> (speculator, drafter, K, tree)
PROPOSALS = {
    "target alone": ("eagle3", False, 0, None),
    "ngram K=4": ("ngram", False, 4, None),
    "ngram K=8": ("ngram", False, 8, None),
    "EAGLE-3 chain K=4": ("eagle3", True, 4, None),
    "EAGLE-3 tree 6,8,31": ("eagle3", True, 4, "6,8,31"),
}


def code_prompt(problem: dict) -> str:
    return f"Complete this Python function. Reply with the code only.\n\n```python\n{problem['prompt']}```"


def _llm(target: str, label: str):
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    speculator, drafter, k, tree = PROPOSALS[label]
    cfg = EngineConfig(speculation="always", max_model_len=1024)
    return LLM(target=target, draft=str(assets.DEFAULT_DRAFT) if drafter else None, num_speculative_tokens=k,
               speculator=speculator, engine_config=cfg, dtype=jnp.bfloat16, warmup=False, progress=False,
               tree=tree)


def measure(llm, prompts: list, params, batch: int) -> tuple[float, float, list]:
    """-> (tok/s, mean acceptance length, replies' token ids) of the prompts at `batch`."""
    runs = [[p] for p in prompts] if batch == 1 else [prompts[:batch]]
    for run in runs:  # warm-up: every shape timed below (at batch 1 each prompt's prefill bucket) compiled
        llm.chat(run, params)
    start, outs = time.perf_counter(), []
    for run in runs:
        outs += llm.chat(run, params)
    wall = time.perf_counter() - start
    return (sum(len(o.token_ids) for o in outs) / wall, float(np.mean([o.metrics.acceptance_length for o in outs])),
            [o.token_ids for o in outs])


def main() -> None:
    from eagle3_jax.sampling_params import SamplingParams

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="converted SmolLM2 directory")
    p.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the cached asset)")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (default: the cached asset)")
    p.add_argument("--prompts", type=int, default=32, help="prompts per workload at batch 1")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    workloads = {
        "MT-bench": [[{"role": "user", "content": turn}]
                     for turn in assets.user_turns(questions=args.questions)][:args.prompts],
        "HumanEval": [[{"role": "user", "content": code_prompt(x)}]
                      for x in assets.humaneval_problems(Path(args.humaneval) if args.humaneval else None)
                      ][:args.prompts],
    }
    params = SamplingParams(max_tokens=args.max_tokens)
    batches = [int(b) for b in args.batches.split(",")]
    rows, reference = [], {}
    for label in PROPOSALS:
        llm = _llm(args.target, label)
        for workload, prompts in workloads.items():
            for b in batches:
                tok_s, acceptance, replies = measure(llm, prompts, params, b)
                ref = reference.setdefault((workload, b), replies)
                same = sum(x == y for x, y in zip(replies, ref))
                rows.append(dict(proposal=label, workload=workload, batch=b, tok_s=round(tok_s),
                                 acceptance=round(acceptance, 3), same_as_target=f"{same}/{len(ref)}"))
                print(rows[-1], flush=True)
        llm.close()
    for row in rows:
        base = next(r for r in rows if r["proposal"] == "target alone" and r["workload"] == row["workload"]
                    and r["batch"] == row["batch"])
        row["speedup"] = round(row["tok_s"] / base["tok_s"], 2)
    print(f"{'proposal':22s} {'workload':10s} {'b':>3s} {'tok/s':>7s} {'x alone':>7s} {'accept':>6s} same")
    for r in rows:
        print(f"{r['proposal']:22s} {r['workload']:10s} {r['batch']:3d} {r['tok_s']:7d} {r['speedup']:7.2f} "
              f"{r['acceptance']:6.2f} {r['same_as_target']}")
    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), max_tokens=args.max_tokens, rows=rows)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "ngram.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
