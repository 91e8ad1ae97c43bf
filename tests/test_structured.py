"""Structured outputs: `SamplingParams.structured_outputs` (a JSON schema, a regex, a choice, a
grammar) compiled by llguidance for the target's tokenizer, its masks along a chain's drafts and at
each node of a tree, the masked logits on the device, and the engine's output: it follows the
grammar exactly, and is the same tokens with speculation on (the EAGLE-3 chain and tree, prompt
lookup) and off. A tiny random target with a byte tokenizer (conftest's `chat_models`); the
server's side is in tests/test_serve.py."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import SamplingParams, TreeSpec
from eagle3_jax.engine.engine import _force_path
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


def depths(parents: list[int]) -> list[int]:
    """Each node's depth in a tree whose node i + 1's parent is parents[i] (the root, node 0: 0)."""
    depth = [0]
    for parent in parents:
        depth.append(depth[parent] + 1)
    return depth


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


def test_tree_masks_are_each_nodes_grammar_under_its_own_path_and_leave_the_matchers_where_they_were(grammars,
                                                                                                    tokenizer):
    """Random trees (a tree's layout: node i + 1's parent parents[i] <= i), most nodes the next
    token of a reply the schema takes, the others random letters or tokens, three rows of a batch of
    four: each node's mask is what a lone matcher allows after that node's path from the root, and
    every token under a token the grammar refuses is allowed; the matchers are where they started."""
    vocab, rng = len(tokenizer), np.random.default_rng(0)
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    schema = StructuredOutputsParams(json=SCHEMA)
    reply = ids('{"name":"ab","age":7,"role":"user","tags":["red"],"address":{"city":"x","zip":"12345"}}')
    reply.append(tokenizer.eos_token_id)
    letters = ids("abxyz017,:")
    reference = grammars.matcher(schema)

    def alone_after(path):  # a lone matcher's mask after `path`, every token where it refuses one
        taken = reference.llg.try_consume_tokens(path)
        mask = grammars.masks([(0, reference, ())], 1, 1)[0, 0] if taken == len(path) else None
        reference.llg.rollback(taken)
        return set(range(vocab)) if mask is None else allowed(mask, vocab)

    starts = [3, 0, 19]  # each row's place in the reply
    matchers = [grammars.matcher(schema) for _ in starts]
    for m, start in zip(matchers, starts):
        assert not any(m.advance(token) for token in reply[:start])
    constrained = 0
    for _ in range(4):
        nodes = 16
        parents = [int(rng.integers(max(0, i - 3), i + 1)) for i in range(nodes)]  # deep and bushy
        depth = depths(parents)
        trees = []
        for start in starts:
            pick = rng.random(nodes)
            tokens = [reply[start + depth[i + 1] - 1] if pick[i] < 0.85 else int(rng.choice(letters)) if pick[i] < 0.95
                      else int(rng.integers(vocab)) for i in range(nodes)]
            trees.append((tokens, parents))
        masks = grammars.tree_masks([(row, m, *tree) for row, m, tree in zip((0, 1, 3), matchers, trees)], 4, nodes + 1)
        for row, start, (tokens, parents) in zip((0, 1, 3), starts, trees):
            reference.llg.reset()
            assert reference.llg.consume_tokens(reply[:start])
            for node in range(nodes + 1):
                path, up = [], node
                while up:
                    path.insert(0, tokens[up - 1])
                    up = parents[up - 1]
                want = alone_after(path)
                assert allowed(masks[row, node], vocab) == want, (row, node, path)
                constrained += len(want) < vocab
        assert all(allowed(masks[2, node], vocab) == set(range(vocab)) for node in range(nodes + 1))
    assert constrained > 4 * 3 * nodes / 2, constrained  # most nodes are under the grammar
    for m, start in zip(matchers, starts):  # each goes on from where it was
        assert not any(m.advance(token) for token in reply[start:start + 5])


def test_tree_masks_are_bit_for_bit_a_fresh_matchers_after_each_nodes_path(grammars, tokenizer):
    """Random trees over a small schema, their rows starting anywhere in a reply so paths run past
    its end (EOS, then more), their nodes the reply's next token or a refused or random one; rows 1
    and 4 of a batch of six have no grammar. Each node's packed mask is the one a fresh matcher
    gives after consuming the node's path from the root (llguidance's own fill, not
    `tree_masks`'), or every token where a token on the path is refused or comes past the
    grammar's end; chains (`masks`) alike; the row's matcher stays where it was."""
    import llguidance
    import llguidance.numpy

    vocab, rng = len(tokenizer), np.random.default_rng(1)
    words = (vocab + 31) // 32
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids
    schema = StructuredOutputsParams(json={"type": "object", "additionalProperties": False, "required": ["a", "n"],
                                           "properties": {"a": {"enum": ["xy", "z"]}, "n": {"type": "integer"}}})
    reply = [*ids('{"a":"xy","n":12}'), tokenizer.eos_token_id]
    others = [*ids('z}"1,'), tokenizer.eos_token_id]
    everything = np.full(words, -1, np.int32)

    def reference(prefix, path):  # a fresh matcher's mask after prefix + path
        fresh = grammars.matcher(schema).llg
        assert fresh.consume_tokens(prefix)
        for token in path:
            if fresh.is_stopped() or fresh.try_consume_tokens([token]) != 1:
                return everything
        mask = np.zeros((1, words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(fresh, mask)
        return mask[0]

    rows, seen = [0, 2, 3, 5], {"constrained": 0, "ended": 0, "free": 0}  # nodes by their reference mask
    for nodes in (12, 12, 12, 6):
        starts = rng.integers(4, len(reply), len(rows))  # each row's place in the reply
        matchers = []
        for start in starts:
            matchers.append(m := grammars.matcher(schema))
            assert m.llg.consume_tokens(reply[:start])
        chain = nodes == 6
        parents = list(range(nodes)) if chain else [int(rng.integers(max(0, i - 4), i + 1)) for i in range(nodes)]
        depth = depths(parents)
        trees = []
        for start in starts:
            pick = rng.random(nodes)
            trees.append([reply[min(start + depth[i + 1] - 1, len(reply) - 1)] if pick[i] < 0.85
                          else int(rng.choice(others)) if pick[i] < 0.95 else int(rng.integers(vocab))
                          for i in range(nodes)])
        if chain:
            masks = grammars.masks([(row, m, tokens) for row, m, tokens in zip(rows, matchers, trees)], 6, nodes + 1)
        else:
            masks = grammars.tree_masks([(row, m, tokens, parents) for row, m, tokens in zip(rows, matchers, trees)],
                                        6, nodes + 1)
        assert masks.shape == (6, nodes + 1, words) and masks.dtype == np.int32
        for row, start, m, tokens in zip(rows, starts, matchers, trees):
            for node in range(nodes + 1):
                path, up = [], node
                while up:
                    path.insert(0, tokens[up - 1])
                    up = parents[up - 1]
                want = reference(reply[:start], path)
                np.testing.assert_array_equal(masks[row, node], want, err_msg=f"{row, node}")
                seen["free" if want is everything else "ended" if not want[1:].any()
                     and want[0] == 1 << tokenizer.eos_token_id else "constrained"] += 1
            assert m.llg.try_consume_tokens(reply[start:-1]) == len(reply) - 1 - start  # where it was
        for row in (1, 4):
            np.testing.assert_array_equal(masks[row], np.broadcast_to(everything, masks[row].shape))
    assert min(seen.values()) >= 5, seen  # under the grammar, at its end (only EOS), and under a refused token


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
# An engine drafting only a tree verifies its grammar batches with it, masked node by node (the
# random drafter's trees are 2 deep: the forced tokens' path takes their last leaves to reach 3).
SPECULATION = {"target alone": {"draft": None, "num_draft": 0}, "eagle3 chain": {"num_draft": 3},
               "prompt lookup": {"draft": None, "num_draft": 3, "speculator": "ngram"},
               "eagle3 tree": {"num_draft": 3, "tree": TreeSpec(3, 2, 5)}}


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
    # Prompt lookup accepts proposals in these repetitive outputs: the masks along drafts were used;
    # the tree accepts the schema's forced tokens (the target alone would accept none).
    assert max(out.metrics.acceptance_length for out in outputs["prompt lookup"][:-1]) > 1
    assert min(out.metrics.acceptance_length for out in outputs["eagle3 tree"][:2]) > 1.5


@pytest.mark.slow
def test_each_iteration_is_masked_by_its_own_rows_grammars_after_its_own_forward(chat_models):
    """A masked iteration is two programs, the verify's forward and then the acceptance under the masks
    the host computed meanwhile (runner/steps.py, `verify_in_place`). Rows under three grammars in
    one batch, iteration after iteration, on the target alone and the EAGLE-3 chain (fused, and a
    program per draft step): each token
    emitted is the argmax of transformers' logits at its position (the same weights, an independent
    forward) among the tokens its own row's grammar allows after the tokens before it. Masks
    applied to another iteration's logits, or another row's, would let other tokens through."""
    import torch
    from conftest import make_llm
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(chat_models[0]), dtype=torch.float32).eval()
    params = [REQUESTS[0], REQUESTS[2], REQUESTS[4]]  # greedy: a schema, a regex, a choice
    prompts = [[{"role": "user", "content": f"Row {i}"}] for i in range(len(params))]
    for how in ({"draft": None, "num_draft": 0}, {"num_draft": 3}, {"num_draft": 3, "fused_iteration": False}):
        llm = make_llm(chat_models[0], **{"draft": chat_models[1], "tree": None, **how}, warmup=False,
                       max_model_len=256)
        grammars, vocab = llm.engine.grammars, llm.engine.step_cfg.target.vocab_size
        outs = llm.chat(prompts, params)
        llm.close()
        binding = 0  # positions whose unconstrained argmax the grammar refused
        for out, p in zip(outs, params):
            prompt = len(out.prompt_token_ids)
            with torch.no_grad():
                logits = model(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].numpy()
            matcher = grammars.matcher(p.structured_outputs)
            assert len(out.token_ids) > 2
            for t, token in enumerate(out.token_ids):
                row, ok = logits[prompt + t - 1], sorted(allowed(grammars.masks([(0, matcher, ())], 1, 1)[0, 0], vocab))
                assert token in ok and row[token] >= row[ok].max() - 1e-4, (how, p.structured_outputs, t)
                binding += int(np.argmax(row)) not in ok
                matcher.advance(token)
        assert binding > 10, how


@pytest.mark.slow
def test_a_tree_under_a_grammar_is_masked_node_by_node(chat_models, outputs):
    """A tree engine under the schema, each iteration verifying a tree set by hand (forced tokens
    off): the target alone's next tokens under the schema as a root path 0..steps deep on a random
    branch, every other node a random byte, most of which the grammar refuses there. The row
    accepts exactly that path and emits the target alone's tokens: each node's children are
    decided under the grammar after that node's own path (masks along another branch, or the
    root's for all, would correct the path's nodes into other tokens)."""
    from conftest import make_llm, tree_with_path
    from runner_probe import set_proposals

    reference, spec = outputs["target alone"][0], TreeSpec(3, 2, 5)
    llm = make_llm(*chat_models, warmup=False, num_draft=3, tree=spec, max_model_len=256)
    engine, vocab, rng = llm.engine, llm.engine.step_cfg.target.vocab_size, np.random.default_rng(0)
    engine.overlap, engine.grammars.forced_drafts = False, False  # read each iteration before setting the next
    req = engine.add_request(reference.prompt_token_ids, REQUESTS[0])
    engine.step()  # the prefill and one iteration on the drafter's own tree
    depths = []
    while not req.finished:
        n = len(req.output)
        truth = reference.token_ids[n:n + int(rng.integers(spec.steps + 1)) + 1]
        set_proposals(engine.runner, req.slot, *tree_with_path(spec, truth, vocab, rng))
        accepted = req.metrics.accepted
        engine.step()
        assert req.metrics.accepted - accepted == len(truth) - 1
        assert req.output == reference.token_ids[:len(req.output)]
        depths.append(len(truth) - 1)
    assert req.output == reference.token_ids and set(depths) == set(range(spec.steps + 1))
    llm.close()


@pytest.mark.slow
def test_a_bad_schema_is_an_error_output_and_the_others_are_served(outputs):
    bad = outputs["eagle3 chain"][-1]
    assert bad.finish_reason == "error" and "structured_outputs json does not compile" in bad.error
    assert "objekt" in bad.error and bad.token_ids == []


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, TreeSpec(2, 2, 3)], ids=["chain", "tree"])
def test_structured_warmup_builds_what_a_structured_request_runs(chat_models, tree):
    """With EngineConfig.structured_warmup, warm-up builds the masked programs (and the reads and
    writes around them: a chain's drafts, a tree's nodes and parents): a structured request then
    compiles nothing, its forced tokens written into the drafts."""
    from conftest import make_llm

    llm = make_llm(*chat_models, warmup=False, tree=tree, structured_warmup=True, batch_buckets=(1,))
    iterations, prefills = llm.engine.programs(greedy=True)
    assert [c.speculator.facts.label for _, c in iterations if c.masked] == [(tree or TreeSpec.chain(3)).label]
    assert sum(masked for *_, masked in prefills) == 1
    llm.engine.warmup(progress=False, greedy=True)
    built = llm.engine.num_compilations
    out = llm.generate("Pick:", SamplingParams(max_tokens=8, structured_outputs={"choice": CHOICE}))[0]
    assert out.text in CHOICE and llm.engine.num_compilations == built
    assert out.metrics.acceptance_length > 1  # the grammar's forced tokens, accepted
    llm.close()


def test_auto_times_batches_under_a_grammar_apart_from_free_ones(chat_models):
    """Under "auto" a step whose batch has a row under a grammar (its masks computed on the host, its
    results read before the next dispatch) is timed among the constrained steps only, and a free
    batch's steps among the free ones (speculation.py, `Timings`)."""
    from conftest import make_llm

    llm = make_llm(*chat_models, warmup=False, tree=None, structured_warmup=True, batch_buckets=(1,),
                   speculation="auto")
    llm.engine.warmup(progress=False, greedy=True)
    spec = llm.engine.speculation
    llm.generate("Code:", SamplingParams(max_tokens=24, ignore_eos=True, structured_outputs={"regex": "[a-c]{24}"}))
    assert spec.constrained.served.get(1) and not spec.free.served
    llm.generate("Code:", SamplingParams(max_tokens=24, ignore_eos=True))
    assert spec.free.served.get(1)
    assert all(t.samples >= 1 for t in (*spec.free.served[1].values(), *spec.constrained.served[1].values()))
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


def test_forced_tokens_go_on_one_root_path_of_a_tree_whose_siblings_stay_distinct():
    """engine.py's `_force_path` on random trees of distinct siblings (a tree's layout), forced runs up
    to the tree's size: a root path holds them, siblings still hold distinct tokens, every node
    comes after its parent, and no node is deeper than the run or than the tree was."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        nodes = int(rng.integers(1, 12))
        parents = np.array([rng.integers(0, i + 1) for i in range(nodes)], np.int32)
        tokens = np.zeros(nodes, np.int32)
        for i in range(nodes):
            taken = set(tokens[:i][parents[:i] == parents[i]].tolist())
            tokens[i] = rng.choice([t for t in range(12) if t not in taken])
        forced = rng.integers(0, 12, int(rng.integers(1, nodes + 1))).tolist()
        tree = _force_path(tokens.copy(), parents.copy(), forced)
        got_tokens, got_parents = (tokens, parents) if tree is None else tree
        assert len(got_tokens) == len(got_parents) == nodes
        assert all(0 <= p <= i for i, p in enumerate(got_parents.tolist()))
        for parent in set(got_parents.tolist()):
            siblings = got_tokens[got_parents == parent].tolist()
            assert len(set(siblings)) == len(siblings)
        node = 0
        for want in forced:
            (node,) = np.flatnonzero((got_parents == node) & (got_tokens == want)) + 1
        assert max(_depths(got_parents)) <= max(len(forced), max(_depths(parents)))


def _depths(parents: np.ndarray) -> list[int]:
    depth = [0]
    for parent in parents.tolist():
        depth.append(depth[parent] + 1)
    return depth


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
