"""`eagle3-jax serve`: the engine, warmed up, behind uvicorn. SIGTERM (or Ctrl-C) stops taking
requests, gives the running ones --shutdown-timeout seconds, ends the rest with a final event
(finish_reason "abort") and exits 0."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import prometheus_client
import uvicorn

from eagle3_jax.api import LLM
from eagle3_jax.serve.app import Settings, create_app
from eagle3_jax.serve.engine_loop import EngineLoop
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger("eagle3_jax.serve")
EXTRA_SHUTDOWN_S = 5  # past the drain, for the last events to reach their clients


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
    prometheus_client.disable_created_metrics()  # vLLM's /metrics has no *_created series either
    metrics = ServerMetrics(model_name)
    engine_loop = EngineLoop(llm.engine, metrics, args.max_waiting)
    app = create_app(llm, engine_loop, metrics, Settings(model_name, args.api_key, args.max_request_bytes))
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=int(args.shutdown_timeout) + EXTRA_SHUTDOWN_S)
    server = _Server(config, engine_loop, args.shutdown_timeout,
                     f"ready: serving {model_name!r} on http://{args.host}:{args.port}/v1")
    # uvicorn re-raises the signal it stopped on once it has shut down: exiting 0 is the answer.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.run()
    return 0 if engine_loop.healthy else 1


def configure_logging(level: str) -> None:
    """The package's loggers at `level`, everything else (uvicorn, JAX) at info at most."""
    logging.basicConfig(level=max(logging.INFO, getattr(logging, level.upper())), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("eagle3_jax").setLevel(level.upper())


def log_engine(llm: LLM) -> None:
    cfg, pool = llm.engine.cfg, llm.engine.scheduler.pool
    logger.info("engine: batch buckets %s, %d slots, max_model_len %d, %d KV pages of %d tokens",
                cfg.batch_buckets, cfg.max_num_seqs, cfg.max_model_len, pool.capacity, cfg.pool.page_size)
    if llm.engine.proposals:
        logger.info("speculation (%s):\n%s", cfg.speculation.mode, llm.engine.speculation.report())
