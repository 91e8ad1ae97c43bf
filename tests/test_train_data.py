"""Tests for the drafter's data pipeline: prompts from every ShareGPT turn and from the target
itself (Magpie), their filters, the temperature mix, regeneration's bookkeeping (with a stand-in
for the engine: no model runs here) and early stopping. CPU, a few seconds."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import assets
from eagle3_jax.train import data as D
from eagle3_jax.train import loop as L
from eagle3_jax.train import objective as O
from eagle3_jax.train import prompts as P
from eagle3_jax.train import regenerate as R

SMOLLM2_PREFIX = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                  "<|im_start|>user\n")


def record(*turns):
    return {"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]}


def user(text):
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def mtbench_all():
    """All 80 MT-bench questions, both turns."""
    return assets.mtbench_questions()


# ----------------------------------------------------------------------------- ShareGPT turns

def test_every_user_turn_with_the_conversation_before_it():
    records = [
        record(("system", "Be brief."), ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"),
               ("human", "q3"), ("gpt", "a3")),
        record(("gpt", "hello"), ("human", "p1"), ("chatgpt", "r1"), ("human", "p2")),  # unanswered last turn
        record(("human", "x"), ("bing", "y")),  # unknown speaker
        record(("human", "s1"), ("gpt", "t1"), ("gpt", "t2"), ("human", "s2"), ("gpt", "t3")),  # broken alternation
        record(("human", "  "), ("gpt", "y")),  # empty turn
        {"id": "no conversations"},
    ]
    convs = [m for m in map(D.to_messages, records) if m is not None]
    prompts = P.sharegpt_prompts(convs)  # every turn
    assert [s for s, _ in prompts] == ["sharegpt-first", "sharegpt-later", "sharegpt-later", "sharegpt-first",
                                       "sharegpt-first"]
    assert [[m["content"] for m in p] for _, p in prompts] == [
        ["Be brief.", "q1"], ["Be brief.", "q1", "a1", "q2"], ["Be brief.", "q1", "a1", "q2", "a2", "q3"],
        ["p1"], ["s1"]]
    for _, p in prompts:
        roles = [m["role"] for m in p if m["role"] != "system"]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    # The first two turns are the same prompts, without the third.
    assert P.user_turns(convs, 2) == [p for k, (_, p) in enumerate(prompts) if k != 2]
    prompts[0][1][0]["content"] = "changed"  # copies: the conversations are untouched
    assert convs[0][0]["content"] == "Be brief."
    with pytest.raises(ValueError, match="turns"):
        P.user_turns(convs, 0)


# ----------------------------------------------------------------------------- Magpie

def test_magpie_prefix_is_the_user_header(tokenizer):
    prefix = P.magpie_prefix(tokenizer)
    assert prefix == SMOLLM2_PREFIX  # the default system message, then the user header
    text = "Write a haiku about rain."
    rendered = tokenizer.apply_chat_template(user(text), tokenize=False)
    assert rendered == prefix + text + "<|im_end|>\n"
    ids = P.magpie_prefix_ids(tokenizer)
    full = tokenizer.apply_chat_template(user(text), tokenize=True, return_dict=False)
    assert list(full[:len(ids)]) == ids and len(full) > len(ids)
    assert tokenizer.decode(ids) == prefix


def test_parse_request(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    special = set(tokenizer.all_special_ids)

    def enc(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def parse(ids):
        return P.parse_request(ids, {eos}, special, tokenizer.decode)

    haiku = "Write a haiku about rain."
    assert parse(enc(f"  {haiku}\n") + [eos] + enc("ignored")) == (haiku, "parsed")
    assert parse(enc("Write a haiku about")) == (None, "unfinished")  # cut by its token budget
    assert parse(enc("Hi<|im_end|>\nmore") + [eos]) == ("Hi", "parsed")  # the first end of turn ends it
    assert parse(enc("Hi\n<|im_start|>assistant\nSure") + [eos]) == (None, "template_tokens")
    assert parse(enc(" \n\n ") + [eos]) == (None, "empty")
    assert P.clean_request("a\r\n\r\n\r\n\r\nb ") == "a\n\nb"


# ----------------------------------------------------------------------------- filters

def test_dedupe_length_and_language_filters():
    act = ("I want you to act as a Linux terminal. I will type commands and you will reply with what the "
           "terminal should show. ")
    assert len(P.normalize(act)) > P.PromptFilters().prefix_chars
    chat = lambda reply: [*user("Explain how a rainbow forms."), {"role": "assistant", "content": reply},
                          *user("continue")]
    cands = [
        ("sharegpt-first", user("Explain how a rainbow forms.")),  # kept
        ("sharegpt-first", user("  explain HOW a rainbow\n forms. ")),  # the same, normalised
        ("sharegpt-first", user(act + "My first command is pwd.")),  # kept
        ("sharegpt-first", user(act + "My first command is ls -la.")),  # same first 100 characters
        ("sharegpt-later", chat("Sunlight is refracted...")),  # kept
        ("sharegpt-later", chat("Raindrops split light...")),  # kept: another context
        ("sharegpt-later", chat("sunlight  is refracted...")),  # the first one's context and turn again
        ("magpie", user("Explain how a rainbow forms.")),  # a ShareGPT prompt again
        ("magpie", user("请解释彩虹是如何形成的。")),  # other scripts
        ("magpie", user("Объясни, как образуется радуга.")),
        ("magpie", user("Explique comment se forme un arc-en-ciel, s'il te plaît.")),  # Latin: kept
        ("magpie", user("Why?")),  # short
        ("magpie", user("12345678")),  # no letter
    ]
    kept, counts = P.select_prompts(cands, P.PromptFilters(), None)
    assert kept == [cands[i] for i in (0, 2, 4, 5, 10)]
    zero = dict.fromkeys(P.FILTERS, 0)
    assert counts["sharegpt-first"] == {"candidates": 4, **zero, "duplicate": 1, "near_duplicate": 1, "kept": 2}
    assert counts["sharegpt-later"] == {"candidates": 3, **zero, "duplicate": 1, "kept": 2}
    assert counts["magpie"] == {"candidates": 6, **zero, "duplicate": 1, "language": 3, "length": 1, "kept": 1}
    # Longer prefixes tell the two terminal prompts apart; no filters keep everything.
    assert cands[3] in P.select_prompts(cands, P.PromptFilters(prefix_chars=200), None)[0]
    kept, counts = P.select_prompts(cands, None, None)
    assert kept == cands and counts["magpie"]["kept"] == 6
    assert P.ascii_letter_share("Ça va très bien") == pytest.approx(10 / 12)
    assert P.ascii_letter_share("42 !") is None


def test_mtbench_exclusion(mtbench_all):
    guard = P.MTBenchGuard(mtbench_all)
    assert len(guard.turns) == 160
    turns = [t for q in mtbench_all for t in q["turns"]]
    first, second = turns[0], turns[11]
    assert guard.overlaps(first)
    assert guard.overlaps("  " + first.upper().replace(" ", "   ") + "!!")  # case, spacing and punctuation
    assert guard.overlaps(f"Please help me with this task. {second} Thank you so much.")  # holds a turn
    ws = first.split()
    assert guard.overlaps(" ".join(ws[len(ws) // 5:-len(ws) // 5]))  # inside a turn
    # Ten consecutive words of a long turn (three shared 8-grams) inside otherwise new text.
    longest = max(turns, key=lambda t: len(P.words(t)))
    piece = P.words(longest)[5:15]
    around = "my cousin asked me this yesterday evening and {} but i could not answer her at all"
    assert guard.overlaps(around.format(" ".join(piece)))
    assert not guard.overlaps(around.format(" ".join(piece[:7])))  # seven words: no shared 8-gram
    # One shared 8-gram in a long new text is under the threshold.
    filler = " ".join(f"word{i}" for i in range(200))
    assert not guard.overlaps(f"{filler} {' '.join(piece[:8])} {filler}")
    for text in ("continue", "more", "Write a travel blog post about Japan.", "Why is the sky blue?"):
        assert not guard.overlaps(text), text
    # In the selection: the copy and every later turn whose context holds it are dropped.
    cands = [("sharegpt-first", user(first)),
             ("sharegpt-later", [*user(first), {"role": "assistant", "content": "ok"}, *user("now shorter")]),
             ("sharegpt-first", user("Why is the sky blue?"))]
    kept, counts = P.select_prompts(cands, P.PromptFilters(), guard)
    assert kept == cands[2:]
    assert counts["sharegpt-first"]["mtbench"] == 1 and counts["sharegpt-later"]["mtbench"] == 1


# ----------------------------------------------------------------------------- temperatures

def test_temperature_mix_is_deterministic():
    plans = [R.temperature_plan(n, 3, 2, seed=0) for n in range(3000)]
    assert plans == [R.temperature_plan(n, 3, 2, seed=0) for n in range(3000)]
    assert all(len(p) == 2 and list(p) == sorted(set(p)) for p in plans)
    use = Counter(k for p in plans for k in p)
    assert all(abs(use[k] - 2000) < 120 for k in range(3)), use  # each temperature in 2 of 3 plans
    assert [R.temperature_plan(n, 3, 2, seed=1) for n in range(3000)] != plans
    one = Counter(R.temperature_plan(n, 3, 1, seed=0) for n in range(3000))
    assert sorted(one) == [(0,), (1,), (2,)] and min(one.values()) > 900
    assert R.temperature_plan(7, 3, None, 0) == R.temperature_plan(7, 3, 3, 0) == (0, 1, 2)
    seeds = {R.sampling_seed(0, n, 3, k) for n in range(1000) for k in range(3)}
    assert len(seeds) == 3000 and min(R.sampling_seed(1, n, 3, k) for n in range(1000) for k in range(3)) > max(seeds)


# ----------------------------------------------------------------------------- regeneration bookkeeping

class StandInLLM:
    """What regeneration uses of `LLM`, with replies made from the sampling seed alone (so a
    shard's replies do not depend on the other prompts): Magpie requests cycle through five
    texts (duplicates), and every 6th is unfinished; answers are 20 tokens, or 3 (too short)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.engine = SimpleNamespace(eos_token_ids=frozenset({self.eos}))
        self.prefix = P.magpie_prefix_ids(tokenizer)
        self.asked = []

    def generate_iter(self, requests):
        outs = []
        for j, (ids, params) in enumerate(requests):
            self.asked.append((list(ids), params))
            seed = params.seed % R.SEEDS_PER_DRAW
            if list(ids) == self.prefix:
                text = self.tokenizer(f"Tell me fact number {seed % 5} about the moon.",
                                      add_special_tokens=False)["input_ids"]
                reply = text if seed % 6 == 5 else [*text, self.eos]
            else:
                reply = [100 + seed % 50] * (3 if seed % 7 == 3 else 19) + [self.eos]
            outs.append((j, SimpleNamespace(token_ids=reply, error=None)))
        yield from reversed(outs)  # finishing out of order


def test_encode_prompts_matches_the_chat_template(tokenizer):
    prompts = [user("Hi there!"), [{"role": "system", "content": "Be brief."}, *user("What is 2 + 2?")],
               user("word " * 2000)]
    ids = R.encode_prompts(tokenizer, prompts, 64)
    for p, x in zip(prompts[:2], ids):
        assert x == list(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False))
    assert ids[2] is None


def _quiet(*a):
    pass


def test_self_distill_rows_seeds_and_provenance(tokenizer, mtbench_all):
    records = [record(("human", f"Question {i}: how do tides work near island {i}?"), ("gpt", "Tides..."),
                      ("human", "continue"), ("gpt", "More...")) for i in range(6)]
    records.append(record(("human", mtbench_all[0]["turns"][0]), ("gpt", "...")))
    convs = [D.to_messages(r) for r in records]
    read = {"records": 7, "usable": 7, "mtbench_exact": 0, "conversations": 7}
    spec = R.RegenerateSpec(max_prompt_tokens=96, max_new_tokens=24, temperatures=(0.0, 0.7, 1.0),
                            replies_per_prompt=2, turns=None, magpie=12)
    llm = StandInLLM(tokenizer)
    ex, prov = R.self_distill(llm, convs, read, 128, spec, mtbench=mtbench_all, progress=False, log=_quiet)
    # 12 requests: 2 unfinished (numbers 5, 11), 10 parsed, of which 5 distinct texts.
    assert prov["magpie"] == {"asked": 12, "parsed": 10, "unfinished": 2, "template_tokens": 0, "empty": 0}
    assert prov["prompts"]["magpie"]["duplicate"] == 5 and prov["prompts"]["magpie"]["kept"] == 5
    assert prov["prompts"]["sharegpt-first"]["mtbench"] == 1 and prov["prompts"]["sharegpt-first"]["kept"] == 6
    assert prov["prompts"]["sharegpt-later"]["kept"] == 6
    answered = [p for p in llm.asked if p[0] != llm.prefix]
    assert len(answered) == 2 * 17  # 17 prompts, two temperatures each
    assert [p.temperature for _, p in answered] == sorted(p.temperature for _, p in answered)  # temperature-major
    short = sum(t["short"] for t in prov["temperatures"])
    assert len(ex.tokens) == 34 - short == sum(r["rows"] for r in prov["regenerated"].values())
    assert sum(t["replies"] for t in prov["temperatures"]) == 34
    reply_tokens = sum(r["reply_tokens"] for r in prov["regenerated"].values())
    assert int(ex.loss_mask.sum()) == reply_tokens == 20 * len(ex.tokens)
    for row, mask, n in zip(ex.tokens, ex.loss_mask, ex.lengths):
        assert mask[:n].tolist() == [False] * (n - 20) + [True] * 20 and row[n - 1] == llm.eos
    text = R.format_provenance(prov)
    assert "magpie: 12 requests asked, 10 parsed (2 unfinished" in text and "temperature 0.7" in text

    # Two shards: the same rows (as a set) and seeds; their provenance merges to the whole one.
    parts = []
    for i in range(2):
        shard = dataclasses.replace(spec, shard=(i, 2))
        parts.append(R.self_distill(StandInLLM(tokenizer), convs, read, 128, shard, mtbench=mtbench_all,
                                    progress=False, log=_quiet))
    rows = lambda e: sorted(map(tuple, e.tokens.tolist()))
    assert rows(parts[0][0]) + rows(parts[1][0]) != [] and sorted(rows(parts[0][0]) + rows(parts[1][0])) == rows(ex)
    merged = R.merge_provenance([parts[1][1], parts[0][1]])
    assert merged["shards"] == [0, 1]
    assert merged["regenerated"] == prov["regenerated"]
    assert [{k: t[k] for k in ("asked", "replies", "tokens", "short")} for t in merged["temperatures"]] == [
        {k: t[k] for k in ("asked", "replies", "tokens", "short")} for t in prov["temperatures"]]
    other = {**parts[1][1], "prompts": {**parts[1][1]["prompts"], "magpie": {}}}
    with pytest.raises(D.DataError, match="different prompts"):
        R.merge_provenance([parts[0][1], other])


def test_provenance_and_magpie_files(tmp_path):
    prov = {"shards": [0], "of": 1, "sharegpt": {}, "magpie": None, "prompts": {}, "spec": {},
            "regenerated": {"magpie": {"rows": 2}}, "temperatures": []}
    data = tmp_path / "data_64.npz"
    assert R.write_provenance(prov, data) == tmp_path / "data_64.provenance.json"
    assert R.read_provenance([data]) == {**prov, "shards": [0]}
    assert R.read_provenance([data, tmp_path / "other.npz"]) is None  # one without provenance
    spec = R.RegenerateSpec(magpie=3)
    params = R.magpie_params(spec, SMOLLM2_PREFIX)
    recs = [{"n": n, "request": f"r{n}", "outcome": "parsed", "tokens": 4} for n in range(3)]
    R.write_magpie(tmp_path / "a.jsonl", params, [recs[0], recs[2]], shard=(0, 2))
    R.write_magpie(tmp_path / "b.jsonl", params, [recs[1]], shard=(1, 2))
    whole = R.merge_magpie([tmp_path / "b.jsonl", tmp_path / "a.jsonl"], tmp_path / "m.jsonl")
    assert R.read_magpie(whole, params) == recs
    with pytest.raises(D.DataError, match="other settings"):
        R.read_magpie(whole, {**params, "seed": 1})
    with pytest.raises(D.DataError, match="holds 2 of the 3"):
        R.read_magpie(tmp_path / "a.jsonl", params)
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(D.DataError, match="not a Magpie request file"):
        R.read_magpie(tmp_path / "bad.jsonl", params)


def test_regeneration_flags():
    ap = argparse.ArgumentParser()
    R.add_arguments(ap)
    parse = lambda *flags: R.spec_from_args(ap.parse_args(["--regenerate", *flags]))
    spec = parse("--regen-turns", "all", "--regen-temperatures", "0,0.7,1", "--regen-replies-per-prompt", "2",
                 "--magpie", "5")
    assert (spec.turns, spec.temperatures, spec.replies_per_prompt, spec.magpie, spec.filters) == (
        None, (0.0, 0.7, 1.0), 2, 5, P.PromptFilters())
    assert parse("--regen-turns", "2", "--no-prompt-filters").filters is None
    with pytest.raises(D.DataError, match="Magpie requests need the prompt filters"):
        parse("--magpie", "5", "--no-prompt-filters")
    assert parse("--min-ascii-letters", "0.8").filters == P.PromptFilters(min_ascii_letters=0.8)
    with pytest.raises(D.DataError, match=r"replies per prompt must be in 1\.\.3"):
        parse("--regen-temperatures", "0,0.7,1", "--regen-replies-per-prompt", "4")
    for bad in (["--regen-turns", "0"], ["--magpie", "-1"], ["--min-ascii-letters", "2"]):
        with pytest.raises(SystemExit):
            ap.parse_args(bad)
    assert json.loads(json.dumps(R.spec_record(spec))) == R.spec_record(spec)
    # Another draw asks for other Magpie requests too, unless their seed is given.
    assert (spec.seed, spec.magpie_seed) == (0, 0)
    assert parse("--regen-seed", "2").magpie_seed == 2
    assert parse("--regen-seed", "2", "--magpie-seed", "0").magpie_seed == 0


# ----------------------------------------------------------------------------- training

def test_chain_acceptance_proxy():
    hits = jnp.array([[[1, 1, 0, 1]], [[1, 0, 1, 1]], [[0, 0, 1, 1]]], bool)  # [S=3, B=1, T=4]
    valid = jnp.array([[1, 1, 1, 0]], bool)  # the last base's chain runs past the reply
    accept = np.asarray(O.chain_acceptance(hits, valid))
    np.testing.assert_allclose(accept, [2 / 3, 1 / 3, 0.0], rtol=1e-6)
    assert L.acceptance_length(accept.tolist(), 2) == pytest.approx(2.0)
    assert O.TTT_STEPS == 6


def test_chain_walk_counts_what_the_engine_counts():
    # Prompt x_0..x_2, reply x_3..x_9: base t is valid while x_{t+2} is a reply token (t = 1..7).
    valid = np.zeros((2, 12), bool)
    valid[0, 1:8] = True
    hits = np.zeros((3, 2, 12), bool)  # [S, B, T]
    hits[0, 0, [2, 5, 6]] = True
    hits[1, 0, [2, 3, 6]] = True
    hits[2, 0, 2] = True
    # The prefill gives x_3; iteration at base 2 accepts 2 of K=2 (x_4, x_5) and emits x_6; at
    # base 5 accepts 1 (x_7), emits x_8; at base 7 accepts none, emits x_9; base 8 is past the
    # reply. Step 1's hit at base 3 is never reached. Row 1 has no reply.
    iterations, emitted, accepted_at = O.chain_walk(hits, valid, 2)
    assert (iterations, emitted, accepted_at.tolist()) == (3, 6, [2, 1])
    # K=3: base 2 accepts all three (x_4..x_6) and emits x_7; base 6 accepts x_8 and x_9 (the
    # last token) and counts its bonus token too, as the engine counts before cutting at a stop.
    iterations, emitted, accepted_at = O.chain_walk(hits, valid, 3)
    assert (iterations, emitted, accepted_at.tolist()) == (2, 7, [2, 2, 1])
    # The uniform proxy over every valid base reads higher than the walk (bases 2, 5, 6 hit at step 0).
    assert float(O.chain_acceptance(jnp.asarray(hits[:2]), jnp.asarray(valid))[0]) == pytest.approx(3 / 7)


def test_early_stopping_stops_at_the_right_evaluation():
    losses = [3.0, 2.5, 2.4, 2.41, 2.39, 2.45, 2.5, 2.6, 2.2]

    def stop_at(values, patience, mode, min_delta=0.0):
        return next((i for i in range(len(values)) if L.should_stop(values[:i + 1], patience, mode, min_delta)), None)

    assert stop_at(losses, 3, "min") == 7 and L.best_evaluation(losses[:8], "min") == 4
    assert stop_at(losses, 3, "min", min_delta=0.02) == 5 and L.best_evaluation(losses[:6], "min", 0.02) == 2
    assert stop_at(losses, 0, "min") is None
    accept = [2.1, 2.4, 2.4, 2.3, 2.5, 2.45]
    assert stop_at(accept, 2, "max") == 3 and stop_at(accept, 3, "max") is None
    with pytest.raises(ValueError, match="mode"):
        L.best_evaluation(losses, "lowest")
