"""Pages on demand, preemption and prefix caching on the tiny random Llama and drafter (conftest's
TINY), on one pool of 39 pages of 4 tokens, a fraction of what the workload needs: requests are
preempted, readmitted and resumed, and share a 21-token system prompt through the prefix cache.
Greedy replies equal the target alone's and those of reserving every page up front; seeded
(and, with the engine's seeds drawn alike, unseeded) samples equal those of reserving every page;
every page is back in the pool after each workload."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from conftest import TINY_VOCAB

from eagle3_jax import SamplingParams
from eagle3_jax.config import EngineConfig, TreeSpec

pytestmark = pytest.mark.slow

SYSTEM = [(7 * j + 1) % TINY_VOCAB for j in range(21)]
PROMPTS = [SYSTEM + [(3 * i + j) % TINY_VOCAB for j in range(1 + (5 * i) % 9)] for i in range(10)]
ENGINE = dict(batch_buckets=(2, 8), prefill_buckets=(16,), prefill_batch_buckets=(1, 4), max_model_len=200,
              num_pages=40, page_size=4, speculation="always", freeze_heap=False)
REPLY = 40


def make(tiny_models, draft: bool = True, **engine):
    from eagle3_jax.api import LLM

    target, drafters = tiny_models
    return LLM(target, drafters["shared"] if draft else None, num_speculative_tokens=3, warmup=False,
               progress=False, engine_config=EngineConfig(**{**ENGINE, **engine}))


def greedy(n: int = REPLY) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def serve(llm, prompts, params, engine_seed: int = 0) -> list[list[int]]:
    """The replies' tokens, the engine's seeds for unseeded requests drawn from `engine_seed`;
    then every page must be back in the pool, none held."""
    llm.engine._seed_rng = np.random.default_rng(engine_seed)
    outputs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outputs), [o.error for o in outputs]
    assert_pool_whole(llm)
    return [o.token_ids for o in outputs]


def assert_pool_whole(llm) -> None:
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.capacity and pool.num_held == 0
    assert all(pool.refs(page) == 0 for page in range(pool.capacity + 1))


@pytest.fixture(scope="module")
def alone(tiny_models):
    return serve(make(tiny_models, draft=False, prefix_caching=False), PROMPTS, greedy())


@pytest.fixture(scope="module")
def reserved(tiny_models):
    """The engine reserving every page a request can need: nothing preempted, nothing cached."""
    return make(tiny_models, page_reservation="whole", prefix_caching=False)


def test_greedy_preempted_many_times_equals_the_target_alone(tiny_models, alone, reserved):
    llm = make(tiny_models, prefix_caching=False)
    assert serve(llm, PROMPTS, greedy()) == alone
    assert llm.engine.stats.preemptions >= 5
    assert serve(reserved, PROMPTS, greedy()) == alone
    assert reserved.engine.stats.preemptions == 0


def test_greedy_with_prefix_hits_equals_the_target_alone(tiny_models, alone):
    """Two requests, then eight more: the later ones reuse the first ones' system prompt pages,
    and none is preempted (the pool holds two at a time of the first, ten of the rest at first)."""
    llm = make(tiny_models)
    first = serve(llm, PROMPTS[:2], greedy())
    stats = llm.engine.stats
    assert stats.prefix_hit_tokens == 0 and stats.preemptions == 0
    outputs = llm.generate(PROMPTS[2:4], greedy())
    assert [o.token_ids for o in outputs] == alone[2:4]
    assert [o.metrics.cached_tokens for o in outputs] == [20, 20]  # 5 of the 21 system tokens' pages
    assert stats.prefix_hit_tokens == 40 and 0 < stats.prefix_hit_rate < 1 and stats.preemptions == 0
    assert first == alone[:2]
    assert_pool_whole(llm)


def test_greedy_preempted_with_prefix_hits_equals_the_target_alone(tiny_models, alone):
    llm = make(tiny_models)
    assert serve(llm, PROMPTS, greedy()) == alone
    stats = llm.engine.stats
    assert stats.preemptions >= 5 and stats.prefix_hit_tokens > 100


def test_a_tree_preempted_with_prefix_hits_equals_the_target_alone(tiny_models, alone):
    """A tree writes more KV positions per iteration than it accepts: its pages in flight cover them."""
    llm = make(tiny_models, tree=TreeSpec(3, 2, 5))
    assert serve(llm, PROMPTS, greedy()) == alone
    assert llm.engine.stats.preemptions >= 5 and llm.engine.stats.prefix_hit_tokens > 100


@pytest.mark.parametrize("rule", ["coupled", "draft_q"])
def test_sampling_preempted_equals_reserving_every_page(tiny_models, reserved, rule):
    """Seeded requests, and unseeded ones with the engine's seeds drawn alike: a resumed request
    continues its key schedule where it stopped, so its samples are those of never stopping."""
    seeded = [SamplingParams(max_tokens=REPLY, ignore_eos=True, temperature=0.9, seed=i, draft_acceptance=rule)
              for i in range(5)]
    unseeded = [SamplingParams(max_tokens=REPLY, ignore_eos=True, temperature=0.9, draft_acceptance=rule)] * 5
    params = [p for pair in zip(seeded, unseeded) for p in pair]
    llm = make(tiny_models)
    got = serve(llm, PROMPTS, params, engine_seed=5)
    assert llm.engine.stats.preemptions >= 5
    assert got == serve(reserved, PROMPTS, params, engine_seed=5)
    assert len({tuple(t) for t in got}) == len(got)  # sampled: no two alike


def test_a_request_the_whole_pool_cannot_hold_is_refused_and_the_others_served(tiny_models, alone, caplog):
    with caplog.at_level(logging.INFO, logger="eagle3_jax.engine.engine"):
        llm = make(tiny_models)
    assert ("KV pool: 39 pages of 4 tokens = 156 tokens, 0 rows at max_model_len 200 (EngineConfig.num_pages); "
            "pages on demand, prefix caching on") in caplog.messages
    too_long = SamplingParams(max_tokens=200 - len(PROMPTS[1]), ignore_eos=True)  # (200 + 8 in flight) / 4 pages
    outputs = llm.generate(PROMPTS[:3], [greedy(), too_long, greedy()])
    assert outputs[1].finish_reason == "error"
    assert outputs[1].error.startswith("prompt + max_tokens needs 52 KV pages; the whole pool has 39")
    assert [outputs[0].token_ids, outputs[2].token_ids] == [alone[0], alone[2]]
    assert_pool_whole(llm)
