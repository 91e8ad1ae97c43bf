"""Prompt lookup (runner/speculators/ngram.py): the lookup itself on hand-made histories, and the
engine serving it with no drafter, token-identical to the target alone in f32 and bf16, seeded
sampling reproducing the target alone's tokens, and its configuration errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_VOCAB
from runner_probe import read_history
from test_cli import run_cli

from eagle3_jax import SamplingParams
from eagle3_jax.config import ConfigError, EngineConfig, TreeSpec
from eagle3_jax.runner.speculators import SPECULATORS
from eagle3_jax.runner.speculators.ngram import NGram, lookup


def proposals(history: list[int], k: int = 4, max_n: int = 4, width: int = 24) -> list[int]:
    """The K proposals after `history` (its last token at len - 1), history padded to `width`."""
    row = np.full((1, width), -7, np.int32)
    row[0, :len(history)] = history
    return lookup(jnp.asarray(row), jnp.array([len(history) - 1]), k, max_n)[0].tolist()


def test_lookup_copies_what_followed_the_latest_longest_match():
    # The last token 5 occurred at 1 and 4; its bigram (4, 5) only at 3..4: the bigram wins.
    assert proposals([9, 5, 1, 4, 5, 2, 3, 4, 5]) == [2, 3, 4, 5]
    # The latest of two equal-length matches: (7, 8) at 0..1 and 4..5 -> what followed 5.
    assert proposals([7, 8, 1, 1, 7, 8, 2, 6, 7, 8], k=2) == [2, 6]
    # max_n 1 sees only the last token: its latest earlier occurrence, at 4.
    assert proposals([9, 5, 1, 4, 5, 2, 3, 4, 5], max_n=1) == [2, 3, 4, 5]
    assert proposals([9, 5, 1, 4, 5, 2, 3, 6, 5], max_n=1, k=2) == [2, 3]


def test_lookup_repeats_a_loop_past_the_end_and_proposes_the_last_token_without_a_match():
    # (1, 2, 3) repeats with period 3: the match ends 3 before the end, and the proposal wraps.
    assert proposals([1, 2, 3, 1, 2, 3], k=7) == [1, 2, 3, 1, 2, 3, 1]
    assert proposals([4, 4, 4], k=3) == [4, 4, 4]  # period 1
    assert proposals([1, 2, 3, 4], k=3) == [4, 4, 4]  # nothing earlier matches
    assert proposals([6], k=2) == [6, 6]  # a lone token


def reference_proposals(history: list[int], k: int, max_n: int) -> list[int]:
    """The rule in plain Python: the latest earlier match of the longest suffix, repeated by its period."""
    last = len(history) - 1
    for n in range(max_n, 0, -1):
        ends = [j for j in range(n - 1, last) if last >= n - 1 and history[j - n + 1:j + 1] == history[last - n + 1:]]
        if ends:
            end = ends[-1]
            return [history[end + 1 + i % (last - end)] for i in range(k)]
    return [history[last]] * k


def test_lookup_equals_the_rule_on_random_histories():
    rng = np.random.default_rng(0)
    for _ in range(200):
        history = rng.integers(0, 3, rng.integers(1, 20)).tolist()  # 3 symbols: many repeats
        assert proposals(history, k=5, max_n=3) == reference_proposals(history, 5, 3), history


def test_ngram_registered_and_shaped_as_a_chain():
    assert "ngram" in SPECULATORS
    spec = NGram(4)
    facts = spec.facts
    assert (facts.verify_width, facts.max_accepted, facts.num_draft_steps, facts.uses_drafter) == (5, 4, 1, False)
    assert facts.slot_layout.history and facts.slot_layout.q_rows == 0
    assert facts.label == "ngram K=4" and spec != NGram(4, max_n=2) and hash(spec) == hash(NGram(4))


# ---- the engine --------------------------------------------------------------------------------
# Prompts that repeat themselves (prompt lookup's case) and some that do not; over 16 tokens they
# are prefilled in two chunks.
PROMPTS = [[(i + j % (2 + i % 3)) % TINY_VOCAB for j in range(3 + 2 * i)] for i in range(8)]
ENGINE = dict(batch_buckets=(1, 4), prefill_buckets=(16,), prefill_batch_buckets=(1, 4), max_model_len=96,
              num_pages=64, speculation="always", freeze_heap=False)


def make(target, speculator: str | None = "ngram", k: int = 3, dtype=None, **engine):
    from eagle3_jax.api import LLM

    return LLM(target, None, num_speculative_tokens=k if speculator else 0, speculator=speculator, dtype=dtype,
               warmup=False, progress=False, engine_config=EngineConfig(**{**ENGINE, **engine}))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_greedy_ngram_is_token_identical_to_the_target_alone(tiny_models, dtype):
    """Greedy replies equal the target alone's, one at a time and as a batch, and the lookup's
    proposals are accepted (the tiny model loops, as small models do)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    alone = [o.token_ids for o in make(tiny_models[0], None, dtype=dtype).generate(PROMPTS, params)]
    llm = make(tiny_models[0], dtype=dtype)
    assert llm.engine.runner.speculator == NGram(3) and llm.engine.step_cfg.draft is None
    batched = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == alone
    assert [llm.generate([p], params)[0].token_ids for p in PROMPTS[:3]] == alone[:3]
    assert sum(o.metrics.accepted for o in batched) > len(PROMPTS) * 5
    assert all(o.metrics.acceptance_length >= 1 for o in batched)
    pool = llm.engine.scheduler.pool
    assert pool.num_free == pool.capacity


@pytest.mark.slow
def test_seeded_ngram_samples_the_target_alones_tokens(tiny_models):
    """A seeded request's tokens are a function of its prompt and seed (the coupled rule), so
    prompt lookup reproduces the target alone's sampled reply, in a batch of mixed requests."""
    params = [SamplingParams(max_tokens=30, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(4)]
    params[1] = SamplingParams(max_tokens=30, temperature=0.7, top_k=5, seed=3, ignore_eos=True)
    alone = [o.token_ids for o in make(tiny_models[0], None).generate(PROMPTS[:4], params)]
    got = make(tiny_models[0], speculation="auto").generate(PROMPTS[:4], params)
    assert [o.token_ids for o in got] == alone


def test_ngram_configuration_errors(tiny_models):
    from eagle3_jax.api import LLM

    target, drafters = tiny_models
    with pytest.raises(ConfigError, match="speculator ngram drafts from the prompt and needs no drafter"):
        LLM(target, drafters["shared"], speculator="ngram", warmup=False, progress=False,
            engine_config=EngineConfig(**ENGINE))
    with pytest.raises(ConfigError, match="tree 3,2,5 needs the EAGLE-3 drafter"):
        LLM(target, None, speculator="ngram", tree=TreeSpec(3, 2, 5), warmup=False, progress=False,
            engine_config=EngineConfig(**ENGINE))
    with pytest.raises(ConfigError, match="speculator must be one of eagle3, ngram, got 'medusa'"):
        LLM(target, None, speculator="medusa", warmup=False, progress=False, engine_config=EngineConfig(**ENGINE))


def test_cli_names_an_unknown_speculator_in_one_line(tiny_models):
    proc, _ = run_cli("generate", "--target", str(tiny_models[0]), "--speculator", "medusa", "--prompt", "hi")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].endswith("--speculator medusa: not one of eagle3, ngram")


@pytest.mark.slow
def test_prefix_cache_hit_leaves_the_whole_prompt_in_the_history(tiny_models):
    """A prompt found in the prefix cache prefills only its last pages; the lookup still sees its
    whole text (not what the slot held before), and the reply is the target alone's."""
    llm = make(tiny_models[0])
    engine, params = llm.engine, SamplingParams(max_tokens=6, ignore_eos=True)
    prompt = [(3 * j) % TINY_VOCAB for j in range(40)]
    other = [(5 * j + 1) % TINY_VOCAB for j in range(40)]
    for ids in (prompt, other):  # the second overwrites the slot's history
        engine.run([engine.add_request(ids, params)])
    again = engine.add_request(prompt, params)
    engine.step()  # admits and prefills it
    assert again.num_cached == 32  # two pages of 16 from the cache; the last 8 tokens prefilled
    assert read_history(engine.runner, again.slot)[:len(prompt)].tolist() == prompt
    engine.run([again])
    alone = make(tiny_models[0], None).generate([prompt], params)[0].token_ids
    assert again.output == alone
