#!/usr/bin/env python3
"""Is the speculation policy ("auto") what makes its bench rows slower on the host?

    python3 experiments/auto_host_probe.py --target ~/.cache/eagle3_jax/checkpoints/smollm2-135m-instruct \
        --draft checkpoints/smollm2-135m-eagle3 --questions question.jsonl [--tree 6,8,31]

In the bench each mode is an engine of its own, built and timed one after another, and the chain's
"auto" row (which runs exactly the chain's iterations) came out 1-10% below the chain's "always"
row, all in the host's time per step. Two readings fit: the policy's own work, or the host's
speed differing between engines built one after another in a process. This probe builds three
engines serving the same chain of K and keeps them all alive: A speculating always, B "auto", C
always again (built last), then times rounds of MT-bench first turns (greedy, 256 tokens) on each in
turn, A B C, repeated, at batches 8 and 64, and prints each round's host and dispatch ms per step
and the round's wall time, then the medians. If B sits between A and C, the policy costs nothing
measurable and the bench's gap is the engines' order.

Measured on the H200 (jax 0.11.2; BENCHMARKS.md, "Trees end to end"): medians over
three repetitions, wall seconds for 64 prompts: batch 8 A 1.212, B 1.243, C 1.276; batch 64 A
0.337, B 0.333, C 0.335 (host ms per step 1.26 / 1.19 / 1.33 and 2.04 / 1.93 / 1.95). Verdict: the
policy is not the cause; two engines with the same settings differ by as much as auto and always do.

The same with the tree (`--tree 6,8,31 --batches 8 --prompts 32`; A and C serve the tree always,
B "auto" with the chain of K beside it): wall seconds for 32 prompts, A 0.568, B 0.583, C 0.584
(host ms per step 1.394 / 1.458 / 1.361); B ran the tree in every iteration but two of the chain
in its first repetition. B again sits between the two engines that serve the tree always.
"""

from __future__ import annotations

import argparse
import statistics
import time

from eagle3_jax.api import LLM
from eagle3_jax.arguments import tree_spec
from eagle3_jax.bench.harness import sized_engine_config
from eagle3_jax.bench.phases import load_prompts, run_round
from eagle3_jax.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the cached asset)")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--tree", type=tree_spec, default=None, metavar="STEPS,TOPK,TOKENS",
                    help="engines of this tree (the auto one with the chain of K beside it) instead of the chain")
    ap.add_argument("--batches", default="8,64")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    batches = tuple(int(b) for b in a.batches.split(","))

    engines = {}  # name -> engine
    for name, speculation in (("A always", "always"), ("B auto", "auto"), ("C always", "always")):
        cfg = sized_engine_config(batches, a.num_draft, 1024, min_bucket=None if a.tree else 2,
                                  speculation=speculation, tree=a.tree)
        llm = LLM(target=a.target, draft=a.draft, num_speculative_tokens=a.num_draft, engine_config=cfg,
                  tree=a.tree, warmup=False, progress=False)  # without --tree the chain alone, as in the bench
        llm.engine.runner.compile_ahead(*llm.engine.programs(greedy=True))
        llm.engine.warmup(progress=False, greedy=True)
        engines[name] = llm.engine
    prompts, _ = load_prompts(a.questions, llm.encode, llm.engine.step_cfg.target.vocab_size, a.prompts)
    params = SamplingParams(max_tokens=256)

    rows = []  # (batch, engine, host ms/step, dispatch ms/step, wall s)
    for rep in range(a.repeats):
        for b in batches:
            for name, engine in engines.items():
                engine.reset_stats()
                start = time.perf_counter()
                for i in range(a.prompts // b):
                    run_round(engine, prompts[i * b:(i + 1) * b], params)
                wall = time.perf_counter() - start
                s = engine.stats
                rows.append((b, name, s.host_ms_per_step, s.dispatch_ms_per_step, wall))
                ran = {label: counts.get(b) for label, counts in s.proposal_iterations.items() if counts.get(b)}
                print(f"repeat {rep} batch {b:3d} {name:9s} iterations {ran} host {s.host_ms_per_step:.3f} "
                      f"dispatch {s.dispatch_ms_per_step:.3f} ms/step, wall {wall:.3f} s", flush=True)
    print("\nmedians over repeats")
    for b in batches:
        for name in engines:
            mine = [r for r in rows if r[0] == b and r[1] == name]
            print(f"batch {b:3d} {name:9s} host {statistics.median(r[2] for r in mine):.3f} "
                  f"dispatch {statistics.median(r[3] for r in mine):.3f} ms/step, "
                  f"wall {statistics.median(r[4] for r in mine):.3f} s")


if __name__ == "__main__":
    main()
