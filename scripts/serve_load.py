#!/usr/bin/env python3
"""`eagle3-jax serve` under concurrent streams against the same engine in process: is the server
as fast as its engine?

    python3 scripts/serve_load.py --target T --draft D --streams 1,8,32,64 --out-dir "$OUT"
    python3 scripts/serve_load.py --target T --draft D --streams 1,64 --requests 64 --max-tokens 32   # CPU

For each stream count N, N clients each send their share of --requests, or of N x
--requests-per-stream where that is more (MT-bench first turns in order, chat template, greedy,
--max-tokens, ignore_eos) one after another, streaming, through the official `openai` client, spread
over client processes of at most --streams-per-client streams (one process's event loop cannot parse
64 streams' chunks as fast as the engine makes them); the server is a subprocess on 127.0.0.1 with
the engine flags given (--engine; --serve-flags: its own, e.g. --no-engine-process; given again, one
server after another, each against the same figures in process). Then the same
engine configuration in this process (`LLM`, after the server has stopped): N requests kept in
flight, a new one added (chat-templated and tokenized, as the server does) as one finishes, the same
requests. Each side runs each level once unmeasured first, so that what N arrivals at once compile
on first use is not in either's numbers.
Output tok/s (output tokens / wall s, first request to last token) of each, their ratio, TTFT and
ITL p50 / p99 (server: as the client sees them, in process: the engine's RequestMetrics), in
process the engine's steps and its host's ms a step (EngineStats; beside it the ms it waited on the
device), acceptance length, and the speculation per batch bucket, as each server's /metrics reports
it and as the engine in process chose it.
Beside them the CPU share over each server level (1.0: one core busy throughout) of the busiest
client process, of the busiest HTTP process (each one's in http_cpu_shares, the server's own
first: --serve-flags="--api-server-count N" runs N) and of the engine's (unless
--no-engine-process): a share near 1.0 names what set the pace.
Prints a table and writes serve_load.json under --out-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import server_process  # scripts/: this script's own directory is on the path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "load"


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _latencies(ttft: list[float], itl: list[float]) -> dict:
    ms = lambda v: None if v is None else round(1e3 * v, 2)
    return dict(ttft_p50_ms=ms(_percentile(ttft, 50)), ttft_p99_ms=ms(_percentile(ttft, 99)),
                itl_p50_ms=ms(_percentile(itl, 50)), itl_p99_ms=ms(_percentile(itl, 99)))


def _prompts(args) -> list[list[dict]]:
    from eagle3_jax import assets

    turns = assets.user_turns(args.prompt_file, args.questions)
    most = max(level_requests(args, n) for n in _levels(args))
    return [[{"role": "user", "content": turns[i % len(turns)]}] for i in range(most)]


def _levels(args) -> list[int]:
    return [int(n) for n in args.streams.split(",")]


def level_requests(args, streams: int) -> int:
    """Requests at a level: --requests, or more where --requests-per-stream asks, so that the waves
    of a wide level are many and its first and last (ramp-up, drain) weigh little."""
    return max(args.requests, streams * args.requests_per_stream)


# ---- the server ----------------------------------------------------------------------------------
def start_server(args, serve_flags: str, log: Path) -> tuple[subprocess.Popen, str]:
    return server_process.start(["--target", args.target, "--served-model-name", MODEL,
                                 *(["--draft", args.draft] if args.draft else []), *args.engine.split(),
                                 *serve_flags.split()], log, args.start_timeout)


def serve_levels(args, serve_flags: str, log: Path, clients, prompts: list, levels: list[int]) -> tuple[dict, dict]:
    """One server's run at every level -> ({streams: its figures}, what its /metrics reports)."""
    rows = {}
    proc, url = start_server(args, serve_flags, log)
    try:
        engine, http = server_process.engine_pid(proc.pid), server_process.http_pids(proc.pid)
        for n in levels:
            # Warm-up at each level, as in process: what a batch of n arrivals compiles on first use.
            clients.level(url, prompts[:n], n, args.max_tokens)
            pids = [*http, *([engine] if engine else [])]
            cpu = [server_process.cpu_s(pid) for pid in pids]
            rows[n] = run = clients.level(url, prompts[:level_requests(args, n)], n, args.max_tokens)
            # CPU share over the level (1.0: a core busy throughout) of each HTTP process (the server's
            # own: every thread, the engine's too with --no-engine-process) and of the engine's process.
            shares = [None if before is None or after is None else round((after - before) / run["wall_s"], 3)
                      for before, after in zip(cpu, map(server_process.cpu_s, pids))]
            if None not in shares[:len(http)]:
                run["http_cpu_share"] = max(shares[:len(http)])  # the busiest: near 1.0, HTTP set the pace
                run["http_cpu_shares"] = shares[:len(http)]
            if engine and shares[-1] is not None:
                run["engine_cpu_share"] = shares[-1]
            print(n, "server", serve_flags, run, flush=True)
        metrics = server_metrics(url)
    finally:
        server_process.stop(proc)
    return rows, metrics


async def _client_stream(client, messages, max_tokens: int) -> tuple[int, float, list[float], float]:
    """One streamed request -> (tokens, TTFT s, inter-token gaps s, finish time)."""
    start = time.monotonic()
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = last = None
    gaps, tokens = [], 0
    async for chunk in stream:
        now = time.monotonic()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    return tokens, (first or time.monotonic()) - start, gaps, time.monotonic()


async def _client_streams(url: str, prompts: list, streams: int, max_tokens: int, start_at: float) -> dict:
    """`streams` streams on one AsyncOpenAI client, each taking the next of `prompts` as its last
    finishes, from `start_at` (time.monotonic) -> each request's result and this process's CPU."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    queue = list(prompts)
    results = []

    async def worker():
        while queue:
            results.append(await _client_stream(client, queue.pop(0), max_tokens))

    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    cpu = time.process_time()
    await asyncio.gather(*[worker() for _ in range(streams)])
    cpu = time.process_time() - cpu
    await client.close()
    return dict(results=results, cpu_s=cpu, wall_s=max(r[3] for r in results) - start_at)


def _client_process(conn) -> None:
    """A client process's loop: run each level's share sent over `conn`, answer its results (or
    the error that ended them, as text)."""
    while (job := conn.recv()) is not None:
        try:
            conn.send(asyncio.run(_client_streams(*job)))
        except Exception as e:  # noqa: BLE001 - the parent reports it
            conn.send(f"{type(e).__name__}: {e}")


class Clients:
    """Streams spread over processes of at most `per_process` streams each: one Python process's
    event loop parsing every chunk through the `openai` client saturates its core (on an H100's
    host: 64 streams at about 21k tokens a second, 8 streams at 11.7k with 95% of a core; BENCHMARKS.md,
    "Serving"), and the server would be measured against its client. Each process's CPU share is
    reported beside the level's figures."""

    def __init__(self, processes: int, per_process: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no fork of a process that may hold JAX's threads
        self.per_process, self.pipes, self.procs = per_process, [], []
        for _ in range(processes):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_client_process, args=(theirs,), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)

    def level(self, url: str, prompts: list, streams: int, max_tokens: int) -> dict:
        """`streams` streams over n = ceil(streams / per_process) processes: process p runs streams
        p, p + n, ... on the requests j with j mod `streams` among them, each stream taking the next
        as its last finishes; all start at one moment (the clock is the machine's, time.monotonic)."""
        n = min(len(self.pipes), -(-streams // self.per_process))
        shares = [list(range(i, streams, n)) for i in range(n)]  # process p runs streams p, p + n, ...
        start_at = time.monotonic() + 1.0  # every process past its sleep before the first request
        for pipe, share in zip(self.pipes, shares):
            mine = [prompts[j] for j in range(len(prompts)) if j % streams in share]
            pipe.send((url, mine, len(share), max_tokens, start_at))
        parts = [pipe.recv() for pipe in self.pipes[:n]]
        if errors := [part for part in parts if isinstance(part, str)]:
            raise RuntimeError(f"a client process failed: {errors[0]}")
        results = [r for part in parts for r in part["results"]]
        wall = max(r[3] for r in results) - start_at
        tokens = sum(r[0] for r in results)
        return dict(tokens=tokens, wall_s=round(wall, 3), tok_s=round(tokens / wall, 1), client_processes=n,
                    # near 1.0: that client process, not the server, may have set the pace
                    client_cpu_share_max=round(max(part["cpu_s"] / part["wall_s"] for part in parts), 3),
                    **_latencies([r[1] for r in results], [g for r in results for g in r[2]]))

    def close(self) -> None:
        for pipe, proc in zip(self.pipes, self.procs):
            pipe.send(None)
            proc.join(10)


def server_metrics(url: str) -> dict:
    """Acceptance and the speculation per bucket, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    chosen = re.compile(r'^eagle3_jax:speculation_choice\{[^}]*bucket="(\d+)"[^}]*choice="([^"]+)"[^}]*\} 1(?:\.0)?$',
                        re.M)
    choices = {m.group(1): m.group(2) for m in chosen.finditer(text)}
    num = lambda name: sum(float(v) for v in re.findall(rf"^eagle3_jax:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    drafts = num("spec_decode_num_drafts_total")
    accepted = num("spec_decode_num_accepted_tokens_total")
    return dict(speculation=choices, acceptance_length=round(1 + accepted / drafts, 3) if drafts else None)


# ---- in process ----------------------------------------------------------------------------------
def in_process_level(llm, prompts: list, streams: int, max_tokens: int) -> dict:
    """N requests kept in flight on the engine, a new one added as one finishes. Each is
    chat-templated and tokenized as it is added, inside the timed region and its time to first
    token, as the server does on each request's arrival (LLM.chat templates its prompts too)."""
    from eagle3_jax import SamplingParams

    engine, params = llm.engine, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.reset_stats()
    pending = list(prompts)
    live, done = [], []
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < streams:
            arrival = time.perf_counter()
            live.append(engine.add_request(llm.encode_chat(pending.pop(0)), params, arrival))
        engine.step()
        done += [r for r in live if r.finished]
        live = [r for r in live if not r.finished]
    wall = time.perf_counter() - start
    tokens = sum(len(r.output) for r in done)
    ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in done if r.metrics.first_token_time]
    itl = [(r.metrics.last_token_time - r.metrics.first_token_time) / (len(r.output) - 1)
           for r in done if len(r.output) > 1 and r.metrics.first_token_time]
    accepted = [r.metrics.acceptance_length for r in done]
    stats = engine.stats  # the engine's steps: its host's Python a step beside the device's wait
    return dict(tokens=tokens, wall_s=round(wall, 3), tok_s=round(tokens / wall, 1), **_latencies(ttft, itl),
                acceptance_length=round(statistics.mean(accepted), 3), steps=stats.steps,
                prefill_calls=stats.prefill_calls, host_ms_per_step=round(stats.host_ms_per_step, 3),
                device_wait_ms_per_step=round(stats.device_wait_ms_per_step, 3))


def _in_process_llm(args):
    """The server's engine, built here from the same flags (through the command line's parser)."""
    from eagle3_jax import cli

    argv = ["serve", "--target", args.target, *(["--draft", args.draft] if args.draft else []), *args.engine.split()]
    parsed = cli.build_parser().parse_args(argv)
    cli.check_paths(parsed)
    return cli.serve_llm(parsed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--engine", default="", help="engine flags for both, as `serve` takes them")
    p.add_argument("--serve-flags", action="append", default=None,
                   help="flags for the server only, e.g. --serve-flags=--no-engine-process (with '=': the value "
                        "starts with --); given again, another server after the first, each measured against the "
                        "same figures in process")
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--requests", type=int, default=64, help="requests at each stream count")
    p.add_argument("--requests-per-stream", type=int, default=0,
                   help="at least this many requests a stream at each level (wide levels run longer)")
    p.add_argument("--streams-per-client", type=int, default=4,
                   help="streams a client process runs at most (its CPU share is reported)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--questions", default=None, help="MT-bench question.jsonl (default: the cached asset)")
    p.add_argument("--prompt-file", default=None, help="user turns, one a line, instead of MT-bench")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args)
    levels = _levels(args)
    clients = Clients(-(-max(levels) // args.streams_per_client), args.streams_per_client)
    servers = []
    try:
        for i, flags in enumerate(args.serve_flags or [""]):
            log = Path(args.out_dir) / ("server.log" if i == 0 else f"server-{i}.log")
            rows, metrics = serve_levels(args, flags, log, clients, prompts, levels)
            servers.append(dict(serve_flags=flags, server_metrics=metrics,
                                rows=[{"streams": n, "server": rows[n]} for n in levels]))
    finally:
        clients.close()
    llm = _in_process_llm(args)
    in_process = {}
    for n in levels:
        in_process_level(llm, prompts[:n], n, args.max_tokens)  # warm-up
        in_process[n] = in_process_level(llm, prompts[:level_requests(args, n)], n, args.max_tokens)
        print(n, "in process", in_process[n], flush=True)
    for server in servers:
        for row in server["rows"]:
            row["ratio"] = round(row["server"]["tok_s"] / in_process[row["streams"]]["tok_s"], 3)
    # The engine's choice per bucket by the end, as each server's /metrics reports its own.
    in_process_choices = {str(row.bucket): row.choice for row in llm.engine.speculation.table()} \
        if llm.engine.proposals else {}
    import jax

    out = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), engine=args.engine,
               max_tokens=args.max_tokens, requests={n: level_requests(args, n) for n in levels},
               in_process=[{"streams": n, **in_process[n]} for n in levels],
               in_process_speculation=in_process_choices, servers=servers)
    for server in servers:
        print(f"server flags: {server['serve_flags'] or '(none)'}")
        print(f"{'streams':>7} {'server tok/s':>12} {'in process':>10} {'ratio':>6} {'TTFT p50 ms':>11} "
              f"{'ITL p50 ms':>10} {'CPU: client max':>15} {'http':>5} {'engine':>6}")
        for row in server["rows"]:
            s = row["server"]
            print(f"{row['streams']:7d} {s['tok_s']:12.1f} {in_process[row['streams']]['tok_s']:10.1f} "
                  f"{row['ratio']:6.3f} {s['ttft_p50_ms']!s:>11} {s['itl_p50_ms']!s:>10} "
                  f"{s['client_cpu_share_max']:15.2f} {s.get('http_cpu_share', '-')!s:>5} "
                  f"{s.get('engine_cpu_share', '-')!s:>6}")
        print("speculation per bucket (server):", server["server_metrics"])
    print("speculation per bucket (in process):", in_process_choices)
    (Path(args.out_dir) / "serve_load.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
