#!/usr/bin/env python3
"""Where does a burst of N streams at `eagle3-jax serve` wait for its first tokens?

    python3 experiments/burst_probe.py --target T --draft D --engine "--max-num-seqs 64" \
        [--streams 64] [--modes thread,process,in-process] [--client raw|openai]

N chat requests (one user turn each, greedy, --max-tokens, ignore_eos) sent at once to the server
(thread: the engine on a thread; process: `--engine-process`), and the same N added at once to the
same engine in this process (`Engine.add_request`, each templated as it is added). The server runs
from this file, which wraps some of its methods to record when each request passes each stage (a
probe of the code as it is: it fails loudly where those methods change). --client raw writes each
request's bytes at once over connections opened beforehand, so the client's own work is not in the
figures; openai: the official client, as scripts/serve_load.py. Each level runs --warmups bursts
unmeasured (on the CPU `serve` compiles each program on first use), then --reps measured.

Per burst, counted: the engine steps from the first prefill until every request has its first
token read, and the prefill calls (rows each) of those steps; how the arrivals spread over engine
steps ("adds per step"); the tokenizer thread's jobs (prompts each); the chunks the streams wrote.
Timed, the median request's ms after the burst's start at each stage: route (the body parsed, the
handler entered), submit (its prompt encoded, handed to the engine), add (the engine took it),
first (its first token read by the engine), put (handed to the event loop), yield (its first
content chunk written), client (the client read it). And CPU ms per thread of each process over
the burst (/proc; `other`: threads Python did not start, XLA's on the CPU).

Measured on a 2-core CPU shared with other jobs (timings vary by up to 2x between runs; the counts
much less), the tiny random chat model of tests/conftest.py (byte tokenizer), `--engine "--num-draft
3 --tree none --speculation always --batch-buckets 1,64 --max-num-seqs 64 --max-model-len 512"`, 64
streams, 32 tokens, MT-bench first turns cut to 90 characters (about 110 tokens templated), raw
client, 8 bursts each (two rounds, the code before and after interleaved), medians:

| server | steps to the last first token | tokenizer jobs | TTFT p50 / max ms |
|---|---|---|---|
| thread, before | 10 (5-11) | 64 | 164 / 244 |
| thread, after | 3 (3-4) | 3 (2-4) | 161 / 183 |
| --engine-process, before | 11 (6-13) | 64 | 194 / 268 |
| --engine-process, after | 4.5 (3-11) | 3 (2-4) | 143 / 156 |
| in process | 2 | - | 65-69 / 69-77 |

Before: the arrivals reached the engine in 2-4 groups (e.g. 1, 22, 41); once the first group
decoded, the rest were prefilled one call (eight prompts) a step. After: every burst's prefills in
one or two steps (engine/prefill.py), the prompts encoded a few jobs a burst (Codec.encode_each).
Left (thread, after; median ms from the burst's start): parsed 26, encoded and submitted 34, taken
by the engine 39, first token read 115 (the engine's ~70 ms for the burst, as in process), handed
to the event loop 123, first chunk written 159: on the CPU the event loop waits for cores that
XLA's threads and the engine take (about 450 ms of XLA CPU in a burst of about 700 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

TRACE = "BURST_PROBE_TRACE"  # where a traced server (and its engine's process) writes its records


# ---- the traced server (this file run as `serve ...` with TRACE set) -----------------------------
def install_tracing(path: str, process: str) -> None:
    """Wrap the server's and engine's methods to record each stage, written to `path`.<pid> as JSON
    lines whenever the engine goes idle, and at exit; `process` names this one in the CPU figures."""
    import atexit

    from eagle3_jax import api
    from eagle3_jax.engine import engine as E
    from eagle3_jax.serve import app as A
    from eagle3_jax.serve import engine_loop as EL
    from eagle3_jax.serve import engine_process as EP

    records: list[dict] = []
    out = f"{path}.{os.getpid()}"

    def cpu() -> dict:
        names = {t.native_id: t.name for t in threading.enumerate()}
        seconds: dict[str, float] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
            except OSError:
                continue
            name = names.get(int(tid), "other")
            seconds[name] = seconds.get(name, 0.0) + ns / 1e9
        return seconds

    def dump() -> None:
        records.append(dict(kind="cpu", pid=process, t=time.perf_counter(), cpu=cpu()))
        taken = records[:]
        del records[:len(taken)]
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in taken)

    step, prefill_call, add_request = E.Engine.step, E.Engine._run_prefill_call, E.Engine.add_request

    def traced_step(self):
        t0, calls, self._probe_rows = time.perf_counter(), self.stats.prefill_calls, []
        changed = step(self)
        seen = self.__dict__.setdefault("_probe_first", set())
        firsts = [r for r in changed if r.metrics.first_token_time is not None and r.id not in seen]
        seen.update(r.id for r in firsts)
        records.append(dict(kind="step", t0=t0, t1=time.perf_counter(), rows=self._probe_rows,
                            calls=self.stats.prefill_calls - calls, firsts=[r.id for r in firsts]))
        records.extend(dict(kind="first", id=r.id, t=r.metrics.first_token_time) for r in firsts)
        if not self.has_unfinished():
            dump()
        return changed

    def traced_prefill_call(self, chunks):
        self._probe_rows.append(len(chunks))
        return prefill_call(self, chunks)

    def traced_add(self, prompt, params, arrival_time=None):
        req = add_request(self, prompt, params, arrival_time)
        records.append(dict(kind="add", id=req.id, t=time.perf_counter()))
        return req

    E.Engine.step, E.Engine._run_prefill_call, E.Engine.add_request = traced_step, traced_prefill_call, traced_add

    submit, stream, put_all = A.OpenAIServer.submit, A.OpenAIServer.stream, EL.put_all

    def traced_submit(self, work, arrival):
        records.append(dict(kind="submit", t=time.perf_counter(), route=arrival))
        return submit(self, work, arrival)

    async def traced_stream(self, *args, **kwargs):
        n = 0
        async for chunk in stream(self, *args, **kwargs):
            n += 1
            if n == 2:  # after the role's opening chunk
                records.append(dict(kind="yield", t=time.perf_counter()))
            yield chunk
        records.append(dict(kind="chunks", t=time.perf_counter(), n=n))

    def traced_put_all(batch):
        fresh = 0
        for submission, update in batch:
            if update.token_ids and not getattr(submission, "_probe_put", False):
                submission._probe_put, fresh = True, fresh + 1
        records.extend([dict(kind="put", t=time.perf_counter())] * fresh)
        return put_all(batch)

    A.OpenAIServer.submit, A.OpenAIServer.stream = traced_submit, traced_stream
    EL.put_all = EP.put_all = traced_put_all

    body_limit = A.BodyLimit.__call__
    last_request = [0.0]

    async def traced_body_limit(self, scope, receive, send):
        now = time.perf_counter()
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and now - last_request[0] > 0.3:
            records.append(dict(kind="cpu", pid=process, t=now, cpu=cpu()))  # a burst's first request
        last_request[0] = now
        return await body_limit(self, scope, receive, send)

    A.BodyLimit.__call__ = traced_body_limit
    if hasattr(api.Codec, "encode_each"):  # the tokenizer thread's jobs
        encode_each = api.Codec.encode_each

        def traced_encode_each(self, prompts):
            records.append(dict(kind="encode_job", t=time.perf_counter(), n=len(prompts)))
            return encode_each(self, prompts)

        api.Codec.encode_each = traced_encode_each
    else:
        encode = api.Codec.encode

        def traced_encode(self, prompt, tools=None):
            records.append(dict(kind="encode_job", t=time.perf_counter(), n=1))
            return encode(self, prompt, tools)

        api.Codec.encode = traced_encode
    init = api.LLM.__init__

    def warm_init(self, *args, **kwargs):  # every program compiled before serving, on the CPU too
        kwargs["warmup"] = True
        init(self, *args, **kwargs)

    api.LLM.__init__ = warm_init
    atexit.register(dump)


# ---- the clients ---------------------------------------------------------------------------------
async def raw_request(url: str, text: str, max_tokens: int, go: asyncio.Future) -> tuple[float, float]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(dict(model="probe", messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                           temperature=0, stream=True, ignore_eos=True)).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    await go
    start = time.perf_counter()
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    first, data = None, b""
    while b"[DONE]" not in data:
        more = await reader.read(65536)
        if not more:
            break
        data += more
        if first is None and b'"content":"' in data.replace(b'"content":""', b""):
            first = time.perf_counter()
    writer.close()
    return start, first or time.perf_counter()


async def openai_request(client, text: str, max_tokens: int, go: asyncio.Future) -> tuple[float, float]:
    await go
    start = time.perf_counter()
    stream = await client.chat.completions.create(model="probe", messages=[{"role": "user", "content": text}],
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    return start, first or time.perf_counter()


async def burst(url: str, prompts: list[str], max_tokens: int, client: str) -> tuple[float, list]:
    go = asyncio.get_running_loop().create_future()
    if client == "openai":
        import openai

        api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
        tasks = [asyncio.ensure_future(openai_request(api, p, max_tokens, go)) for p in prompts]
    else:
        tasks = [asyncio.ensure_future(raw_request(url, p, max_tokens, go)) for p in prompts]
    await asyncio.sleep(0.3)  # connections open
    start = time.perf_counter()
    go.set_result(None)
    return start, await asyncio.gather(*tasks)


# ---- the summary ---------------------------------------------------------------------------------
def summary(trace: list[dict], start: float, end: float, clients: list) -> dict:
    def within(kind: str) -> list[dict]:
        return [r for r in trace if r["kind"] == kind and start <= r["t" if "t" in r else "t1"] < end]

    adds, steps = within("add"), [r for r in trace if r["kind"] == "step" and start <= r["t1"] < end]
    ids, got, out = {a["id"] for a in adds}, set(), {}
    first_prefill = next((i for i, s in enumerate(steps) if s["calls"]), 0)
    for i, s in enumerate(steps):
        got |= set(s["firsts"]) & ids
        if ids and got == ids:
            taken = steps[first_prefill:i + 1]
            out["steps"] = len(taken)
            out["prefill_rows"] = [s["rows"] for s in taken if s["rows"]]
            break
    per_step: dict[int, int] = {}
    for a in adds:
        k = next((j for j, s in enumerate(steps) if s["t0"] >= a["t"]), -1)
        per_step[k] = per_step.get(k, 0) + 1
    out["adds_per_step"] = list(per_step.values())
    out["tokenizer_jobs"] = [r["n"] for r in within("encode_job")]
    out["stream_chunks"] = sum(r["n"] for r in within("chunks"))
    times = {"route": sorted(r["route"] for r in within("submit")), "client": sorted(f for _, f in clients)}
    times.update({stage: sorted(r["t"] for r in within(stage)) for stage in ("submit", "add", "first", "put", "yield")})
    out["median_ms"] = {stage: round(1e3 * (ts[len(ts) // 2] - start), 1) for stage, ts in times.items() if ts}
    out["client_ttft_ms"] = dict(p50=round(1e3 * statistics.median(f - s for s, f in clients), 1),
                                 max=round(1e3 * max(f - s for s, f in clients), 1))
    out["cpu_ms"] = {}
    for pid in {r["pid"] for r in trace if r["kind"] == "cpu"}:
        marks = sorted((r for r in trace if r["kind"] == "cpu" and r["pid"] == pid), key=lambda r: r["t"])
        before = [m for m in marks if m["t"] <= start + 0.2]
        after = [m for m in marks if m["t"] > start + 0.2]
        if before and after:
            b, a = before[-1]["cpu"], after[0]["cpu"]
            used = {k: round(1e3 * (v - b.get(k, 0.0))) for k, v in a.items()}
            out["cpu_ms"].update({f"{pid}/{k}": ms for k, ms in used.items() if ms > 0})
    return out


def read_trace(prefix: Path) -> list[dict]:
    return [json.loads(line) for f in prefix.parent.glob(prefix.name + ".*") for line in f.read_text().splitlines()]


# ---- the modes -----------------------------------------------------------------------------------
def serve(args, prompts: list[str], flags: list[str], name: str) -> list[dict]:
    import server_process

    prefix = Path(args.out_dir) / f"trace-{name}"
    for old in prefix.parent.glob(prefix.name + ".*"):
        old.unlink()
    port = server_process.free_port()
    cmd = [sys.executable, __file__, "serve", "--port", str(port), "--target",
           args.target, "--served-model-name", "probe", *(["--draft", args.draft] if args.draft else []),
           *args.engine.split(), *flags]
    log_path = Path(args.out_dir) / f"server-{name}.log"
    log = open(log_path, "w")  # noqa: SIM115 - open while the server runs
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, TRACE: str(prefix)})
    url = f"http://127.0.0.1:{port}"
    try:
        server_process.wait_healthy(url, proc, args.start_timeout, log_path)
        bursts = []
        for rep in range(args.warmups + args.reps):
            start, clients = asyncio.run(burst(url, prompts, args.max_tokens, args.client))
            if rep >= args.warmups:
                bursts.append((start, clients))
            time.sleep(0.5)
    finally:
        server_process.stop(proc)
    trace = read_trace(prefix)
    ends = [s for s, _ in bursts[1:]] + [float("inf")]
    return [summary(trace, s, e, c) for (s, c), e in zip(bursts, ends)]


def in_process(args, prompts: list[str]) -> list[dict]:
    from eagle3_jax import SamplingParams, cli

    parsed = cli.build_parser().parse_args(["serve", "--target", args.target,
                                            *(["--draft", args.draft] if args.draft else []), *args.engine.split()])
    cli.check_paths(parsed)
    llm = cli.serve_llm(parsed)
    llm.engine.warmup(progress=False)
    engine, params, rows = llm.engine, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), []
    for rep in range(args.warmups + args.reps):
        start, calls, steps = time.perf_counter(), engine.stats.prefill_calls, 0
        reqs = [engine.add_request(llm.encode_chat([{"role": "user", "content": p}]), params, time.perf_counter())
                for p in prompts]
        while not all(r.output for r in reqs):
            engine.step()
            steps += 1
        calls = engine.stats.prefill_calls - calls
        while engine.has_unfinished():
            engine.step()
        ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in reqs]
        if rep >= args.warmups:
            rows.append(dict(steps=steps, prefill_calls=calls, client_ttft_ms=dict(
                p50=round(1e3 * statistics.median(ttft), 1), max=round(1e3 * max(ttft), 1)),
                median_ms=dict(first=round(1e3 * (statistics.median(r.metrics.first_token_time for r in reqs)
                                                  - start), 1))))
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "serve" and TRACE in os.environ:
        install_tracing(os.environ[TRACE], "server")
        from eagle3_jax import cli

        sys.exit(cli.main(sys.argv[1:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--engine", default="--max-num-seqs 64", help="engine flags, as `serve` takes them")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-file", default=None, help="user turns, one a line (default: MT-bench first turns)")
    p.add_argument("--modes", default="thread,process,in-process")
    p.add_argument("--client", choices=("raw", "openai"), default="raw")
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    from eagle3_jax import assets

    turns = assets.user_turns(args.prompt_file)
    prompts = [turns[i % len(turns)] for i in range(args.streams)]
    for mode in args.modes.split(","):
        if mode == "in-process":
            rows = in_process(args, prompts)
        else:
            rows = serve(args, prompts, ["--engine-process"] if mode == "process" else [], mode)
        for row in rows:
            print(mode, json.dumps(row), flush=True)


if __name__ == "__mp_main__" and TRACE in os.environ:  # the engine's process of a traced server
    install_tracing(os.environ[TRACE], "engine process")

if __name__ == "__main__":
    main()
