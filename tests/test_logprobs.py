"""Logprobs (SamplingParams.logprobs, prompt_logprobs): the target's raw log-softmax at each emitted
token, scored inside the verify and the prefill, against transformers' LlamaForCausalLM on the same
weights in f32; the same values with speculation on (a chain, a tree) or off, the iteration fused or
a program per step, alone or batched, bit for bit under batch_invariant=True; prompt scoring with
max_tokens 0 and no prefix-cache hits. A tiny random target and drafter (tests/conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import TINY_VOCAB

from eagle3_jax import Logprob, SamplingParams, TreeSpec
from eagle3_jax.config import EngineConfig
from eagle3_jax.runner import logprobs

# Mixed lengths; the 21-token one prefills in two chunks of the 16-token bucket.
PROMPTS = [[(5 * i + 3 * j) % TINY_VOCAB for j in range(n)] for i, n in enumerate([21, 4, 9, 1])]
ENGINE = dict(batch_buckets=(1, 4), prefill_buckets=(16,), prefill_batch_buckets=(1, 4), max_model_len=64,
              num_pages=64, speculation="always", freeze_heap=False)
TOP = 5


def make(tiny_models, draft: bool, tree: TreeSpec | None = None, **engine):
    from eagle3_jax.api import LLM

    target, drafters = tiny_models
    return LLM(target, drafters["shared"] if draft else None, num_speculative_tokens=3, warmup=False, progress=False,
               engine_config=EngineConfig(**{**ENGINE, "tree": tree, **engine}))


def scored(max_tokens: int = 10, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP, **fields)


def reference_log_softmax(target_dir, ids: list[int]) -> np.ndarray:
    """transformers' f32 log-softmax of its logits at each position of `ids` [T] -> [T, V]."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1).numpy()


def assert_matches(entries: list[dict[int, Logprob]], tokens: list[int], ref: np.ndarray) -> None:
    """Each entry (the token first, then its TOP likeliest) against the reference's row [V] for that
    token: every logprob, and the reference's values at each rank (so near-ties may swap ids)."""
    assert len(entries) == len(tokens) == len(ref)
    for entry, token, row in zip(entries, tokens, ref):
        ranked = -np.sort(-row)
        assert next(iter(entry)) == token and len(entry) == TOP + (entry[token].rank > TOP)
        assert sorted(lp.rank for lp in entry.values())[:TOP] == list(range(1, TOP + 1))
        for i, lp in entry.items():
            assert lp.logprob == pytest.approx(row[i], abs=1e-3)
            assert ranked[lp.rank - 1] == pytest.approx(row[i], abs=1e-3)


def test_packed_rows_are_the_log_softmax_its_top_and_the_rank():
    """runner/logprobs.py on random logits over a vocabulary of 5,000 (the kernel's chunks merged),
    XLA's form and the batch-invariant kernel's."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (3, 2, 5000)) * 3
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 2), 0, 5000)
    x = np.asarray(logits, np.float64)
    ref = x - x.max(-1, keepdims=True)
    ref -= np.log(np.sum(np.exp(ref), -1, keepdims=True))
    want = np.take_along_axis(ref, np.asarray(tokens)[..., None], -1)[..., 0]
    for invariant in (False, True):
        logprob, rank, ids, top = logprobs.unpack(np.asarray(logprobs.token_logprobs(logits, tokens, invariant)))
        assert ids.shape == top.shape == (3, 2, logprobs.top_n(5000)) == (3, 2, 20)
        np.testing.assert_allclose(logprob, want, atol=1e-5)
        np.testing.assert_array_equal(rank, 1 + np.sum(ref > want[..., None], -1))
        np.testing.assert_array_equal(ids, np.argsort(-ref, -1, kind="stable")[..., :20])
        np.testing.assert_allclose(top, -np.sort(-ref, -1)[..., :20], atol=1e-5)
    assert logprobs.fields(TINY_VOCAB) == 2 + 2 * TINY_VOCAB  # a vocabulary under the limit lists all of it


@pytest.mark.slow
def test_logprobs_equal_transformers_log_softmax_in_a_speculative_batch(tiny_models):
    """A chain of 3 over a batch of four, greedy and sampled rows (logprobs before temperature and
    top-k): every generated and prompt token's logprob, top 5 and rank as transformers' f32; a
    prompt-scoring request (max_tokens 0) gets the same prompt logprobs and nothing else, without
    taking the prefix the others left cached."""
    llm = make(tiny_models, draft=True)
    params = [scored(), scored(temperature=0.8, top_k=3, seed=1), scored(), scored(temperature=1.0, seed=2)]
    outs = llm.generate(PROMPTS, params)
    assert sum(o.metrics.accepted for o in outs) > 0  # the verify's logits scored accepted drafts
    for prompt, out in zip(PROMPTS, outs):
        ref = reference_log_softmax(tiny_models[0], prompt + out.token_ids)
        sample = out.outputs[0]
        assert len(sample.logprobs) == len(out.token_ids) == 10
        assert_matches(sample.logprobs, out.token_ids, ref[len(prompt) - 1:-1])
        assert sample.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(sample.logprobs,
                                                                                          out.token_ids)))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert_matches(out.prompt_logprobs[1:], prompt[1:], ref[:len(prompt) - 1])
    hits = llm.engine.stats.prefix_hit_tokens
    (only,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=0, prompt_logprobs=TOP))
    assert only.token_ids == [] and only.finish_reason == "length" and only.outputs[0].logprobs is None
    assert only.prompt_logprobs == outs[0].prompt_logprobs
    assert llm.engine.stats.prefix_hit_tokens == hits
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    assert plain.token_ids == outs[0].token_ids[:4]  # greedy: the scoring programs emit the same tokens
    assert llm.engine.stats.prefix_hit_tokens > hits  # the cache still serves requests not scoring their prompt



def test_prompt_logprobs_of_a_prompt_prefilled_over_several_steps(tiny_models):
    """A two-chunk prompt arriving while a row decodes prefills a chunk a step: its prompt's
    logprobs, gathered over those steps, and its tokens' are those of it prefilled alone in one step."""
    llm = make(tiny_models, draft=False, batch_invariant=True)
    engine = llm.engine
    alone = engine.add_request(PROMPTS[0], scored(4))
    engine.run([alone])
    decoding = engine.add_request(PROMPTS[1], scored(20))
    while not decoding.output:
        engine.step()
    late = engine.add_request(PROMPTS[0], scored(4))
    engine.step()
    assert late.prefilling  # its first chunk dispatched, the second not yet
    engine.run([decoding, late])
    assert late.prompt_logprobs == alone.prompt_logprobs and len(late.prompt_logprobs) == len(PROMPTS[0])
    assert late.output == alone.output and late.logprobs == alone.logprobs

@pytest.mark.slow
def test_logprobs_are_the_same_with_speculation_on_or_off_alone_or_batched(tiny_models):
    """Under batch_invariant=True: the target alone with each request alone, a chain dispatched a
    program per step on a pool so short that requests are preempted (and resume), and a tree, each
    over the whole batch, give the same logprobs bit for bit."""
    params = [scored(12), scored(12, temperature=0.9, seed=5), scored(12), scored(12)]
    alone = make(tiny_models, draft=False, batch_invariant=True)
    want = [alone.generate([p], sp)[0] for p, sp in zip(PROMPTS, params)]
    engines = {"chain, per step": make(tiny_models, draft=True, batch_invariant=True, fused_iteration=False,
                                       num_pages=5),
               "tree": make(tiny_models, draft=True, tree=TreeSpec(3, 2, 5), batch_invariant=True)}
    for name, llm in engines.items():
        got = llm.generate(PROMPTS, params)
        assert sum(o.metrics.accepted for o in got) > 0, name
        assert (llm.engine.stats.preemptions > 0) == (name == "chain, per step"), name
        for g, w in zip(got, want):
            assert g.token_ids == w.token_ids, name
            assert g.outputs[0].logprobs == w.outputs[0].logprobs, name
            assert g.prompt_logprobs == w.prompt_logprobs, name
