"""The engine in a process of its own (`serve`, unless --no-engine-process): the HTTP process and the engine
then hold a GIL each. The child (multiprocessing, spawn) builds the LLM, runs EngineLoop's loop on
commands from a pipe (add, abort, drain, stop) and sends one message per step: every changed
sample's Update and ServerMetrics' records. The HTTP process holds no weights: `EngineClient` has
EngineLoop's interface, `EngineFront` the tokenizer and the checks app.py makes before it submits.
With `--api-server-count N` the child has one pipe to each of N HTTP processes (`EngineProcess`):
it reads the commands of all, keeps each one's submissions apart, sends each its own updates and
every one all the records, so that each process's /metrics is the whole server's.

Messages, child -> HTTP process: ("ready", EngineFacts) once warm; ("step", updates, [(ServerMetrics
method, args)], samples taken, waiting), each update (submission id, sample index, token ids) where
it is only new tokens (most are; plain values pickle several times faster than an Update) else
(submission id, Update), the records pickled once for every pipe (bytes) where there are several;
("drain",) where another HTTP process asked for a drain; ("error", text) where building the engine
failed; ("failed",) where the engine failed (every live sample ended first)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing import connection
from pathlib import Path

from eagle3_jax.api import Codec, load_tokenizer
from eagle3_jax.config import EngineConfig, ServedConfig
from eagle3_jax.engine.engine import Engine, check_request
from eagle3_jax.engine.scheduler import RequestMetrics, Scheduler
from eagle3_jax.engine.structured import Grammars
from eagle3_jax.sampling_params import SamplingParams
from eagle3_jax.serve.engine_loop import FAILED, EngineLoop, Submission, Unavailable, Update, check_admission, put_all
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
STOP_S = 30.0  # how long `EngineProcess.join` waits for the child to exit before it terminates it
METRICS_WRITERS = frozenset({"admitted", "tokens", "finish", "engine_state", "choices"})


class EngineFailed(Exception):
    """The engine's process could not build the engine, or exited before it was ready."""


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the HTTP process needs of the engine to check requests as the engine does."""

    target: Path  # the resolved target directory: its tokenizer and chat template
    cfg: EngineConfig
    served: ServedConfig  # the scheduler's, the pool's page count settled
    vocab_size: int
    num_draft: int
    positions_per_iteration: int
    eos_token_ids: list[int]

    @classmethod
    def of(cls, llm) -> EngineFacts:
        s = llm.engine.scheduler
        return cls(llm.target, llm.engine.cfg, s.cfg, s.vocab_size, s.num_draft, s.positions_per_iteration,
                   list(llm.engine.grammars.eos_token_ids))


class EngineChecks:
    """What app.py reads of Engine (cfg, grammars, validate_request), without the engine: the
    scheduler's checks read only the static config and the pool's capacity, a grammar compiles on
    the host, so a bad request is refused at once as with the engine in process."""

    def __init__(self, facts: EngineFacts, tokenizer):
        self.cfg = facts.cfg
        self._scheduler = Scheduler(facts.served, facts.vocab_size, facts.num_draft, facts.positions_per_iteration)
        self.grammars = Grammars(tokenizer, facts.vocab_size, facts.eos_token_ids)

    def validate_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Engine.validate_request's checks."""
        check_request(self._scheduler, self.grammars, prompt, params)


class EngineFront(Codec):
    """The `llm` app.py serves with, the engine in another process: the target's tokenizer and chat
    template (loaded as LLM loads them), `engine` its checks (EngineChecks)."""

    def __init__(self, facts: EngineFacts):
        super().__init__(load_tokenizer(facts.target))
        self.engine = EngineChecks(facts, self.tokenizer)


# ---- the HTTP process ------------------------------------------------------------------------------
@dataclasses.dataclass
class _Pending:
    submission: Submission
    unfinished: set[int]  # its samples without a last update yet


class EngineProcess:
    """The engine's process (multiprocessing, spawn) and a pipe to it for each of `connections` HTTP
    processes: `connections[i]` is the i-th one's end, for its EngineClient."""

    def __init__(self, build: Callable[[argparse.Namespace], object], args: argparse.Namespace,
                 connections: int = 1):
        context = multiprocessing.get_context("spawn")  # a fork would copy the parent's threads' locks
        pipes = [context.Pipe() for _ in range(connections)]
        self.connections = [ours for ours, _ in pipes]
        self._child_ends = [theirs for _, theirs in pipes]
        self._process = context.Process(target=child_main, args=(build, args, self._child_ends), name="engine",
                                        daemon=True)

    def start(self) -> None:
        """Start it; each connection's first message says whether it is ready (EngineClient.connect)."""
        self._process.start()
        for end in self._child_ends:
            end.close()  # the child's ends live in the child only: its exit is our EOF

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def join(self, timeout_s: float = STOP_S) -> None:
        """Wait for it to exit (once every HTTP process has stopped or gone), killing it after
        `timeout_s` seconds."""
        self._process.join(timeout_s)
        if self._process.is_alive():
            logger.warning("the engine's process did not stop in %.0f s: killing it", timeout_s)
            self.kill()
            self._process.join(5)

    def kill(self) -> None:
        """End it now, where it runs (SIGKILL: it ignores SIGTERM, the HTTP processes decide when it
        stops, and multiprocessing's exit would wait for it forever). Safe from a signal handler."""
        if self._process.is_alive():
            self._process.kill()


class EngineClient:
    """EngineLoop's interface (submit, abort, drain, stop, num_waiting, healthy, accepting) over a
    pipe to the engine's process (EngineProcess.connections). Commands leave through a queue and a
    writer thread (drain is called from a signal handler); a reader thread takes each step's
    message, applies its metrics and hands its updates to the event loop in one call. If the child
    dies, every live sample ends as failed. `on_drain` is called (on the reader's thread) where
    another HTTP process drained the engine: this one stops taking requests and should exit too."""

    def __init__(self, conn, metrics: ServerMetrics, max_waiting: int | None = None):
        self._conn = conn
        self.metrics, self.max_waiting = metrics, max_waiting
        self.accepting = True
        self.on_drain: Callable[[], None] | None = None
        self._ready = self._failed = self._stopping = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._sent = self._taken = self._waiting = 0  # samples sent, taken by the child; its queue's length
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-writer", daemon=True)

    def connect(self) -> EngineFacts:
        """Wait until the engine is warm; EngineFailed if building it failed or its process exited."""
        try:
            message = self._conn.recv()
        except EOFError:
            raise EngineFailed("the engine's process exited before it was ready (see the log)") from None
        if message[0] == "error":
            raise EngineFailed(message[1])
        self._ready = True
        self._writer.start()
        return message[1]

    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._reader.start()

    @property
    def healthy(self) -> bool:
        return self._ready and not self._failed

    @property
    def num_waiting(self) -> int:
        """Samples not yet running: the engine's queue and those on their way to it."""
        return self._waiting + self._sent - self._taken

    def submit(self, samples: list[tuple[list[int], SamplingParams]], arrival_time: float) -> Submission:
        check_admission(self, len(samples))
        submission, sid = Submission(samples, arrival_time), self._next_id
        self._next_id += 1
        submission.request_ids.append(sid)  # the engine's ids stay in its process; `abort` sends this one
        self._pending[sid] = _Pending(submission, set(range(len(samples))))
        self._sent += len(samples)
        # time.perf_counter is the system's monotonic clock: the child's engine reads the same.
        self._outbox.put(("add", sid, samples, arrival_time))
        if not self.healthy:  # failed meanwhile: the reader may have ended the live ones before this one
            self._pending.pop(sid, None)
            raise Unavailable("the engine failed; the server is not serving")
        return submission

    def abort(self, submission: Submission) -> None:
        self._outbox.put(("abort", submission.request_ids[0]))

    def drain(self, grace_s: float) -> None:
        """Take no new requests; the child ends those still running after `grace_s` seconds. Safe
        from a signal handler (SimpleQueue.put is reentrant)."""
        self.accepting = False
        self._outbox.put(("drain", grace_s))

    def stop(self) -> None:
        """Tell the engine this process takes no more updates (it then ends this one's unfinished
        samples); the engine's process exits once every HTTP process has (EngineProcess.join)."""
        self._stopping = True
        self._outbox.put(("stop",))

    def _write(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._conn.send(command)
            except (OSError, ValueError):  # the child is gone: the reader ends what was live
                return
            if command[0] == "stop":
                return

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):  # the child exited: after a stop, or not (only `stop` joins it)
                message = ("stopped",) if self._stopping else ("failed",)
            if message[0] == "step":
                self._step(*message[1:])
                continue
            if message[0] == "drain":  # asked of another HTTP process: the whole server stops
                self.accepting = False
                if self.on_drain is not None:
                    self.on_drain()
                continue
            if message[0] == "failed" or self._pending:
                logger.error("the engine's process failed or exited (see the log above): ending every request")
                self._failed = True
                self._deliver([(p.submission, Update(i, [], True, "error", FAILED))
                               for p in list(self._pending.values()) for i in sorted(p.unfinished)])
                self._pending.clear()
            return

    def _step(self, updates: list[tuple], records: list[tuple[str, tuple]] | bytes, taken: int,
              waiting: int) -> None:
        if type(records) is bytes:  # pickled once for every HTTP process
            records = pickle.loads(records)
        for name, args in records:
            if name in METRICS_WRITERS:
                getattr(self.metrics, name)(*args)
        self._taken, self._waiting = taken, waiting
        batch = []
        for sent in updates:
            sid = sent[0]
            pending = self._pending.get(sid)
            if pending is None:
                continue
            update = Update(sent[1], sent[2]) if len(sent) == 3 else sent[1]
            if update.finished:
                pending.unfinished.discard(update.index)
                if not pending.unfinished:
                    del self._pending[sid]
            batch.append((pending.submission, update))
        self._deliver(batch)

    def _deliver(self, batch: list[tuple[Submission, Update]]) -> None:
        if batch and self._event_loop is not None and not self._event_loop.is_closed():
            self._event_loop.call_soon_threadsafe(put_all, batch)


# ---- the engine's process ------------------------------------------------------------------------
@dataclasses.dataclass(eq=False)
class _Front:
    """An HTTP process's pipe, in the child: its submissions by their id there, and this
    iteration's updates for it. `fileno` lets multiprocessing.connection.wait watch it."""

    conn: connection.Connection
    remotes: dict[int, _Remote] = dataclasses.field(default_factory=dict)
    unfinished: dict[int, int] = dataclasses.field(default_factory=dict)  # by id: its samples not yet ended
    out: list[tuple] = dataclasses.field(default_factory=list)  # as the step message carries them
    taken: int = 0  # its samples taken so far

    def fileno(self) -> int:
        return self.conn.fileno()


@dataclasses.dataclass(eq=False)
class _Remote:
    """A submission of an HTTP process, in the child: what EngineLoop reads of a Submission."""

    front: _Front
    id: int
    samples: list[tuple[list[int], SamplingParams]]
    arrival_time: float
    request_ids: list[int] = dataclasses.field(default_factory=list)


class _MetricsRecords:
    """ServerMetrics' writers, recorded for the HTTP process's ServerMetrics (EngineClient._step)."""

    def __init__(self):
        self.records: list[tuple[str, tuple]] = []
        self._choices: dict[int, str] = {}

    def admitted(self, prompt_tokens: int) -> None:
        self.records.append(("admitted", (prompt_tokens,)))

    def tokens(self, arrival_time: float, token_time: float, count: int, previous_time: float | None) -> None:
        self.records.append(("tokens", (arrival_time, token_time, count, previous_time)))

    def finish(self, finish_reason: str, m: RequestMetrics) -> None:
        self.records.append(("finish", (finish_reason, m)))

    def engine_state(self, *args) -> None:
        self.records.append(("engine_state", args))

    def choices(self, table: dict[int, str], labels: list[str]) -> dict[int, str]:
        """As ServerMetrics.choices: the buckets whose choice changed (this process logs them)."""
        self.records.append(("choices", (table, labels)))
        changed = {b: c for b, c in table.items() if self._choices.get(b) != c}
        self._choices = dict(table)
        return changed

    def take(self) -> list[tuple[str, tuple]]:
        records, self.records = self.records, []
        return records


class _ChildLoop(EngineLoop):
    """EngineLoop in the engine's process, on its main thread: it reads its commands from the
    pipes between steps (no second thread to share the interpreter with), and each iteration's
    updates and metrics leave in one message a pipe. It stops once every HTTP process has said
    stop or is gone; one that goes has its unfinished samples aborted."""

    def __init__(self, engine: Engine, conns: Sequence[connection.Connection]):
        self.records = _MetricsRecords()
        super().__init__(engine, self.records)
        self._fronts = [_Front(conn) for conn in conns]  # those still open

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting  # each HTTP process adds what is on its way

    def _take_commands(self, block: bool) -> bool:
        """Apply every command the pipes hold (waiting for one when `block`), read between steps on
        this thread; False once no HTTP process is left."""
        for front in self._readable(block):
            try:
                while True:
                    command = front.conn.recv()
                    kind = command[0]
                    if kind == "stop":
                        self._close(front)
                        break
                    if kind == "add":
                        self._add(_Remote(front, *command[1:]))
                    elif kind == "abort":
                        self._abort(front, command[1])
                    elif kind == "drain":
                        self._drain(front, command[1])
                    if not front.conn.poll():
                        break
            except (EOFError, OSError):  # that HTTP process is gone
                self._close(front, gone=True)
        return bool(self._fronts)

    def _readable(self, block: bool) -> Sequence[_Front]:
        """The fronts with something to read (waiting for one when `block`). One pipe, the default,
        is polled as it is: a wait over several builds a selector on every call."""
        if len(self._fronts) == 1:
            front = self._fronts[0]
            return (front,) if block or front.conn.poll() else ()
        return connection.wait(self._fronts, None if block else 0)

    def _add(self, remote: _Remote) -> None:
        front = remote.front
        front.remotes[remote.id] = remote
        front.unfinished[remote.id] = len(remote.samples)
        front.taken += len(remote.samples)
        super()._add(remote)

    def _abort(self, front: _Front, sid: int) -> None:
        if (remote := front.remotes.get(sid)) is not None:
            super()._abort(remote)

    def _drain(self, front: _Front, grace_s: float) -> None:
        """A drain asked by one HTTP process drains the engine, and the others are told to stop
        taking requests and exit: the whole server shuts down."""
        deadline = time.monotonic() + grace_s
        if self._deadline is None:
            for other in list(self._fronts):
                if other is not front:
                    self._send(other, ("drain",))
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def _close(self, front: _Front, gone: bool = False) -> None:
        """Send `front` nothing more; end its unfinished samples (its process takes no updates now)."""
        if front not in self._fronts:
            return
        self._fronts.remove(front)
        front.conn.close()
        if gone and front.remotes:
            logger.warning("an HTTP process is gone: aborting its %d unfinished request(s)", len(front.remotes))
        for remote in list(front.remotes.values()):
            super()._abort(remote)

    def _deliver(self, batch: list[tuple[_Remote, Update]]) -> None:
        for remote, update in batch:
            front = remote.front
            only_tokens = not update.finished and update.logprobs is None and update.prompt_logprobs is None
            front.out.append((remote.id, update.index, update.token_ids) if only_tokens else (remote.id, update))
            if update.finished and remote.id in front.unfinished:  # else refused before it was taken
                front.unfinished[remote.id] -= 1
                if not front.unfinished[remote.id]:
                    del front.remotes[remote.id], front.unfinished[remote.id]

    def _observe_engine(self) -> None:
        super()._observe_engine()
        self.send()

    def send(self) -> None:
        """This iteration's updates and records, one message a pipe: each HTTP process its own
        updates, every one all the records (pickled once where there are several)."""
        records, waiting = self.records.take(), self.engine.num_waiting
        if len(self._fronts) > 1:
            records = pickle.dumps(records, pickle.HIGHEST_PROTOCOL)
        for front in list(self._fronts):
            out, front.out = front.out, []
            self._send(front, ("step", out, records, front.taken, waiting))

    def broadcast(self, message: tuple) -> None:
        for front in list(self._fronts):
            self._send(front, message)

    def _send(self, front: _Front, message: tuple) -> None:
        try:
            front.conn.send(message)
        except OSError:  # that HTTP process is gone (BrokenPipeError, ConnectionResetError)
            self._close(front, gone=True)

    def run(self) -> None:
        self._run()
        self.send()  # what a failure ended


def child_main(build: Callable[[argparse.Namespace], object], args: argparse.Namespace,
               conns: Sequence[connection.Connection]) -> None:
    """The engine's process: build the LLM from the serve command's arguments (`build` also sets
    up this process's logging), report ready on every pipe, loop."""
    # The HTTP processes decide when to stop (a signal to the whole group reaches them too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = build(args)
        facts = EngineFacts.of(llm)
        loop = _ChildLoop(llm.engine, conns)
    except Exception as e:
        logger.exception("building the engine failed")
        for conn in conns:
            with contextlib.suppress(OSError):  # that HTTP process is gone already
                conn.send(("error", f"building the engine failed: {e}"))
        raise SystemExit(1) from None
    loop.broadcast(("ready", facts))
    loop.run()
    if not loop.healthy:
        loop.broadcast(("failed",))
    raise SystemExit(0 if loop.healthy else 1)
