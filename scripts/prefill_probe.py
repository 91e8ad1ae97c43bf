#!/usr/bin/env python3
"""Device time of the engine's prefill programs by shape (prompts per call x chunk tokens), with
the drafter and without, and where the largest one's time goes.

    python3 scripts/prefill_probe.py --target checkpoints/smollm2-135m-instruct \\
        --draft checkpoints/smollm2-135m-eagle3 --profile /tmp/prefill-profile

Why: 32 SmolLM2 requests arriving at once waited 80-93 ms for their first tokens, whether their
prefills ran as 32 calls of one prompt or 5 calls of up to eight (scripts/serve_arrivals.py,
BENCHMARKS.md, eleventh session). So a prefill's time grows with its rows, not with its calls:
this measures by how much, and which kernels take it.

Each call is the engine's own program (`steps.prefill_step`) on padding rows (the dummy slot,
positions from 0, the whole chunk computed as for a real prompt), back to back with the state
threaded through; ms per call is the median of rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax

from eagle3_jax.bench import profile
from eagle3_jax.bench.harness import time_calls
from eagle3_jax.bench.options import sorted_ints
from eagle3_jax.config import EngineConfig
from eagle3_jax.runner.steps import prefill_step


def prefill_call(engine, rows: int, size: int):
    """The engine's greedy prefill of (rows, size) padding rows as state -> (state, None)."""
    cfg = engine.prefill_configs(greedy=True)[0]
    rest = engine.padding_prefill_args(rows, size)[3:]

    def call(state):
        return prefill_step(engine.params, engine.draft_params, state, *rest, cfg=cfg), None

    return call


def ms_per_call(engine, rows: int, size: int, calls: int = 5, rounds: int = 5) -> float:
    engine.state, samples = time_calls(prefill_call(engine, rows, size), engine.state, lambda s: s, calls, rounds)
    return 1e3 * statistics.median(samples)


def main() -> int:
    from eagle3_jax.api import LLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--rows", type=sorted_ints, default=(1, 8))
    ap.add_argument("--sizes", type=sorted_ints, default=(128, 512))
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--profile", default=None, help="trace the largest shape with the drafter here; list its kernels")
    a = ap.parse_args()
    modes = [("target only", None, 0)] + ([(f"EAGLE-3 K={a.num_draft}", a.draft, a.num_draft)] if a.draft else [])
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {a.target}; max_model_len {a.max_model_len}; "
          "ms per prefill call (padding rows, greedy)\n")
    print("| mode | rows | chunk tokens | ms/call | ms/row | tokens/s |\n|---|---|---|---|---|---|")
    for name, draft, k in modes:
        engine_cfg = EngineConfig(batch_buckets=(1,), prefill_buckets=a.sizes, prefill_batch_buckets=a.rows,
                                  num_speculative_tokens=k, max_model_len=a.max_model_len)
        engine = LLM(target=a.target, draft=draft, num_speculative_tokens=k, engine_config=engine_cfg,
                     warmup=False, progress=False).engine
        for size in a.sizes:
            for rows in a.rows:
                ms = ms_per_call(engine, rows, size)
                print(f"| {name} | {rows} | {size} | {ms:.2f} | {ms / rows:.2f} | {rows * size / ms * 1e3:,.0f} |",
                      flush=True)
        if a.profile and name == modes[-1][0]:  # with the drafter when there is one
            print_profile(engine, name, a.rows[-1], a.sizes[-1], a.profile)
    return 0


def print_profile(engine, name: str, rows: int, size: int, out_dir: str, calls: int = 3) -> None:
    """The kernels of `calls` prefills of (rows, size) under JAX's profiler, per call."""
    engine.state, activity = profile.profile_calls(prefill_call(engine, rows, size), engine.state, calls, out_dir)
    print(f"\n{name}, {rows} x {size}, {calls} calls: busy {activity.busy_us / calls / 1e3:.2f} ms a call; "
          "top kernels (count, us a call):")
    for kernel, count, total in activity.by_name:
        print(f"- {kernel}: {count // calls}, {total / calls:.0f}")
    print()


if __name__ == "__main__":
    sys.exit(main())
