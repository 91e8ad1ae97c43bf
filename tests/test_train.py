"""Tests for eagle3_jax.train: ShareGPT reading, draft vocabulary, the TTT mask/shifts (also
against the inference draft path), loss going down, and exact orbax resume. CPU, tiny configs."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax.config import ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import draft_forward, draft_logits, fuse_captures
from eagle3_jax.train import data as D
from eagle3_jax.train import loop as L
from eagle3_jax.train import objective as O
from eagle3_jax.train import prompts as P
from eagle3_jax.train.config import TrainConfig

V, H = 64, 32


@pytest.fixture(scope="module")
def tiny():
    """A 4-layer random target (peaky logits), its drafter config and a draft vocabulary of 40."""
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=256, tie_word_embeddings=True).with_capture_layers((0, 2, 3))
    params = llama.init_params(cfg, jax.random.PRNGKey(0), jnp.float32)
    params = params.replace(embed=params.embed * 50.0)  # logits far from uniform: something to learn
    tokens = jax.random.randint(jax.random.PRNGKey(1), (4, 16), 0, V, jnp.int32)
    _, logits = jax.jit(O.target_pass, static_argnums=1)(params, cfg, tokens)
    counts = np.bincount(np.asarray(jnp.argmax(logits, -1)).ravel(), minlength=V)
    vocab = D.build_draft_vocab(counts + 1, 40)
    dcfg = L.draft_config_for(cfg, 40)
    dev_vocab = L.device_vocab(vocab)
    batch = {"tokens": tokens, "loss_mask": jnp.ones(tokens.shape, bool)}
    return cfg, params, dcfg, vocab, dev_vocab, batch


# ----------------------------------------------------------------------------- data

def test_read_truncated_json_array():
    records = [{"id": "a", "conversations": [{"from": "human", "value": "hi [1, 2]"},
                                             {"from": "gpt", "value": "hello, \"you\""}]},
               {"id": "b", "conversations": []}]
    text = json.dumps(records, indent=2)  # '[\n  {...},\n  {...}\n]'
    truncated = text[:-2] + ',\n  {"id": "c", "conversations": [{"from": "human", "va'  # cut mid-record
    assert D.read_json_array_prefix(text) == records
    assert D.read_json_array_prefix(truncated) == records
    assert D.read_json_array_prefix(text[:-2] + ",\n  ") == records
    assert D.read_json_array_prefix("[  ") == []


def test_load_sharegpt_counts(tmp_path):
    rec = {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    path = tmp_path / "s.json"
    path.write_text("[" + ",".join([json.dumps(rec)] * 3) + ', {"id": "y", "conv')
    assert len(D.load_sharegpt(path, expect=3)) == 3
    with pytest.raises(ValueError, match="expected 4"):
        D.load_sharegpt(path, expect=4)


def test_cut_copy_keeps_the_prompts(tmp_path):
    """A cut-down ShareGPT copy (cut_for_prompts) gives the same prompts as the full records for its
    number of turns, keeps every record, and reads back from .xz."""
    import lzma

    def turn(who, text):
        return {"from": who, "value": text}

    records = [{"id": "a", "conversations": [turn("human", "q1"), turn("gpt", "a1 " * 300), turn("human", "q2"),
                                             turn("gpt", "a2 " * 300), turn("human", "q3"), turn("gpt", "a3")]},
               {"id": "b", "conversations": [turn("system", "be brief"), turn("human", "q"), turn("gpt", "a")]},
               {"id": "c", "conversations": [turn("human", "q"), turn("bing", "x"), turn("human", "q2")]},
               {"id": "d", "conversations": [turn("gpt", "hello"), turn("human", "q"), turn("gpt", "r" * 500)]}]

    def prompts(recs, turns):
        return P.user_turns([m for m in map(D.to_messages, recs) if m is not None], turns)

    for turns in (1, 2):
        cut = [D.cut_for_prompts(r, turns) for r in records]
        assert len(cut) == len(records) and prompts(cut, turns) == prompts(records, turns)
        assert len(json.dumps(cut)) < len(json.dumps(records))
    cut = [D.cut_for_prompts(r, 1) for r in records]
    assert cut[0]["conversations"] == [turn("human", "q1"), turn("gpt", ("a1 " * 300)[:200])]
    assert D.to_messages(cut[2]) is None  # dropped in the full file, dropped in the copy
    path = tmp_path / "s.json.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump(cut, f)
    assert D.load_sharegpt(path, expect=4) == cut


def test_to_messages_roles():
    conv = lambda *turns: {"conversations": [{"from": f, "value": v} for f, v in turns]}
    assert D.to_messages(conv(("gpt", "hi"), ("human", "q"), ("chatgpt", "a"), ("user", "q2"))) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]  # leading gpt, odd tail dropped
    assert D.to_messages(conv(("system", "be nice"), ("human", "q"), ("gpt", "a")))[0]["role"] == "system"
    assert D.to_messages(conv(("human", "q"), ("bing", "a"))) is None  # unknown speaker
    assert D.to_messages(conv(("human", "q"), ("gpt", "  "))) is None  # empty answer
    assert D.to_messages(conv(("human", "q"), ("gpt", "a"), ("gpt", "b"))) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]  # broken alternation
    assert D.to_messages({"conversations": []}) is None


def test_drop_mtbench():
    convs = [[{"role": "user", "content": "Compose an  engaging travel blog"}, {"role": "assistant", "content": "x"}],
             [{"role": "user", "content": "other"}, {"role": "assistant", "content": "y"}]]
    kept, dropped = D.drop_mtbench(convs, [{"turns": ["compose an engaging travel blog", "t2"]}])
    assert dropped == 1 and kept == convs[1:]


@pytest.mark.slow
def test_regenerated_examples_are_the_targets_replies(target_llm):
    """Self-distillation data: each row is the chat prompt plus the target's own greedy reply,
    the loss mask covers exactly the reply; over-long prompts are skipped."""
    from eagle3_jax.sampling_params import SamplingParams
    from eagle3_jax.train import regenerate as R

    convs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
              {"role": "assistant", "content": "Blue."}],
             [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"},
              {"role": "user", "content": "Again."}, {"role": "assistant", "content": "1 2 3"}],
             [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok"}]]
    prompts = P.user_turns(convs)
    assert [[m["role"] for m in p] for p in prompts] == [["system", "user"], ["user"], ["user"]]
    # Later turns come with everything before them; a conversation with fewer turns gives fewer.
    later = P.user_turns(convs, turns=2)
    assert [[m["content"] for m in p] for p in later] == [
        ["Be brief.", "Name a colour."], ["Count to three."], ["Count to three.", "1 2 3", "Again."], ["word " * 200]]
    with pytest.raises(ValueError, match="turns"):
        P.user_turns(convs, turns=0)
    # Each prompt once greedy, once sampled: rows are (prompt 0 greedy, prompt 0 sampled, prompt 1 ...).
    ex = R.regenerate_examples(target_llm, prompts, 96, max_prompt_tokens=64, max_new_tokens=8,
                               temperatures=(0.0, 1.0), min_reply_tokens=1, progress=False, log=lambda *a: None)
    assert len(ex.tokens) == 4  # the 200-word prompt is over 64 tokens
    for i, prompt in enumerate(prompts[:2]):
        ids = target_llm.encode(prompt)
        for k, temperature in enumerate((0.0, 1.0)):
            row = 2 * i + k
            # The seed regenerate_examples gives (prompt i, temperature k): the same reply again.
            params = SamplingParams(max_tokens=8, temperature=temperature, seed=2 * i + k)
            reply = target_llm.generate([ids], params)[0].token_ids
            n = len(ids) + len(reply)
            assert ex.lengths[row] == n
            assert ex.tokens[row, :n].tolist() == ids + reply
            assert ex.loss_mask[row].tolist() == [False] * len(ids) + [True] * len(reply) + [False] * (96 - n)
    # Another draw (seed 1, as a continued training run asks): the greedy reply stays, the sampled
    # one comes from the seed's own range.
    again = R.regenerate_examples(target_llm, prompts[:1], 96, max_prompt_tokens=64, max_new_tokens=8,
                                  temperatures=(0.0, 1.0), min_reply_tokens=1, seed=1, progress=False,
                                  log=lambda *a: None)
    assert again.tokens[0].tolist() == ex.tokens[0].tolist()
    ids = target_llm.encode(prompts[0])
    reply = target_llm.generate([ids], SamplingParams(max_tokens=8, temperature=1.0, seed=R.SEEDS_PER_DRAW + 1))
    assert again.tokens[1, :len(ids) + len(reply[0].token_ids)].tolist() == ids + reply[0].token_ids


def test_data_files_concatenate_in_order(tmp_path):
    """Regeneration shards written by separate processes are read back as one dataset, in order;
    a missing shard or a different row length is an error, not silently less data."""
    from eagle3_jax.train.loop import load_examples

    parts = [D.pad_examples([(np.full(n, n, np.int32), np.ones(n, bool))], 8, 0) for n in (3, 5)]
    paths = [tmp_path / f"shard{i}.npz" for i in range(2)]
    for ex, path in zip(parts, paths):
        D.save_examples(ex, path)
    ex = load_examples("unused", "unused", 8, None, paths, None, log=lambda *a: None)
    assert ex.lengths.tolist() == [3, 5] and ex.tokens[1].tolist() == [5] * 5 + [0] * 3
    with pytest.raises(FileNotFoundError, match="shard2"):
        load_examples("unused", "unused", 8, None, [*paths, tmp_path / "shard2.npz"], None)
    D.save_examples(D.pad_examples([(np.ones(2, np.int32), np.ones(2, bool))], 4, 0), paths[1])
    with pytest.raises(ValueError, match="different row lengths"):
        load_examples("unused", "unused", 8, None, paths, None)


def test_draft_vocab_toy():
    counts = np.array([5, 0, 3, 3, 9, 1])
    v = D.build_draft_vocab(counts, 3)
    np.testing.assert_array_equal(v.used, [0, 2, 4])  # 4 (9), 0 (5), then 2 beats 3 on the tie
    np.testing.assert_array_equal(v.d2t, [0, 1, 2])  # target id = draft id + d2t
    np.testing.assert_array_equal(v.t2d, [True, False, True, False, True, False])
    assert v.coverage == pytest.approx(17 / 21)
    np.testing.assert_array_equal(np.arange(3) + v.d2t, v.used)
    assert D.coverage_table(counts, (1, 3, 6)) == {1: pytest.approx(9 / 21), 3: pytest.approx(17 / 21), 6: 1.0}


def test_batches_deterministic_one_epoch():
    ex = D.pad_examples([(np.full(n, n, np.int32), np.ones(n, bool)) for n in range(1, 11)], 4, 0)
    assert ex.tokens.shape == (10, 4) and ex.lengths.tolist() == [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]
    a, b = D.Batches(ex, 3, seed=1).at(7), D.Batches(ex, 3, seed=1).at(7)
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    batches = D.Batches(ex, 3, seed=1)
    assert batches.per_epoch == 3 and batches.shapes() == [(3, 4)]
    rows = np.concatenate([batches.at(s)["tokens"][:, 0] for s in range(3)])  # one epoch
    assert len(set(rows.tolist())) == 9  # no row twice within an epoch


def test_batches_by_length_bucket():
    # 12 rows of lengths 1..12 in rows of 12; buckets 4, 8, 12: rows 1-4, 5-8, 9-12.
    lengths = list(range(1, 13))
    ex = D.pad_examples([(np.full(n, n, np.int32), np.ones(n, bool)) for n in lengths], 12, 0)
    batches = D.Batches(ex, 1, seed=3, buckets=(4, 8, 12))
    # One full-width row's 12 token slots: 3 rows of 4, 1 row of 8 (12 // 8), 1 row of 12.
    assert batches.rows_per_batch == (3, 1, 1)
    assert batches.shapes() == [(3, 4), (1, 8), (1, 12)]
    assert batches.per_epoch == 1 + 4 + 4 and batches.share() == [1 / 9, 4 / 9, 4 / 9]
    seen = []
    for s in range(batches.per_epoch):
        b = batches.at(s)
        t = b["tokens"].shape[1]
        assert t in (4, 8, 12) and b["loss_mask"].shape == b["tokens"].shape
        ids = b["tokens"][:, 0]  # each row is filled with its length
        assert all(t - 4 < n <= t for n in ids)  # every row in the shortest bucket it fits
        np.testing.assert_array_equal(b["tokens"], ex.tokens[ids - 1, :t])  # cut, not changed
        seen += ids.tolist()
    # An epoch covers every row once, but one of bucket 4's four rows: the remainder of 3 per batch.
    assert len(seen) == len(set(seen)) == 11 and set(range(5, 13)) <= set(seen)
    assert [batches.at(s)["tokens"].shape for s in range(9)] != [batches.at(9 + s)["tokens"].shape for s in range(9)]
    with pytest.raises(ValueError, match="reach the row width"):
        D.Batches(ex, 1, seed=0, buckets=(4, 8))


def test_assistant_mask_chatml():
    from pathlib import Path

    from eagle3_jax.assets import DEFAULT_TARGET

    if not (Path(DEFAULT_TARGET) / "tokenizer.json").is_file():
        pytest.skip("SmolLM2 tokenizer not prepared")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(DEFAULT_TARGET))
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4 \n"}]
    text, spans = D.assistant_spans(tok, msgs)
    assert [text[a:b] for a, b in spans] == ["Hello! How can I help?<|im_end|>", " 4 \n<|im_end|>"]
    assert spans == D._prefix_spans(tok, msgs, text)
    (ids, mask), = D.tokenize_conversations(tok, [msgs], 4096)
    assert tok.decode(ids[mask]) == "Hello! How can I help?<|im_end|> 4 \n<|im_end|>"
    (ids8, mask8), = D.tokenize_conversations(tok, [msgs], 8)
    np.testing.assert_array_equal(ids8, ids[:8])
    np.testing.assert_array_equal(mask8, mask[:8])


# ----------------------------------------------------------------------------- TTT mask and shifts

def test_ttt_visibility_exact():
    m = O.ttt_visibility(4, 2)
    step0 = np.tril(np.ones((4, 4), bool))
    expected = np.concatenate([step0, np.eye(4, dtype=bool), np.eye(4, dtype=bool)], axis=1)
    np.testing.assert_array_equal(m, expected)
    # Query base 2 at step 2: step-0 keys 0..2, step-1 key at 2, step-2 key at 2.
    np.testing.assert_array_equal(np.flatnonzero(m[2]), [0, 1, 2, 6, 10])
    np.testing.assert_array_equal(O.ttt_visibility(4, 0), step0)


def test_step_targets_exact():
    t = 6
    tokens = jnp.arange(10, 10 + t, dtype=jnp.int32)[None]  # x_i = 10 + i
    loss_mask = jnp.array([[False, True, True, True, True, True]])
    in_vocab = jnp.array([[True, True, True, False, True, True]])
    p = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32)[None, :, None], (1, t, 3))  # p[t] tagged t
    got = [O.step_targets(tokens, loss_mask, p, in_vocab, j) for j in range(3)]
    # step j, base t: input x_{t+1+j}, target the target's logits at t+1+j, mask token t+2+j.
    np.testing.assert_array_equal(got[0][0][0], [11, 12, 13, 14, 15, 0])
    np.testing.assert_array_equal(got[1][0][0], [12, 13, 14, 15, 0, 0])
    np.testing.assert_array_equal(got[2][0][0], [13, 14, 15, 0, 0, 0])
    np.testing.assert_array_equal(got[0][1][0, :, 0], [1, 2, 3, 4, 5, 0])
    np.testing.assert_array_equal(got[2][1][0, :, 0], [3, 4, 5, 0, 0, 0])
    np.testing.assert_array_equal(got[0][3][0], [True, True, True, True, False, False])  # assistant x_{t+2}
    np.testing.assert_array_equal(got[0][2][0], [True, True, False, True, False, False])  # & in_vocab[t+1]
    np.testing.assert_array_equal(got[1][2][0], [True, False, True, False, False, False])
    np.testing.assert_array_equal(got[2][2][0], [False, True, False, False, False, False])


def test_ttt_attention_matches_dense_mask():
    b, t, h, kvh, hd, steps = 2, 5, 4, 2, 8, 3
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 10))
    rnd = lambda *s: jax.random.normal(next(keys), s, jnp.float32)
    q = rnd(b, t, h, hd)
    ks = [rnd(b, t, kvh, hd) for _ in range(steps)]
    vs = [rnd(b, t, kvh, hd) for _ in range(steps)]
    got = jax.jit(O.ttt_attention)(q, ks[0], vs[0], tuple(ks[1:]), tuple(vs[1:]))
    # Dense reference: all steps' keys side by side under ttt_visibility.
    k_all = jnp.repeat(jnp.concatenate(ks, 1), h // kvh, axis=2)  # [B, S*T, H, hd]
    v_all = jnp.repeat(jnp.concatenate(vs, 1), h // kvh, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k_all) / math.sqrt(hd)
    scores = jnp.where(O.ttt_visibility(t, steps - 1), scores, -jnp.inf)
    want = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v_all)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_ttt_equals_inference_chain(tiny):
    """TTT step j at base t == prefill of x_0..x_t then j single-token chain steps (paged cache)."""
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    dp = L.draft_params(L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2)),
                        dev_vocab["d2t"], jnp.float32)
    tokens = batch["tokens"][:2]
    captures, _ = jax.jit(O.target_pass, static_argnums=1)(params, cfg, tokens)
    hs = jax.jit(O.ttt_hiddens, static_argnums=(1, 5))(dp, dcfg, params.embed, captures, tokens, 3)
    forward = jax.jit(draft_forward, static_argnums=1)
    for t in (0, 5, 11):
        b = tokens.shape[0]
        cache, table = O.row_pages(b, 32, 1, dcfg.num_kv_heads, dcfg.head_dim, jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(t + 1), (b, t + 1))
        h, cache = forward(dp, dcfg, params.embed, tokens[:, 1:t + 2], fuse_captures(dp, captures[:, :t + 1]),
                                 pos, cache, table)
        np.testing.assert_allclose(h[:, t], hs[0][:, t], rtol=1e-4, atol=1e-4)
        h = h[:, t:t + 1]
        for j in (1, 2):
            h, cache = forward(dp, dcfg, params.embed, tokens[:, t + 1 + j:t + 2 + j], h,
                                     jnp.full((b, 1), t + j), cache, table)
            np.testing.assert_allclose(h[:, 0], hs[j][:, t], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_chain_walk_over_the_ttt_hits_counts_what_the_engine_counted(tiny_models):
    """The engine's greedy replies (a chain of 3, f32), then the training's evaluation over the
    same rows: `objective.chain_walk` of its hits gives each reply's iterations exactly, and its
    accepted drafts short only by what the last iteration accepted past max_tokens."""
    from eagle3_jax import LLM, SamplingParams
    from eagle3_jax.config import EngineConfig
    from eagle3_jax.weights.llama import load_llama

    target_dir, drafters = tiny_models
    k, max_tokens = 3, 40
    llm = LLM(target_dir, drafters["shared"], num_speculative_tokens=k, warmup=False, progress=False,
              engine_config=EngineConfig(batch_buckets=(4,), prefill_buckets=(16,), max_model_len=64,
                                         speculation="always", freeze_heap=False))
    prompts = [[(5 * i + j) % 12 for j in range(3 + 4 * i)] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    tcfg, target = load_llama(target_dir, dtype=jnp.float32)
    dcfg, trainable, d2t = L.load_init_drafter(drafters["shared"], tcfg)
    tcfg = tcfg.with_capture_layers(dcfg.capture_layer_ids) if dcfg.capture_layer_ids else tcfg
    vocab = L.device_vocab(D.vocab_from_d2t(d2t, np.zeros(tcfg.vocab_size)))
    evaluate = L.make_eval_step(tcfg, dcfg, L.HParams(steps=1, batch_size=4, seq_len=64, ttt_steps=k), jnp.float32)
    rows = D.pad_examples([(np.asarray([*p, *o.token_ids], np.int32), np.arange(len(p) + max_tokens) >= len(p))
                           for p, o in zip(prompts, outputs)], 64, 0)
    m = jax.device_get(evaluate(trainable, target, vocab, {"tokens": rows.tokens, "loss_mask": rows.loss_mask}))
    accepted_some = 0
    for r, o in enumerate(outputs):
        iterations, emitted, accepted_at = O.chain_walk(m["hits"][:, r:r + 1], m["valid"][r:r + 1], k)
        assert iterations == o.metrics.iterations
        assert 0 <= o.metrics.emitted - emitted <= k
        assert all(0 <= a - b <= 1 for a, b in zip(o.metrics.accepted_at, accepted_at.tolist()))
        accepted_some += int(accepted_at.sum())
    assert accepted_some > 0  # the walk saw accepted drafts, not only misses


def test_reach_mask_counts_only_what_inference_reaches(tiny):
    """With reach_top_k = k, step j's loss is the CE over the bases where every earlier step had
    the data's next token within its top k; accuracy stays over every base."""
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    dp = L.draft_params(L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2)),
                        dev_vocab["d2t"], jnp.float32)
    tokens, loss_mask = batch["tokens"], batch["loss_mask"]
    captures, logits = jax.jit(O.target_pass, static_argnums=1)(params, cfg, tokens)
    p, in_vocab = O.target_distribution(logits, dev_vocab["used"], dev_vocab["t2d"])
    ids = O.draft_ids_of(tokens, dev_vocab["used"], V)
    np.testing.assert_array_equal(np.asarray(ids), [[list(vocab.used).index(x) if x in vocab.used else -1
                                                     for x in row] for row in np.asarray(tokens)])
    steps = 3
    hs = O.ttt_hiddens(dp, dcfg, params.embed, captures, tokens, steps)
    loss = jax.jit(O.ttt_loss, static_argnums=(1, 8, 9, 11))
    metrics = {k: loss(dp, dcfg, params.embed, captures, tokens, loss_mask, p, in_vocab, steps, 0.8, ids, k)[1]
               for k in (0, 12, 30)}  # of 40: the tokens are random, the draft untrained
    plain = metrics[0]
    for k in (12, 30):
        got = metrics[k]
        reach = np.ones(tokens.shape, bool)
        for j in range(steps):
            _, step_p, mask, _ = O.step_targets(tokens, loss_mask, p, in_vocab, j)
            lg = np.asarray(draft_logits(dp, dcfg, hs[j]), np.float64)
            log_q = lg - lg.max(-1, keepdims=True)
            log_q -= np.log(np.exp(log_q).sum(-1, keepdims=True))
            ce = -(np.asarray(step_p) * log_q).sum(-1)
            counted = np.asarray(mask) & reach
            assert counted.sum() > 0 and (j == 0 or counted.sum() < np.asarray(mask).sum())
            np.testing.assert_allclose(got["loss_steps"][j], ce[counted].mean(), rtol=1e-5)
            nxt = np.asarray(O.shift_left(ids, 2 + j, -1))
            better = (lg > np.take_along_axis(lg, np.maximum(nxt, 0)[..., None], -1)).sum(-1)
            reach &= (nxt >= 0) & (better < k)
        np.testing.assert_array_equal(got["acc_steps"], plain["acc_steps"])
        np.testing.assert_array_equal(got["accept_steps"], plain["accept_steps"])
        assert float(got["loss_steps"][0]) == pytest.approx(float(plain["loss_steps"][0]))
    # The train step passes the draft ids and k through (HParams.reach_top_k).
    hp = L.HParams(steps=1, batch_size=4, seq_len=16, ttt_steps=steps, reach_top_k=12)
    state = L.init_state(L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2)), hp)
    _, m = L.make_train_step(cfg, dcfg, hp, jnp.float32)(state, params, dev_vocab, batch, 0.0)
    np.testing.assert_allclose(m["loss_steps"], metrics[12]["loss_steps"], rtol=1e-5)


# ----------------------------------------------------------------------------- training

@pytest.fixture(scope="module")
def trainer(tiny):
    """(hparams, jitted train step), compiled once for the training tests."""
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    hp = L.HParams(steps=30, batch_size=4, seq_len=16, lr=3e-3, ttt_steps=3, warmup_frac=0.05)
    return hp, L.make_train_step(cfg, dcfg, hp, jnp.float32)


def _fresh_state(tiny, hp):
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    return L.init_state(L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2)), hp)


def test_training_lowers_loss(tiny, trainer):
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    hp, step = trainer
    state = _fresh_state(tiny, hp)
    losses = []
    for s in range(hp.steps):
        state, m = step(state, params, dev_vocab, batch, L.learning_rate(s, hp))
        losses.append(float(m["loss"]))
    assert all(np.isfinite(losses))
    assert losses[-1] < 0.6 * losses[0], losses
    assert m["acc_steps"].shape == (3,) and float(m["acc_steps"][0]) > 0.3


def test_resume_is_exact(tiny, trainer, tmp_path):
    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    hp, step = trainer
    state = _fresh_state(tiny, hp)
    batches = [jax.tree.map(lambda x, s=s: jnp.roll(x, s, axis=1), batch) for s in range(4)]
    for s in range(2):
        state, _ = step(state, params, dev_vocab, batches[s], L.learning_rate(s, hp))
    manager = L.checkpoint_manager(tmp_path / "ckpt")
    L.save_state(manager, state)
    template = jax.tree.map(jnp.copy, state)
    state, _ = step(state, params, dev_vocab, batches[2], L.learning_rate(2, hp))
    straight = jax.device_get(state)

    restored = L.restore_state(L.checkpoint_manager(tmp_path / "ckpt"), template)
    assert int(restored["step"]) == 2
    restored, _ = step(restored, params, dev_vocab, batches[2], L.learning_rate(2, hp))
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(jax.device_get(restored))):
        np.testing.assert_array_equal(a, b)


def test_learning_rate_schedule():
    hp = L.HParams(steps=100, batch_size=1, seq_len=8, lr=1.0, warmup_frac=0.1, final_lr_frac=0.1)
    assert L.learning_rate(0, hp) == pytest.approx(0.1)
    assert L.learning_rate(9, hp) == pytest.approx(1.0)
    assert L.learning_rate(99, hp) == pytest.approx(0.1, abs=1e-3)
    assert L.learning_rate(55, hp) == pytest.approx(0.55)  # half-way through the cosine


def test_export_loads(tiny, tmp_path):
    from eagle3_jax.weights.eagle3 import load_drafter

    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    trainable = L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2))
    from eagle3_jax.weights.eagle3 import save_drafter

    save_drafter(L.draft_params(trainable, dev_vocab["d2t"], jnp.float32), dcfg, tmp_path / "d")
    lcfg, lp = load_drafter(tmp_path / "d", target=cfg, dtype=jnp.float32)
    assert lcfg.draft_vocab_size == 40
    np.testing.assert_array_equal(np.arange(40) + np.asarray(lp.d2t), vocab.used)
    np.testing.assert_allclose(lp.lm_head, trainable["lm_head"], rtol=1e-3, atol=1e-3)


def test_a_widened_mlp_computes_what_it_did(tiny):
    """--draft-intermediate-size: the drafter starts from the target's last-layer MLP in its first
    units and zero down rows in the rest, so its TTT loss and accuracies at step 0 equal those of
    the drafter at the target's width; narrowing is refused."""
    from eagle3_jax.config import ConfigError

    cfg, params, dcfg, vocab, dev_vocab, batch = tiny
    wide = L.draft_config_for(cfg, 40, intermediate_size=160)
    assert (dcfg.intermediate_size, wide.intermediate_size) == (64, 160)
    narrow_w = L.init_draft_from_target(params, dcfg, vocab.used, jax.random.PRNGKey(2))
    wide_w = L.init_draft_from_target(params, wide, vocab.used, jax.random.PRNGKey(2))
    last = params.layers[-1]
    assert wide_w["w_gate_up"].shape == (cfg.hidden_size, 2, 160) and wide_w["w_down"].shape == (160, cfg.hidden_size)
    np.testing.assert_array_equal(wide_w["w_gate_up"][:, :, :64], last.w_gate_up)
    np.testing.assert_array_equal(wide_w["w_down"][:64], last.w_down)
    assert not np.asarray(wide_w["w_down"][64:]).any() and np.asarray(wide_w["w_gate_up"][:, :, 64:]).std() > 0.01
    hp = L.HParams(steps=1, batch_size=4, seq_len=16, ttt_steps=3)
    got = L.make_eval_step(cfg, wide, hp, jnp.float32)(wide_w, params, dev_vocab, batch)
    want = L.make_eval_step(cfg, dcfg, hp, jnp.float32)(narrow_w, params, dev_vocab, batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_array_equal(got["acc_steps"], want["acc_steps"])
    with pytest.raises(ConfigError, match="can only be widened: 32 units asked, it has 64"):
        L.widen_mlp(narrow_w["w_gate_up"], narrow_w["w_down"], 32, jax.random.PRNGKey(0))
    # A drafter whose MLP starts random (or from "head") may be any width: nothing is read to check it.
    for init in ("random", "head"):
        L.check_shape("no such target", init, None, 32)
        narrow = L.init_draft_from_target(params, L.draft_config_for(cfg, 40, 32), vocab.used, jax.random.PRNGKey(2),
                                          init)
        assert narrow["w_down"].shape == (32, cfg.hidden_size)


def test_a_narrowed_vocabulary_keeps_the_most_frequent_of_its_tokens():
    """--draft-vocab-size below an init drafter's: the data's most frequent of its tokens (ties to
    the lower id; never a token outside it, however frequent), and their lm_head columns."""
    from eagle3_jax.config import ConfigError

    counts = np.zeros(12, np.int64)
    counts[[1, 3, 5, 7, 9]] = [100, 5, 0, 5, 10]  # token 1 is frequent but not the drafter's
    old = D.vocab_from_d2t(np.array([3, 4, 5, 6]), counts)  # target ids 3, 5, 7, 9
    new = L.narrow_vocab(old, counts, 2)
    np.testing.assert_array_equal(new.used, [3, 9])
    np.testing.assert_array_equal(new.d2t, [3, 8])
    assert new.coverage == pytest.approx(15 / 120)
    lm_head = jnp.arange(8.0).reshape(2, 4)  # [H, N]: column j is draft id j's
    np.testing.assert_array_equal(L.lm_head_columns(lm_head, old.used, new.used), [[0.0, 3.0], [4.0, 7.0]])
    with pytest.raises(ConfigError, match="can only be narrowed: 5 tokens asked, it has 4"):
        L.narrow_vocab(old, counts, 5)


@pytest.mark.slow
def test_training_continues_from_a_drafter(tmp_path):
    """--init DIR: training starts at that drafter's weights and keeps its vocabulary, shape and
    capture layers (here with lr 0, so the export must equal the input), whatever the data's most
    frequent tokens are. With lr 0 the held-out loss never improves: early stopping with patience 2
    stops at the third evaluation and writes the first's drafter. Continued with a wider MLP, the
    drafter keeps every weight and the new units' down rows are zero."""
    from safetensors.numpy import load_file

    from eagle3_jax.bench.phases import write_random_models
    from eagle3_jax.config import ConfigError, DraftConfig
    from eagle3_jax.weights.eagle3 import load_drafter

    tiny = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                       num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=128, tie_word_embeddings=False, eos_token_ids=(2,))
    draft_cfg = DraftConfig.like_target(tiny, 64, capture_layer_ids=(0, 1, 3))
    target, drafter = write_random_models(tiny, draft_cfg, tmp_path)
    rng = np.random.default_rng(0)  # replies made of ids 128..255: none in the drafter's vocabulary 0..63
    pairs = [(rng.integers(128, 256, 24).astype(np.int32), np.arange(24) >= 8) for _ in range(12)]
    D.save_examples(D.pad_examples(pairs, 32, 0), tmp_path / "data.npz")
    out = tmp_path / "continued"
    rec = L.train_drafter(target, out, TrainConfig(steps=6, batch_size=2, seq_len=32, lr=0.0, init=str(drafter),
                                                   mtbench=None, data_cache=tmp_path / "data.npz", eval_rows=2,
                                                   log_dir=tmp_path / "log", ckpt_every=1, patience=2, progress=False))
    assert rec["vocab"] == {"size": 64, "coverage": 0.0}
    assert [e["step"] for e in rec["evals"]] == [1, 2, 3] and rec["stopped_early"] and rec["eval"]["step"] == 1
    assert len({e["loss"] for e in rec["evals"]}) == 1 and len(rec["eval"]["accept_steps"]) == O.TTT_STEPS
    assert rec["eval"]["walk_lengths"] == [1.0] * O.TTT_STEPS  # no reply token is a draft token: every draft missed
    before, after = load_file(drafter / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_array_equal(before[name], after[name], err_msg=name)
    assert json.loads((out / "config.json").read_text()) == json.loads((drafter / "config.json").read_text())
    # A wider MLP and a narrower vocabulary from the same drafter (lr 0): its first 64 units, the
    # lm_head rows of the 32 tokens kept (none in the data: the lowest ids) and every other weight
    # as they were, the new units' down rows zero; the config says so, and it loads for the target.
    reshaped = tmp_path / "reshaped"
    L.train_drafter(target, reshaped, TrainConfig(steps=2, batch_size=2, seq_len=32, lr=0.0, init=str(drafter),
                                                  mtbench=None, data_cache=tmp_path / "data.npz", eval_rows=2,
                                                  log_dir=tmp_path / "log3", intermediate_size=96, draft_vocab_size=32,
                                                  progress=False))
    grown = load_file(reshaped / "model.safetensors")
    config = json.loads((reshaped / "config.json").read_text())
    assert (config["intermediate_size"], config["draft_vocab_size"]) == (96, 32)
    down, gate, up = (f"midlayer.mlp.{n}_proj.weight" for n in ("down", "gate", "up"))
    np.testing.assert_array_equal(grown[down][:, :64], before[down])
    assert not grown[down][:, 64:].any() and grown[gate].shape == grown[up].shape == (96, 32)
    for name in (gate, up):
        np.testing.assert_array_equal(grown[name][:64], before[name], err_msg=name)
    np.testing.assert_array_equal(grown["lm_head.weight"], before["lm_head.weight"][:32])
    np.testing.assert_array_equal(grown["d2t"], np.zeros(32))
    np.testing.assert_array_equal(np.flatnonzero(grown["t2d"]), np.arange(32))
    for name in before.keys() - {down, gate, up, "lm_head.weight", "d2t", "t2d"}:
        np.testing.assert_array_equal(grown[name], before[name], err_msg=name)
    lcfg = load_drafter(reshaped, target=tiny, dtype=jnp.float32)[0]
    assert (lcfg.intermediate_size, lcfg.draft_vocab_size) == (96, 32)
    # A shape that cannot be made is refused before the data (here: no such file) is read.
    for init, shape, message in [(str(drafter), dict(intermediate_size=48), "only be widened from its 64 units"),
                                 ("target", dict(intermediate_size=32), "only be widened from its 64 units"),
                                 (str(drafter), dict(draft_vocab_size=65), "only be narrowed from its 64 tokens")]:
        with pytest.raises(ConfigError, match=message):
            L.train_drafter(target, tmp_path / "no", TrainConfig(steps=1, init=init, mtbench=None,
                                                                 data_cache=tmp_path / "none.npz",
                                                                 log_dir=tmp_path / "log4", progress=False, **shape))
    with pytest.raises(FileNotFoundError, match="config"):
        L.train_drafter(target, out, TrainConfig(steps=1, batch_size=2, seq_len=32, init=str(tmp_path / "nothing"),
                                                 mtbench=None, data_cache=tmp_path / "data.npz",
                                                 log_dir=tmp_path / "log2", progress=False))
