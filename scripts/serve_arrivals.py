#!/usr/bin/env python3
"""Online serving with staggered arrivals: requests arriving as a Poisson process, at several
rates, served by the engine's step loop, target-only against EAGLE-3.

    python3 scripts/serve_arrivals.py --questions .stage/data/question.jsonl
    python3 scripts/serve_arrivals.py --requests 4 --max-tokens 16 --rates 4,inf --batches 2,4   # quick, CPU
    python3 scripts/serve_arrivals.py --log-graph-updates           # + XLA's CUDA-graph updates per rate

Each mode (the target alone; EAGLE-3 speculating always, and by the engine's policy: `--speculation`)
gets one engine, built from the checkpoints as `eagle3-jax bench` builds it and warmed up (greedy
programs only: every request is greedy). Then, for each rate, N requests (MT-bench first turns in
order, chat template) arrive at the times of a seeded Poisson process at that many requests/s
(`inf`: all at t=0); every mode sees the same times. The loop adds each request once its arrival
time has passed, steps the engine while it has work, and sleeps until the next arrival only while
it has none. The engine gets each request's arrival time (`Engine.add_request(arrival_time=...)`),
so the time to first token includes the wait for the step that admits it.

Columns: output tok/s = output tokens / wall s (first arrival until the engine is idle); speedup =
tok/s over target-only's at the same rate (while requests trickle in, the arrivals set the wall
time and this ratio stays near 1: read the TPOT one); TPOT speedup = target-only's TPOT p50 over
this mode's; TTFT = arrival -> first token collected by the host and
TPOT = (last token time - first token time) / (tokens - 1), p50 and p90 over requests (the engine's
RequestMetrics); acceptance length = tokens per target forward, the mean over requests; iterations,
host and device-wait ms per step (EngineStats); compiles = executables built during the timed part
(0 after warm-up, else a WARNING line). In "auto" the engine's acceptance estimate carries over
from one rate to the next, as it would while serving.

--log-graph-updates runs this script again in a child process with XLA's command-buffer log on
(TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3) and counts its "Update command
buffer" lines per mode and rate: XLA rewriting a CUDA graph before a launch because a buffer it
records moved (BENCHMARKS.md, "Host overhead"). GPU only: on any other backend the counts are n/a.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import numpy as np

from eagle3_jax import assets
from eagle3_jax.arguments import sizes
from eagle3_jax.bench.common import Column, Result, markdown_table
from eagle3_jax.bench.harness import sized_engine_config
from eagle3_jax.bench.phases import load_prompts, request_latencies, user_turn_encoder
from eagle3_jax.config import ATTENTION_KINDS, EngineConfig
from eagle3_jax.engine.engine import Engine, EngineStats
from eagle3_jax.engine.scheduler import Request
from eagle3_jax.sampling_params import SamplingParams

# Prefix of this script's own stderr lines; the child's timed parts are bracketed by
# "<prefix> begin <mode> | <rate>" and "<prefix> end" for --log-graph-updates.
LOG_PREFIX = "[serve_arrivals]"
GRAPH_UPDATE = "Update command buffer"  # XLA's command_buffer_thunk log line, VLOG(3)

COLUMNS = [Column("rate", "arrivals"), Column("mode", "mode"), Column("batch", "requests", "{}"),
           Column("tokens", "output tokens", "{}"), Column("wall_s", "wall s", "{:.2f}"),
           Column("tok_s", "output tok/s", "{:.1f}"), Column("speedup", "speedup", "{:.2f}x"),
           Column("tpot_speedup", "TPOT speedup", "{:.2f}x"),
           Column("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"), Column("ttft_p90_ms", "TTFT p90 ms", "{:.1f}"),
           Column("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"), Column("tpot_p90_ms", "TPOT p90 ms", "{:.2f}"),
           Column("acceptance_length", "acceptance length", "{:.2f}"), Column("iterations", "iterations", "{}"),
           Column("prefill_calls", "prefill calls", "{}"),
           Column("host_ms_per_step", "host ms/step", "{:.2f}"),
           Column("device_wait_ms_per_step", "device wait ms/step", "{:.2f}"), Column("compiles", "compiles", "{}")]


def log(message: str) -> None:
    print(f"{LOG_PREFIX} {message}", file=sys.stderr, flush=True)


def poisson_arrivals(count: int, rate: float, seed: int) -> np.ndarray:
    """Arrival times [count] in seconds: the first at 0, then exponential gaps of mean 1 / rate (a
    Poisson process at `rate` requests/s); rate inf puts all at 0. The gaps are the same seeded
    draws at every rate, scaled by 1 / rate."""
    gaps = np.random.default_rng(seed).exponential(1.0, count - 1) / rate
    return np.concatenate([[0.0], np.cumsum(gaps)])


def rate_label(rate: float) -> str:
    return "all at t=0" if math.isinf(rate) else f"{rate:g}/s"


def serve(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams,
          arrivals: np.ndarray) -> tuple[list[Request], float]:
    """Add prompt i once arrivals[i] seconds have passed since the start, stepping the engine while
    it has work and sleeping until the next arrival while it has none.
    -> (the requests, wall seconds from the start until the engine is idle)."""
    start = time.perf_counter()
    requests: list[Request] = []
    while len(requests) < len(prompts) or engine.has_unfinished():
        now = time.perf_counter()
        while len(requests) < len(prompts) and start + arrivals[len(requests)] <= now:
            i = len(requests)
            requests.append(engine.add_request(prompts[i], params, arrival_time=start + arrivals[i]))
        if engine.has_unfinished():
            engine.step()
        elif len(requests) < len(prompts):  # idle: nothing to do before the next arrival
            time.sleep(max(0.0, start + arrivals[len(requests)] - time.perf_counter()))
    return requests, time.perf_counter() - start


def percentile_ms(seconds: Sequence[float], q: float) -> float:
    return 1e3 * float(np.percentile(seconds, q)) if seconds else math.nan


def figures(requests: Sequence[Request], wall_s: float, stats: EngineStats, compiles: int) -> dict:
    """One table row's values (every column but rate, mode, requests and the two speedups)."""
    ttft, tpot = request_latencies(requests)
    tokens = sum(len(r.output) for r in requests)
    return {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s,
            "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p90_ms": percentile_ms(ttft, 90),
            "tpot_p50_ms": percentile_ms(tpot, 50), "tpot_p90_ms": percentile_ms(tpot, 90),
            "acceptance_length": statistics.mean(r.metrics.acceptance_length for r in requests),
            "iterations": stats.iterations, "prefill_calls": stats.prefill_calls,
            "host_ms_per_step": stats.host_ms_per_step,
            "device_wait_ms_per_step": stats.device_wait_ms_per_step, "compiles": compiles}


def run_mode(a: argparse.Namespace, mode: str, draft: Path | None, k: int, speculation: str,
             rates: Sequence[float]) -> tuple[list[Result], str, str | None]:
    """Every rate on one engine. -> (rows, where the prompts came from, the policy's table in "auto")."""
    from eagle3_jax.api import LLM

    engine_config = sized_engine_config(a.batches, k, a.max_model_len, a.prefill_buckets, min_bucket=1,
                                        speculation=speculation,
                                        attention=a.attention, prefill_batch_buckets=a.prefill_batch_buckets)
    llm = LLM(target=a.target, draft=draft, num_speculative_tokens=k, engine_config=engine_config, tree=None,
              warmup=False, progress=False)
    engine = llm.engine
    warmup_s = engine.warmup(progress=False, greedy=True)  # every request here is greedy
    log(f"{mode}: warm-up {warmup_s:.1f} s")
    prompts, source = load_prompts(a.questions, user_turn_encoder(llm),
                                   engine.step_cfg.target.vocab_size, a.requests)
    params = SamplingParams(max_tokens=a.max_tokens)
    rows = []
    for rate in rates:
        engine.reset_stats()
        compiled = engine.num_compilations
        log(f"begin {mode} | {rate_label(rate)}")
        requests, wall_s = serve(engine, prompts, params, poisson_arrivals(a.requests, rate, a.seed))
        log("end")
        values = figures(requests, wall_s, engine.stats, engine.num_compilations - compiled)
        rows.append(Result("serve", mode, len(requests), {"rate": rate_label(rate), **values}))
        log(f"{mode}, {rate_label(rate)}: {values['tok_s']:.1f} tok/s, TTFT p50 {values['ttft_p50_ms']:.0f} ms")
    table = engine.speculation.report() if speculation == "auto" else None
    return rows, source, table


def serve_all(a: argparse.Namespace) -> int:
    rates = [float(r) for r in a.rates.split(",")]
    speculations = [s for s in a.speculation.split(",") if s]
    if a.requests < 1 or any(not r > 0 for r in rates) or set(speculations) - {"always", "auto"}:
        raise SystemExit("--requests must be >= 1, --rates positive (or inf), --speculation from always,auto")
    log(f"backend {jax.default_backend()}")
    modes = [("target-only", None, 0, "always")]
    modes += [(f"EAGLE-3 K={a.num_draft} {s}", a.draft, a.num_draft, s) for s in speculations]
    rows, notes = [], []
    for mode, draft, k, speculation in modes:
        mode_rows, source, table = run_mode(a, mode, draft, k, speculation, rates)
        rows += mode_rows
        if table is not None:
            notes.append(f"{mode}: speculation policy after the last rate (engine/policy.py):\n{table}")
    target_only = {r.values["rate"]: r.values for r in rows if r.mode == "target-only"}
    for r in rows:
        base = target_only[r.values["rate"]]
        r.values["speedup"] = r.values["tok_s"] / base["tok_s"]
        r.values["tpot_speedup"] = base["tpot_p50_ms"] / r.values["tpot_p50_ms"]
    order = {rate_label(rate): i for i, rate in enumerate(rates)}
    rows.sort(key=lambda r: order[r.values["rate"]])  # stable: modes side by side within a rate
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; target {a.target}, drafter {a.draft}; "
          f"{a.requests} requests per rate ({source}), greedy, max_tokens {a.max_tokens}, Poisson seed {a.seed}; "
          f"batch buckets {a.batches}, prefill buckets {a.prefill_buckets} x rows "
          f"{a.prefill_batch_buckets or EngineConfig.prefill_batch_buckets}, max_model_len {a.max_model_len}\n")
    print(markdown_table(rows, COLUMNS))
    for r in rows:
        if r.values["compiles"]:
            print(f"\nWARNING: {r.mode}, {r.values['rate']}: {r.values['compiles']} compilation(s) during the "
                  "timed part (the warm-up missed a program)")
    for note in notes:
        print(f"\n{note}")
    return 0


def count_graph_updates(argv: list[str]) -> int:
    """Run this script again with XLA's command-buffer log on; its table passes through, then the
    "Update command buffer" lines of each timed (mode, rate) in its stderr are counted."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0", TF_CPP_VMODULE="command_buffer_thunk=3")
    child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *argv], env=env,
                             stderr=subprocess.PIPE, text=True, errors="replace")
    counts: dict[str, int] = {}  # "mode | rate" -> graph updates
    backend, timed = None, None
    tail = collections.deque(maxlen=40)  # the child's last stderr lines, shown if it fails
    for line in child.stderr:
        tail.append(line)
        if line.startswith(LOG_PREFIX):
            sys.stderr.write(line)
            kind, _, rest = line[len(LOG_PREFIX):].strip().partition(" ")
            if kind == "backend":
                backend = rest
            elif kind == "begin":
                timed = rest
                counts[timed] = 0
            elif kind == "end":
                timed = None
        elif timed is not None and GRAPH_UPDATE in line:
            counts[timed] += 1
    if child.wait() != 0:
        sys.stderr.writelines(tail)
        return child.returncode
    print(f"\nXLA's CUDA-graph updates during each timed part (\"{GRAPH_UPDATE}\" lines of "
          "TF_CPP_VMODULE=command_buffer_thunk=3; GPU only)\n\n| mode | arrivals | graph updates |\n|---|---|---|")
    for timed, n in counts.items():
        mode, _, rate = timed.partition(" | ")
        print(f"| {mode} | {rate} | {n if backend == 'gpu' else 'n/a (backend ' + str(backend) + ')'} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--target", type=Path, default=assets.DEFAULT_TARGET, help="target checkpoint directory")
    ap.add_argument("--draft", type=Path, default=assets.DEFAULT_DRAFT, help="EAGLE-3 drafter directory")
    ap.add_argument("--questions", default=None,
                    help="MT-bench question.jsonl (default: the packaged asset, fetched when not cached)")
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--rates", default="2,8,32,inf", help="arrival rates, requests/s; inf: all at t=0")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-draft", type=int, default=3, help="K of the EAGLE-3 modes")
    ap.add_argument("--speculation", default="always,auto",
                    help="EAGLE-3 modes beside target-only: EngineConfig.speculation values (empty: none)")
    ap.add_argument("--batches", type=sizes, default=(2, 4, 8, 16, 32),
                    help="batch buckets compiled; the largest is how many requests run at once")
    ap.add_argument("--prefill-buckets", type=sizes, default=(128, 512))
    ap.add_argument("--prefill-batch-buckets", type=sizes, default=None,
                    help="prompts per prefill call compiled (EngineConfig.prefill_batch_buckets; default: its default)")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--attention", default="auto", choices=ATTENTION_KINDS, help="EngineConfig.attention")
    ap.add_argument("--log-graph-updates", action="store_true",
                    help="count XLA's CUDA-graph updates per rate (GPU), in a child process with XLA's log on")
    a = ap.parse_args()
    if a.log_graph_updates:
        return count_graph_updates([arg for arg in sys.argv[1:] if arg != "--log-graph-updates"])
    return serve_all(a)


if __name__ == "__main__":
    sys.exit(main())
