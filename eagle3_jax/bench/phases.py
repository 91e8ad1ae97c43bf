"""The JAX phases: smollm2 (the engine end to end), 8b (step functions on synthetic state), tp
(TP=N vs TP=1 tokens)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from eagle3_jax import assets
from eagle3_jax.bench import profile
from eagle3_jax.bench.collectives import (
    device_memory_gb,
    hlo_collectives,
    random_sharded,
    sharded_random_params,
    weight_bytes,
)
from eagle3_jax.bench.common import Result, collector_pauses, log
from eagle3_jax.bench.costs import Ceilings, Cost, LinkCeilings, iteration_cost, target_cost, tree_iteration_cost
from eagle3_jax.bench.harness import (
    bucket_for,
    draft_config_like,
    hf_config_dict,
    own_embedding,
    sized_engine_config,
    step_models,
    synthetic_rows,
)
from eagle3_jax.bench.options import Options
from eagle3_jax.config import (
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    ServedConfig,
    TreeSpec,
    check_draft_fits,
)
from eagle3_jax.engine.engine import Engine, EngineStats
from eagle3_jax.engine.scheduler import Request
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.parallel import sharding
from eagle3_jax.runner.runner import (
    CompileCounter,
    Job,
    PinnedBatch,
    compile_on_pool,
    iterate_pinned,
    time_calls,
)
from eagle3_jax.runner.served import DeviceFacts, attention_kind, served_config
from eagle3_jax.runner.speculators import Chain, eagle3_proposal
from eagle3_jax.runner.state import DeviceState, SlotLayout, init_state, state_shardings, with_lengths
from eagle3_jax.runner.steps import (
    CUBLAS_MAX_HIDDEN,
    CUBLAS_MAX_ROWS,
    CUBLAS_MIN_ROWS,
    TARGET_ALONE,
    StepConfig,
    gemm_for,
    iterate_in_place_step,
    iteration_gemm,
    jit_per_gemm,
)
from eagle3_jax.sampling_params import SamplingParams


@functools.cache
def step_sources() -> frozenset[str]:
    """The package's source files but the bench's own: where a step's kernels come from (--profile)."""
    return frozenset(p.name for p in Path(__file__).resolve().parents[1].rglob("*.py") if p.parent.name != "bench")


@dataclasses.dataclass
class Round:
    """One round of b prompts, as the harness's step loop saw it."""

    requests: list
    wall_s: float
    ttft_s: list[float]  # per request
    tpot_s: list[float]  # per request with two tokens or more
    steady_steps_s: list[float]  # steps with the whole batch running and no prefill


def request_latencies(requests: Sequence[Request]) -> tuple[list[float], list[float]]:
    """(TTFT s per request that produced a token, TPOT s per request of two tokens or more), from
    each one's metrics: TTFT = arrival -> first token collected by the host, TPOT = (last token
    time - first token time) / (tokens - 1)."""
    ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in requests
            if r.metrics.first_token_time is not None]
    tpot = [(r.metrics.last_token_time - r.metrics.first_token_time) / (len(r.output) - 1)
            for r in requests if len(r.output) > 1]
    return ttft, tpot


def run_round(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams) -> Round:
    """Submit the prompts together and step the engine until it is idle (LLM.generate's loop)."""
    batch = len(prompts)
    reqs = [engine.add_request(p, params) for p in prompts]
    steady = []
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        running, waiting = engine.num_running, engine.num_waiting
        t = time.perf_counter()
        engine.step()
        steps += 1
        if steps > 2 and not waiting and running == batch == engine.num_running:
            steady.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    return Round(reqs, wall, *request_latencies(reqs), steady)


def user_turn_encoder(llm):
    """text -> the ids of one user turn through the target's chat template (None: no tokenizer)."""
    if llm.tokenizer is None:
        return None
    return lambda text: llm.encode_chat([{"role": "user", "content": text}])


def load_prompts(questions: str | None, encode, vocab_size: int, count: int) -> tuple[list[list[int]], str]:
    """`count` prompts as token ids, and where they came from: MT-bench first turns in order
    (repeated as needed) through `encode` (the chat template), from the question.jsonl at
    `questions` (None: the packaged asset); random ids without a tokenizer."""
    if encode is None:
        rng = np.random.default_rng(0)
        return ([rng.integers(1, vocab_size, 32).tolist() for _ in range(count)],
                "random token ids (no tokenizer), 32 per prompt")
    if questions:
        with open(questions) as f:
            records = [json.loads(line) for line in f if line.strip()]
    else:
        records = assets.mtbench_questions()
    turns = [q["turns"][0] for q in records]
    return ([list(encode(turns[i % len(turns)])) for i in range(count)],
            f"MT-bench first turns ({len(turns)} questions, in order, repeated as needed), chat template")


def resolve_draft(opts: Options, target_cfg: ModelConfig, scratch: Path) -> tuple[Path, str]:
    """The drafter directory and its label: --draft, else the shipped drafter wherever it fits the
    target (SmolLM2-135M-Instruct converted anywhere, not only to the default directory), else a
    random one written to `scratch` (also when asked for with "random")."""
    if opts.draft not in (None, "random"):
        return Path(opts.draft), f"drafter {opts.draft}"
    shipped = assets.DEFAULT_DRAFT
    if opts.draft is None and (shipped / "config.json").is_file():
        try:  # the shipped drafter stores no embedding: it reads the target's
            check_draft_fits(target_cfg, DraftConfig.from_json(shipped / "config.json"), has_own_embedding=False)
            return shipped, f"trained drafter {shipped.name}"
        except ConfigError:
            pass
    from eagle3_jax.weights.eagle3 import save_drafter

    dcfg = draft_config_like(target_cfg)
    path = save_drafter(init_draft_params(dcfg, jax.random.PRNGKey(1), jnp.float32), dcfg, scratch / "random-drafter")
    return path, "RANDOM drafter (init_draft_params; untrained, so acceptance says nothing)"


def isolated_iteration_s(engine: Engine, batch: int, context: int, opts: Options) -> float:
    """Median seconds per call of the engine's iteration alone, back to back, in the bucket
    `batch` runs in and as it runs there now (speculative or target-only): its weights, rows with
    pages of their own and `context` cached tokens."""
    bucket = bucket_for(engine.cfg, batch)
    rows, tables = synthetic_rows(engine.cfg, bucket)
    samples = engine.runner.time_iteration(rows, tables, engine.iterate_config(bucket), context, opts.calls,
                                           opts.rounds)
    return statistics.median(samples)


def engine_figures(rounds: Sequence[Round], stats: EngineStats, k: int) -> dict[str, Any]:
    """Throughput, latency, acceptance and loop figures of one (mode, batch)."""
    reqs = [r for rnd in rounds for r in rnd.requests]
    wall = sum(rnd.wall_s for rnd in rounds)
    tokens = sum(len(r.output) for r in reqs)
    iterations = max(sum(r.metrics.iterations for r in reqs), 1)
    accepted_at = np.sum([r.metrics.accepted_at for r in reqs], axis=0) if k else np.zeros(0)
    steady = [s for rnd in rounds for s in rnd.steady_steps_s]
    tpot = [s for rnd in rounds for s in rnd.tpot_s]
    ttft = [s for rnd in rounds for s in rnd.ttft_s]
    nan = float("nan")
    return {
        "tok_s": tokens / wall, "tokens": tokens, "requests": len(reqs), "tokens_per_request": tokens / len(reqs),
        "wall_s": wall,
        "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else nan,
        "ttft_ms": 1e3 * statistics.mean(ttft) if ttft else nan,
        "acceptance_length": sum(r.metrics.emitted for r in reqs) / iterations,
        "acceptance_rates": (accepted_at / iterations).tolist(),
        "iterations": stats.iterations, "iter_ms": 1e3 * wall / max(stats.iterations, 1),
        "step_ms": 1e3 * statistics.median(steady) if steady else nan, "steady_steps": len(steady),
        "host_ms_per_step": stats.host_ms_per_step, "dispatch_ms_per_step": stats.dispatch_ms_per_step,
        "device_wait_ms_per_step": stats.device_wait_ms_per_step,
    }


def run_mode(opts: Options, mode: str, draft_dir: Path | None, k: int, ceilings: Ceilings | None,
             notes: list[str], fused: bool = True, speculation: str = "always",
             tree: TreeSpec | None = None) -> tuple[list[Result], str]:
    """Every batch size of one mode (target-only, or EAGLE-3 with K = k, fused or per-step, or
    with `tree` (its chain of K beside it in "auto"), speculating always or by the engine's policy)
    on one engine. -> (rows, where the prompts came from)."""
    from eagle3_jax.api import LLM

    engine_config = dataclasses.replace(
        sized_engine_config(opts.batches, k, opts.max_model_len, opts.prefill_buckets, opts.min_bucket, speculation,
                            opts.attention, opts.prefill_batch_buckets, opts.gemv, tree, opts.gemm),
        fused_iteration=fused)
    # tree given, never LLM's "auto": a chain mode under "auto" must not gain the GPU's default tree.
    llm = LLM(target=opts.target, draft=draft_dir, num_speculative_tokens=k, dtype=opts.dtype,
              engine_config=engine_config, warmup=False, progress=False, tree=tree)
    engine = llm.engine
    # The fused programs on a thread pool, timed apart (Engine.warmup then loads them); it builds the per-step ones.
    # Greedy programs only: every request here is greedy (a sampling program compiling inside the
    # timed rounds would show in the notes).
    compile_s = (engine.runner.compile_ahead(*engine.programs(greedy=True))
                 if opts.parallel_compile and fused else float("nan"))
    warmup_s = engine.warmup(progress=False, greedy=True)
    log(f"{mode}: compiled in {compile_s:.1f} s, Engine.warmup {warmup_s:.1f} s")
    target, draft = engine.step_cfg.target, engine.step_cfg.draft
    count = max(math.ceil(opts.prompts / b) * b for b in opts.batches)
    prompts, source = load_prompts(opts.questions, user_turn_encoder(llm), target.vocab_size, count)
    params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=opts.ignore_eos)
    results = []
    for b in opts.batches:
        num_rounds = max(1, math.ceil(opts.prompts / b))
        engine.reset_stats()
        compiles = engine.num_compilations
        log(f"{mode}, batch {b}: {num_rounds} round(s) of {b} prompts")
        with collector_pauses() as pauses:
            rounds = [run_round(engine, prompts[i * b:(i + 1) * b], params) for i in range(num_rounds)]
        if engine.num_compilations != compiles:
            notes.append(f"{mode}, batch {b}: {engine.num_compilations - compiles} compile(s) inside the timed rounds")
        values = engine_figures(rounds, engine.stats, engine_config.max_proposals)
        values.update(gc_passes=sum(pauses.passes), gc_full_passes=pauses.full_passes,
                      gc_ms_per_step=1e3 * pauses.seconds / max(engine.stats.steps, 1))
        if pauses.full_passes:
            notes.append(f"{mode}, batch {b}: {pauses.full_passes} full garbage collection(s) inside the timed "
                         f"rounds; all collections {1e3 * pauses.seconds:.0f} ms")
        # Device time per iteration: the iterate step alone, at the rounds' mean context.
        context = int(np.mean([len(p) for p in prompts[:num_rounds * b]])) + opts.max_tokens // 2
        bucket = bucket_for(engine.cfg, b)
        values.update(rounds=num_rounds, context=context, compile_s=compile_s, warmup_s=warmup_s, bucket=bucket,
                      speculative_iterations=engine.stats.speculative_iterations.get(bucket, 0),
                      target_only_iterations=engine.stats.target_only_iterations.get(bucket, 0),
                      iterations_by_proposal={label: counts[bucket] for label, counts
                                              in engine.stats.proposal_iterations.items() if bucket in counts},
                      device_ms=1e3 * isolated_iteration_s(engine, b, context, opts))
        steady = values["iter_ms"] if math.isnan(values["step_ms"]) else values["step_ms"]
        values["idle_frac"] = max(0.0, 1.0 - values["device_ms"] / steady)
        if opts.profile:
            busy, host = profiled_round(engine, prompts[:b], params, opts.profile / f"{slug(mode)}-b{b}",
                                        values["iter_ms"])
            values.update(busy)
            notes.append(f"{mode}, batch {b}: the host thread's self time per iteration in the profiled round "
                         "(us; the profiler slows the host): " + ", ".join(f"{n} {t:.0f}" for n, t in host))
        if ceilings is not None:
            ran = engine.iterate_config(bucket)
            itemsize = jnp.dtype(opts.dtype).itemsize
            spec = ran.speculator.facts.spec if ran.speculative else None
            cost = (tree_iteration_cost(target, draft, spec, bucket, context, itemsize) if spec and not spec.is_chain
                    else iteration_cost(target, draft, ran.speculator.facts.max_accepted, bucket, context, itemsize))
            values["floor_ms"] = 1e3 * cost.floor_s(ceilings)
        results.append(Result("smollm2", mode, b, values))
        log(f"{mode}, batch {b}: {values['tok_s']:.0f} tok/s, acceptance length {values['acceptance_length']:.2f}, "
            f"device {values['device_ms']:.2f} ms/iter")
    if speculation == "auto":
        notes.append(f"{mode}: speculation policy after the run (engine/policy.py):\n"
                     + engine.speculation.report())
    return results, source


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


def profiled_round(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams, out_dir: Path,
                   iter_ms: float, top: int = 12) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """One more round under the profiler: the device's busy time per iteration, and device idle
    against the unprofiled rounds' wall time per iteration (the profiler slows the host, not the
    kernels, so idle within the profiled round would overstate it). Both count prefill's kernels
    and time alike. Also where the host thread's time went: the `top` event names by self time,
    us per iteration. In "auto" the round also feeds the speculation policy, as any round does."""
    iterations = engine.stats.iterations
    _, activity, host = profile.profile_region(lambda: run_round(engine, prompts, params), out_dir, host=True)
    n = max(engine.stats.iterations - iterations, 1)
    busy_ms = activity.busy_us / 1e3 / n
    return ({"device_busy_ms": busy_ms, "idle_measured": max(0.0, 1.0 - busy_ms / iter_ms)},
            [(name, own / n) for name, _, _, own in host[:top]])


def phase_smollm2(opts: Options, ceilings: Ceilings | None, notes: list[str]) -> tuple[list[Result], dict]:
    target_cfg = ModelConfig.from_json(opts.target / "config.json")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        draft_dir, draft_label = resolve_draft(opts, target_cfg, Path(scratch))
        log(f"drafter: {draft_label}")
        rows, source = run_mode(opts, "target-only", None, 0, ceilings, notes)
        results += rows
        for k in opts.num_draft:
            results += run_mode(opts, f"EAGLE-3 K={k}", draft_dir, k, ceilings, notes)[0]
            if opts.per_step:
                results += run_mode(opts, f"EAGLE-3 K={k} per-step", draft_dir, k, ceilings, notes, fused=False)[0]
            if opts.auto:
                results += run_mode(opts, f"EAGLE-3 K={k} auto", draft_dir, k, ceilings, notes,
                                    speculation="auto")[0]
        chain = max(opts.num_draft)  # the chain "auto" weighs against each tree
        for spec in opts.trees:
            results += run_mode(opts, f"EAGLE-3 {spec.label}", draft_dir, chain, ceilings, notes, tree=spec)[0]
            if opts.auto:
                results += run_mode(opts, f"EAGLE-3 {spec.label} auto (chain K={chain})", draft_dir, chain, ceilings,
                                    notes, speculation="auto", tree=spec)[0]
    base = {r.batch: r.values["tok_s"] for r in results if r.mode == "target-only"}
    for r in results:
        r.values["speedup"] = r.values["tok_s"] / base[r.batch]
    info = {"target": str(opts.target), "drafter": draft_label, "prompts": source,
            "prompts per batch size": f"{opts.prompts} (batch b: max(1, ceil({opts.prompts}/b)) rounds of b)",
            "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos, "max_model_len": opts.max_model_len,
            "prefill_buckets": list(opts.prefill_buckets),
            "prefill_batch_buckets": list(opts.prefill_batch_buckets or EngineConfig.prefill_batch_buckets),
            "dtype": jnp.dtype(opts.dtype).name,
            "compile": "parallel precompile, then Engine.warmup" if opts.parallel_compile else "Engine.warmup",
            "paged attention": attention_kind(EngineConfig(attention=opts.attention), DeviceFacts.of(None)),
            "few-row projections": opts.gemv, "GEMMs": opts.gemm}
    return results, info


# ==== phase 8b: step functions on synthetic state =================================================
def _verify_only(params, kv, tokens, positions, block_tables, cfg: ModelConfig, mesh: Mesh | None = None,
                 attention: str = "xla", gemv: str = "xla"):
    # Under tp, the same pins as the engine's steps: the cache as it came in after every layer,
    # replicated residual stream, logits left vocab-sharded (an argmax moves per-shard (max,
    # index) pairs).
    hidden, _, kv = llama.forward(params, cfg, tokens, positions, kv, block_tables, attention,
                                  sharding.cache_pin(mesh, cfg.num_kv_heads), gemv)
    logits = sharding.vocab_logits(llama.logits(params, sharding.replicate(hidden, mesh), gemv), mesh, gather=False)
    return kv, jnp.argmax(logits, axis=-1)


# Compiled as an iteration of the same rows would be (EngineConfig.gemm).
verify_only = jit_per_gemm(_verify_only, static_argnames=("cfg", "mesh", "attention", "gemv"), donate_argnames="kv")


def synthetic_state(target: ModelConfig, draft: DraftConfig | None, served: ServedConfig, dtype,
                    mesh: Mesh | None = None, layout: SlotLayout = TARGET_ALONE.facts.slot_layout) -> DeviceState:
    """init_state with random KV (never time on zeros), random last tokens and proposals (a tree's
    nodes all under the root: its parents stay 0). Under a mesh, in the layout the engine keeps
    (state_shardings), each KV page array created on its shards. layout: the slots' (init_state's)."""
    if mesh is not None:
        return _sharded_synthetic_state(target, draft, served, dtype, mesh, layout)
    state = init_state(target, draft, served, dtype, layout)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 4 * target.num_layers + 8))

    def fill(kv):
        if kv is None:
            return None
        return jax.tree_util.tree_map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), kv)

    s = state.slots
    slots = s.replace(last_token=jax.random.randint(next(keys), s.last_token.shape, 0, target.vocab_size),
                      drafts=jax.random.randint(next(keys), s.drafts.shape, 0, target.vocab_size))
    return DeviceState(target_kv=fill(state.target_kv), draft_kv=fill(state.draft_kv), slots=slots)


def _sharded_synthetic_state(target: ModelConfig, draft: DraftConfig | None, served: ServedConfig, dtype,
                             mesh: Mesh, layout: SlotLayout) -> DeviceState:
    shapes = jax.eval_shape(lambda: init_state(target, draft, served, dtype, layout))
    where = state_shardings(shapes, target, draft, mesh)
    k_target, k_draft, k_slots = jax.random.split(jax.random.PRNGKey(2), 3)

    def make_slots(key):  # jit drops init_state's KV pool: only the (replicated) slots are made
        s = init_state(target, draft, served, dtype, layout).slots
        k1, k2 = jax.random.split(key)
        return s.replace(last_token=jax.random.randint(k1, s.last_token.shape, 0, target.vocab_size),
                         drafts=jax.random.randint(k2, s.drafts.shape, 0, target.vocab_size))

    draft_kv = None if shapes.draft_kv is None else random_sharded(shapes.draft_kv, where.draft_kv, k_draft, 1.0)
    return DeviceState(target_kv=random_sharded(shapes.target_kv, where.target_kv, k_target, 1.0), draft_kv=draft_kv,
                       slots=jax.jit(make_slots, out_shardings=where.slots)(k_slots))


@dataclasses.dataclass(frozen=True)
class StepKind:  # hashable: keys the phase's programs
    name: str
    num_draft: int  # K of the StepConfig (a tree's steps); 0 is target-only
    verify_only: bool = False
    tree: TreeSpec | None = None  # the iteration drafts this tree
    tokens: int | None = None  # a verify's tokens per row (None: K + 1)


def step_gemm(kind: StepKind, scfg: StepConfig, batch: int, new_tokens: int) -> str:
    """The GEMMs a step of `kind` at `batch` rows compiles with (EngineConfig.gemm): a verify alone
    as an iteration verifying the same rows would."""
    return gemm_for(scfg.gemm, scfg.target, batch * new_tokens) if kind.verify_only else iteration_gemm(scfg, batch)


def step_call(kind: StepKind, params, dparams, scfg: StepConfig, rows: np.ndarray, tables: np.ndarray,
              new_tokens: int, context: int) -> tuple[Callable, Callable[[DeviceState], Job]]:
    """(state -> (state, out)) for one kind of step at one batch, and its precompile job."""
    if kind.verify_only:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, scfg.target.vocab_size, (len(rows), new_tokens)).astype(np.int32)
        positions = np.broadcast_to(context + np.arange(new_tokens, dtype=np.int32), tokens.shape).copy()
        # On the device once: the same buffers every call, as the engine's pinned arguments.
        placement = sharding.replicated_placement(scfg.mesh)
        tokens, positions, tables = jax.device_put((tokens, positions, tables), placement)

        kw = {"cfg": scfg.target, "mesh": scfg.mesh, "attention": scfg.attention, "gemv": scfg.gemv}
        verify = verify_only[step_gemm(kind, scfg, len(rows), new_tokens)]

        def job(state):
            return verify, (params, state.target_kv, tokens, positions, tables), kw

        def call(state):
            kv, out = verify(params, state.target_kv, tokens, positions, tables, **kw)
            return state.replace(target_kv=kv), out

        return call, job

    pinned = PinnedBatch(scfg.mesh)

    def job(state):
        return iterate_in_place_step(scfg, len(rows)), (params, dparams, state, rows, tables), {"cfg": scfg}

    def call(state):
        state, n = iterate_pinned(params, dparams, state, pinned, rows, tables, scfg)
        return state, n

    return call, job


def random_step_weights(target: ModelConfig, draft: DraftConfig, own: bool, dtype,
                        mesh: Mesh | None) -> tuple[Any, Any, float, dict[str, int]]:
    """Random target and draft weights, as the engine serves them (norm gains folded); under a mesh
    in the engine's layout. -> (params, dparams, seconds taken, weight_bytes)."""
    start = time.perf_counter()
    if mesh is None:
        # Eager: jitted, the whole init is one huge program to compile.
        params = llama.init_params(target, jax.random.PRNGKey(0), dtype)
        dparams = init_draft_params(draft, jax.random.PRNGKey(1), dtype, own)
    else:
        # 70B in bf16 is 141 GB: each tensor is created on its shards, never whole on one device.
        params, dparams = sharded_random_params(target, draft, own, mesh, dtype)
    params = llama.fold_norm_gains(params)  # as the engine serves them
    jax.block_until_ready((params, dparams))
    init_s = time.perf_counter() - start
    held = weight_bytes(params, dparams)
    log(f"8b: random weights in {init_s:.1f} s, {(held['target'] + held['draft']) / 1e9:.2f} GB per device")
    return params, dparams, init_s, held


def step_kinds(k: int, trees: Sequence[TreeSpec]) -> list[StepKind]:
    """Decode, the chain iteration at K=k and its verify alone, then each tree's iteration and verify."""
    kinds = [
        StepKind("decode, target-only (K=0)", 0),
        StepKind(f"EAGLE-3 iteration (K={k})", k),
        StepKind(f"verify only (B x {k + 1} tokens)", 0, verify_only=True),
    ]
    for spec in trees:
        kinds += [StepKind(f"EAGLE-3 iteration, tree {spec.steps},{spec.top_k},{spec.tokens}", spec.steps, tree=spec),
                  StepKind(f"verify only (B x {spec.verify_width} tokens)", 0, verify_only=True,
                           tokens=spec.verify_width)]
    return list(dict.fromkeys(kinds))  # a tree's verify width may equal the chain's


def step_configs(opts: Options, kinds: Sequence[StepKind], target: ModelConfig, draft: DraftConfig,
                 served: ServedConfig, mesh: Mesh | None, notes: list[str]) -> dict[StepKind, StepConfig]:
    """Each kind's StepConfig, with the kernels `served` settled under `mesh` (noted)."""
    # Greedy programs: what a batch of greedy requests runs (StepConfig.greedy).
    attention, gemv, gemm = served.kernels.attention, served.kernels.gemv, served.kernels.gemm
    notes.append(
        f"8b: paged attention {attention} (--attention {opts.attention}); few-row projections {gemv} "
        f"(--gemv {opts.gemv}); GEMMs {gemm} (--gemm {opts.gemm}: under auto, cuBLAS where a call verifies "
        f"{CUBLAS_MIN_ROWS} to {CUBLAS_MAX_ROWS} rows of a target at most {CUBLAS_MAX_HIDDEN} wide)"
    )
    return {
        kind: StepConfig(
            target=target,
            draft=draft if kind.num_draft else None,
            speculator=eagle3_proposal(kind.tree) if kind.tree else Chain(kind.num_draft),
            mesh=mesh,
            greedy=True,
            attention=attention,
            gemv=gemv,
            gemm=gemm,
        )
        for kind in kinds
    }


def step_calls(opts: Options, scfgs: dict[StepKind, StepConfig], params, dparams, served: ServedConfig,
               k: int) -> dict[tuple[StepKind, int], tuple[Callable, Callable[[DeviceState], Job]]]:
    """(kind, batch) -> step_call's (call, precompile job), at every batch of --batches-8b."""
    return {
        (kind, b): step_call(
            kind, params, dparams if kind.num_draft else None, scfg, *synthetic_rows(served, b), kind.tokens or k + 1,
            opts.context,
        )
        for kind, scfg in scfgs.items()
        for b in opts.batches_8b
    }


def precompile_steps(opts: Options, scfgs: dict[StepKind, StepConfig], calls: dict, served: ServedConfig,
                     mesh: Mesh | None) -> tuple[dict[str, float], dict, dict]:
    """Lower, then compile every call's program at once. -> (seconds of each, under a mesh
    (kind, batch) -> the program's collectives (hlo_collectives), under --profile (kind, batch) ->
    (HLO module name, its kernel launches))."""
    # Lowered first, one kind's state at a time (lowering keeps only shapes and shardings).
    lower_start, lowered = time.perf_counter(), {}
    for kind, scfg in scfgs.items():
        state = synthetic_state(scfg.target, scfg.draft, served, opts.dtype, mesh, scfg.speculator.facts.slot_layout)
        for b in opts.batches_8b:
            fn, args, kw = calls[kind, b][1](state)
            lowered[kind, b] = fn.lower(*args, **kw)
        del state
    lower_s = time.perf_counter() - lower_start
    seconds, compiled = compile_on_pool([low.compile for low in lowered.values()])
    compile_s = {"lowering": round(lower_s, 1), f"compiling {len(lowered)} programs at once": round(seconds, 1)}
    texts = {key: c.as_text() for key, c in zip(lowered, compiled)} if mesh is not None or opts.profile else {}
    collectives, sites = {}, {}
    if mesh is not None:
        collectives = {key: hlo_collectives(text) for key, text in texts.items()}
    if opts.profile:  # each program's kernel launches and their source lines, for the profile
        sites = {key: (text.split(",", 1)[0].split()[-1], profile.hlo_kernel_sites(text))
                 for key, text in texts.items()}
    del lowered, compiled, texts
    log(f"8b: compiled {len(calls)} programs in {seconds:.1f} s")
    return compile_s, collectives, sites


def profile_step(opts: Options, label: str, call: Callable, state: DeviceState, out: Path,
                 site: tuple[str, list] | None) -> tuple[DeviceState, profile.DeviceActivity, list]:
    """--profile: a trace of opts.calls calls into `out`. -> (state, the device's activity, per call
    (source line, kernels, us) where the precompile's `site` (module, kernel launches) is known)."""
    state, activity = profile.profile_calls(call, state, opts.calls, out)
    rows = []
    if site is not None:
        module, launches = site
        one_call = profile.call_kernels(profile.load_trace(out), opts.calls, module)
        rows = profile.kernels_by_source(profile.align_kernels(launches, one_call), step_sources().__contains__)
        if rows:  # none where the trace shows no GPU (the CPU)
            log(f"8b {label}: per call by source line (us, kernels): "
                + "; ".join(f"{source} {us:.0f} x{count}" for source, count, us in rows[:8]))
    log(
        f"8b {label}: device busy {activity.busy_us / 1e3 / opts.calls:.3f} ms/call, "
        f"idle {activity.idle_frac:.0%}; per call (us, count): "
        + "; ".join(
            f"{name[:60]} {total / opts.calls:.0f} x{count / opts.calls:.0f}" for name, count, total in activity.by_name
        )
    )
    return state, activity, rows


def measure_step(opts: Options, kind: StepKind, b: int, call: Callable, state: DeviceState, served: ServedConfig,
                 site: tuple[str, list] | None,
                 notes: list[str]) -> tuple[DeviceState, list[float], profile.DeviceActivity | None, list]:
    """Seconds per call of one (kind, batch), a sample per round; under --profile, its trace too
    (profile_step). -> (state, samples, activity or None, by-source rows)."""
    rows, _ = synthetic_rows(served, b)
    # One call first: it builds the small programs around the step (the pinned arguments' copy,
    # the verdicts' gather), and the eager scatter of with_lengths compiles here too.
    state, _ = call(state)
    state = with_lengths(state, rows, opts.context)
    compiles = CompileCounter.count
    state, samples = time_calls(call, state, lambda s: with_lengths(s, rows, opts.context), opts.calls, opts.rounds)
    activity, sources = None, []
    if opts.profile:
        state = with_lengths(state, rows, opts.context)
        out = opts.profile / f"{slug(kind.name)}-b{b}"  # one trace folder per step kind
        state, activity, sources = profile_step(opts, f"{kind.name}, batch {b}", call, state, out, site)
    if opts.parallel_compile and CompileCounter.count != compiles:
        notes.append(f"8b {kind.name}, batch {b}: {CompileCounter.count - compiles} compile(s) after the precompile")
    return state, samples, activity, sources


def step_cost(kind: StepKind, scfg: StepConfig, b: int, new_tokens: int, context: int, itemsize: int, tp: int) -> Cost:
    """The floor's bytes, FLOPs and all-reduces of one call of `kind` at `b` rows."""
    if kind.verify_only:
        return target_cost(scfg.target, b, new_tokens, context, itemsize, tp)
    if kind.tree is not None:
        return tree_iteration_cost(scfg.target, scfg.draft, kind.tree, b, context, itemsize, tp)
    return iteration_cost(scfg.target, scfg.draft, kind.num_draft, b, context, itemsize, tp)


def tp_values(label: str, cost: Cost, ceilings: Ceilings, link: LinkCeilings, tp: int, found: dict | None,
              notes: list[str]) -> dict[str, Any]:
    """A tensor-parallel row's floors and all-reduces: as counted, and as the compiled program
    does them (`found`: hlo_collectives, from the precompile); a mismatch is noted."""
    values = {
        "tp": tp,
        "device_floor_ms": 1e3 * cost.device_floor_s(ceilings),
        "ar_floor_ms": 1e3 * cost.allreduce_floor_s(link),
        "ar_count": len(cost.allreduces),
        "ar_mb": cost.allreduce_bytes / 1e6,
        "ar_latency_ms": 1e3 * link.latency_s(cost.allreduces),
    }
    if found is not None:
        values.update(
            ar_count_hlo=len(found.get("all-reduce", [])),
            ar_mb_hlo=sum(n for _, n in found.get("all-reduce", [])) / 1e6,
            other_collectives_hlo={op: len(v) for op, v in found.items() if op != "all-reduce"},
        )
        if (values["ar_count_hlo"], round(values["ar_mb_hlo"], 3)) != (values["ar_count"], round(values["ar_mb"], 3)):
            notes.append(
                f"8b {label}: the compiled program all-reduces {values['ar_count_hlo']} arrays, "
                f"{values['ar_mb_hlo']:.3f} MB; the floor counts {values['ar_count']}, {values['ar_mb']:.3f} MB "
                "(the program's dtype may differ)"
            )
    return values


def step_values(opts: Options, kind: StepKind, scfg: StepConfig, b: int, samples: Sequence[float],
                activity: profile.DeviceActivity | None, ceilings: Ceilings, link: LinkCeilings | None,
                found: dict | None, notes: list[str]) -> dict[str, Any]:
    """One row's figures: the time per call against its floor, under a mesh the all-reduces
    (tp_values), under --profile the device's busy time, for an iteration its assumed tokens/s."""
    new_tokens = kind.tokens or max(opts.num_draft) + 1
    tp = 1 if scfg.mesh is None else scfg.mesh.shape[sharding.TP]
    cost = step_cost(kind, scfg, b, new_tokens, opts.context, jnp.dtype(opts.dtype).itemsize, tp)
    ms, floor_ms = 1e3 * statistics.median(samples), 1e3 * cost.floor_s(ceilings, link)
    values = {
        "ms": ms,
        "ms_min": 1e3 * min(samples),
        "ms_max": 1e3 * max(samples),
        "floor_ms": floor_ms,
        "pct_of_floor": 100 * floor_ms / ms,
        "bound": cost.bound(ceilings),
        "gb": cost.bytes / 1e9,
        "tflop": cost.flops / 1e12,
        "gemm": step_gemm(kind, scfg, b, new_tokens),
    }
    if scfg.mesh is not None:
        values.update(tp_values(f"{kind.name}, batch {b}", cost, ceilings, link, tp, found, notes))
    if activity is not None:
        values.update(device_busy_ms=activity.busy_us / 1e3 / opts.calls, device_idle_pct=100 * activity.idle_frac)
    if not kind.verify_only:
        accept = opts.assumed_acceptance if kind.num_draft else 1.0
        values["tok_s_assumed"] = b * accept / (ms / 1e3)
    return values


def step_info(opts: Options, target: ModelConfig, draft: DraftConfig, own: bool, mesh: Mesh | None, init_s: float,
              compile_s: dict[str, float], held: dict[str, int], kernels: dict[str, profile.DeviceActivity],
              by_source: dict[str, list]) -> dict[str, Any]:
    """The phase's info: the models and settings, the profile's kernels per call, the mesh's layout."""
    info = {
        "model": opts.step_model,
        "K": max(opts.num_draft),
        "context (cached tokens per row)": opts.context,
        "max_model_len (block tables)": opts.max_model_len_8b,
        "assumed acceptance length L (NOT measured)": opts.assumed_acceptance,
        "dtype": jnp.dtype(opts.dtype).name,
        "random init s": round(init_s, 1),
        "parallel compile s": compile_s,
        "target": dataclasses.asdict(target),
        "draft": dataclasses.asdict(draft),
    }
    if kernels:
        info["device kernels per call (--profile: family, us, count)"] = {
            step: [
                (name, round(total / opts.calls, 1), round(count / opts.calls, 1))
                for name, count, total in activity.by_name
            ]
            for step, activity in kernels.items()
        }
    if by_source:
        info["device kernels per call by source line (--profile: the innermost two frames in the package, "
             "kernels, us)"] = {step: [(label, count, round(us, 1)) for label, count, us in rows]
                               for step, rows in by_source.items()}
    if mesh is not None:
        info.update(
            {
                "tensor parallel": f"TP={mesh.shape[sharding.TP]} over {', '.join(str(d) for d in mesh.devices.flat)} "
                "(parallel/sharding.py layout; steps pin it as the engine does)",
                "drafter": "replicated on every device (no collective in the draft extend or steps), with "
                + ("its own embedding (70B layout)" if own else "a copy of the target's embedding"),
                "all-reduce implementation": opts.allreduce,
                "random init": "one jitted creator per tensor shape with out_shardings: each device generates only "
                "its own slice",
                "weights per device": f"{held['target'] / 1e9:.2f} GB target + {held['draft'] / 1e9:.2f} GB draft "
                f"(whole: {held['target_whole'] / 1e9:.2f} + {held['draft_whole'] / 1e9:.2f} GB)",
                "weight bytes": held,
                "peak device memory GB (per device)": device_memory_gb(list(mesh.devices.flat)),
            }
        )
    return info


def phase_8b(
    opts: Options, ceilings: Ceilings, notes: list[str], mesh: Mesh | None = None, link: LinkCeilings | None = None
) -> tuple[list[Result], dict]:
    """The step functions on synthetic state; with `mesh` (tp > 1) under tensor parallelism, with
    the all-reduce ceilings `link` in the floors."""
    target, draft = step_models(opts)
    k, own = max(opts.num_draft), own_embedding(target, draft)
    ecfg = sized_engine_config(opts.batches_8b, k, opts.max_model_len_8b, min_bucket=1, attention=opts.attention,
                               gemv=opts.gemv, gemm=opts.gemm)  # the step functions at exactly these batch sizes
    served = served_config(ecfg, target, draft, DeviceFacts.of(mesh), opts.dtype)  # its kernels and pool
    params, dparams, init_s, held = random_step_weights(target, draft, own, opts.dtype, mesh)
    kinds = step_kinds(k, opts.trees)
    scfgs = step_configs(opts, kinds, target, draft, served, mesh, notes)
    calls = step_calls(opts, scfgs, params, dparams, served, k)
    compile_s, collectives, sites = {}, {}, {}  # see precompile_steps
    if opts.parallel_compile:  # 70B programs take minutes, one core each: all compile at once
        compile_s, collectives, sites = precompile_steps(opts, scfgs, calls, served, mesh)
    results = []
    kernels: dict[str, profile.DeviceActivity] = {}  # --profile: "kind, batch b" -> the device's activity
    by_source: dict[str, list] = {}  # --profile: "kind, batch b" -> (source line, kernels, us) per call
    for kind, scfg in scfgs.items():
        state = synthetic_state(target, scfg.draft, served, opts.dtype, mesh, scfg.speculator.facts.slot_layout)
        for b in opts.batches_8b:
            state, samples, activity, sources = measure_step(opts, kind, b, calls[kind, b][0], state, served,
                                                             sites.get((kind, b)), notes)
            if activity is not None:
                kernels[f"{kind.name}, batch {b}"] = activity
            if sources:
                by_source[f"{kind.name}, batch {b}"] = sources
            values = step_values(opts, kind, scfg, b, samples, activity, ceilings, link, collectives.get((kind, b)),
                                 notes)
            results.append(Result("8b", kind.name, b, values))
            log(f"8b {kind.name}, batch {b}: {values['ms']:.2f} ms/call, {values['pct_of_floor']:.0f}% of floor")
        del state
    decode = {r.batch: r.values["tok_s_assumed"] for r in results if r.mode == kinds[0].name}
    for r in results:
        if "tok_s_assumed" in r.values:
            r.values["speedup_assumed"] = r.values["tok_s_assumed"] / decode[r.batch]
    return results, step_info(opts, target, draft, own, mesh, init_s, compile_s, held, kernels, by_source)


# ==== phase tp: the same greedy tokens at TP=N as at TP=1 ==========================================
def tp_check_models(opts: Options) -> tuple[ModelConfig, DraftConfig]:
    """A small Llama (8 heads, 2 kv heads: the kv heads split at tp 2 and are replicated above, both
    layouts of sharding.py) and a drafter in the 70B layout: half as wide, its own embedding."""
    h = opts.tp_check_hidden
    target = ModelConfig(
        vocab_size=opts.tp_check_vocab,
        hidden_size=h,
        intermediate_size=2 * h,
        num_layers=opts.tp_check_layers,
        num_heads=8,
        num_kv_heads=2,
        head_dim=h // 8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_ids=(2,),
    )
    draft = DraftConfig.like_target(
        target, opts.tp_check_vocab // 4, hidden_size=h // 2, intermediate_size=h, head_dim=h // 16
    )
    return target, draft


def write_random_models(target: ModelConfig, draft: DraftConfig, directory: Path) -> tuple[Path, Path]:
    """A random target checkpoint (config.json + safetensors) and drafter, in f32, for LLM() to load."""
    from eagle3_jax.weights.eagle3 import save_drafter
    from eagle3_jax.weights.llama import save_llama

    def host_random(shapes, seed: int):  # init_params' statistics, drawn on the host (no program per shape)
        rng = np.random.default_rng(seed)

        def make(x):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return np.zeros(x.shape, x.dtype)
            return np.ones(x.shape, np.float32) if x.ndim == 1 else 0.02 * rng.standard_normal(x.shape, np.float32)

        return jax.tree.map(make, shapes)

    target_dir = directory / "target"
    target_dir.mkdir(parents=True, exist_ok=True)
    save_llama(
        host_random(jax.eval_shape(lambda: llama.init_params(target, jax.random.PRNGKey(0), jnp.float32)), 10),
        target_dir,
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "eos_token_id": list(target.eos_token_ids),
        **hf_config_dict(target),
    }
    (target_dir / "config.json").write_text(json.dumps(config))
    dshapes = jax.eval_shape(
        lambda: init_draft_params(draft, jax.random.PRNGKey(0), jnp.float32, own_embedding(target, draft))
    )
    return target_dir, save_drafter(host_random(dshapes, 11), draft, directory / "draft")


def compare_tokens(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Token-by-token comparison of two runs over the same prompts."""
    mismatched = [
        (i, j)
        for i, (a, b) in enumerate(zip(got, ref))
        for j in range(max(len(a), len(b)))
        if j >= len(a) or j >= len(b) or a[j] != b[j]
    ]
    return {
        "identical": "yes" if not mismatched and len(got) == len(ref) else "no",
        "mismatched": len(mismatched),
        "first_mismatch": f"prompt {mismatched[0][0]}, token {mismatched[0][1]}" if mismatched else None,
    }


def tp_generate(target_dir: Path, draft_dir: Path | None, k: int, tp: int, ecfg: EngineConfig,
                prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], dict]:
    """Greedy replies of LLM(tensor_parallel_size=tp) in f32 -> (their tokens, the run's values)."""
    from eagle3_jax.api import LLM

    start = time.perf_counter()
    llm = LLM(target=target_dir, draft=draft_dir, num_speculative_tokens=k, dtype=jnp.float32, engine_config=ecfg,
              tensor_parallel_size=tp, warmup=False, progress=False)
    outs = llm.generate(prompts, params)
    del llm
    tokens = [o.token_ids for o in outs]
    return tokens, {
        "tp": tp,
        "tokens": sum(map(len, tokens)),
        "s": time.perf_counter() - start,
        "acceptance_length": statistics.mean(o.metrics.acceptance_length for o in outs),
        "iterations": sum(o.metrics.iterations for o in outs),
        "speculative_iterations": sum(o.metrics.speculative_iterations for o in outs) if k else 0,
    }


def phase_tp(opts: Options, notes: list[str]) -> tuple[list[Result], dict]:
    """Greedy generation through LLM(tensor_parallel_size=...) (load straight to shards, the
    engine's sharded steps) at TP=1 and TP=N, target-only and EAGLE-3: every run's tokens against
    TP=1's of the same mode, and against target-only TP=1 (greedy EAGLE-3 is lossless)."""
    n, k = opts.tp, max(opts.num_draft)
    target, draft = tp_check_models(opts)
    prompts = [
        np.random.default_rng(i).integers(3, target.vocab_size, 7 + 11 * i).tolist()
        for i in range(opts.tp_check_prompts)
    ]
    longest = max(map(len, prompts)) + opts.tp_check_tokens
    # Speculate at every iteration, so the EAGLE-3 runs verify drafts throughout ("auto" would run
    # a random drafter's target alone).
    ecfg = EngineConfig(batch_buckets=(len(prompts),), prefill_buckets=(32,), num_speculative_tokens=k,
                        max_model_len=16 * math.ceil(longest / 16), speculation="always")
    params = SamplingParams(max_tokens=opts.tp_check_tokens, ignore_eos=True)
    runs = [("target-only", 1, 0), (f"EAGLE-3 K={k}", 1, k), ("target-only", n, 0), (f"EAGLE-3 K={k}", n, k)]
    tokens, results = {}, []
    with tempfile.TemporaryDirectory() as tmp, jax.default_matmul_precision("highest"):
        # f32 at full precision (no TF32 on GPUs): what differs between TP=1 and TP=N is then only
        # the order of the sums, far below the logit gaps of greedy decoding.
        target_dir, draft_dir = write_random_models(target, draft, Path(tmp))
        for mode, tp, kk in runs:
            tokens[mode, tp], values = tp_generate(target_dir, draft_dir if kk else None, kk, tp, ecfg, prompts,
                                                   params)
            if tp > 1:
                values.update(compare_tokens(tokens[mode, tp], tokens[mode, 1]))
            if (mode, tp) != ("target-only", 1):
                values["identical_target_tp1"] = compare_tokens(tokens[mode, tp], tokens["target-only", 1])["identical"]
            results.append(Result("tp", mode, len(prompts), values))
            log(
                f"tp {mode}, TP={tp}: {values['tokens']} tokens in {values['s']:.1f} s"
                + (f", identical to TP=1: {values['identical']}" if tp > 1 else "")
            )
    identical = all(r.values.get("identical", "yes") == "yes" for r in results)
    if not identical:
        notes.append(f"tp: TP={n} greedy tokens DIFFER from TP=1 (see the tp table)")
    info = {
        "TP=N": n,
        "identical": "yes" if identical else "NO",
        "target": f"random f32 Llama: hidden {target.hidden_size}, {target.num_layers} layers, "
        f"{target.num_heads} heads, {target.num_kv_heads} kv heads, intermediate "
        f"{target.intermediate_size}, vocab {target.vocab_size}",
        "drafter": f"random, 70B layout: hidden {draft.hidden_size} (own embedding), draft vocab "
        f"{draft.draft_vocab_size}; K={k}",
        "prompts": f"{len(prompts)} random-id prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
        f"submitted together (batch bucket {len(prompts)}; prefill chunks of 32)",
        "generation": f"greedy, {opts.tp_check_tokens} tokens per prompt (ignore_eos), f32, "
        "jax.default_matmul_precision('highest')",
        "path": "LLM(target, draft, tensor_parallel_size=TP): weights loaded onto their shards, Engine(mesh)",
        "coverage": "a random drafter's proposals are (almost) all rejected: the EAGLE-3 runs check verify, "
        "rejection, the draft extend and chain under TP, not the bookkeeping of accepted drafts",
    }
    return results, info
