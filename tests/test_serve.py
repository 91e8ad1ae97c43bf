"""`eagle3-jax serve` as users run it: a subprocess on 127.0.0.1, driven by the official `openai`
client (raw bodies through urllib). One server for the module, a tiny random target with a byte
tokenizer (tests/conftest.py, `chat_models`); its greedy output is compared with `LLM.chat` and
`LLM.generate` in this process on the same engine config. The last test stops it with SIGTERM."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from eagle3_jax import SamplingParams  # noqa: E402
from eagle3_jax.serve import server as serve_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny-chat"
KEY = "test-key"
MAX_MODEL_LEN = 1024  # room for a tools prompt (a system message of their JSON) in byte tokens
MAX_WAITING = 72
START_S = 180  # start-up on a busy 2-core machine, compiles excluded (they happen on first use)
REQUEST_S = 120  # a request that compiles the programs it needs first
ENGINE = ["--num-draft", "3", "--tree", "none", "--speculation", "always", "--batch-buckets", "1,8",
          "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN)]
GREEDY = {"temperature": 0, "max_tokens": 16}

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"/health did not answer 200 within {timeout_s} s")


def start_server(chat_models, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`serve` of the chat models with ENGINE and `flags` on a free port, output in `log` -> (its
    process, its URL) once /health answers; killed if it does not."""
    target, draft = chat_models
    port = free_port()
    args = [sys.executable, "-m", "eagle3_jax.cli", "serve", "--target", str(target), "--draft", str(draft), *ENGINE,
            "--port", str(port), "--api-key", KEY, "--served-model-name", MODEL, "--shutdown-timeout", "0", *flags]
    with log.open("w") as out:
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, START_S)
    except BaseException:
        proc.kill()
        raise
    return proc, url


@pytest.fixture(scope="module")
def server(chat_models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = start_server(chat_models, log, "--max-waiting", str(MAX_WAITING), "--log-level", "debug")
    try:
        yield {"url": url, "proc": proc, "log": log}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)


@pytest.fixture(scope="module")
def llm(chat_models):
    """The server's engine, in this process (the CLI's config for --max-num-seqs 8)."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    target, draft = chat_models
    cfg = EngineConfig(batch_buckets=(1, 8), prefill_batch_buckets=(1, 8), max_model_len=MAX_MODEL_LEN,
                       speculation="always", max_num_seqs=8, freeze_heap=False)
    return LLM(target, draft, num_speculative_tokens=3, tree=None, engine_config=cfg, warmup=False, progress=False)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def raw_post(url: str, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON body) of a POST of `body` as it is."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"{url}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(url: str) -> dict[str, float]:
    """/metrics as {series with labels: value}."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def metric(values: dict[str, float], name: str) -> float:
    (value,) = [v for k, v in values.items() if re.fullmatch(rf"eagle3_jax:{name}(\{{.*\}})?", k)]
    return value


def wait_idle(url: str, timeout_s: float = 30) -> dict[str, float]:
    """/metrics once nothing runs or waits and every KV page is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = scrape(url)
        idle = [metric(values, n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")]
        if idle == [0, 0, 0] or time.monotonic() > deadline:
            return values
        time.sleep(0.1)


def stream_text(stream) -> tuple[str, list[int], str | None, dict | None]:
    """(text, token ids, finish_reason, usage) of a streamed chat or completion."""
    text, ids, reason, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            ids += (choice.model_extra or {}).get("token_ids") or []
            reason = choice.finish_reason or reason
    return "".join(text), ids, reason, usage


# ---- the API -------------------------------------------------------------------------------
def test_health_models_and_key(server, client):
    assert urllib.request.urlopen(f"{server['url']}/health", timeout=10).status == 200  # no key needed
    assert [m.id for m in client.models.list().data] == [MODEL]
    for key in (None, "wrong"):
        status, body = raw_post(server["url"], "/v1/completions", b'{"model": "tiny-chat", "prompt": "a"}', key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key" and "Bearer" in body["error"]["message"]


def test_chat_greedy_equals_llm_chat_with_usage_and_speculation_metrics(client, llm):
    messages = user("Name a colour.")
    response = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"return_token_ids": True},
                                              **GREEDY)
    (want,) = llm.chat(messages, SamplingParams(max_tokens=16))
    (choice,) = response.choices
    assert choice.model_extra["token_ids"] == want.token_ids and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason and choice.message.role == "assistant"
    prompt_ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)
    assert response.model_extra["prompt_token_ids"] == list(prompt_ids)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), len(want.token_ids))
    assert response.usage.total_tokens == len(prompt_ids) + len(want.token_ids)
    spec = response.model_extra["metrics"]["speculative_decoding"]
    m = want.metrics
    assert spec["num_drafts"] == m.speculative_iterations > 0
    assert spec["num_draft_tokens"] == 3 * m.speculative_iterations
    assert spec["num_accepted_tokens_per_pos"] == m.accepted_at and spec["num_accepted_tokens"] == m.accepted
    assert spec["mean_acceptance_length"] == pytest.approx(1 + m.accepted / m.speculative_iterations)


def test_metrics_use_vllms_names_and_count_what_was_served(server, client):
    # Its own traffic first, whatever ran before: a prompt twice (the second a prefix-cache hit) and
    # eight at once (bucket 8).
    for _ in range(2):
        client.chat.completions.create(model=MODEL, messages=user("Name three colors."), **GREEDY)
    client.completions.create(model=MODEL, prompt=[f"Count to {i}:" for i in range(8)], **GREEDY)
    values = scrape(server["url"])
    names = {re.sub(r"\{.*", "", k).removeprefix("eagle3_jax:") for k in values}
    counters = ["prompt_tokens_total", "generation_tokens_total", "spec_decode_num_drafts_total",
                "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
                "spec_decode_num_accepted_tokens_per_pos_total", "num_preemptions_total", "prefix_cache_queries_total",
                "prefix_cache_hits_total", "engine_steps_total"]
    histograms = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"]
    gauges = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "speculation_choice"]
    assert set(counters + gauges) | {f"{h}_bucket" for h in histograms} <= names
    assert metric(values, "generation_tokens_total") > 0 and metric(values, "spec_decode_num_drafts_total") > 0
    assert metric(values, "engine_steps_total") >= metric(values, "spec_decode_num_drafts_total") / 8  # 8 rows a step
    assert metric(values, "prefix_cache_queries_total") >= metric(values, "prefix_cache_hits_total") >= 0
    assert metric(values, "prefix_cache_queries_total") > 0
    chosen = {k: v for k, v in values.items() if k.startswith("eagle3_jax:speculation_choice") and v == 1}
    assert sorted(re.search(r'bucket="(\d+)"', k).group(1) for k in chosen) == ["1", "8"]  # one choice a bucket
    # vLLM's own names too, for its dashboards: the same samples (speculation_choice and engine_steps
    # are ours alone).
    vllms = {k.removeprefix("vllm:"): v for k, v in values.items() if k.startswith("vllm:")}
    assert vllms == {k.removeprefix("eagle3_jax:"): v for k, v in values.items() if k.startswith("eagle3_jax:")
                     and not k.startswith(("eagle3_jax:speculation_choice", "eagle3_jax:engine_steps"))}
    assert vllms['generation_tokens_total{model_name="tiny-chat"}'] > 0


def test_completions_take_text_lists_and_token_ids_as_llm_generate_does(client, llm):
    prompts = ["The sky is", "Once upon", [5, 6, 7, 8], [40, 41]]
    want = llm.generate(prompts, SamplingParams(max_tokens=16))
    got = [client.completions.create(model=MODEL, prompt=p, extra_body={"return_token_ids": True}, **GREEDY)
           for p in prompts]
    assert [r.choices[0].model_extra["token_ids"] for r in got] == [o.token_ids for o in want]
    assert [r.choices[0].text for r in got] == [o.text for o in want]
    assert [r.usage.prompt_tokens for r in got] == [len(llm.encode(p)) for p in prompts]
    # A list of prompts (texts, then token-id lists): one choice each, in order.
    for batch, outs in ((prompts[:2], want[:2]), (prompts[2:], want[2:])):
        response = client.completions.create(model=MODEL, prompt=batch, **GREEDY)
        assert [c.index for c in response.choices] == [0, 1]
        assert [c.text for c in response.choices] == [o.text for o in outs]
        assert response.usage.prompt_tokens == sum(len(llm.encode(p)) for p in batch)


def test_streamed_equals_non_streamed(client, llm):
    messages = user("Tell me a story.")
    whole = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                              stream_options={"include_usage": True},
                                              extra_body={"return_token_ids": True}, **GREEDY)
    text, ids, reason, usage = stream_text(streamed)
    assert text == whole.choices[0].message.content and reason == whole.choices[0].finish_reason
    assert ids == llm.chat(messages, SamplingParams(max_tokens=16))[0].token_ids
    assert usage == whole.usage.model_dump()
    completion = client.completions.create(model=MODEL, prompt="Hello", **GREEDY)
    text, _, reason, usage = stream_text(client.completions.create(model=MODEL, prompt="Hello", stream=True, **GREEDY))
    assert (text, reason, usage) == (completion.choices[0].text, completion.choices[0].finish_reason, None)


def test_stop_strings_cut_the_text_streamed_or_not(client, llm):
    full = llm.generate(["Hello"], SamplingParams(max_tokens=24))[0].text
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    cut = full[:full.index(stop)]
    response = client.completions.create(model=MODEL, prompt="Hello", stop=[stop], temperature=0, max_tokens=24)
    assert (response.choices[0].text, response.choices[0].finish_reason) == (cut, "stop")
    text, _, reason, _ = stream_text(client.completions.create(model=MODEL, prompt="Hello", stop=stop, stream=True,
                                                               temperature=0, max_tokens=24))
    assert (text, reason) == (cut, "stop")


def test_seeded_samples_reproduce_and_n_samples_differ(client, llm):
    sampled = {"temperature": 1.0, "max_tokens": 16, "seed": 7}
    body = {"model": MODEL, "prompt": "Pick a word", **sampled, "extra_body": {"return_token_ids": True}}
    first, again = (client.completions.create(**body).choices[0].model_extra["token_ids"] for _ in range(2))
    assert first == again == llm.generate(["Pick a word"], SamplingParams(**sampled))[0].token_ids
    pair = client.completions.create(**{**body, "n": 2})
    ids = [c.model_extra["token_ids"] for c in pair.choices]
    assert ids[0] == first and ids[1] != first  # the second sample is seeded seed + 1
    assert pair.model_extra["metrics"] is None  # per-request metrics describe one sample
    assert pair.usage.completion_tokens == sum(map(len, ids))
    extensions = client.completions.create(model=MODEL, prompt="Pick a word", temperature=1.0, max_tokens=8, seed=3,
                                           extra_body={"top_k": 5, "ignore_eos": True})
    assert extensions.usage.completion_tokens == 8  # past any EOS
    no_top_k = {"top_k": -1, "return_token_ids": True}  # vLLM's "off"
    off = client.completions.create(model=MODEL, prompt="Pick a word", extra_body=no_top_k, **GREEDY)
    greedy = llm.generate(["Pick a word"], SamplingParams(max_tokens=16))[0].token_ids
    assert off.choices[0].model_extra["token_ids"] == greedy


def test_chat_logprobs_are_llm_chats_streamed_or_not(client, llm):
    """logprobs + top_logprobs on chat: OpenAI's typed content, each token's text, logprob and top 3
    those of LLM.chat's logprobs, its bytes the token's own (joined, the reply's, characters split
    over tokens whole again), the same in the stream's chunks."""
    messages = user("Name a colour.")
    response = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=3, **GREEDY)
    (want,) = llm.chat(messages, SamplingParams(max_tokens=16, logprobs=3))
    content = response.choices[0].logprobs.content
    assert [c.token for c in content] == [d[t].decoded_token for d, t in zip(want.outputs[0].logprobs, want.token_ids)]
    for c, d, t in zip(content, want.outputs[0].logprobs, want.token_ids, strict=True):
        assert c.logprob == pytest.approx(d[t].logprob, abs=1e-5)
        top = sorted(d.values(), key=lambda lp: lp.rank)[:3]
        assert [x.token for x in c.top_logprobs] == [lp.decoded_token for lp in top]
        assert [x.logprob for x in c.top_logprobs] == pytest.approx([lp.logprob for lp in top], abs=1e-5)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob
    joined = b"".join(bytes(c.bytes) for c in content).decode(errors="replace")
    assert joined == llm.tokenizer.decode(want.token_ids, skip_special_tokens=False)
    stream = client.chat.completions.create(model=MODEL, messages=messages, logprobs=True, top_logprobs=3, stream=True,
                                            **GREEDY)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    # (the prefix cache holds the prompt now: its prefill, a shorter program, may round otherwise)
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-5)
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == response.choices[0].message.content


def test_completions_echo_scores_the_prompt_with_max_tokens_0_and_before_the_reply(client, llm):
    """echo + logprobs: with max_tokens 0 (a prefill only, as lm-evaluation-harness asks) the prompt and
    its logprobs (the first token's None) as LLM.generate's prompt_logprobs; with a reply, the prompt's
    then the reply's, in one list with text offsets, the same streamed."""
    prompt = "The sky is blue"
    ids = llm.encode(prompt)
    (want,) = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2))
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    (choice,) = scored.choices
    assert choice.text == prompt and choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    texts = llm.token_texts(ids)
    assert lp.tokens == [texts[i] for i in ids] and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([d[t].logprob for d, t in zip(want.prompt_logprobs[1:], ids[1:])],
                                                  abs=1e-5)
    assert all(len(top) <= 3 and max(top.values()) >= v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    body = dict(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    replied = client.completions.create(**body).choices[0]
    assert replied.text == prompt + want.text
    assert replied.logprobs.tokens[:len(ids)] == lp.tokens and len(replied.logprobs.tokens) == len(ids) + 6
    assert replied.logprobs.token_logprobs[len(ids):] == pytest.approx(
        [d[t].logprob for d, t in zip(want.outputs[0].logprobs, want.token_ids)], abs=1e-5)
    chunks = [c for chunk in client.completions.create(**body, stream=True) for c in chunk.choices]
    assert "".join(c.text for c in chunks) == replied.text
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(replied.logprobs.token_logprobs[1:], abs=1e-5)
    assert [t for c in chunks if c.logprobs for t in c.logprobs.text_offset] == replied.logprobs.text_offset
    echoed = client.completions.create(model=MODEL, prompt=[5, 6, 7], echo=True, max_tokens=0)
    assert echoed.choices[0].text == llm.decode([5, 6, 7]) and echoed.choices[0].logprobs is None


ANSWER = {"type": "object", "additionalProperties": False, "required": ["answer", "score", "tags"],
          "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9},
                         "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}}}


def test_structured_outputs_through_response_format_and_vllms_field(server, client, llm):
    jsonschema = pytest.importorskip("jsonschema")
    messages = user("Answer in JSON.")
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    response = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format,
                                              extra_body={"return_token_ids": True}, temperature=0, max_tokens=64)
    (choice,) = response.choices
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
    assert choice.finish_reason == "stop"
    want = llm.chat(messages, SamplingParams(max_tokens=64, structured_outputs={"json": ANSWER}))[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    picked = client.completions.create(model=MODEL, prompt="Left or right?", temperature=0, max_tokens=16,
                                       extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert picked.choices[0].text in ("left", "right") and picked.choices[0].finish_reason == "stop"
    url = server["url"]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}}
    assert_error(url, 400, json.dumps({"model": MODEL, "messages": messages, "response_format": bad_schema}).encode(),
                 "does not compile", "response_format", path="/v1/chat/completions")
    assert_error(url, 400, json.dumps({"model": MODEL, "prompt": "a", "structured_outputs": {"regex": "a(b"}}).encode(),
                 "unclosed group", "structured_outputs")
    both = {"model": MODEL, "prompt": "a", "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}
    assert_error(url, 400, json.dumps(both).encode(), "send one", "structured_outputs")
    assert_error(url, 400, json.dumps({"model": MODEL, "prompt": "a", "response_format": {"type": "yaml"}}).encode(),
                 "text, json_object or json_schema", "response_format")
    again = client.chat.completions.create(model=MODEL, messages=messages, response_format=response_format,
                                           temperature=0, max_tokens=64)
    assert again.choices[0].message.content == choice.message.content  # and it keeps serving


# ---- tools ---------------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {
              "name": "get_weather", "description": "The weather of a city.",
              "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {
              "name": "get_time",
              "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                             "additionalProperties": False}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def streamed_reply(client, **request):
    """The choice openai's own stream reader puts together from a streamed chat's chunks (its
    snapshot: its final completion refuses a reply cut by max_tokens)."""
    with client.chat.completions.stream(model=MODEL, **request) as reader:
        for _ in reader:
            pass
        return reader.current_completion_snapshot.choices[0]


def test_a_required_or_named_tool_choice_answers_a_call_of_a_tool_streamed_or_not(client):
    jsonschema = pytest.importorskip("jsonschema")
    from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageFunctionToolCall

    messages = user("What is the weather in Paris for 3 days?")
    calls = {}
    for tool_choice, names in (("required", set(SCHEMAS)), ({"type": "function", "function": {"name": "get_time"}},
                                                            {"get_time"})):
        response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                                  temperature=0, max_tokens=64, logprobs=True)
        (choice,) = response.choices
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
        (call,) = choice.message.tool_calls
        assert isinstance(call, ChatCompletionMessageFunctionToolCall) and call.type == "function"
        assert re.fullmatch(r"call_[0-9a-f]+", call.id) and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        calls[json.dumps(tool_choice)] = call.function
        if tool_choice == "required":
            tokens = [entry.token for entry in choice.logprobs.content]
    # Streamed: OpenAI's incremental call, its arguments' pieces adding up to the unstreamed call's;
    # each chunk with the logprobs of its tokens.
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                            temperature=0, max_tokens=64, stream=True, logprobs=True)
    chunks = list(stream)
    scored = [c.choices[0].logprobs.content for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(scored) > 1 and [entry.token for content in scored for entry in content] == tokens
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    opening = chunks[0].choices[0].delta
    assert (opening.role, opening.content, opening.tool_calls) == ("assistant", None, None)
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert all(len(d) == 1 and d[0].index == 0 for d in deltas)
    (start,), pieces = deltas[0], [d[0] for d in deltas[1:]]
    assert start.type == "function" and re.fullmatch(r"call_[0-9a-f]+", start.id)
    assert (start.function.name, start.function.arguments) == (calls['"required"'].name, "")
    assert len(pieces) > 1 and all(p.id is None and p.type is None and p.function.name is None for p in pieces)
    assert "".join(p.function.arguments for p in pieces) == calls['"required"'].arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    # openai's own stream reader puts the pieces together into the unstreamed call.
    final = streamed_reply(client, messages=messages, tools=TOOLS, tool_choice="required", temperature=0,
                           max_tokens=64)
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert (call.function.name, call.function.arguments) == (calls['"required"'].name, calls['"required"'].arguments)


def test_tool_choice_none_answers_text_and_a_history_of_calls_and_results_is_taken(client):
    text = client.chat.completions.create(model=MODEL, messages=user("Weather?"), tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    (choice,) = text.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    history = [*user("Weather in Oslo tomorrow?"),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]
    for tool_choice in ("auto", "none"):
        reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice=tool_choice,
                                               temperature=0, max_tokens=8)
        (choice,) = reply.choices
        if choice.finish_reason == "tool_calls":  # "auto": a random model's reply may be one
            assert choice.message.tool_calls[0].function.name in SCHEMAS
        else:
            assert isinstance(choice.message.content, str)
        # Streamed, the same reply: text as it comes, or the call in pieces.
        streamed = streamed_reply(client, messages=history, tools=TOOLS, tool_choice=tool_choice, temperature=0,
                                  max_tokens=8)
        assert (streamed.finish_reason, streamed.message.content) == (choice.finish_reason, choice.message.content)
        assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or []] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def test_tools_that_cannot_be_served_answer_400_naming_the_field(server):
    url = server["url"]

    def body(**fields) -> bytes:
        return json.dumps({"model": MODEL, "messages": user("hi"), "max_tokens": 4, **fields}).encode()

    named = {"type": "function", "function": {"name": "get_mail"}}
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    bad_call = [*user("hi"), {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                    "function": {"name": "f", "arguments": "[1"}}]}]
    cases = [
        (body(tools=TOOLS, tool_choice=named), "'get_mail', which is not among tools", "tool_choice"),
        (body(tool_choice="required"), "tool_choice needs tools", "tool_choice"),
        (body(tools=TOOLS, tool_choice="sometimes"), "tool_choice must be none, auto, required", "tool_choice"),
        (body(tools=bad_schema), "does not compile", "tools"),
        (body(tools=bad_schema, tool_choice="required"), "does not compile", "tools"),
        (body(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "must be a JSON schema",
         "tools"),
        (body(tools=[{"type": "function", "function": {}}]), "needs a non-empty string name", "tools"),
        (body(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "send one",
         "tool_choice"),
        (body(messages=bad_call), "tool_calls must be", "messages"),
    ]
    for raw, words, param in cases:
        assert_error(url, 400, raw, words, param, path="/v1/chat/completions")


# ---- errors --------------------------------------------------------------------------------
def assert_error(url: str, status: int, body: bytes, words: str, param: str | None = None, path="/v1/completions"):
    got, error = raw_post(url, path, body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert words in error["error"]["message"] and error["error"]["param"] == param


def test_each_error_has_its_status_and_body_and_the_server_keeps_serving(server, client):
    url = server["url"]

    def body(**fields) -> bytes:
        return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}).encode()

    cases = [
        (400, b"{bad json", "not valid JSON", None),
        (400, b"", "empty", None),
        (400, body(temperature=-1), "temperature must be", "temperature"),
        (400, body(max_tokens=0), "max_tokens must be at least 1 (0 only on completions with echo", "max_tokens"),
        (400, body(prompt=[]), "prompt is empty", "prompt"),
        (400, body(prompt="x" * (2 * MAX_MODEL_LEN)), f"the context holds {MAX_MODEL_LEN}", "prompt"),
        (400, body(max_tokens=MAX_MODEL_LEN - 1), f"max_tokens {MAX_MODEL_LEN - 1} does not fit: the prompt has 2 "
                                                  f"tokens and max_model_len is {MAX_MODEL_LEN}", "max_tokens"),
        (400, body(prompt=[1, 10**6]), "outside the vocabulary", "prompt"),
        (400, body(logprobs=21), "less than or equal to 20", "logprobs"),
        (400, body(logprobs=-1), "greater than or equal to 0", "logprobs"),
        (400, body(logprobs="2"), "valid integer", "logprobs"),
        (400, body(echo="yes"), "valid boolean", "echo"),
        (400, body(suffix="!"), "suffix is not supported", "suffix"),
        (400, body(prompt={"not": "a prompt"}), "prompt", "prompt"),
        (404, body(model="gpt-4"), "does not exist", "model"),
        (413, b'{"prompt": "' + b"x" * (10 << 20) + b'"}', "over", None),
    ]
    for status, raw, words, param in cases:
        assert_error(url, status, raw, words, param)
        good = client.completions.create(model=MODEL, prompt="ok", max_tokens=2, extra_body={"ignore_eos": True})
        assert good.usage.completion_tokens == 2 and good.choices[0].finish_reason == "length"
    assert_error(url, 400, json.dumps({"model": MODEL, "messages": []}).encode(), "at least 1", "messages",
                 path="/v1/chat/completions")
    assert_error(url, 400, json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
                 "'system', 'user', 'assistant', 'tool' or 'developer'", "messages", path="/v1/chat/completions")
    with pytest.raises(openai.BadRequestError) as e:  # a limit the context has no room for
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_completion_tokens=MAX_MODEL_LEN)
    assert (e.value.body["param"], e.value.body["code"]) == ("max_completion_tokens", "context_length_exceeded")
    # No limit: the reply may fill the rest of the context.
    whole = client.completions.create(model=MODEL, prompt="hi", extra_body={"ignore_eos": True})
    assert (whole.usage.completion_tokens, whole.choices[0].finish_reason) == (MAX_MODEL_LEN - 2, "length")
    # 10 MB sent in chunks, with no length declared: refused as it arrives.
    conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=REQUEST_S)
    big = b'{"prompt": "' + b"x" * (10 << 20) + b'"}'
    conn.request("POST", "/v1/completions", body=(big[i:i + (1 << 16)] for i in range(0, len(big), 1 << 16)),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, encode_chunked=True)
    response = conn.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    conn.close()
    chat = [({"logprobs": True, "top_logprobs": 21}, "less than or equal to 20", "top_logprobs"),
            ({"top_logprobs": 2}, "top_logprobs needs logprobs: true", "top_logprobs"),
            ({"logprobs": "yes"}, "valid boolean", "logprobs"), ({"max_tokens": 0}, "at least 1", "max_tokens")]
    for fields, words, param in chat:
        assert_error(url, 400, json.dumps({"model": MODEL, "messages": user("hi"), **fields}).encode(), words, param,
                     path="/v1/chat/completions")
    with pytest.raises(openai.BadRequestError) as e:  # the client's own view of one of them
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, logprobs=True, top_logprobs=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(MODEL + "-not")


def test_a_full_queue_answers_429_with_retry_after_and_drains(server, client):
    """One request of MAX_WAITING samples fills the queue (8 run, the rest wait); the next is
    refused with Retry-After until the first is dropped (its waiting samples leave the queue)."""
    url = server["url"]
    flood = client.completions.create(model=MODEL, prompt="flood", n=MAX_WAITING, temperature=1.0,
                                      stream=True)  # no max_tokens: the rest of the context
    next(iter(flood))  # its samples are queued and running
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="one more", n=16, max_tokens=4)
    assert e.value.status_code == 429 and e.value.response.headers["retry-after"] == "1"
    assert e.value.body["code"] == "queue_full"
    flood.close()  # a disconnect: every sample aborted, waiting or running
    values = wait_idle(url)
    assert metric(values, "num_requests_running") == 0 and metric(values, "kv_cache_usage_perc") == 0
    again = client.completions.create(model=MODEL, prompt="one more", n=16, max_tokens=4,
                                      extra_body={"ignore_eos": True})
    assert again.usage.completion_tokens == 16 * 4


# ---- under load ----------------------------------------------------------------------------
def test_64_streams_with_16_disconnecting_finish_as_alone_and_free_everything(server, llm):
    """64 concurrent streaming clients, every fourth hanging up after its first chunk: the others
    get exactly the greedy tokens of their prompt alone, and the engine ends idle with every KV
    page free."""
    prompts = [f"Question {i}: what comes next?" for i in range(64)]
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24))]
    aclient = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)

    async def one(i: int) -> list[int] | None:
        stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], temperature=0, max_tokens=24,
                                                  stream=True, extra_body={"return_token_ids": True})
        ids = []
        async for chunk in stream:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            if i % 4 == 3:
                await stream.close()
                return None
        return ids

    async def all_of_them():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), REQUEST_S)
        finally:
            await aclient.close()

    got = asyncio.run(all_of_them())
    completed = [i for i in range(64) if i % 4 != 3]
    assert [got[i] for i in completed] == [want[i] for i in completed]
    values = wait_idle(server["url"])
    assert [metric(values, n) for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")] == \
        [0, 0, 0]
    assert values['eagle3_jax:request_success_total{finished_reason="abort",model_name="tiny-chat"}'] >= 16
    assert metric(values, "time_to_first_token_seconds_count") >= 64


GUIDELLM_REQUESTS, GUIDELLM_OUTPUT = 8, 8


def test_guidellm_benchmarks_the_server_at_1_and_8_streams(server, chat_models, llm, tmp_path):
    """GuideLLM (`guidellm run`, its concurrent profile, synthetic prompts) against the server, as a
    user benchmarks it: every request of each level served in full (no error, none cut short), the
    prompt counted as the chat template makes it, and the speculation's counts that GuideLLM reads
    from the responses."""
    pytest.importorskip("guidellm")
    target, _ = chat_models
    report, scenario_file = tmp_path / "guidellm.json", tmp_path / "scenario.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server["url"], "model": MODEL, "api_key": KEY,
                    "request_format": "/v1/chat/completions"},
        "profile": {"kind": "concurrent", "streams": [1, 8]},
        "tokenizer": {"kind": "huggingface_auto", "model": str(target)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 24, "output_tokens": GUIDELLM_OUTPUT}],
        "constraints": [{"kind": "max_requests", "count": GUIDELLM_REQUESTS},
                        {"kind": "max_duration", "seconds": REQUEST_S}],
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    scenario_file.write_text(json.dumps(scenario))
    done = subprocess.run([sys.executable, "-m", "guidellm", "run", "--scenario", str(scenario_file),
                           "--disable-console"], cwd=tmp_path, capture_output=True, text=True, timeout=2 * REQUEST_S,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    benchmarks = json.loads(report.read_text())["benchmarks"]
    assert len(benchmarks) == 2  # one a level
    for benchmark in benchmarks:
        requests = benchmark["requests"]
        assert [len(requests[k]) for k in ("successful", "errored", "incomplete")] == [GUIDELLM_REQUESTS, 0, 0]
        for request in requests["successful"]:
            assert request["output_tokens"] == GUIDELLM_OUTPUT  # ignore_eos and max_completion_tokens kept
            # GuideLLM sends its text as a content part; the server templates it as a string.
            (message,) = json.loads(request["request_args"])["body"]["messages"]
            text = "".join(part["text"] for part in message["content"])
            assert request["prompt_tokens"] == len(llm.encode(user(text)))
            assert request["time_to_first_token_ms"] > 0
            spec = request["response_metrics"]["speculative_decoding"]  # speculation "always"
            assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] >= 1


# ---- last: SIGTERM -------------------------------------------------------------------------
def check_sigterm_mid_stream(proc, client, log_path, n: int) -> None:
    """SIGTERM while a stream of n samples runs (no max_tokens: the rest of the context): every sample
    ends with a finish reason, the server exits 0, and its log has no traceback."""
    stream = client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, n=n, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    proc.send_signal(signal.SIGTERM)
    reasons = {c.index: c.finish_reason for chunk in [first, *chunks] for c in chunk.choices if c.finish_reason}
    assert sorted(reasons) == list(range(n)) and set(reasons.values()) <= {"abort", "length", "stop"}
    assert proc.wait(60) == 0
    log = log_path.read_text()
    assert "ready: serving 'tiny-chat'" in log and "Traceback" not in log
    # The line names what uvicorn runs: uvloop and httptools where installed (as here, for the tests).
    loop, http = serve_server.event_loop_and_http()
    assert f"(uvicorn: {loop} event loop, {http} HTTP)" in log


def test_sigterm_mid_stream_ends_the_stream_and_exits_0(server, client):
    check_sigterm_mid_stream(server["proc"], client, server["log"], 8)
