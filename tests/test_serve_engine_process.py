"""`eagle3-jax serve --engine-process`: the engine in a process of its own. The main paths as
test_serve.py drives them (same tiny models and engine flags), then the engine's process killed:
every live request ends with an error, /health and new requests answer 503, nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_serve import (
    GREEDY,
    KEY,
    MODEL,
    REQUEST_S,
    check_sigterm_mid_stream,
    llm,  # noqa: F401  (the fixture: the server's engine in this process)
    metric,
    raw_post,
    start_server,
    stream_text,
    user,
    wait_idle,
)

from eagle3_jax import SamplingParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def engine_pid(server_pid: int) -> int:
    """The pid of the server's engine process (beside it, multiprocessing's resource tracker)."""
    with open(f"/proc/{server_pid}/task/{server_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    engines = [p for p in children if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(engines) == 1, children
    return engines[0]


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_engine_process_serves_as_the_thread_does_and_drains_on_sigterm(chat_models, llm, tmp_path):  # noqa: F811
    proc, url = start_server(chat_models, tmp_path / "server.log", "--engine-process")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)
        messages = user("Tell me a story.")
        want = llm.chat(messages, SamplingParams(max_tokens=16))[0]
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                extra_body={"return_token_ids": True}, **GREEDY)
        text, ids, reason, _ = stream_text(stream)
        assert ids == want.token_ids and text == want.text and reason == want.finish_reason
        values = wait_idle(url)
        assert values[f'eagle3_jax:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}'] == 1
        assert metric(values, "generation_tokens_total") == len(ids)

        # A client hanging up mid-stream aborts its request in the engine's process.
        stream = client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, max_tokens=500,
                                           stream=True)
        next(iter(stream))
        stream.close()
        values = wait_idle(url)
        assert values[f'eagle3_jax:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'] == 1
        assert metric(values, "kv_cache_usage_perc") == 0

        # Checked in the HTTP process, as the engine would: 400 at once.
        status, body = raw_post(url, "/v1/completions", b'{"model": "%s", "prompt": [1, 2, 999999]}' % MODEL.encode())
        assert status == 400 and "outside the vocabulary" in body["error"]["message"]
        status, body = raw_post(url, "/v1/completions", b'{"model": "%s", "prompt": "hi", "max_tokens": 4, '
                                b'"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
                                b'"schema": {"type": "nonsense"}}}}' % MODEL.encode())
        assert status == 400, body

        check_sigterm_mid_stream(proc, client, tmp_path / "server.log", 4)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_engine_process_dying_ends_live_requests_and_answers_503(chat_models, tmp_path):
    proc, url = start_server(chat_models, tmp_path / "server.log", "--engine-process")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)
        # ignore_eos: a sampled end of text could finish the reply before the kill (its last chunk the first read)
        stream = client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, max_tokens=1000,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        assert next(chunks).choices[0].finish_reason is None
        finished = threading.Event()
        rest: list = []

        def read_rest():
            try:
                rest.extend(chunks)
            except openai.APIError as e:  # the error event: the client raises it
                rest.append(e)
            finished.set()

        threading.Thread(target=read_rest, daemon=True).start()
        os.kill(engine_pid(proc.pid), signal.SIGKILL)
        assert finished.wait(60), "the live stream did not end"
        assert isinstance(rest[-1], openai.APIError) and "engine failed" in str(rest[-1])
        assert health(url) == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)  # exits (as the threaded server does on SIGTERM, whatever its engine's state)
    finally:
        if proc.poll() is None:
            proc.kill()
