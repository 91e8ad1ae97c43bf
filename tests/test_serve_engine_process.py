"""`eagle3-jax serve`'s engine in a process of its own (the default, as test_serve.py drives it) and
on a thread of the server's process (--no-engine-process): the main paths; with --api-server-count 2 two HTTP
processes on one socket, each shown to serve on its own while the other is stopped (SIGSTOP: it
accepts nothing meanwhile); then an HTTP process and the engine's process killed: the first's
requests are aborted and the other serves on, the second's end every live request with an error,
/health and new requests answer 503, nothing hangs."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_serve import (
    GREEDY,
    KEY,
    MODEL,
    REPO,
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
from test_serve import scrape as scrape_metrics

from eagle3_jax import SamplingParams

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def load_server_process():
    """scripts/server_process.py, whose look-up of a server's processes scripts/serve_load.py uses."""
    spec = importlib.util.spec_from_file_location("server_process", REPO / "scripts" / "server_process.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server_pids(server_pid: int) -> tuple[list[int], int]:
    """(the HTTP processes: the server's own, then those it spawned holding its listening socket; the
    engine's process: the one spawned that does not), beside multiprocessing's resource tracker."""
    server_process = load_server_process()
    http, engine = server_process.http_pids(server_pid), server_process.engine_pid(server_pid)
    assert engine is not None and engine not in http, (http, engine)
    return http, engine


@contextlib.contextmanager
def stopped(pid: int):
    """Process `pid` stopped (SIGSTOP) meanwhile: it accepts no connection, the others take them all."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def served(values: dict[str, float]) -> float:
    """Requests finished, whatever the reason, as /metrics counts them."""
    return sum(v for k, v in values.items() if k.startswith("eagle3_jax:request_success_total{"))


def wait_served(url: str, count: int, timeout_s: float = 30) -> float:
    """served() once /metrics says `count` (or `timeout_s` seconds have passed)."""
    deadline = time.monotonic() + timeout_s
    while (now := served(scrape_metrics(url))) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


def wait_ready_line(log: Path, timeout_s: float = 60) -> str:
    """The server's log once it has its ready line (logged once every HTTP process listens)."""
    deadline = time.monotonic() + timeout_s
    while "ready: serving" not in (text := log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return text


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_engine_on_the_servers_thread_serves_as_its_process_does_and_drains_on_sigterm(chat_models, llm,  # noqa: F811
                                                                                            tmp_path):
    proc, url = start_server(chat_models, tmp_path / "server.log", "--no-engine-process")
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

        # A client hanging up mid-stream aborts its request in the engine (ignore_eos and
        # 1,000 tokens: a sampled end of text, or the last token, must not come before the hang-up).
        stream = client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, max_tokens=1000,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        values = wait_idle(url)
        assert values[f'eagle3_jax:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'] == 1
        assert metric(values, "kv_cache_usage_perc") == 0

        # Checked before the engine sees them: 400 at once.
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


def test_an_http_process_dying_aborts_its_requests_and_the_engine_dying_ends_every_one(chat_models, tmp_path):
    proc, url = start_server(chat_models, tmp_path / "server.log", "--engine-process", "--api-server-count", "2")
    try:
        wait_ready_line(tmp_path / "server.log")
        (main, worker), engine = server_pids(proc.pid)
        # The second HTTP process killed mid-stream: the engine aborts its request, the first serves on.
        with stopped(main):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)
            stream = client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, max_tokens=1000,
                                               stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
        os.kill(worker, signal.SIGKILL)
        wait_served(url, 1)  # the first has read what came while it was stopped (else its gauges say idle)
        values = wait_idle(url)
        assert values[f'eagle3_jax:request_success_total{{finished_reason="abort",model_name="{MODEL}"}}'] == 1
        assert metric(values, "kv_cache_usage_perc") == 0

        # The engine's process killed mid-stream.
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
        os.kill(engine, signal.SIGKILL)
        assert finished.wait(60), "the live stream did not end"
        assert isinstance(rest[-1], openai.APIError) and "engine failed" in str(rest[-1])
        assert health(url) == 503
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 1  # the engine failed
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_http_processes_serve_one_socket_and_one_engine_and_stop_together_on_sigterm(chat_models, llm,  # noqa: F811
                                                                                          tmp_path):
    log = tmp_path / "server.log"
    proc, url = start_server(chat_models, log, "--engine-process", "--api-server-count", "2")
    try:
        assert "by 2 HTTP processes" in wait_ready_line(log)
        http, engine = server_pids(proc.pid)
        assert len(http) == 2
        conversations = [user(f"Tell me about the number {i}.") for i in range(16)]
        want = llm.chat(conversations, SamplingParams(max_tokens=16))

        async def streamed(messages: list[dict], client) -> tuple[str, list[int]]:
            stream = await client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                          extra_body={"return_token_ids": True}, **GREEDY)
            text, ids = [], []
            async for chunk in stream:
                for choice in chunk.choices:
                    text.append(choice.delta.content or "")
                    ids += (choice.model_extra or {}).get("token_ids") or []
            return "".join(text), ids

        async def all_streamed() -> list[tuple[str, list[int]]]:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0,
                                          timeout=REQUEST_S) as client:
                return await asyncio.gather(*(streamed(m, client) for m in conversations))

        assert asyncio.run(all_streamed()) == [(w.text, w.token_ids) for w in want]
        assert wait_served(url, 16) == 16

        # Each process serves on its own while the other is stopped, and its /metrics counts every
        # request, those the other served too.
        messages = user("Name a colour.")
        alone = llm.chat(messages, SamplingParams(max_tokens=16))[0]
        for count, other in ((17, http[1]), (18, http[0])):
            with stopped(other):
                client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)
                reply = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
                assert reply.choices[0].message.content == alone.text
                assert wait_served(url, count) == count
        with stopped(http[1]):  # the first, once it has read what came while it was stopped
            assert wait_served(url, 18) == 18
        assert [served(scrape_metrics(url)) for _ in range(6)] == [18] * 6

        # SIGTERM to the first process alone, a stream running on the second: it is drained and ends,
        # every process exits, the first once the others have.
        with stopped(http[0]):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=REQUEST_S)
            chunks = iter(client.completions.create(model=MODEL, prompt="A long answer", temperature=1.0, n=4,
                                                    stream=True))
            first = next(chunks)
        proc.send_signal(signal.SIGTERM)
        reasons = {c.index: c.finish_reason for chunk in [first, *chunks] for c in chunk.choices if c.finish_reason}
        assert sorted(reasons) == list(range(4)) and set(reasons.values()) <= {"abort", "length", "stop"}
        assert proc.wait(60) == 0
        assert not [pid for pid in [*http, engine] if Path(f"/proc/{pid}").exists()]
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
