"""The Python API as vLLM's: `chat` applies the chat template, `generate` takes text as it is;
`n` samples in `RequestOutput.outputs`; `Engine.abort`; and the server's pieces without HTTP:
its engine thread's drain, and its streamed text, which must add up to the final text. A tiny
random target with a byte tokenizer (conftest's `chat_models`)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from eagle3_jax import SamplingParams
from eagle3_jax.serve.detokenize import TextStream


@pytest.fixture(scope="module")
def llm(chat_models):
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    target, draft = chat_models
    cfg = EngineConfig(batch_buckets=(1, 8), prefill_buckets=(64,), prefill_batch_buckets=(1,), max_model_len=128,
                       speculation="always", freeze_heap=False)
    return LLM(target, draft, num_speculative_tokens=3, tree=None, engine_config=cfg, warmup=False, progress=False)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_generate_takes_raw_text_and_chat_applies_the_template(llm):
    params = SamplingParams(max_tokens=8)
    raw = llm.tokenizer("Hello there").input_ids
    templated = llm.tokenizer.apply_chat_template(user("Hello there"), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    assert len(templated) > len(raw)
    (text,) = llm.generate("Hello there", params)
    assert text.prompt_token_ids == raw and text.token_ids == llm.generate([raw], params)[0].token_ids
    chats = llm.chat([user("Hello there"), user("Bye")], params)
    assert chats[0].prompt_token_ids == list(templated)
    assert chats[0].token_ids == llm.generate([list(templated)], params)[0].token_ids
    assert llm.chat(user("Bye"), params)[0].token_ids == chats[1].token_ids  # one conversation, or a list of them
    (bad,) = llm.chat([[{"role": "user"}]], params)
    assert bad.finish_reason == "error" and "'role' and a 'content'" in bad.error
    with pytest.raises(TypeError, match=r"LLM\.generate takes raw text"):
        llm.chat("Hello there")


@pytest.mark.slow
def test_n_samples_come_in_outputs_each_seeded_seed_plus_i(llm):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3)
    (out,) = llm.generate(["Pick"], params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    alone = [llm.generate(["Pick"], SamplingParams(max_tokens=8, temperature=1.0, seed=11 + i))[0].token_ids
             for i in range(3)]
    assert [o.token_ids for o in out.outputs] == alone and len({tuple(a) for a in alone}) == 3
    assert (out.token_ids, out.text, out.finish_reason) == (alone[0], out.outputs[0].text, out.outputs[0].finish_reason)
    grouped = dict(llm.generate_iter([("Pick", params), ("Other", SamplingParams(max_tokens=4))]))
    assert [o.token_ids for o in grouped[0].outputs] == alone and len(grouped[1].outputs) == 1
    with pytest.raises(ValueError, match="n=2"):
        next(llm.stream("Pick", SamplingParams(n=2)))
    with pytest.raises(ValueError, match="n must be a positive int"):
        SamplingParams(n=0)


@pytest.mark.slow
def test_abort_frees_the_slot_and_pages_of_a_running_request_and_dequeues_a_waiting_one(llm):
    engine = llm.engine
    free = engine.scheduler.pool.num_free
    long = SamplingParams(max_tokens=64, ignore_eos=True)
    running = [engine.add_request([5, 6, 7], long) for _ in range(engine.cfg.max_num_seqs)]
    waiting = engine.add_request([8, 9], long)
    engine.step()
    assert engine.num_running == engine.cfg.max_num_seqs and engine.num_waiting == 1
    assert engine.abort(waiting.id) is waiting and waiting.finish_reason == "abort" and engine.num_waiting == 0
    assert engine.abort(running[0].id) is running[0] and engine.num_running == engine.cfg.max_num_seqs - 1
    assert engine.abort(running[0].id) is None  # already ended
    for req in running[1:]:
        engine.abort(req.id)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_running == 0 and engine.scheduler.pool.num_free == free
    assert [len(r.output) < 64 for r in running] == [True] * len(running)


@pytest.mark.slow
@pytest.mark.parametrize("grace_s, reason", [(0.0, "abort"), (60.0, "length")])
def test_a_drain_refuses_new_work_and_ends_what_runs_after_its_grace(llm, grace_s, reason):
    from eagle3_jax.serve.engine_loop import EngineLoop, Unavailable
    from eagle3_jax.serve.metrics import ServerMetrics

    work = [([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))] * 3

    async def drained() -> dict:
        engine_loop = EngineLoop(llm.engine, ServerMetrics("tiny"))
        engine_loop.start(asyncio.get_running_loop())
        submission = engine_loop.submit(work, time.perf_counter())
        finals = {}
        try:
            assert not any(u.finished for u in await asyncio.wait_for(submission.next_updates(), 60))  # running
            engine_loop.drain(grace_s)
            with pytest.raises(Unavailable, match="shutting down"):
                engine_loop.submit(work, time.perf_counter())
            while len(finals) < len(work):
                for update in await asyncio.wait_for(submission.next_updates(), 60):
                    if update.finished:
                        finals[update.index] = update
        finally:
            engine_loop.stop()
        return finals

    finals = asyncio.run(drained())
    assert {u.finish_reason for u in finals.values()} == {reason}
    assert llm.engine.num_running == 0 and llm.engine.scheduler.pool.num_free == llm.engine.scheduler.pool.capacity


def test_chat_roles_are_openais_and_developer_is_the_system_where_the_template_lacks_it():
    from pydantic import ValidationError

    from eagle3_jax.serve import protocol as P

    with pytest.raises(ValidationError, match="'system', 'user', 'assistant', 'tool' or 'developer'"):
        P.ChatCompletionRequest(model="m", messages=[{"role": "wizard", "content": "hi"}])
    body = P.ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "tool", "content": "42"}, {"role": "user", "content": "hi"}])
    assert [m.as_template_input(developer_role=False) for m in body.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "tool", "content": "42"},
        {"role": "user", "content": "hi"}]
    assert body.messages[0].as_template_input(developer_role=True)["role"] == "developer"


def test_an_output_limit_that_does_not_fit_beside_the_prompt_is_refused():
    """OpenAI's and vLLM's 400 naming the prompt's length, the limit and max_model_len; with no
    limit given the reply fills the context."""
    from eagle3_jax.serve import protocol as P

    completion = P.CompletionRequest(model="m", prompt="x", max_tokens=100)
    P.check_fits(completion, 28, 128)  # exactly the context
    with pytest.raises(P.APIError) as e:
        P.check_fits(completion, 29, 128)
    assert (e.value.status, e.value.param, e.value.code) == (400, "max_tokens", "context_length_exceeded")
    assert e.value.message.startswith("max_tokens 100 does not fit: the prompt has 29 tokens and max_model_len is "
                                      "128 (29 + 100 > 128); ask for at most 99"), e.value.message
    chat = P.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=128)
    with pytest.raises(P.APIError, match="max_completion_tokens 128 does not fit") as e:
        P.check_fits(chat, 1, 128)
    assert e.value.param == "max_completion_tokens"
    unlimited = P.CompletionRequest(model="m", prompt="x")
    P.check_fits(unlimited, 127, 128)
    assert unlimited.sampling_params(128).max_tokens == 128  # the whole context, the engine keeps what is left


def test_the_metrics_vllm_has_are_also_under_its_names_with_the_same_values():
    """A dashboard built for vLLM's /metrics reads `vllm:` names: every metric of ours that vLLM
    has is there too, with the same samples; ours alone (speculation_choice, engine_steps) only under ours."""
    from prometheus_client import generate_latest

    from eagle3_jax.serve.metrics import ServerMetrics

    metrics = ServerMetrics("tiny")
    metrics.prompt_tokens.inc(5)
    metrics.ttft.observe(0.03)
    metrics.finished.labels("tiny", "stop").inc()
    metrics.accepted_per_pos.labels("tiny", "0").inc(2)
    metrics.engine_state(running=1, waiting=2, pages_free=3, pages=4)
    metrics.choices({1: "chain K=3"}, ["target-only", "chain K=3"])
    series = dict(line.rsplit(" ", 1) for line in generate_latest(metrics.registry).decode().splitlines()
                  if line and not line.startswith("#"))
    ours = {k.removeprefix("eagle3_jax:"): v for k, v in series.items() if k.startswith("eagle3_jax:")}
    vllms = {k.removeprefix("vllm:"): v for k, v in series.items() if k.startswith("vllm:")}
    assert set(series) == {f"eagle3_jax:{k}" for k in ours} | {f"vllm:{k}" for k in vllms}
    assert vllms == {k: v for k, v in ours.items() if not k.startswith(("speculation_choice", "engine_steps"))}
    assert float(vllms['prompt_tokens_total{model_name="tiny"}']) == 5
    assert float(vllms['request_success_total{finished_reason="stop",model_name="tiny"}']) == 1
    assert float(vllms['spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}']) == 2
    assert float(vllms['time_to_first_token_seconds_count{model_name="tiny"}']) == 1
    assert float(vllms['num_requests_waiting{model_name="tiny"}']) == 2
    assert float(vllms['kv_cache_usage_perc{model_name="tiny"}']) == 0.25


def engine_cut(decode, ids: list[int], stops) -> tuple[list[int], str]:
    """(tokens, text) as the engine ends them: at the first token after which the text holds a
    stop string, cut before it (scheduler.hit_stop_string)."""
    for k in range(1, len(ids) + 1):
        text = decode(ids[:k])
        for stop in stops:
            if stop in text:
                return ids[:k], text[:text.index(stop)]
    return ids, decode(ids)


@pytest.mark.parametrize("stops", [(), ("Q", "xyz")])
def test_streamed_text_adds_up_to_the_final_text(llm, stops):
    """Random bytes (split UTF-8 characters among them) pushed in random pieces, the last piece
    recorded as the engine's final update is: the released text is a prefix of the final text
    all along and adds up to it."""
    rng = np.random.default_rng(0)
    cut = 0
    for _ in range(50):
        ids, final = engine_cut(llm.decode, rng.integers(0, 259, 40).tolist(), stops)  # specials too
        cut += len(ids) < 40
        stream, released = TextStream(llm.decode, stops), ""
        cuts = sorted(set(rng.integers(1, len(ids) + 1, 12).tolist()) | {len(ids)})
        for start, end in zip([0, *cuts], cuts):
            if end == len(ids):
                stream.add(ids[start:end])
                break
            released += stream.push(ids[start:end])
            assert final.startswith(released)
        assert released + stream.finish(final) == final
    assert cut > 0 if stops else cut == 0


@pytest.mark.slow
def test_streamed_text_of_a_real_tokenizer_is_the_whole_decode_at_every_step(tokenizer):
    """SmolLM2's byte-level BPE, one to three tokens a push: what is released is always the
    start of the whole decode, and each push decodes a few tokens, not all of them."""
    from pathlib import Path

    ids = tokenizer(Path(__file__).read_text())["input_ids"][:1500]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)
    decoded = []
    stream, released, i = TextStream(lambda t: decoded.append(len(t)) or decode(t)), "", 0
    rng = np.random.default_rng(1)
    while i < len(ids):
        step = int(rng.integers(1, 4))
        released += stream.push(ids[i:i + step])
        i += step
        assert decode(ids[:i]).startswith(released) and len(decode(ids[:i])) - len(released) <= 1
    assert released + stream.finish(decode(ids)) == decode(ids)
    assert max(decoded) <= 8  # the last two pushes' tokens



@pytest.mark.slow
def test_an_engine_failure_ends_its_requests_and_refuses_new_ones(llm, monkeypatch):
    from eagle3_jax.serve.engine_loop import EngineLoop, Unavailable
    from eagle3_jax.serve.metrics import ServerMetrics

    engine_loop = EngineLoop(llm.engine, ServerMetrics("tiny"))
    work = [([5, 6, 7], SamplingParams(max_tokens=8))] * 2

    def lost_device():
        raise RuntimeError("device lost")

    async def failing() -> list:
        engine_loop.start(asyncio.get_running_loop())
        monkeypatch.setattr(llm.engine, "step", lost_device)
        submission = engine_loop.submit(work, time.perf_counter())
        updates = []
        while len(updates) < len(work):
            updates += await asyncio.wait_for(submission.next_updates(), 30)
        with pytest.raises(Unavailable, match="engine failed"):
            engine_loop.submit(work, time.perf_counter())
        engine_loop.stop()
        return updates

    updates = asyncio.run(failing())
    assert [(u.finished, u.finish_reason) for u in updates] == [(True, "error")] * 2
    assert "engine failed" in updates[0].error and not engine_loop.healthy
    monkeypatch.undo()
    for req in list(llm.engine.scheduler.waiting):  # what the failed steps left queued
        llm.engine.abort(req.id)


def test_a_consumer_behind_takes_each_samples_queued_updates_as_one_in_order():
    """Submission.next_updates: what is queued for a sample is merged into one update (tokens and
    logprobs in order, the end and final text of the last); another sample's updates keep theirs."""
    from eagle3_jax.engine.scheduler import TokenLogprobs
    from eagle3_jax.serve.engine_loop import Submission, Update

    scored = lambda t: TokenLogprobs(t, -0.5, 1, (t,), (-0.5,))

    async def taken() -> list[list[Update]]:
        submission = Submission([([1], SamplingParams()), ([1], SamplingParams())], 0.0)
        for update in [Update(0, [3], logprobs=[scored(3)], prompt_logprobs=[None]), Update(1, [7]),
                       Update(0, [4, 5], logprobs=[scored(4), scored(5)]), Update(1, [8]),
                       Update(0, [6], True, "stop", text="cut", logprobs=[scored(6)]), Update(1, [9])]:
            submission.put(update)
        first = await submission.next_updates()
        assert not submission.has_updates
        waiting = asyncio.get_running_loop().create_task(submission.next_updates())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing put: it waits
        submission.put(Update(1, [10], True, "length"))
        return [first, await waiting]

    (zero, one), (last,) = asyncio.run(taken())
    assert (zero.index, zero.token_ids, zero.finished, zero.finish_reason, zero.text) == (0, [3, 4, 5, 6], True,
                                                                                          "stop", "cut")
    assert [s.token for s in zero.logprobs] == [3, 4, 5, 6] and zero.prompt_logprobs == [None]
    assert (one.index, one.token_ids, one.finished, one.logprobs) == (1, [7, 8, 9], False, None)
    assert (last.index, last.token_ids, last.finish_reason) == (1, [10], "length")  # one queued: as it came


def test_a_stream_behind_its_engine_sends_the_same_text_in_fewer_chunks(llm):
    """The chat stream of one reply whose steps are all queued when it reads (a consumer behind its
    engine) sends them as one chunk, written with the usage's and [DONE] at once; read step by step,
    one chunk a step, each written alone. Both add up to the decode."""
    import json

    from eagle3_jax.engine.scheduler import RequestMetrics
    from eagle3_jax.serve import protocol as P
    from eagle3_jax.serve.app import CHAT, OpenAIServer, Settings, _Sample
    from eagle3_jax.serve.engine_loop import Submission, Update

    ids = llm.encode("h\u00e9llo w\u00f6rld \u2014 \u00fcn\u00efcode \u2713")  # characters split across byte tokens
    steps = [ids[i:i + 2] for i in range(0, len(ids), 2)]
    body = P.ChatCompletionRequest(model="tiny", messages=user("hi"), stream=True,
                                   stream_options={"include_usage": True})
    server = OpenAIServer(llm, None, Settings("tiny"))

    async def contents(behind: bool) -> tuple[list[str], int, int]:
        submission = Submission([([1], SamplingParams())], 0.0)
        last = Update(0, steps[-1], True, "length", metrics=RequestMetrics())
        updates = [Update(0, step) for step in steps[:-1]] + [last]
        watcher = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        stream = server.stream(CHAT, body, submission, [_Sample(TextStream(llm.decode))], 1, watcher)

        async def feed():  # each update once the stream waits for the next
            for update in updates:
                submission.put(update)
                while submission.has_updates:
                    await asyncio.sleep(0)

        if behind:
            for update in updates:
                submission.put(update)
        else:
            feeder = asyncio.get_running_loop().create_task(feed())
        writes = [piece async for piece in stream]
        events = "".join(writes).removesuffix("\n\n").split("\n\n")
        assert events[-1] == "data: [DONE]" and all(w.endswith("\n\n") for w in writes)
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
        if not behind:
            await feeder
        return [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"] and
                c["choices"][0]["delta"].get("content")], len(writes), len(events)

    (behind, behind_writes, _), (step_by_step, writes, events) = asyncio.run(contents(True)), \
        asyncio.run(contents(False))
    assert "".join(behind) == "".join(step_by_step) == llm.decode(ids)
    assert len(behind) == 1 and behind_writes == 2  # the role's chunk, then the rest
    # A write a chunk, but the last: the final chunk, the usage's and [DONE] together.
    assert len(step_by_step) > len(steps) // 2 and writes == events - 2


@pytest.fixture(scope="module")
def codec(chat_models):
    """The chat models' tokenizer and template alone (`Codec`), with the one engine fact the server reads."""
    import types

    from eagle3_jax.api import Codec, load_tokenizer

    codec = Codec(load_tokenizer(chat_models[0]))
    codec.engine = types.SimpleNamespace(cfg=types.SimpleNamespace(max_model_len=128))
    return codec


def test_encode_each_gives_each_prompt_what_encode_gives_it_alone(codec, monkeypatch):
    """Codec.encode_each: the conversations without tools templated in one batched call, the raw
    texts tokenized in one; each prompt's ids those of `encode`, a bad prompt its own error. Where
    a batched call fails, each of its prompts is encoded alone, so only the bad one fails."""
    from eagle3_jax.engine.scheduler import RequestError

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    prompts = [(user("hello"), None), ("raw text", None), (user("h\u00e9llo w\u00f6rld"), None), ("more", None),
               ([5, 6, 7], None), (user("with tools"), tools), ("  ", None), ([{"role": "user"}], None)]
    template = codec.tokenizer.apply_chat_template
    calls = []
    monkeypatch.setattr(codec.tokenizer, "apply_chat_template", lambda *a, **kw: (calls.append(a[0]),
                                                                                   template(*a, **kw))[1])
    got = codec.encode_each(prompts)
    assert got[:6] == [codec.encode(p, t) for p, t in prompts[:6]]
    assert isinstance(got[6], RequestError) and str(got[6]) == "prompt is empty"
    assert isinstance(got[7], RequestError) and "'role' and a 'content'" in str(got[7])
    assert calls[0] == [user("hello"), user("h\u00e9llo w\u00f6rld")]  # both chats, one call

    def failing(conversation, **kw):  # a template that refuses one conversation of the batch
        if any(c == user("boom") for c in (conversation if isinstance(conversation[0], list) else [conversation])):
            raise ValueError("the template refuses it")
        return template(conversation, **kw)

    monkeypatch.setattr(codec.tokenizer, "apply_chat_template", failing)
    got = codec.encode_each([(user("hello"), None), (user("boom"), None), (user("bye"), None)])
    assert got[0] == codec.encode(user("hello")) and got[2] == codec.encode(user("bye"))
    assert isinstance(got[1], ValueError)


def test_prompts_arriving_together_are_encoded_as_one_job_on_the_tokenizer_thread(codec, monkeypatch):
    """The server's `encode`: prompts arriving in one turn of the event loop go to the tokenizer's
    thread as one job (`Codec.encode_each`), those arriving while it runs as the next one, not one
    job each. Each request gets its prompt's ids; a bad prompt its 400 naming its field, the others
    unaffected."""
    import threading

    from eagle3_jax.serve import protocol as P
    from eagle3_jax.serve.app import OpenAIServer, Settings

    jobs, release = [], threading.Event()
    encode_each = type(codec).encode_each

    def counted(self, prompts):
        jobs.append(len(prompts))
        if len(jobs) == 1:
            release.wait(30)  # the first job holds the thread while the next prompts arrive
        return encode_each(self, prompts)

    monkeypatch.setattr(type(codec), "encode_each", counted)
    server = OpenAIServer(codec, None, Settings("tiny"))
    burst = [(user(f"question {i}"), "messages") for i in range(6)] + [("raw", "prompt"), ("", "prompt")]

    async def arrivals():
        first = asyncio.ensure_future(server.encode(user("first"), "messages"))
        while not jobs:  # the first is on the thread
            await asyncio.sleep(0.01)
        rest = asyncio.gather(*(server.encode(p, field) for p, field in burst), return_exceptions=True)
        await asyncio.sleep(0.05)
        release.set()
        return await first, await rest

    try:
        first, rest = asyncio.run(arrivals())
    finally:
        server.tokenizer_pool.shutdown()
    assert jobs == [1, len(burst)]
    assert first == codec.encode(user("first"))
    assert rest[:7] == [codec.encode(p) for p, _ in burst[:7]]
    assert isinstance(rest[7], P.APIError) and (rest[7].status, rest[7].param) == (400, "prompt")
