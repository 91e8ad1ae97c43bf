"""The engine's paths on a tiny random Llama and drafter (conftest's TINY): a pool too small for
the workload, the per-step dispatch against the fused iteration, speculation switched off past a
batch size, "auto" following its cost table and timing every bucket in warm-up, and proposals forced
by hand (none, some and all accepted; EOS and max_tokens inside an accepted run). Greedy output
equals the target alone's in each. The same engine on the real SmolLM2 is tests/test_engine.py."""

from __future__ import annotations

import pytest
from conftest import TINY_VOCAB
from runner_probe import set_proposals

from eagle3_jax import SamplingParams
from eagle3_jax.config import EngineConfig
from eagle3_jax.engine import policy
from eagle3_jax.engine.policy import BucketCost
from eagle3_jax.runner.speculators import Chain

# Every test here builds and runs engines: seconds to tens of seconds each on 2 CPU cores.
pytestmark = pytest.mark.slow

# Twelve prompts of 1..18 tokens; over 16 they are prefilled in two chunks.
PROMPTS = [[(3 * i + j) % TINY_VOCAB for j in range(1 + (5 * i) % 18)] for i in range(12)]
ENGINE = dict(batch_buckets=(2, 8), prefill_buckets=(16,), prefill_batch_buckets=(1, 4), max_model_len=64,
              num_pages=64, speculation="always", freeze_heap=False)


def make(tiny_models, draft: str | None = "shared", warmup: bool = False, **engine):
    from eagle3_jax.api import LLM

    target, drafters = tiny_models
    return LLM(target, drafters[draft] if draft else None, num_speculative_tokens=3, warmup=warmup, progress=False,
               engine_config=EngineConfig(**{**ENGINE, **engine}))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_models):
    """The target alone's greedy replies to PROMPTS, 40 tokens each (a reply of n is the first n)."""
    llm = make(tiny_models, None)
    return [o.token_ids for o in llm.generate(PROMPTS, greedy(40))]


def test_workload_larger_than_the_pool_completes(tiny_models, alone):
    """7 pages, 6 to allocate: two or three requests at a time (2 or 3 pages each); the others
    wait their turn, first come first served, and every reply is the target alone's."""
    llm = make(tiny_models, num_pages=7)
    outputs = llm.generate(PROMPTS, greedy(12))
    assert [o.token_ids for o in outputs] == [ref[:12] for ref in alone]
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.capacity


def test_per_step_dispatch_equals_the_fused_iteration(tiny_models, alone):
    """The iteration as K + 1 programs with the draft carry threaded by the driver gives the
    fused program's tokens, greedy and sampled, and compiles nothing after warm-up."""
    per_step = make(tiny_models, warmup=True, batch_buckets=(4,), fused_iteration=False)
    compiled = per_step.engine.num_compilations
    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0.7, seed=3, ignore_eos=True), greedy(12),
              SamplingParams(max_tokens=20, temperature=1.0, top_k=5, seed=4, draft_acceptance="draft_q",
                             ignore_eos=True)]
    got = per_step.generate(PROMPTS[:4], params)
    assert per_step.engine.num_compilations == compiled
    fused = make(tiny_models, batch_buckets=(4,)).generate(PROMPTS[:4], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in fused]
    assert got[0].token_ids == alone[0][:20] and got[2].token_ids == alone[2][:12]
    assert sum(o.metrics.accepted for o in got) > 0


def test_speculation_switched_off_past_a_batch_size_stays_lossless(tiny_models, alone):
    """Bucket 8 runs the target alone, bucket 2 speculates: as requests finish, the same rows move
    between the two and every output still equals the target alone."""
    llm = make(tiny_models, speculative_max_batch=2)
    assert llm.engine.iterate_config(8).speculator == Chain(0) and llm.engine.iterate_config(2).speculator == Chain(3)
    lengths = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    outputs = llm.generate(PROMPTS[:10], [greedy(n) for n in lengths])
    assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(alone, lengths)]
    # The long requests finished in bucket 2, where proposals were verified again.
    assert max(o.metrics.accepted for o in outputs) > 0
    stats = llm.engine.stats
    assert set(stats.speculative_iterations) == {2} and set(stats.target_only_iterations) == {8}


def test_auto_follows_the_cost_table_per_bucket_and_stays_lossless(tiny_models, alone):
    """ "auto" with bucket 8's cost injected (speculation 10x dearer: never pays) and bucket 2's
    timed in warm-up, then replaced by one where speculation is cheaper than the target alone:
    bucket 8 runs target-only, bucket 2 speculates, the rows move between them as requests finish,
    nothing compiles after warm-up and every output equals the target alone. The steps' served
    times are left out (`time_served`): the CPU's would decide instead of the table."""
    import dataclasses

    llm = make(tiny_models, warmup=True, speculation="auto", step_costs=((8, 0.010, 0.100), (16, 1.0, 1.0)))
    engine = llm.engine
    engine.speculation.policy = dataclasses.replace(engine.speculation.policy, time_served=False)
    compiled = engine.num_compilations
    assert set(engine.speculation.step_costs) == {2, 8}  # 16 is no bucket: ignored
    assert engine.speculation.step_costs[8] == BucketCost(0.010, 0.100)  # injected, not timed
    timed = engine.speculation.step_costs[2]
    assert timed.target_only_s > 0 and len(timed.speculative_s) == 1 and timed.speculative_s[0] > 0
    engine.speculation.step_costs[2] = BucketCost(target_only_s=0.010, speculative_s=0.008)
    table = engine.speculation.table()
    assert [(c.bucket, c.choice) for c in table] == [(2, "chain K=3"), (8, "target-only")]
    assert "target-only" in engine.speculation.report()

    lengths = [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    outputs = llm.generate(PROMPTS[:10], [greedy(n) for n in lengths])
    assert engine.num_compilations == compiled, "switching modes compiled after warm-up"
    assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(alone, lengths)]
    stats = engine.stats
    assert set(stats.speculative_iterations) == {2} and set(stats.target_only_iterations) == {8}
    assert stats.speculative_iterations[2] > 0 and stats.target_only_iterations[8] > 0
    assert sum(stats.speculative_iterations.values()) + sum(stats.target_only_iterations.values()) == stats.iterations
    # Requests' metrics tell the two apart; the estimator saw only speculative, fresh rows.
    spec_iters = sum(o.metrics.speculative_iterations for o in outputs)
    assert 0 < spec_iters < sum(o.metrics.iterations for o in outputs)
    (est,) = engine.speculation.acceptance  # one proposal: the chain
    assert 0 < est.rows <= spec_iters and 1.0 <= est.mean <= 4.0
    for o in outputs:
        assert all(0.0 <= r <= 1.0 for r in o.metrics.acceptance_rates)
    # Plain "auto" times every bucket in warm-up; past speculative_max_batch nothing speculates,
    # so nothing is timed there.
    capped = make(tiny_models, warmup=True, speculation="auto", speculative_max_batch=2)
    assert set(capped.engine.speculation.step_costs) == {2}
    assert capped.engine.speculation.table()[1] == policy.BucketChoice(8, None, "target-only")


# ---- proposals forced by hand: none, some and all accepted; EOS and max_tokens inside a run --------
K = 3


@pytest.fixture(scope="module")
def forced_llm(tiny_models):
    return make(tiny_models, batch_buckets=(2,))


@pytest.fixture(scope="module")
def eos_case(alone):
    """A prompt whose greedy reply ends with EOS (token 2) after at least 16 tokens, and that reply."""
    eos = 2
    for prompt, reply in zip(PROMPTS, alone):
        if eos in reply[16:] and eos not in reply[:16]:
            return prompt, reply[:reply.index(eos) + 1]
    pytest.fail("no prompt with an EOS-terminated greedy reply of 17..40 tokens")


def run_forced(llm, prompt, ref, max_tokens, choose_mismatch):
    """Decode with proposals taken from the known greedy continuation `ref`, wrong at the index
    `choose_mismatch(tokens_remaining)` returns (None: all right).
    -> (request, [(tokens emitted, proposals accepted) per iteration after the first])."""
    engine = llm.engine
    engine.overlap = False  # read each iteration before forcing the next one's proposals
    req = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    history = []
    while not req.finished:
        before, accepted = len(req.output), req.metrics.accepted
        engine.step()
        if before:
            history.append((len(req.output) - before, req.metrics.accepted - accepted))
        if req.finished:
            break
        n = len(req.output)
        proposals = (ref[n:n + K] + [0] * K)[:K]
        wrong = choose_mismatch(min(len(ref), max_tokens) - n)
        if wrong is not None:
            proposals[wrong] = (proposals[wrong] + 1) % TINY_VOCAB
        set_proposals(engine.runner, req.slot, proposals)  # the next iteration verifies these
    while engine.has_unfinished():
        engine.step()
    engine.overlap = True
    return req, history


def test_forced_proposals_none_some_all_accepted(forced_llm, eos_case):
    prompt, ref = eos_case
    plan = iter([0, 1, 2, None] * 16)  # none, some, some, all K plus the bonus, ...
    req, history = run_forced(forced_llm, prompt, ref, 40, lambda remaining: next(plan))
    assert req.output == ref and req.finish_reason == "stop"
    assert history[:4] == [(1, 0), (2, 1), (3, 2), (4, 3)]  # (emitted, accepted) per iteration


def test_forced_proposals_eos_inside_an_accepted_run(forced_llm, eos_case):
    prompt, ref = eos_case
    # All right, except one mismatch at 0 to shift the runs so EOS lands on a proposal, not the bonus.
    req, history = run_forced(forced_llm, prompt, ref, 40, lambda remaining: 0 if remaining == K + 1 else None)
    assert req.output == ref and req.finish_reason == "stop"
    emitted, accepted = history[-1]
    assert emitted <= K and accepted >= emitted  # EOS was an accepted proposal; the rest discarded


def test_forced_proposals_max_tokens_inside_an_accepted_run(forced_llm, eos_case):
    prompt, ref = eos_case
    req, history = run_forced(forced_llm, prompt, ref, 5, lambda remaining: None)
    assert req.output == ref[:5] and req.finish_reason == "length"
    emitted, accepted = history[-1]
    assert accepted == K and emitted < K + 1  # all K accepted, cut by max_tokens


def test_compile_ahead_builds_each_fused_program_once_and_serving_runs_it(tiny_models, alone, monkeypatch):
    """runner.compile_ahead builds every fused program of the warm-up on a thread pool, JAX's
    persistent cache set or not, skips what it has built, and the engine runs those executables:
    with the jitted steps gone, it still serves greedy requests (and replies as the target alone)."""
    import jax

    from eagle3_jax.runner import runner as runner_module

    llm = make(tiny_models, batch_buckets=(2,), prefill_batch_buckets=(1,))
    engine = llm.engine
    iterations, prefills = engine.programs(greedy=True)
    assert len(engine.runner.ahead_programs(iterations, prefills)) == len(iterations) + len(prefills) == 1 + 1
    compiled = []
    lower = runner_module.AheadProgram.compile
    monkeypatch.setattr(runner_module.AheadProgram, "compile", lambda self: compiled.append(self.key) or lower(self))
    cache_dir = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)  # nothing kept on disk, nothing loaded
        engine.runner.compile_ahead(iterations, prefills)
    finally:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
    assert len(compiled) == 2
    engine.runner.compile_ahead(iterations, prefills)
    assert len(compiled) == 2  # built: skipped
    engine.runner.compile_ahead(iterations, engine.programs(greedy=False)[1])
    assert len(compiled) == 3  # the sampling prefill, new

    def traced(*args, **kwargs):
        raise AssertionError("a jitted step ran where a program was built ahead")

    monkeypatch.setattr(runner_module, "prefill_step", traced)
    monkeypatch.setattr(runner_module, "iterate_in_place_step", traced)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(8))] == [ref[:8] for ref in alone[:2]]


def test_a_kept_program_loads_and_runs_in_a_fresh_process_under_the_same_key(tmp_path):
    """runner/executables.py: a program compiled here is kept under its key (computed without
    tracing), and a fresh process computing the same key loads it, compiles nothing, and computes
    the same; another argument shape is another key."""
    import os
    import subprocess
    import sys
    import textwrap

    import jax
    import numpy as np

    from eagle3_jax.runner.executables import ExecutableStore, program_key

    script = textwrap.dedent("""
        import sys
        import jax, numpy as np
        from eagle3_jax.runner.executables import ExecutableStore, program_key
        jax.config.update("jax_platforms", "cpu")
        step = jax.jit(lambda x, scale: x * scale + 1, static_argnames="scale")
        x = np.arange(12, dtype=np.float32).reshape(3, 4)
        store = ExecutableStore(sys.argv[1], jax.devices()[:1])
        key = program_key("probe", 2.0, (x,), {}, store.devices)
        loaded = store.load(key)
        compiled = loaded or store.build(key, lambda: step.lower(x, scale=2.0).compile())
        print(loaded is not None, key, np.asarray(compiled(x)).tolist())
    """)
    runs = [subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                           check=True).stdout.split(" ", 2) for _ in range(2)]
    assert [run[0] for run in runs] == ["False", "True"]  # compiled and kept, then loaded
    assert runs[0][1:] == runs[1][1:]
    assert runs[1][2].strip() == str((np.arange(12, dtype=np.float32).reshape(3, 4) * 2 + 1).tolist())
    devices = jax.devices()[:1]
    assert program_key("probe", 2.0, (np.zeros((3, 4), np.float32),), {}, devices) == runs[0][1]
    assert program_key("probe", 2.0, (np.zeros((3, 5), np.float32),), {}, devices) != runs[0][1]
    precision = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", "highest")  # a setting changed since: another key
    try:
        assert program_key("probe", 2.0, (np.zeros((3, 4), np.float32),), {}, devices) != runs[0][1]
    finally:
        jax.config.update("jax_default_matmul_precision", precision)
    assert ExecutableStore.beside_compilation_cache(devices).directory is None  # the CPU: none kept
    # Tile tables read over the shipped one change what the programs compute: another key.
    tiles = tmp_path / "tiles.json"
    tiles.write_text('{"GPU X": []}')
    tuned = subprocess.run([sys.executable, "-c", script, str(tmp_path / "other")], capture_output=True, text=True,
                           check=True, env={**os.environ, "EAGLE3_JAX_GEMM_TILES": str(tiles)}).stdout.split(" ", 2)
    assert tuned[0] == "False" and tuned[1] != runs[0][1] and tuned[2] == runs[0][2]


def test_cublas_gemms_serve_every_bucket_without_compiling_after_warmup(tiny_models, alone):
    """EngineConfig(gemm="cublas"): every iteration program is the one jitted with cuBLAS's GEMMs
    (a compiler option: on the CPU it changes nothing), warm-up builds those very programs, so
    serving compiles nothing more, and the replies are the target alone's."""
    from eagle3_jax.runner.steps import iteration_gemm

    llm = make(tiny_models, warmup=True, gemm="cublas")
    engine = llm.engine
    assert {iteration_gemm(engine.iterate_config(b), b) for b in (2, 8)} == {"cublas"}
    compiled = engine.num_compilations
    outputs = llm.generate(PROMPTS, greedy(16))
    assert engine.num_compilations == compiled, "an iteration compiled after warm-up"
    assert [o.token_ids for o in outputs] == [ref[:16] for ref in alone]


def test_auto_replaces_warmup_costs_by_served_step_times_but_not_injected_ones(tiny_models, alone):
    """Under "auto" a step running the same bucket and choice as the step before, neither with a
    prefill, is timed, and a timing probe runs each choice not yet timed there; the policy then takes
    those served times in place of warm-up's costs (policy.py, "The costs"), and never for a bucket
    whose costs the user injected."""
    llm = make(tiny_models, warmup=True, speculation="auto", step_costs=((8, 0.010, 0.100),))
    engine = llm.engine
    warm = engine.speculation.step_costs[2]
    outputs = llm.generate(PROMPTS[:2], greedy(40))  # one bucket-2 batch, many steady steps
    assert [o.token_ids for o in outputs] == [ref[:40] for ref in alone[:2]]
    served = engine.speculation.served[2]
    assert set(engine.speculation.served) == {2}  # bucket 8 (injected) never timed
    assert set(served) == {None, 0} and set(engine.stats.proposal_iterations) == {"target-only", "chain K=3"}
    assert all(t.samples >= 1 and 0 < t.mean < 5.0 for t in served.values())
    cost = engine.speculation.bucket_cost(2)
    assert (cost.target_only_s, cost.speculative_s) == (served[None].mean, (served[0].mean,)) != (
        warm.target_only_s, warm.speculative_s)
    assert engine.speculation.bucket_cost(8) == BucketCost(0.010, 0.100)
    assert engine.speculation.table()[0].cost == cost


# ---- a long prompt arriving while rows decode ---------------------------------------------------
LONG = [(7 * j + 1) % TINY_VOCAB for j in range(60)]  # four chunks of the 16-token bucket: 16, 16, 16, 12


def test_a_long_prompt_arriving_while_rows_decode_prefills_one_chunk_per_iteration(tiny_models, alone, monkeypatch):
    """Two requests decoding when a prompt of four chunks arrives: each step dispatches one of its
    chunks, then the iteration, so the running rows never wait for more than one chunk; the prompt
    joins the batch once its last chunk is dispatched. Its reply, prefilled so in four chunks, is
    the target alone's from one unchunked prefill (a 64-token chunk bucket); the others' replies
    are the target alone's too."""
    llm = make(tiny_models)
    engine, order = llm.engine, []
    prefill, iterate = engine.runner.prefill, engine.runner.iterate
    monkeypatch.setattr(engine.runner, "prefill", lambda *a, **kw: (order.append("prefill"), prefill(*a, **kw))[1])
    monkeypatch.setattr(engine.runner, "iterate", lambda *a, **kw: (order.append("iterate"), iterate(*a, **kw))[1])
    running = [engine.add_request(p, greedy(30)) for p in PROMPTS[:2]]
    while not all(r.output for r in running):
        engine.step()
    order.clear()
    long = engine.add_request(LONG, greedy(4))
    engine.run([*running, long])
    assert order[:9] == ["prefill", "iterate"] * 4 + ["iterate"]
    assert "prefill" not in order[8:]
    assert [r.output for r in running] == [ref[:30] for ref in alone[:2]]
    unchunked = make(tiny_models, None, prefill_buckets=(64,)).generate([LONG], greedy(4))[0]
    assert long.output == unchunked.token_ids and len(long.output) == 4


def test_long_prompts_arriving_together_prefill_their_chunks_in_rounds(tiny_models):
    """Five prompts of 1 to 3 leading chunks (16 tokens) and a last one, with nothing decoding: one
    step prefills the prompts' first leading chunks together (two calls of up to four), then their
    second (one), their third (one), then the last chunks (two): 6 calls, where a call per leading
    chunk made 13. Every reply is the target alone's from unchunked prefills (a 64-token bucket)."""
    prompts = [[(5 * i + 3 * j + 1) % TINY_VOCAB for j in range(n)] for i, n in enumerate((60, 40, 50, 33, 17))]
    llm = make(tiny_models)
    replies = [o.token_ids for o in llm.generate(prompts, greedy(4))]
    assert llm.engine.stats.prefill_calls == 6
    unchunked = make(tiny_models, None, prefill_buckets=(64,)).generate(prompts, greedy(4))
    assert replies == [o.token_ids for o in unchunked] and all(len(r) == 4 for r in replies)


# ---- a burst arriving while a row streams ---------------------------------------------------------
def test_a_burst_arriving_while_a_row_streams_is_prefilled_in_one_step(tiny_models, alone):
    """One request streaming when seven short prompts arrive (a burst, as 64 streams opened at once
    reach a server's engine over a few steps): the next step dispatches all seven prefills, two
    calls of up to four, where one a step would take seven steps (the 16-token bucket: one prompt
    fills half the two chunks' budget); the step after reads every first token. Counted in steps,
    not timed. Every reply is the target alone's."""
    llm = make(tiny_models)
    engine = llm.engine
    first = engine.add_request(PROMPTS[0], greedy(30))
    while not first.output:
        engine.step()
    picked = [1, 2, 3, 4, 5, 6, 8]  # prompts of 3..16 tokens: one chunk each
    burst = [engine.add_request(PROMPTS[i], greedy(8)) for i in picked]
    calls = engine.stats.prefill_calls
    engine.step()
    assert engine.stats.prefill_calls - calls == 2 and not engine.scheduler.prefilling
    engine.step()
    assert all(len(r.output) >= 1 for r in burst)
    engine.run([first, *burst])
    assert first.output == alone[0][:30] and [r.output for r in burst] == [alone[i][:8] for i in picked]
