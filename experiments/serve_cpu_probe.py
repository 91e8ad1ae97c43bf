#!/usr/bin/env python3
"""What does `eagle3-jax serve`'s HTTP process spend in CPU per streamed chunk and per token, with
uvicorn on asyncio and h11 or on uvloop and httptools?

    python3 experiments/serve_cpu_probe.py --target T --draft D --engine "--max-num-seqs 64" \\
        [--servers asyncio/h11,uvloop/httptools] [--serve-flags=--engine-process] [--streams 64]

Per server (`--loop`/`--http` as named, with --serve-flags), N clients each stream their share of
--requests chat requests (one user turn, greedy, --max-tokens, ignore_eos, usage included) one after
another; once unmeasured first (programs compile on first use on the CPU), then --reps times
measured. The clients write raw HTTP/1.1 and only count what they read (the server's work, not a
client's, is the question; a client shares the machine's cores). Per measured run: the SSE events
("chunks", the role's opening chunk and the usage chunk among them) and tokens the clients read,
the HTTP process's CPU seconds (/proc: every thread of it, so with the engine on a thread its steps
too; and its main thread's, the event loop's, alone), the engine's process's (--engine-process)
and its steps (/metrics); then CPU us per chunk and per token of the HTTP process, CPU us per chunk
of its event loop, and CPU ms per step of the engine's.

Measured on a 2-core CPU shared with other jobs (per-chunk figures vary by about 20% between
runs), the tiny random chat model of tests/conftest.py (byte tokenizer), `--engine "--num-draft 3
--tree none --speculation always --batch-buckets 1,64 --max-num-seqs 64 --max-model-len 512"`,
--engine-process, 64 streams, 256 requests of 64 tokens (short prompts, one a line of
--prompt-file), about 1.2 tokens a chunk. Two runs of the code before and after the changes
below, interleaved; each figure the median of a run's two measured levels:

| server | HTTP us/chunk | event loop us/chunk | HTTP us/token |
|---|---|---|---|
| uvloop/httptools, before | 69.7, 65.5 | 56.6, 53.8 | 57.0, 54.3 |
| asyncio/h11, before | 74.5, 72.5 | 62.8, 62.2 | 61.9, 59.8 |
| uvloop/httptools, after | 50.4, 50.7 | 41.2, 33.6 | 41.8, 41.8 |
| asyncio/h11, after | 49.5, 58.4 | 40.7, 50.0 | 41.2, 46.4 |

uvloop with httptools spends 5-10% less per chunk than asyncio with h11 here, less than the
spread between runs. A profile of the event loop (cProfile) put the largest single cost in
uvicorn's `send`, the socket write of each chunk (about a third), then the stream's own Python:
transformers' decode wrapper twice per update, an asyncio.Queue per request, each chunk's JSON
whole, FastAPI running the API-key check on a worker thread per request. After: the tokenizers
library's decode, one wakeup per stream per step and one write per batch of updates taken,
the chunk's fixed fields encoded once, the key check a coroutine (serve/app.py, engine_loop.py,
api.py); the engine's process sends plain values for updates that are only tokens (a step of 64
rows pickled in ~90 us, not ~250; engine_process.py). The engine's CPU per step (11-12 ms here)
is XLA's on the CPU and did not move.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

MODEL = "probe"
def engine_steps(url: str) -> float | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^eagle3_jax:engine_steps_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


async def stream(host: str, port: int, text: str, max_tokens: int) -> tuple[int, int]:
    """One streamed chat request over a connection of its own -> (SSE events, completion tokens)."""
    reader, writer = await asyncio.open_connection(host, port)
    body = json.dumps(dict(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                           temperature=0, stream=True, ignore_eos=True,
                           stream_options={"include_usage": True})).encode()
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    data = bytearray()
    while more := await reader.read(1 << 16):
        data += more
    writer.close()
    events = data.count(b"\ndata: ") + data.startswith(b"data: ")
    usage = re.search(rb'"completion_tokens":(\d+)', bytes(data))
    if b"[DONE]" not in data or usage is None:
        raise RuntimeError(f"an incomplete stream: {bytes(data[-300:])!r}")
    return events - 1, int(usage.group(1))  # [DONE] is no chunk


async def level(url: str, prompts: list[str], streams: int, max_tokens: int) -> dict:
    host, port = url.removeprefix("http://").split(":")
    queue, results = list(prompts), []

    async def client():
        while queue:
            results.append(await stream(host, int(port), queue.pop(0), max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*[client() for _ in range(streams)])
    return dict(wall_s=time.perf_counter() - start, chunks=sum(r[0] for r in results),
                tokens=sum(r[1] for r in results))


def measure(args, loop: str, http: str, prompts: list[str]) -> list[dict]:
    import server_process
    from server_process import cpu_s, engine_pid

    name = f"{loop}-{http}"
    proc, url = server_process.start(
        ["--target", args.target, "--served-model-name", MODEL, *(["--draft", args.draft] if args.draft else []),
         *args.engine.split(), "--loop", loop, "--http", http, *args.serve_flags.split()],
        Path(args.out_dir) / f"server-{name}.log", args.start_timeout)
    rows = []
    try:
        engine = engine_pid(proc.pid)
        asyncio.run(level(url, prompts, args.streams, args.max_tokens))  # compiles, unmeasured
        for _ in range(args.reps):
            steps, http_cpu, engine_cpu = engine_steps(url), cpu_s(proc.pid), engine and cpu_s(engine)
            loop_cpu = cpu_s(proc.pid, proc.pid)
            run = asyncio.run(level(url, prompts, args.streams, args.max_tokens))
            http_cpu, loop_cpu = cpu_s(proc.pid) - http_cpu, cpu_s(proc.pid, proc.pid) - loop_cpu
            row = dict(server=name, streams=args.streams, wall_s=round(run["wall_s"], 2), chunks=run["chunks"],
                       tokens=run["tokens"], tok_s=round(run["tokens"] / run["wall_s"], 1),
                       tokens_per_chunk=round(run["tokens"] / run["chunks"], 2), http_cpu_s=round(http_cpu, 2),
                       http_us_per_chunk=round(1e6 * http_cpu / run["chunks"], 1),
                       http_us_per_token=round(1e6 * http_cpu / run["tokens"], 1),
                       loop_us_per_chunk=round(1e6 * loop_cpu / run["chunks"], 1))
            if engine is not None:
                engine_cpu = cpu_s(engine) - engine_cpu
                steps = None if steps is None else engine_steps(url) - steps
                row.update(engine_cpu_s=round(engine_cpu, 2), engine_steps=steps,
                           engine_ms_per_step=round(1e3 * engine_cpu / steps, 2) if steps else None)
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        server_process.stop(proc)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--engine", default="--max-num-seqs 64", help="engine flags, as `serve` takes them")
    p.add_argument("--serve-flags", default="--engine-process",
                   help="the server's own flags (with '=': the value starts with --)")
    p.add_argument("--servers", default="asyncio/h11,uvloop/httptools", help="LOOP/HTTP, comma-separated")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--prompt-file", default=None, help="user turns, one a line (default: MT-bench first turns)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    from eagle3_jax import assets

    turns = assets.user_turns(args.prompt_file)
    prompts = [turns[i % len(turns)] for i in range(args.requests)]
    rows = []
    for server in args.servers.split(","):
        rows += measure(args, *server.split("/"), prompts)
    print(f"{'server':>18} {'tok/s':>7} {'tok/chunk':>9} {'HTTP us/chunk':>13} {'HTTP us/token':>13} "
          f"{'loop us/chunk':>13} {'engine ms/step':>14}")
    for server in args.servers.split(","):
        mine = [r for r in rows if r["server"] == server.replace("/", "-")]

        def med(key: str, mine=mine) -> float:
            return statistics.median(r[key] for r in mine) if all(r.get(key) for r in mine) else float("nan")

        print(f"{server:>18} {med('tok_s'):7.0f} {med('tokens_per_chunk'):9.2f} {med('http_us_per_chunk'):13.1f} "
              f"{med('http_us_per_token'):13.1f} {med('loop_us_per_chunk'):13.1f} {med('engine_ms_per_step'):14.2f}")
    (Path(args.out_dir) / "serve_cpu_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
