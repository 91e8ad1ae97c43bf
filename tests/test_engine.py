"""Engine on the real SmolLM2 with its drafter: continuous batching over buckets, compile-free
serving, bad requests in a live workload, a tree against the chain, streaming, prefills shared by admitted prompts, the
programs greedy batches run, buffers that keep their addresses; and the speculation policy's
estimator. The engine's other paths (a small pool, per-step dispatch, speculation switched off,
"auto") run on a tiny model in tests/test_engine_tiny.py."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import numpy as np
import pytest
from conftest import CyclicGarbage, make_llm, served
from runner_probe import buffer_addresses, pinned_batch, trace_iteration, trace_prefill
from test_policy import speculate

from eagle3_jax import SamplingParams, TreeSpec, assets
from eagle3_jax.config import ConfigError, EngineConfig
from eagle3_jax.engine import policy
from eagle3_jax.engine.policy import AcceptanceEstimate, BucketCost, SpeculationPolicy
from eagle3_jax.runner.state import DUMMY_SLOT


@pytest.fixture(scope="module")
def spec_llm(smollm2_dir):
    """The shipped drafter, K=3 (real acceptance), warmed up: buckets 1 and 8."""
    return make_llm(smollm2_dir, assets.DEFAULT_DRAFT, num_draft=3, prefill_batch_buckets=(1, 8))


@pytest.fixture(scope="module")
def workload(chat_ids):
    """16 requests, twice the largest bucket: MT-bench prompts of up to 245 tokens (some prefilled
    in several chunks), each with its own output length (3 to 17 tokens: rows finish and are
    refilled at different iterations)."""
    prompts = [ids for ids in chat_ids if len(ids) < 250][:16]
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, 18, len(prompts)).tolist()
    return prompts, lengths


@pytest.mark.slow
def test_mixed_workload_matches_target_alone(spec_llm, target_llm, workload):
    prompts, lengths = workload
    assert len(prompts) == 16 and max(map(len, prompts)) > 128
    engine = spec_llm.engine
    compiled = engine.num_compilations
    # Bad requests in the middle of the workload: each gets its own error, nothing else changes.
    bad = {3: ("", {"max_tokens": 8}), 7: ([3, 70000, 5], {"max_tokens": 8}),
           10: ([7] * 400, {"max_tokens": 8}), 14: (prompts[0], {"max_tokens": 0})}
    all_prompts, all_params = [], []
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        if i in bad:
            all_prompts.append(bad[i][0])
            all_params.append(bad[i][1])
        all_prompts.append(prompt)
        all_params.append(SamplingParams(max_tokens=n))
    outputs = spec_llm.generate(all_prompts, all_params)
    assert engine.num_compilations == compiled, "a request mix compiled after warm-up"

    errors = [o for o in outputs if o.error]
    assert [o.finish_reason for o in errors] == ["error"] * 4
    assert "empty" in errors[0].error
    assert "70000" in errors[1].error
    assert "400 tokens" in errors[2].error
    assert "max_tokens" in errors[3].error
    served = [o for o in outputs if not o.error]
    assert len(served) == 16
    # The target alone's replies, in one batch of its own (its rows do not interact either).
    alone = target_llm.generate(prompts, [SamplingParams(max_tokens=n) for n in lengths])
    assert [o.token_ids for o in served] == [o.token_ids for o in alone]
    assert [o.finish_reason for o in served] == [o.finish_reason for o in alone]
    # Everything handed back: pages, slots.
    sched = engine.scheduler
    assert sched.pool.num_free == sched.pool.capacity
    assert not sched.running and not sched.waiting and not engine.has_unfinished()
    assert (sched.block_tables == 0).all()


@pytest.mark.slow
def test_a_tree_is_token_identical_and_accepts_more_than_the_chain(smollm2_dir, spec_llm, target_llm, chat_ids):
    """The shipped drafter drafting the tree (3, 4, 8): the target alone's greedy tokens, and more
    tokens per iteration than its chain of 3 (the same three draft forwards, one path of them)."""
    prompts, params = chat_ids[:4], SamplingParams(max_tokens=20)
    want = [o.token_ids for o in target_llm.generate(prompts, params)]
    tree_llm = make_llm(smollm2_dir, assets.DEFAULT_DRAFT, warmup=False, batch_buckets=(4,), tree=TreeSpec(3, 4, 8))
    lengths = {}
    for name, llm in (("tree", tree_llm), ("chain", spec_llm)):
        outputs = llm.generate(prompts, params)
        assert [o.token_ids for o in outputs] == want, name
        lengths[name] = sum(o.metrics.emitted for o in outputs) / sum(o.metrics.iterations for o in outputs)
    assert lengths["tree"] > lengths["chain"] > 1.5


@pytest.mark.slow
def test_streaming_yields_the_batch_tokens(spec_llm, chat_ids):
    params = SamplingParams(max_tokens=24)
    batch = spec_llm.generate([chat_ids[3]], params)[0]
    deltas = list(spec_llm.stream(chat_ids[3], params))
    streamed = [t for d in deltas for t in d.token_ids]
    assert streamed == batch.token_ids
    assert deltas[-1].finished and deltas[-1].output.token_ids == batch.token_ids
    assert "".join(d.text for d in deltas).strip()  # text arrives with the tokens


@pytest.mark.slow
def test_generate_iter_streams_requests_through_the_batch(spec_llm, workload):
    """Requests pulled lazily (at most one waiting), refilled as rows finish: every output equals
    the batch API's, a bad request comes back as its error, and an iterable that stops early
    leaves nothing behind."""
    prompts, lengths = workload
    short = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[:6]  # what is pulled, not prefill, is tested
    requests = [(prompts[i], SamplingParams(max_tokens=lengths[i])) for i in short]
    requests.insert(4, ("", SamplingParams(max_tokens=8)))
    batch = spec_llm.generate([p for p, _ in requests], [q for _, q in requests])
    pulled = []

    def source():
        for i, r in enumerate(requests):
            pulled.append((i, spec_llm.engine.num_running))
            yield r

    outputs = dict(spec_llm.generate_iter(source(), max_waiting=1))
    assert sorted(outputs) == list(range(7))
    assert outputs[4].finish_reason == "error" and "empty" in outputs[4].error
    assert [outputs[i].token_ids for i in range(7)] == [o.token_ids for o in batch]
    assert max(running for _, running in pulled) > 1  # later requests joined a running batch
    stopped = list(spec_llm.generate_iter(r for i, r in enumerate(requests) if i < 3))
    assert sorted(i for i, _ in stopped) == [0, 1, 2]
    assert not spec_llm.engine.has_unfinished()
    assert spec_llm.engine.scheduler.pool.num_free == spec_llm.engine.scheduler.pool.capacity


@pytest.mark.slow
def test_stop_token_ids_and_stop_strings(spec_llm, chat_ids):
    ref = spec_llm.generate([chat_ids[1]], SamplingParams(max_tokens=30))[0]
    stop_id = ref.token_ids[10]
    cut = spec_llm.generate([chat_ids[1]], SamplingParams(max_tokens=30, stop_token_ids=[stop_id]))[0]
    assert cut.token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1] and cut.finish_reason == "stop"
    word = ref.text.split()[4]
    cut = spec_llm.generate([chat_ids[1]], SamplingParams(max_tokens=30, stop=[word]))[0]
    assert cut.finish_reason == "stop" and word not in cut.text and ref.text.startswith(cut.text)


@pytest.mark.slow
def test_prompts_admitted_together_share_prefill_calls(spec_llm, target_llm, chat_ids):
    """Six prompts admitted in one step: the long ones' j-th leading chunks share a call, round after
    round, then all six last chunks run as one call of the 8-row prefill (two padding rows), where a
    call per leading chunk made more. The greedy tokens equal the target alone's, and a seeded sample
    (its first token drawn in that call) equals its own alone. A token after BOS no other test's prompt
    has keeps them out of the prefix cache."""
    engine = spec_llm.engine
    assert engine.cfg.prefill_batch_buckets == (1, 8) and engine.cfg.prefill_buckets == (64,)
    prompts = [[p[0], 100 + i, *p[1:]] for i, p in enumerate(chat_ids[10:16])]
    leading = [(len(p) - 1) // 64 for p in prompts]  # each prompt's leading chunks
    assert sum(leading) > max(leading) > 0  # some prompts are prefilled in chunks, several of them
    compiled, calls = engine.num_compilations, engine.stats.prefill_calls
    params = [SamplingParams(max_tokens=8)] * 5 + [SamplingParams(max_tokens=8, temperature=1.0, seed=7)]
    outputs = spec_llm.generate(prompts, params)
    assert engine.stats.prefill_calls - calls == max(leading) + 1
    assert [o.metrics.cached_tokens for o in outputs] == [0] * 6
    assert engine.num_compilations == compiled  # warm-up built the 8-row prefill
    alone = target_llm.generate(prompts[:5], SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outputs[:5]] == [o.token_ids for o in alone]
    assert outputs[5].token_ids == spec_llm.generate([prompts[5]], params[5])[0].token_ids


@pytest.mark.slow
def test_greedy_batches_run_programs_without_device_branches(spec_llm, chat_ids, monkeypatch):
    """A lax.cond is a host-device synchronization on the GPU (XLA's ConditionalThunk copies the
    predicate to the host and blocks), so the iteration a batch of greedy requests runs has none,
    and the sampling iteration none of the old all-greedy kind (only top-k/top-p's sort guard,
    one per sampled distribution: the verify and each of the K draft tokens). The driver picks
    the program from the requests' parameters."""
    engine = spec_llm.engine
    k = engine.step_cfg.speculator.facts.max_accepted
    bucket = engine.cfg.batch_buckets[1]  # padded rows: the same program as real ones

    def branches(cfg) -> int:
        return trace_iteration(engine.runner, bucket, cfg).lower().as_text().count('"stablehlo.case"')

    greedy, sampling = (engine.iterate_config(bucket, greedy=g) for g in (True, False))
    assert (branches(greedy), branches(sampling)) == (0, k + 1)
    first = trace_prefill(engine.runner, 1, 32, dataclasses.replace(engine.step_cfg, greedy=True)).lower().as_text()
    assert '"stablehlo.case"' not in first

    ran = []
    iterate = engine.runner.iterate
    monkeypatch.setattr(engine.runner, "iterate",
                        lambda s, t, cfg, mask=None: (ran.append(cfg.greedy), iterate(s, t, cfg, mask))[1])
    spec_llm.generate(chat_ids[:2], SamplingParams(max_tokens=6))
    assert ran and all(ran)
    ran.clear()
    mixed = [SamplingParams(max_tokens=6), SamplingParams(max_tokens=6, temperature=0.8, seed=1)]
    spec_llm.generate(chat_ids[:2], mixed)
    assert ran and not ran[0]  # both rows run the first iteration: the sampling program


@pytest.mark.slow
def test_iteration_buffers_keep_their_addresses(spec_llm):
    """XLA launches the iteration as a CUDA graph that records every buffer address, and rewrites
    the nodes of a moved buffer before the next launch (on the H200 this cost about 1 ms of host
    time per SmolLM2 iteration). So nothing the iteration touches moves: the state is donated and
    aliased, the per-call arguments are pinned per bucket and overwritten in place when the batch
    changes, and the verdicts stay in the state until a gather of their own copies them out, into
    two buffers per bucket taken in turn (nothing may be allocated between iterations either)."""
    engine = spec_llm.engine
    k = engine.step_cfg.speculator.facts.max_accepted
    bucket = engine.cfg.batch_buckets[1]
    slots = np.full(bucket, DUMMY_SLOT, np.int32)
    tables = np.zeros((bucket, engine.cfg.pool.max_blocks_per_seq), np.int32)
    cfg = engine.iterate_config(bucket, greedy=True)

    runner = engine.runner

    def addresses() -> list[int]:
        return buffer_addresses(runner) + [x.unsafe_buffer_pointer() for x in pinned_batch(runner, slots, tables)]

    runner.iterate(slots, tables, cfg)
    before = addresses()
    verdict_addresses = []
    for page in (1, 2, 2, 2):
        tables = tables.copy()
        tables[0, -1] = page  # a new page in a block the dummy row never reaches: same work
        verdicts = runner.iterate(slots, tables, cfg)
        verdict_addresses.append(verdicts.unsafe_buffer_pointer())
    assert verdicts.shape == (bucket, 2 + k + 1)  # proposals accepted, top1_accepted, then the tokens emitted
    assert pinned_batch(runner, slots, tables)[1][0, -1] == 2
    assert addresses() == before
    a, b = verdict_addresses[:2]
    assert a != b and verdict_addresses == [a, b, a, b]


@pytest.mark.slow
def test_first_tokens_are_read_into_buffers_held_per_slot(spec_llm, chat_ids, monkeypatch):
    """Nor does an admission leave a new buffer on the device: the prefill's only output is the
    donated state, and its first token is copied out of the slots into a buffer held per slot.
    Requests admitted together are all read (each slot's buffer is its own), and a slot admitted
    again reuses its buffer. Each request's metrics time its arrival and its tokens' collection."""
    runner = spec_llm.engine.runner
    reads = []  # (slot, address of the first-token array)
    read = runner.first_token

    def recording(slot):
        first = read(slot)
        reads.append((slot, first.unsafe_buffer_pointer()))
        return first

    monkeypatch.setattr(runner, "first_token", recording)
    state_addresses = buffer_addresses(runner)
    for _ in range(2):  # three requests admitted in one step, twice into the same three slots
        outputs = spec_llm.generate(chat_ids[:3], SamplingParams(max_tokens=2))
    assert buffer_addresses(runner) == state_addresses
    assert all(o.metrics.arrival_time < o.metrics.first_token_time <= o.metrics.last_token_time for o in outputs)
    slots = sorted({slot for slot, _ in reads})
    assert len(reads) == 6 and len(slots) == 3
    by_slot = {slot: {address for s, address in reads if s == slot} for slot in slots}
    assert all(len(addresses) == 1 for addresses in by_slot.values())
    assert len(set.union(*by_slot.values())) == 3


def test_state_buffers_do_not_grow_with_the_layers(smollm2_cfg):
    """Every buffer a step takes and donates costs host time at each dispatch (about 2.5 us on the
    H200), so the KV cache is one array for K and one for V whatever the depth: a 30-layer target's
    state has as many buffers as a 2-layer one's, and layer l's pages are row l of them."""
    from eagle3_jax.config import DraftConfig
    from eagle3_jax.runner.speculators import Chain
    from eagle3_jax.runner.state import init_state

    engine_cfg = served(EngineConfig(batch_buckets=(2,), num_speculative_tokens=4, max_model_len=256))
    shallow = dataclasses.replace(smollm2_cfg, num_layers=2, capture_layer_ids=(0, 1, 1))
    states = {
        cfg.num_layers: jax.eval_shape(
            lambda c=cfg: init_state(c, DraftConfig.like_target(c, 64), engine_cfg, jax.numpy.bfloat16,
                                     Chain(4).facts.slot_layout)
        )
        for cfg in (smollm2_cfg, shallow)
    }
    assert len(jax.tree.leaves(states[30])) == len(jax.tree.leaves(states[2]))
    k = states[30].target_kv.k
    assert k.shape == (30, engine_cfg.pool.num_pages, engine_cfg.pool.page_size, 3, 64)
    assert states[30].draft_kv.k.shape[0] == 1  # the drafter's one layer


def test_prior_is_optimistic_then_measurements_take_over():
    pol = SpeculationPolicy(margin=0.05, prior_weight=2, window=4, probe_every=10)
    est = AcceptanceEstimate.prior(3)
    assert (est.mean, est.rows, est.unmeasured) == (4.0, 0, 0)
    cheap, dear, hopeless = BucketCost(0.01, 0.02), BucketCost(0.01, 0.03), BucketCost(0.01, 0.05)
    # Before any measurement: wherever K+1 = 4 tokens would pay, speculation is tried.
    assert speculate(cheap, est, 3, pol) and speculate(dear, est, 3, pol)
    assert not speculate(hopeless, est, 3, pol)  # break-even 5 > K+1: never worth trying
    assert speculate(None, est, 3, pol)  # unmeasured bucket: speculate, as without a policy
    # Rows 0, 1, 3 measured (lengths 1, 3, 2); row 2 (finished, stale or padded) is not. The prior
    # counts as 2 rows: 4 -> 4 + (1 - 4)/3 = 3 -> 3 + (3 - 3)/4 = 3 -> (window 4) 3 + (2 - 3)/4.
    est = policy.observe(est, [0, 2, 3, 1], [True, True, False, True], pol)
    assert est.mean == pytest.approx(2.75) and est.rows == 3 and est.unmeasured == 0
    for _ in range(40):  # steady traffic at L = 2 (one draft accepted per iteration)
        est = policy.observe(est, [1, 1], [True, True], pol)
    assert est.mean == pytest.approx(2.0, abs=1e-3) and est.rows == 83
    # L = 2 against (1 + margin) * break-even: 2.1 and 3.15 lose, 1.575 wins.
    assert not speculate(cheap, est, 3, pol)
    assert speculate(BucketCost(0.02, 0.03), est, 3, pol)
    assert not speculate(dear, est, 3, pol)


def test_probe_after_a_stretch_without_measurements():
    pol = SpeculationPolicy(probe_every=3)
    est = AcceptanceEstimate(mean=1.5, rows=100)
    cost = BucketCost(0.01, 0.02)  # break-even 2: off at L = 1.5, on at K+1 = 4
    for unmeasured in range(3):
        assert not speculate(cost, est, 3, pol) and est.unmeasured == unmeasured
        est = policy.observe(est, [0, 0], [False, False], pol)  # a target-only iteration
    assert est.mean == 1.5 and speculate(cost, est, 3, pol)  # probe
    assert not speculate(BucketCost(0.01, 0.05), est, 3, pol)  # could never pay: no probe
    rows = 0
    while speculate(cost, est, 3, pol):  # the probe measures L = 1 until even L = 4 could not pay
        est = policy.observe(est, [0], [True], pol)
        rows += 1
    assert rows == 3 and est.unmeasured == 0 and est.mean < 1.5  # back off


def test_engine_config_speculation_fields():
    cfg = EngineConfig(step_costs=[[2, 0.01, 0.02], (8, 1, 3)])
    assert cfg.speculation == "auto" and cfg.step_costs == ((2, 0.01, 0.02), (8, 1.0, 3.0))
    hash(cfg)  # still a static, hashable config
    # With a tree, "auto" chooses among the tree, the chain of K and the target alone: one figure each.
    tree = EngineConfig(tree=TreeSpec(4, 4, 8), num_speculative_tokens=3, step_costs=((2, 0.01, 0.03, 0.02),))
    assert tree.speculative_proposals == (TreeSpec(4, 4, 8), TreeSpec.chain(3)) and tree.max_proposals == 4
    with pytest.raises(ConfigError, match=r"\(bucket, target-only seconds, then seconds of tree 4,4,8, chain K=3\): "
                                          r"4 numbers, got \(2, 0.01, 0.02\)"):
        EngineConfig(tree=TreeSpec(4, 4, 8), step_costs=((2, 0.01, 0.02),))
    assert EngineConfig(tree=TreeSpec(4, 4, 8), speculation="always").speculative_proposals == (TreeSpec(4, 4, 8),)
    assert EngineConfig(tree=TreeSpec(4, 4, 8), num_speculative_tokens=0).speculative_proposals == (TreeSpec(4, 4, 8),)
    with pytest.raises(ConfigError, match="speculation"):
        EngineConfig(speculation="sometimes")
    with pytest.raises(ConfigError, match="attention must be one of"):
        EngineConfig(attention="flash")
    with pytest.raises(ConfigError, match="positive"):
        EngineConfig(step_costs=((2, 0.0, 0.02),))
    with pytest.raises(ConfigError, match="twice"):
        EngineConfig(step_costs=((2, 0.01, 0.02), (2, 0.01, 0.03)))


def test_greedy_only_warmup_builds_what_greedy_requests_use(tiny_models):
    """warmup(greedy=True) builds the greedy programs alone: greedy requests then compile
    nothing, a sampled request compiles its own programs on first use. Warm-up ends by freezing
    the heap (EngineConfig.freeze_heap, the default), after collecting what was frozen before."""
    from eagle3_jax.api import LLM

    target, drafters = tiny_models
    llm = LLM(target, drafters["shared"], num_speculative_tokens=2, warmup=False, progress=False,
              engine_config=EngineConfig(batch_buckets=(2,), prefill_buckets=(16,), max_model_len=64, num_pages=32,
                                         speculation="always"))
    engine = llm.engine
    iterations, prefills = engine.programs(greedy=True)
    assert all(c.greedy for _, c in iterations) and all(greedy for _, _, greedy, _ in prefills)
    before = engine.num_compilations
    junk = CyclicGarbage()  # an earlier engine's cyclic garbage, frozen with the heap
    earlier = weakref.ref(junk)
    gc.freeze()
    del junk
    try:
        assert earlier() is not None
        engine.warmup(progress=False, greedy=True)
        assert earlier() is None  # collected before the heap was frozen again
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()  # the rest of this test process collects as usual
    built = engine.num_compilations
    assert built > before
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert engine.num_compilations == built
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=1.0, seed=0, ignore_eos=True))
    assert engine.num_compilations > built
