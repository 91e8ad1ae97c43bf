"""`eagle3-jax serve`: the engine, warmed up, behind uvicorn. SIGTERM (or Ctrl-C) stops taking
requests, gives the running ones --shutdown-timeout seconds, ends the rest with a final event
(finish_reason "abort") and exits 0 (1 where the engine had failed).

With --api-server-count N (the engine in its own process) this process binds the listening socket once and
serves it as HTTP process 0 beside N - 1 more (multiprocessing, spawn), each with its own pipe to
the engine's process; the kernel hands each connection to one of the processes accepting on it. A
drain reaching any of them drains the engine, which tells the others to stop too; SIGTERM to this
process is also passed on to the others, and it exits once they and the engine have."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import importlib
import importlib.util
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing import connection

import prometheus_client
import uvicorn

from eagle3_jax.api import LLM
from eagle3_jax.serve.app import Settings, create_app
from eagle3_jax.serve.engine_loop import EngineLoop
from eagle3_jax.serve.engine_process import STOP_S, EngineClient, EngineFailed, EngineFront, EngineProcess
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger("eagle3_jax.serve")
EXTRA_SHUTDOWN_S = 5  # past the drain, for the last events to reach their clients
# uvicorn's event loops and HTTP/1.1 parsers, the fast one first: (fast, plain). At 64 streams the HTTP
# side's CPU per streamed chunk decides whether it keeps pace with the engine; uvloop with httptools
# spend less of it than asyncio with h11 (experiments/serve_cpu_probe.py measures both).
EVENT_LOOPS = ("uvloop", "asyncio")
HTTP_PARSERS = ("httptools", "h11")


class _Server(uvicorn.Server):
    """uvicorn's server, draining the engine when a signal asks it to exit (and passing SIGTERM on
    to the other HTTP processes, `workers`), calling `on_started` once it listens. Given the main
    process's pid (`parent`: this is another HTTP process), it drains and exits too once that
    process is gone, killed say: the server does not serve on without it."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop | EngineClient, grace_s: float,
                 on_started: Callable[[], None], workers: Sequence[multiprocessing.Process] = (),
                 parent: int | None = None):
        super().__init__(config)
        self.engine_loop, self.grace_s, self.on_started, self.workers = engine_loop, grace_s, on_started, workers
        self.parent = parent

    async def on_tick(self, counter: int) -> bool:
        if self.parent is not None and os.getppid() != self.parent and not self.should_exit:  # every 0.1 s
            logger.error("the server's main process is gone: draining and exiting")
            self.engine_loop.drain(self.grace_s)
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.drain(self.grace_s)
        # SIGTERM, not a second SIGINT: to uvicorn that would say exit now, without the drain.
        for worker in self.workers:
            if worker.exitcode is None:
                os.kill(worker.pid, signal.SIGTERM)
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_started()


def run(llm: LLM, args: argparse.Namespace, model_name: str) -> int:
    """Serve `llm`, its engine stepped on a thread of this process (EngineLoop)."""
    prometheus_client.disable_created_metrics()  # vLLM's /metrics has no *_created series either
    metrics = ServerMetrics(model_name)
    engine_loop = EngineLoop(llm.engine, metrics, args.max_waiting)
    return _serve(llm, engine_loop, metrics, args, model_name)


def run_engine_process(build: Callable[[argparse.Namespace], LLM], args: argparse.Namespace, model_name: str) -> int:
    """Serve the LLM that `build(args)` makes in a process of its own (engine_process.py): this
    one holds the tokenizer and HTTP only, beside --api-server-count - 1 more HTTP processes
    (AddressError where the listening socket cannot be bound)."""
    count = args.api_server_count
    sockets = [listening_socket(args.host, args.port)] if count > 1 else None
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(model_name)
    engine = EngineProcess(functools.partial(engine_process_llm, build), args, count)
    client = EngineClient(engine.connections[0], metrics, args.max_waiting)
    # A signal before this process serves ends it; the other HTTP processes, daemons, get SIGTERM as
    # it exits.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        engine.start()
        facts = client.connect()
        workers = start_http_processes(engine.connections[1:], sockets, args, model_name)
    except EngineFailed as e:
        engine.join(5)
        logger.error("%s (exit code %s)", e, engine.exitcode)
        return 1
    except WorkerFailed as e:
        logger.error("%s", e)
        engine.kill()
        return 1
    except BaseException:  # SIGTERM, Ctrl-C: the engine ignores both, and exiting would wait for it
        engine.kill()
        raise
    try:
        code = _serve(EngineFront(facts), client, metrics, args, model_name, sockets, workers)
    finally:
        client.stop()  # where uvicorn did not (Ctrl-C before it started, or twice: it exits at once)
        failed = join_http_processes(workers, args.shutdown_timeout + EXTRA_SHUTDOWN_S + STOP_S)
        engine.join()
    return code or int(failed)


def engine_process_llm(build: Callable[[argparse.Namespace], LLM], args: argparse.Namespace) -> LLM:
    """In the engine's process: its logging as the server's, the LLM built and described."""
    configure_logging(args.log_level)
    llm = build(args)
    log_engine(llm)
    return llm


def _serve(llm, engine_loop: EngineLoop | EngineClient, metrics: ServerMetrics, args: argparse.Namespace,
           model_name: str, sockets: list[socket.socket] | None = None,
           workers: Sequence[multiprocessing.Process] = (), on_started: Callable[[], None] | None = None,
           parent: int | None = None) -> int:
    """Serve the app on `sockets` (None: uvicorn binds --host and --port itself) until a signal or
    a drain elsewhere ends it; -> the exit status. `on_started` (default: the ready line) is called
    once it listens; `workers`, `parent`: as _Server takes them."""
    app = create_app(llm, engine_loop, metrics, Settings(model_name, args.api_key, args.max_request_bytes))
    loop, http = event_loop_and_http(args.loop, args.http)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False, loop=loop,
                            http=http, timeout_graceful_shutdown=int(args.shutdown_timeout) + EXTRA_SHUTDOWN_S)
    processes = f" by {len(workers) + 1} HTTP processes" if workers else ""
    ready_line = (f"ready: serving {model_name!r} on http://{args.host}:{args.port}/v1{processes} (uvicorn: {loop} "
                  f"event loop, {http} HTTP)")
    server = _Server(config, engine_loop, args.shutdown_timeout, on_started or (lambda: logger.info(ready_line)),
                     workers, parent)
    if isinstance(engine_loop, EngineClient):
        engine_loop.on_drain = functools.partial(setattr, server, "should_exit", True)  # polled by uvicorn's loop
    # uvicorn re-raises the signal it stopped on once it has shut down: SIGTERM's answer is the exit status.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0 if engine_loop.healthy else 1))
    server.run(sockets)
    return 0 if engine_loop.healthy else 1


# ---- more HTTP processes (--api-server-count) ------------------------------------------------------
class WorkerFailed(Exception):
    """An HTTP process beside the main one exited before it served."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host`:`port` as uvicorn binds one for its workers (Config.bind_socket:
    SO_REUSEADDR; IPv6 where the host is an IPv6 address); each HTTP process's event loop listens on
    it. AddressError where it cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise AddressError(_bind_problem(host, port, e)) from None
    return sock


def start_http_processes(conns: Sequence[connection.Connection], sockets: list[socket.socket] | None,
                         args: argparse.Namespace, model_name: str) -> list[multiprocessing.Process]:
    """An HTTP process for each of the engine's pipes `conns`, each serving `sockets`; returns once
    every one listens (WorkerFailed where one exits first). This process's ends of the pipes are
    closed: each lives in its HTTP process only, so that its exit is the engine's EOF."""
    context = multiprocessing.get_context("spawn")  # as the engine's: no fork of a process with threads
    workers, heard = [], []
    for i, conn in enumerate(conns, 1):
        listen, say = context.Pipe(duplex=False)
        worker = context.Process(target=http_process_main, args=(conn, sockets, say, args, model_name),
                                 name=f"http-{i}", daemon=True)
        worker.start()
        conn.close()
        say.close()
        workers.append(worker)
        heard.append(listen)
    for i, (worker, listen) in enumerate(zip(workers, heard), 1):
        try:
            listen.recv()
        except EOFError:
            worker.join(5)
            raise WorkerFailed(f"HTTP process {i} exited with {worker.exitcode} before it served (see the log)") \
                from None
        finally:
            listen.close()
    return workers


def join_http_processes(workers: Sequence[multiprocessing.Process], timeout_s: float) -> bool:
    """Wait for the other HTTP processes to exit (terminating any still there after `timeout_s`
    seconds); -> whether one failed (the engine's failure, or a process that died)."""
    deadline = time.monotonic() + timeout_s
    failed = False
    for i, worker in enumerate(workers, 1):
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            logger.warning("HTTP process %d did not stop in %.0f s: terminating it", i, timeout_s)
            worker.terminate()
            worker.join(5)
        if worker.exitcode != 0:
            logger.error("HTTP process %d exited with %s", i, worker.exitcode)
            failed = True
    return failed


def http_process_main(conn: connection.Connection, sockets: list[socket.socket], started: connection.Connection,
                      args: argparse.Namespace, model_name: str) -> None:
    """An HTTP process beside the main one: the app over its own pipe to the engine (`conn`), on the
    shared listening `sockets`; `started` hears once it listens."""
    # Ctrl-C reaches the whole process group: while this one starts, the main process decides (it
    # ends this one as it exits); while it serves, uvicorn takes either signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    configure_logging(args.log_level)
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(model_name)
    client = EngineClient(conn, metrics, args.max_waiting)
    try:
        facts = client.connect()
    except EngineFailed as e:
        logger.error("%s", e)
        raise SystemExit(1) from None

    def listening() -> None:
        started.send(True)
        started.close()

    raise SystemExit(_serve(EngineFront(facts), client, metrics, args, model_name, sockets, on_started=listening,
                            parent=parent))


class MissingPackage(Exception):
    """--loop or --http names an implementation whose package is not installed."""


def event_loop_and_http(loop: str = "auto", http: str = "auto") -> tuple[str, str]:
    """(event loop, HTTP parser) uvicorn runs for --loop and --http: "auto" is uvloop and httptools
    where they import (pyproject lists them; uvloop has no Windows build), else asyncio and h11.
    MissingPackage where one is named but does not import."""
    return _implementation("--loop", loop, EVENT_LOOPS), _implementation("--http", http, HTTP_PARSERS)


def _implementation(flag: str, asked: str, choices: tuple[str, str]) -> str:
    fast, plain = choices
    if asked == plain:
        return plain
    try:
        importlib.import_module(fast)
    except ImportError:
        if asked == "auto":
            return plain
        raise MissingPackage(f"{flag} {fast}: the package {fast} is not installed (pip install {fast}), or give "
                             f"{flag} {plain}") from None
    return fast


class AddressError(Exception):
    """--host or --port where uvicorn could not listen; the message names the flag and what to do."""


def check_address(host: str, port: int) -> None:
    """AddressError unless `host` resolves and `port` binds on each of its addresses, bound as
    uvicorn binds them (the event loop's create_server: SO_REUSEADDR, IPv6 sockets IPv6 only) and
    closed again: found in a second, not after the model has loaded."""

    async def bind() -> None:
        server = await asyncio.get_running_loop().create_server(asyncio.Protocol, host, port, start_serving=False)
        server.close()
        await server.wait_closed()

    try:
        asyncio.run(bind())
    except socket.gaierror as e:
        raise AddressError(f"--host {host}: the name does not resolve ({e.strerror}); give a host name or an "
                           "address of this machine (127.0.0.1: this machine only, 0.0.0.0: every interface)") from None
    except OSError as e:
        raise AddressError(_bind_problem(host, port, e)) from None


def _bind_problem(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"--port {port}: {host}:{port} is in use (another server listens there): give another --port"
    if e.errno == errno.EACCES:
        return f"--port {port}: not permitted to listen on {host}:{port} (ports below 1024 need privileges)"
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host}: not an address of this machine (127.0.0.1: this machine only, 0.0.0.0: every "
                "interface)")
    return f"--host {host} --port {port}: cannot listen there ({e.strerror or e})"


class _NoTpuProbe(logging.Filter):
    """Drops JAX's report, at every start, that its TPU backend did not start because libtpu is not
    installed: on a CPU or a GPU it is no news. Its other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Unable to initialize backend 'tpu'")


NO_TPU_PROBE = _NoTpuProbe()
JAX_BACKENDS_LOGGER = "jax._src.xla_bridge"  # where JAX reports the backends it tried


def configure_logging(level: str) -> None:
    """The package's loggers at `level`, everything else (uvicorn, JAX) at info at most, without
    JAX's TPU probe where no libtpu is installed."""
    logging.basicConfig(level=max(logging.INFO, getattr(logging, level.upper())), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("eagle3_jax").setLevel(level.upper())
    if importlib.util.find_spec("libtpu") is None:
        logging.getLogger(JAX_BACKENDS_LOGGER).addFilter(NO_TPU_PROBE)


def log_engine(llm: LLM) -> None:
    cfg, pool = llm.engine.cfg, llm.engine.scheduler.pool
    logger.info("engine: batch buckets %s, %d slots, max_model_len %d, %d KV pages of %d tokens",
                cfg.batch_buckets, cfg.max_num_seqs, cfg.max_model_len, pool.capacity, cfg.pool.page_size)
    if llm.engine.proposals:
        logger.info("speculation (%s):\n%s", cfg.speculation.mode, llm.engine.speculation.report())
