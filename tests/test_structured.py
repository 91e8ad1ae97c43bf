"""Structured outputs: `SamplingParams.structured_outputs` (a JSON schema, a regex, a choice, a
grammar) compiled by llguidance for the target's tokenizer, its masks along a chain's drafts, the
masked logits on the device, and the engine's output: it follows the grammar exactly, and is the
same tokens with speculation on (the EAGLE-3 chain, prompt lookup) and off. A tiny random target
with a byte tokenizer (conftest's `chat_models`); the server's side is in tests/test_serve.py."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import SamplingParams, TreeSpec
from eagle3_jax.engine.structured import GrammarError, Grammars
from eagle3_jax.runner.sampling import mask_logits
from eagle3_jax.sampling_params import StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

# Nested objects, enums, arrays; every string and array bounded, so even a random model's
# constrained output ends within max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
REGEX = "[a-c]{3}-[0-9]{2,6}"
CHOICE = ["yes", "no way", "maybe"]


@pytest.fixture(scope="module")
def tokenizer(chat_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_models[0]))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def allowed(words: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_structured_outputs_take_exactly_one_form_and_a_dict_of_fields():
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert params.structured_outputs.kind == "json"
    as_text = SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert as_text == params and hash(as_text) == hash(params)
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")
    for bad, message in [({}, "exactly one of"), ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
                         ({"json": "{not json"}, "not valid JSON"), ({"choice": "ab"}, "list of strings"),
                         ({"grammar": ""}, "non-empty string"), ({"pattern": "a"}, "no field 'pattern'"),
                         ("json", "a dict of its fields")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(structured_outputs=bad)


def test_masked_logits_keep_exactly_the_tokens_whose_bits_are_set():
    vocab = 70  # three words, the last partly used
    rng = np.random.default_rng(0)
    keep = rng.random((2, 3, vocab)) < 0.3
    words = np.zeros((2, 3, 3), np.uint32)
    for t in range(vocab):
        words[..., t // 32] |= keep[..., t].astype(np.uint32) << np.uint32(t % 32)
    logits = rng.normal(size=(2, 3, vocab)).astype(np.float32)
    masked = np.asarray(mask_logits(jnp.asarray(logits), jnp.asarray(words.view(np.int32))))
    np.testing.assert_array_equal(masked, np.where(keep, logits, -np.inf))


def test_masks_follow_the_grammar_along_the_drafts_and_leave_the_matcher_where_it_was(grammars, tokenizer):
    vocab = len(tokenizer)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    matcher = grammars.matcher(StructuredOutputsParams(choice=CHOICE))
    reference = grammars.matcher(StructuredOutputsParams(choice=CHOICE))

    def one_by_one(tokens):  # the mask after each prefix of `tokens`, as a lone matcher gives it
        out = []
        for i in range(len(tokens) + 1):
            out.append(allowed(grammars.masks([(0, reference, ())], 1, 1)[0, 0], vocab))
            if i < len(tokens):
                assert not reference.advance(tokens[i]) or i == len(tokens) - 1
        reference.llg.reset()
        return out

    drafts = ids("may")  # a prefix of "maybe": every position constrained
    masks = grammars.masks([(1, matcher, drafts)], 3, 4)
    assert [allowed(masks[1, i], vocab) for i in range(4)] == one_by_one(drafts)
    assert allowed(masks[1, 0], vocab) == {ids("y")[0], ids("n")[0], ids("m")[0]}
    assert all(allowed(masks[row, i], vocab) == set(range(vocab)) for row in (0, 2) for i in range(4))
    # "no way" ends the grammar: then only EOS; past a refused draft nothing is constrained.
    masks = grammars.masks([(0, matcher, ids("no way") + [0])], 1, 8)
    assert allowed(masks[0, 6], vocab) == {tokenizer.eos_token_id} and allowed(masks[0, 7], vocab) == set(range(vocab))
    masks = grammars.masks([(0, matcher, ids("nx") + ids("yy"))], 1, 5)
    assert allowed(masks[0, 1], vocab) == {ids("o")[0]} and allowed(masks[0, 2], vocab) == set(range(vocab))
    assert not matcher.advance(ids("y")[0]) and not matcher.advance(ids("e")[0]) and matcher.advance(ids("s")[0])


@pytest.mark.parametrize("params, message", [
    ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "json does not compile: .*nowhere"),
    ({"json": {"type": "objekt"}}, "json does not compile: .*objekt"),
    ({"regex": "a(b"}, "regex does not compile: .*unclosed group"),
    ({"grammar": "start: missing_rule"}, "grammar does not compile: .*missing_rule"),
])
def test_a_grammar_that_does_not_compile_is_refused_naming_why(grammars, params, message):
    with pytest.raises(GrammarError, match=f"(?s){message}"):
        grammars.compile(StructuredOutputsParams(**params))


def test_a_target_without_a_tokenizer_refuses_structured_outputs():
    with pytest.raises(GrammarError, match="needs the target's tokenizer"):
        Grammars(None, 12, [2]).compile(StructuredOutputsParams(regex="a+"))


# ---- the engine ------------------------------------------------------------------------------
# An engine drafting only a tree verifies its grammar batches with the target alone.
SPECULATION = {"target alone": {"draft": None, "num_draft": 0}, "eagle3 chain": {"num_draft": 3},
               "prompt lookup": {"draft": None, "num_draft": 3, "speculator": "ngram"},
               "eagle3 tree": {"num_draft": 3, "tree": TreeSpec(2, 2, 3)}}


@pytest.fixture(scope="module")
def outputs(chat_models):
    """Each speculation's outputs of REQUESTS (one batch), and its engine's bad-schema output."""
    from conftest import make_llm

    target, draft = chat_models
    results = {}
    for name, how in SPECULATION.items():
        llm = make_llm(target, **{"draft": draft, "tree": None, **how}, warmup=False, max_model_len=256)
        prompts = [[{"role": "user", "content": f"Request {i}"}] for i in range(len(REQUESTS))]
        bad = {"structured_outputs": {"json": {"type": "objekt"}}}
        results[name] = llm.chat(prompts + prompts[:1], [*REQUESTS, bad])
        llm.close()
    return results


REQUESTS = [
    SamplingParams(max_tokens=150, structured_outputs={"json": SCHEMA}),
    SamplingParams(max_tokens=150, temperature=1.0, seed=3, structured_outputs={"json": SCHEMA}),
    SamplingParams(max_tokens=20, structured_outputs={"regex": REGEX}),
    SamplingParams(max_tokens=20, temperature=0.8, seed=1, structured_outputs={"regex": REGEX}),
    SamplingParams(max_tokens=20, structured_outputs={"choice": CHOICE}),
    SamplingParams(max_tokens=12),  # unconstrained, in the same batch
]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECULATION))
def test_constrained_output_follows_the_grammar_exactly(outputs, name):
    schema_greedy, schema_sampled, regex_greedy, regex_sampled, choice, free, _ = outputs[name]
    for out in (schema_greedy, schema_sampled):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    for out in (regex_greedy, regex_sampled):
        assert re.fullmatch(REGEX, out.text) or (out.finish_reason == "length" and re.match(REGEX[:-6], out.text))
    assert choice.text in CHOICE and choice.finish_reason == "stop"
    assert len(free.token_ids) == 12 and free.finish_reason == "length"


@pytest.mark.slow
def test_constrained_output_is_the_same_tokens_with_speculation_on_and_off(outputs):
    alone = [out.token_ids for out in outputs["target alone"][:-1]]
    for name in ("eagle3 chain", "prompt lookup", "eagle3 tree"):
        assert [out.token_ids for out in outputs[name][:-1]] == alone, name
    # Prompt lookup accepts proposals in these repetitive outputs: the masks along drafts were used.
    assert max(out.metrics.acceptance_length for out in outputs["prompt lookup"][:-1]) > 1


@pytest.mark.slow
def test_a_bad_schema_is_an_error_output_and_the_others_are_served(outputs):
    bad = outputs["eagle3 chain"][-1]
    assert bad.finish_reason == "error" and "structured_outputs json does not compile" in bad.error
    assert "objekt" in bad.error and bad.token_ids == []


@pytest.mark.slow
def test_structured_warmup_builds_what_a_structured_request_runs(chat_models):
    """With EngineConfig.structured_warmup, warm-up builds the masked programs (and the reads and
    writes around them): a structured request then compiles nothing."""
    from conftest import make_llm

    llm = make_llm(*chat_models, warmup=False, tree=None, structured_warmup=True, batch_buckets=(1,))
    iterations, prefills = llm.engine.programs(greedy=True)
    assert sum(c.masked for _, c in iterations) == 1 and sum(masked for *_, masked in prefills) == 1
    llm.engine.warmup(progress=False, greedy=True)
    built = llm.engine.num_compilations
    out = llm.generate("Pick:", SamplingParams(max_tokens=8, structured_outputs={"choice": CHOICE}))[0]
    assert out.text in CHOICE and llm.engine.num_compilations == built
    llm.close()


@pytest.mark.slow
def test_logprobs_of_a_constrained_output_are_the_targets_before_the_mask(chat_models):
    """Structured outputs with logprobs (the scoring and the masked programs at once, on the EAGLE-3
    chain): the output follows the grammar, and each token's logprobs are the target's unmasked
    log-softmax, as scoring prompt + output with prompt_logprobs gives them (its top tokens may be
    ones the grammar refused). A long prompt arriving while it decodes prefills over several steps
    and changes none of its tokens."""
    from conftest import make_llm

    llm = make_llm(*chat_models, warmup=False, tree=None, max_model_len=256)
    params = SamplingParams(max_tokens=20, logprobs=5, structured_outputs={"regex": REGEX})
    (out,) = llm.generate(["Pick:"], params)
    assert re.fullmatch(REGEX, out.text) or (out.finish_reason == "length" and re.match(REGEX[:-6], out.text))
    (scoring,) = llm.generate([out.prompt_token_ids + out.token_ids], SamplingParams(max_tokens=0, prompt_logprobs=5))
    want = scoring.prompt_logprobs[len(out.prompt_token_ids):]
    for got, expected, token in zip(out.outputs[0].logprobs, want, out.token_ids, strict=True):
        assert got[token].rank == expected[token].rank and list(got) == list(expected)
        assert [lp.logprob for lp in got.values()] == pytest.approx([lp.logprob for lp in expected.values()], abs=1e-4)
    engine, largest = llm.engine, llm.engine.cfg.prefill_buckets[-1]
    constrained = engine.add_request(out.prompt_token_ids, params)
    while not constrained.output:
        engine.step()
    long = engine.add_request([(7 * i) % 200 + 3 for i in range(2 * largest + 5)], SamplingParams(max_tokens=4))
    engine.step()
    assert long.prefilling  # its chunks go one a step while the constrained row decodes
    engine.run([constrained, long])
    assert constrained.output == out.token_ids
    llm.close()


def test_forced_tokens_are_what_the_grammar_allows_alone_and_leave_the_matcher_where_it_was(grammars, tokenizer):
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    schema = StructuredOutputsParams(json={"type": "object", "properties": {"role": {"enum": ["admin", "guest"]}},
                                           "required": ["role"], "additionalProperties": False})
    matcher = grammars.matcher(schema)
    # Compact JSON: `{"role":"` is forced, then a choice; a byte tokenizer splits it one way only.
    assert grammars.forced([(matcher, False), (matcher, True)], 4) == [ids('{"ro'), ids('{"ro')]
    assert grammars.forced([(matcher, True)], 20) == [ids('{"role":"')]
    assert grammars.forced([(matcher, False)], 0) == [[]]
    for token in ids('{"role":"'):
        assert not matcher.advance(token)
    assert grammars.forced([(matcher, True)], 4) == [[]]  # admin or guest
    assert not matcher.advance(ids("g")[0])
    assert grammars.forced([(matcher, True)], 8) == [ids('uest"}')]


def test_a_draft_the_mask_allows_alone_is_accepted_by_every_rule_whatever_its_q():
    """A grammar-forced draft keeps the drafter's q (engine.py, `_force_drafts`): where the masked
    target allows that token alone, greedy, coupled, one-hot and draft-q rows all accept it, and
    draft-q whatever q gave it, 0 or 1 included."""
    from eagle3_jax.runner.sampling import RowSampling, coupling_noise, verify_chain

    rng = np.random.default_rng(0)
    B, K, V = 8, 3, 40
    drafts = rng.integers(0, V, (B, K)).astype(np.int32)
    keep = np.zeros((B, K + 1, V), bool)
    keep[:, :K][np.arange(B)[:, None], np.arange(K), drafts] = True  # each draft the one token allowed
    keep[:, K] = True
    words = np.zeros((B, K + 1, 2), np.uint32)
    for t in range(V):
        words[..., t // 32] |= keep[..., t].astype(np.uint32) << np.uint32(t % 32)
    logits = mask_logits(jnp.asarray(rng.normal(size=(B, K + 1, V)) * 4, jnp.float32),
                         jnp.asarray(words.view(np.int32)))
    q = rng.dirichlet(np.ones(V), (B, K)).astype(np.float32)
    q[0, :, :] = 0  # q(d) = 0
    q[1] = np.eye(V, dtype=np.float32)[drafts[1]]  # q(d) = 1
    rules = np.array([0, 1, 2, 3] * 2)  # greedy, draft-q, one-hot, coupled
    row = RowSampling(temperature=jnp.asarray(np.where(rules == 0, 0.0, 1.0), jnp.float32),
                      top_k=jnp.zeros(B, jnp.int32), top_p=jnp.ones(B), min_p=jnp.zeros(B),
                      key=jnp.asarray(rng.integers(0, 2**32, (B, 2)), jnp.uint32), one_hot=jnp.asarray(rules == 2),
                      coupled=jnp.asarray(rules == 3))
    noise = coupling_noise(row.key, jnp.broadcast_to(jnp.arange(K + 1), (B, K + 1)), V)
    for seed in range(4):
        keys = jnp.asarray(np.random.default_rng(seed).integers(0, 2**32, (B, 2)), jnp.uint32)
        n, emitted = verify_chain(logits, drafts, jnp.asarray(q), row, keys, noise)
        assert np.asarray(n).tolist() == [K] * B
        np.testing.assert_array_equal(np.asarray(emitted)[:, :K], drafts)


@pytest.mark.slow
def test_forced_drafts_keep_the_output_and_raise_acceptance(chat_models):
    """The EAGLE-3 chain under a schema, the grammar's forced tokens put in place of the drafts or
    not: the same tokens (greedy, and seeded sampling: the coupled rule), and a random drafter,
    which almost never proposes a brace or a key name, accepts far more with them; so does a
    draft-q row (its tokens are a draw, exact but not the same draw), its output following the
    schema."""
    from conftest import make_llm

    llm = make_llm(*chat_models, warmup=False, tree=None, num_draft=3, max_model_len=256)
    prompts = [[{"role": "user", "content": f"Request {i}"}] for i in range(3)]
    draft_q = SamplingParams(max_tokens=150, temperature=1.0, seed=5, draft_acceptance="draft_q",
                             structured_outputs={"json": SCHEMA})
    runs = {}
    for forced in (False, True):
        llm.engine.grammars.forced_drafts = forced
        runs[forced] = llm.chat(prompts, [*REQUESTS[:2], draft_q])
    assert [o.token_ids for o in runs[True][:2]] == [o.token_ids for o in runs[False][:2]]
    for out in runs[True] + runs[False]:
        jsonschema.validate(json.loads(out.text), SCHEMA)
    without, with_forced = ([o.metrics.acceptance_length for o in runs[f]] for f in (False, True))
    assert min(with_forced) > max(without) + 0.5, (with_forced, without)
    llm.close()
