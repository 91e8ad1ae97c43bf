"""`eagle3-jax serve`: the engine, warmed up, behind uvicorn. SIGTERM (or Ctrl-C) stops taking
requests, gives the running ones --shutdown-timeout seconds, ends the rest with a final event
(finish_reason "abort") and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import importlib
import importlib.util
import logging
import signal
import socket
import sys
from collections.abc import Callable

import prometheus_client
import uvicorn

from eagle3_jax.api import LLM
from eagle3_jax.serve.app import Settings, create_app
from eagle3_jax.serve.engine_loop import EngineLoop
from eagle3_jax.serve.engine_process import EngineClient, EngineFailed, EngineFront
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger("eagle3_jax.serve")
EXTRA_SHUTDOWN_S = 5  # past the drain, for the last events to reach their clients
# uvicorn's event loops and HTTP/1.1 parsers, the fast one first: (fast, plain). At 64 streams the HTTP
# side's CPU per streamed chunk decides whether it keeps pace with the engine; uvloop with httptools
# spend less of it than asyncio with h11 (experiments/serve_cpu_probe.py measures both).
EVENT_LOOPS = ("uvloop", "asyncio")
HTTP_PARSERS = ("httptools", "h11")


class _Server(uvicorn.Server):
    """uvicorn's server, draining the engine when a signal asks it to exit, and logging once it
    listens."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace_s: float, ready_line: str):
        super().__init__(config)
        self.engine_loop, self.grace_s, self.ready_line = engine_loop, grace_s, ready_line

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.drain(self.grace_s)
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info(self.ready_line)


def run(llm: LLM, args: argparse.Namespace, model_name: str) -> int:
    """Serve `llm`, its engine stepped on a thread of this process (EngineLoop)."""
    prometheus_client.disable_created_metrics()  # vLLM's /metrics has no *_created series either
    metrics = ServerMetrics(model_name)
    engine_loop = EngineLoop(llm.engine, metrics, args.max_waiting)
    return _serve(llm, engine_loop, metrics, args, model_name)


def run_engine_process(build: Callable[[argparse.Namespace], LLM], args: argparse.Namespace, model_name: str) -> int:
    """Serve the LLM that `build(args)` makes in a process of its own (engine_process.py): this
    one holds the tokenizer and HTTP only."""
    prometheus_client.disable_created_metrics()
    metrics = ServerMetrics(model_name)
    client = EngineClient(functools.partial(engine_process_llm, build), args, metrics, args.max_waiting)
    # A signal while the engine loads ends this process; the engine's, a daemon, goes with it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        facts = client.start_child()
    except EngineFailed as e:
        logger.error("%s", e)
        return 1
    return _serve(EngineFront(facts), client, metrics, args, model_name)


def engine_process_llm(build: Callable[[argparse.Namespace], LLM], args: argparse.Namespace) -> LLM:
    """In the engine's process: its logging as the server's, the LLM built and described."""
    configure_logging(args.log_level)
    llm = build(args)
    log_engine(llm)
    return llm


def _serve(llm, engine_loop: EngineLoop | EngineClient, metrics: ServerMetrics, args: argparse.Namespace,
           model_name: str) -> int:
    app = create_app(llm, engine_loop, metrics, Settings(model_name, args.api_key, args.max_request_bytes))
    loop, http = event_loop_and_http(args.loop, args.http)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False, loop=loop,
                            http=http, timeout_graceful_shutdown=int(args.shutdown_timeout) + EXTRA_SHUTDOWN_S)
    server = _Server(config, engine_loop, args.shutdown_timeout,
                     f"ready: serving {model_name!r} on http://{args.host}:{args.port}/v1 (uvicorn: {loop} event "
                     f"loop, {http} HTTP)")
    # uvicorn re-raises the signal it stopped on once it has shut down: exiting 0 is the answer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run()
    return 0 if engine_loop.healthy else 1


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
