#!/usr/bin/env python3
"""Where a small model's step time goes: the host enqueueing the program, or the device running it.

    python3 scripts/dispatch_overhead.py                        # SmolLM2 shapes, random weights
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 scripts/dispatch_overhead.py

For each step kind (target-only decode, the fused EAGLE-3 iteration, the same iteration as K + 1
programs) and batch bucket, N calls are dispatched back to back through the engine and then
waited for. `enqueue ms` is the host's time per call until the dispatch returned; `wall ms` is
per call until the device finished the last one. enqueue ≈ wall means the host is the limit
(launch-bound): the device waits for the next program. XLA_FLAGS (command buffers, i.e. CUDA
graphs) is read by XLA at start, so compare flag sets in separate processes. To see whether XLA
rewrites a program's CUDA graph between calls (it must when a buffer moves), run with
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 and count "Update command buffer".

`--profile DIR` adds, per step kind and batch, one more round under JAX's profiler, and reads the
device's busy time from the trace (eagle3_jax/bench/profile.py): `device busy ms/call` is the
union of the GPU's kernel intervals over the round divided by its calls, `device idle` the rest of
the round's wall time; the step's largest kernels follow. The script keeps XLA's CUDA graphs on
while profiling (--xla_enable_command_buffers_during_profiling=true; XLA otherwise launches the
kernels one by one under a profiler).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eagle3_jax import presets  # noqa: E402
from eagle3_jax.bench import profile  # noqa: E402
from eagle3_jax.bench.profile import DeviceActivity  # noqa: E402
from eagle3_jax.config import ATTENTION_KINDS, DraftConfig, EngineConfig, ModelConfig  # noqa: E402
from eagle3_jax.engine.driver import Engine  # noqa: E402
from eagle3_jax.runner.steps import iterate_in_place_step  # noqa: E402
from eagle3_jax.model import llama  # noqa: E402
from eagle3_jax.model.eagle3 import init_draft_params  # noqa: E402

if "--profile" in sys.argv:
    profile.keep_command_buffers()  # before the backend starts (the first use of a device)


def engine_for(target: ModelConfig, draft: DraftConfig, k: int, fused: bool, batches, dtype,
               attention: str = "auto") -> Engine:
    params = llama.init_params(target, jax.random.PRNGKey(0), dtype)
    dparams = init_draft_params(draft, jax.random.PRNGKey(1), dtype) if k else None
    cfg = EngineConfig(batch_buckets=tuple(batches), prefill_buckets=(32,), num_speculative_tokens=k,
                       fused_iteration=fused, max_model_len=1024, attention=attention)
    return Engine(target, params, draft if k else None, dparams, cfg)


def census(engine: Engine, batch: int) -> str:
    """What the compiled iteration launches, from its optimized HLO: fusions by kind, custom calls
    by target and every other op (copies, loops, conditionals), counted in the entry computation
    and in the command buffers XLA wrapped parts of it into (a graph's nodes)."""
    rows = np.arange(1, batch + 1, dtype=np.int32)
    tables = np.zeros((batch, engine.cfg.max_blocks_per_seq), np.int32)
    step_cfg = dataclasses.replace(engine.step_cfg, greedy=True)
    text = iterate_in_place_step.lower(engine.params, engine.draft_params, engine.state, rows, tables,
                                       cfg=step_cfg).compile().as_text()
    blocks = re.split(r"\n(?=\S)", text)  # one per computation
    launched = [b for b in blocks if b.startswith("ENTRY") or re.match(r"%?command_buffer", b)]
    counts = collections.Counter()
    for line in "\n".join(launched).splitlines():
        op = re.search(r"= \S+ ([a-z-]+)\(", line)
        if op is None or op.group(1) in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
            continue
        name = op.group(1)
        if name == "fusion":
            kind = re.search(r"kind=(\w+)", line)
            name += f" {kind.group(1) if kind else '?'}"
            backend = re.search(r'"kind":"(\w+)"', line)
            if backend:
                name += f" {backend.group(1)}"
        elif name == "custom-call":
            name += " " + re.search(r'custom_call_target="([^"]+)"', line).group(1)
        counts[name] += 1
    return ", ".join(f"{name} {n}" for name, n in counts.most_common())


def time_bucket(engine: Engine, batch: int, context: int, calls: int, rounds: int,
                drained: bool = False) -> tuple[float, float]:
    """(enqueue ms, wall ms) per call, medians over rounds of `calls` back-to-back iterations; with
    `drained`, the device finishes each call before the next is dispatched (the launch alone)."""
    rows = np.arange(1, batch + 1, dtype=np.int32)
    tables = np.zeros((batch, engine.cfg.max_blocks_per_seq), np.int32)  # scratch pages: same work
    step_cfg = dataclasses.replace(engine.step_cfg, greedy=True)  # what a batch of greedy requests runs
    enqueue, wall = [], []
    for r in range(rounds + 1):  # round 0 compiles and warms up
        s = engine.state
        engine.state = s.replace(slots=s.slots.replace(length=jnp.full_like(s.slots.length, context)))
        start, launching = time.perf_counter(), 0.0
        for _ in range(calls):
            if drained:
                jax.block_until_ready(engine.state)
                t = time.perf_counter()
            engine.state, n = engine.dispatch_iteration(rows, tables, step_cfg)
            if drained:
                launching += time.perf_counter() - t
        queued = time.perf_counter()
        n.block_until_ready()
        done = time.perf_counter()
        if r:
            enqueue.append((launching if drained else queued - start) / calls)
            wall.append((done - start) / calls)
    return 1e3 * statistics.median(enqueue), 1e3 * statistics.median(wall)


def profile_bucket(engine: Engine, batch: int, context: int, calls: int, out_dir: Path) -> DeviceActivity:
    """One round of `calls` iterations under the profiler; the device's activity during it."""
    rows = np.arange(1, batch + 1, dtype=np.int32)
    tables = np.zeros((batch, engine.cfg.max_blocks_per_seq), np.int32)
    step_cfg = dataclasses.replace(engine.step_cfg, greedy=True)
    s = engine.state
    state = s.replace(slots=s.slots.replace(length=jnp.full_like(s.slots.length, context)))

    def call(state):
        engine.state = state  # dispatch_iteration reads the engine's state and donates it
        state, n = engine.dispatch_iteration(rows, tables, step_cfg)
        return state, n

    engine.state, activity = profile.profile_calls(call, state, calls, out_dir)
    return activity


def time_identity(engine: Engine, calls: int, rounds: int, with_params: bool) -> tuple[float, float]:
    """The same dispatch with no kernels: a program returning the donated state it is given.
    Its enqueue time is the per-call cost of the arguments alone (one buffer per pytree leaf)."""
    fn = jax.jit(lambda p, d, s: s, donate_argnums=2)
    args = (engine.params, engine.draft_params) if with_params else (None, None)
    enqueue, wall = [], []
    for r in range(rounds + 1):
        start = time.perf_counter()
        for _ in range(calls):
            engine.state = fn(*args, engine.state)
        queued = time.perf_counter()
        jax.block_until_ready(engine.state)
        done = time.perf_counter()
        if r:
            enqueue.append((queued - start) / calls)
            wall.append((done - start) / calls)
    return 1e3 * statistics.median(enqueue), 1e3 * statistics.median(wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="2,8")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", metavar="DIR", help="also profile one round per step and batch, traces in DIR")
    ap.add_argument("--kinds", default="decode,fused,programs",
                    help="which steps: decode (target-only), fused (one program per iteration), programs (K + 1)")
    ap.add_argument("--attention", default="auto", choices=ATTENTION_KINDS, help="EngineConfig.attention")
    ap.add_argument("--census", action="store_true", help="also list what each compiled iteration launches")
    a = ap.parse_args()
    target = ModelConfig.from_hf(presets.SMOLLM2_135M)
    draft = DraftConfig.like_target(target, draft_vocab_size=16384)
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    batches = [int(b) for b in a.batches.split(",")]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print("| step | batch | enqueue ms/call | wall ms/call | host share | enqueue ms/call, device drained |\n"
          "|---|---|---|---|---|---|")
    kinds = {"decode": ("target-only decode", 0, True), "fused": (f"EAGLE-3 K={a.k} fused", a.k, True),
             "programs": (f"EAGLE-3 K={a.k} as {a.k + 1} programs", a.k, False)}
    kinds = [kinds[k] for k in a.kinds.split(",")]
    profiled, censuses = [], []
    for name, k, fused in kinds:
        engine = engine_for(target, draft, k, fused, batches, dtype, a.attention)
        for b in batches:
            enqueue, wall = time_bucket(engine, b, a.context, a.calls, a.rounds)
            alone, _ = time_bucket(engine, b, a.context, a.calls, a.rounds, drained=True)
            print(f"| {name} | {b} | {enqueue:.3f} | {wall:.3f} | {enqueue / wall:.0%} | {alone:.3f} |", flush=True)
            if a.census and fused:
                censuses.append(f"{name}, batch {b}: {census(engine, b)}")
            if a.profile:
                out = Path(a.profile) / f"{name.split()[0]}-k{k}-{'fused' if fused else 'programs'}-b{b}"
                profiled.append((name, b, wall, profile_bucket(engine, b, a.context, a.calls, out)))
        if fused and k:
            leaves = len(jax.tree_util.tree_leaves((engine.params, engine.draft_params, engine.state)))
            for with_params in (False, True):
                what = f"no kernels: state{' + weights' if with_params else ''} in, state out"
                enqueue, wall = time_identity(engine, a.calls, a.rounds, with_params)
                print(f"| {what} ({leaves if with_params else len(jax.tree_util.tree_leaves(engine.state))} "
                      f"leaves) | - | {enqueue:.3f} | {wall:.3f} | {enqueue / wall:.0%} |", flush=True)
        del engine
    for line in censuses:
        print(f"\n{line}")
    if profiled:
        print_profiles(profiled, a.calls)
    return 0


def print_profiles(profiled: list[tuple[str, int, float, DeviceActivity]], calls: int) -> None:
    """The profiler slows the host (its wall time per call is longer than without it), not the
    kernels: device idle is given both within the profiled round and against the unprofiled wall."""
    print("\n| step | batch | wall ms/call (profiled) | device busy ms/call | device idle (profiled) | "
          "wall ms/call (not profiled) | device idle (busy / wall not profiled) | device events/call |\n"
          "|---|---|---|---|---|---|---|---|")
    for name, b, wall, act in profiled:
        busy = act.busy_us / 1e3 / calls
        print(f"| {name} | {b} | {act.window_us / 1e3 / calls:.3f} | {busy:.3f} | {act.idle_frac:.0%} | {wall:.3f} | "
              f"{max(0.0, 1 - busy / wall):.0%} | {act.events / calls:.0f} |")
    for name, b, _, act in profiled:
        if not act.events:
            print(f"\n{name}, batch {b}: no device events in the trace (no GPU?)")
            continue
        print(f"\n{name}, batch {b}: largest device events (us per call, count per call)")
        for kernel, count, total in act.by_name:
            print(f"  {total / calls:8.1f}  {count / calls:5.1f}  {kernel[:110]}")


if __name__ == "__main__":
    sys.exit(main())
