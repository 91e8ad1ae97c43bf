"""The engine on its own thread. The HTTP side queues requests and aborts; the thread takes them
between iterations, steps, and hands every request's new tokens to the event loop in one call
per step. It blocks only on its queue, when it has nothing to run, never on HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time

from eagle3_jax.engine.engine import Engine
from eagle3_jax.engine.scheduler import Request, RequestError, RequestMetrics, TokenLogprobs
from eagle3_jax.sampling_params import SamplingParams
from eagle3_jax.serve.metrics import ServerMetrics

logger = logging.getLogger(__name__)
POLICY_REFRESH_S = 1.0  # how often the policy's choices are read into /metrics and the log
FAILED = "the engine failed (see the server's log)"


class QueueFull(Exception):
    """More requests wait than the server takes (--max-waiting)."""


class Unavailable(Exception):
    """The server is shutting down, or its engine failed."""


def check_admission(loop, samples: int) -> None:
    """Unavailable or QueueFull where `loop` (this module's EngineLoop or the engine process's
    client: healthy, accepting, max_waiting, num_waiting) cannot take `samples` more samples now."""
    if not loop.healthy:
        raise Unavailable("the engine failed; the server is not serving")
    if not loop.accepting:
        raise Unavailable("the server is shutting down")
    if loop.max_waiting is not None and loop.num_waiting + samples > loop.max_waiting:
        raise QueueFull(f"{loop.num_waiting} requests are waiting, the most this server queues is "
                        f"{loop.max_waiting}")


@dataclasses.dataclass(frozen=True)
class Update:
    """A sample's tokens since its previous update; the last one has finished set."""

    index: int  # the sample's place in its submission
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None  # a stop string's cut of the text; None: the tokens' decode
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprobs] | None = None  # token_ids' where the sample asks for logprobs
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # the prompt's, on the first update after they are read

    def then(self, later: Update) -> Update:
        """This unfinished update and the same sample's next one as one: the tokens (and their
        logprobs) of both, the end (if any) and the final text and metrics of `later`."""
        logprobs = None if self.logprobs is None and later.logprobs is None else \
            (self.logprobs or []) + (later.logprobs or [])
        prompt = self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs
        return dataclasses.replace(later, token_ids=self.token_ids + later.token_ids, logprobs=logprobs,
                                   prompt_logprobs=prompt)


class Submission:
    """One HTTP request's samples: (prompt ids, single-sample params) each. Their updates arrive
    through `put` on the event loop's thread (in order per sample); `unfinished` counts those
    without a last one yet."""

    def __init__(self, samples: list[tuple[list[int], SamplingParams]], arrival_time: float):
        self.samples = samples
        self.arrival_time = arrival_time  # time.perf_counter()
        self.unfinished = len(samples)
        self.request_ids: list[int] = []  # the engine's, set on its thread
        self._ready: list[Update] = []  # put, not yet taken
        self._wakeup: asyncio.Future | None = None  # the consumer's, while it waits for an update

    def put(self, update: Update) -> None:
        """Hand an update over (the event loop's thread). A waiting consumer is woken once however
        many arrive before it runs: one wakeup per step at most, fewer where it falls behind."""
        self._ready.append(update)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    @property
    def has_updates(self) -> bool:
        """Whether updates were put that `next_updates` has not taken yet."""
        return bool(self._ready)

    async def next_updates(self) -> list[Update]:
        """Every update put since the last call (waiting for one), each sample's merged into one
        (Update.then): a consumer that fell behind the engine by several steps catches up in one
        update a sample, so one stream chunk, not one per step. Each sample's updates keep their
        order; the samples are in the order of their first update."""
        while not self._ready:
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                await self._wakeup
            finally:
                self._wakeup = None
        ready, self._ready = self._ready, []
        merged: list[Update] = []
        last: dict[int, int] = {}  # a sample's place in `merged`
        for update in ready:
            at = last.get(update.index)
            if at is not None and not merged[at].finished:
                merged[at] = merged[at].then(update)
            else:
                last[update.index] = len(merged)
                merged.append(update)
        return merged


@dataclasses.dataclass
class _Live:
    """A running sample, on the engine thread."""

    submission: Submission
    index: int
    request: Request
    sent: int = 0  # its tokens handed over so far
    last_time: float | None = None  # when those were collected
    prompt_sent: bool = False  # its prompt's logprobs handed over


class EngineLoop:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_waiting: int | None = None):
        self.engine = engine
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.healthy = True
        self.accepting = True
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}
        self._deadline: float | None = None  # time.monotonic() at which a drain ends what is left
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._policy_read = 0.0
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    # ---- the HTTP side (the event loop's thread) -----------------------------------------------
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the engine's queue and what its thread has not taken yet."""
        return self.engine.num_waiting + self._inbox.qsize()

    def submit(self, samples: list[tuple[list[int], SamplingParams]], arrival_time: float) -> Submission:
        check_admission(self, len(samples))
        submission = Submission(samples, arrival_time)
        self._inbox.put(("add", submission))
        if not self.healthy:  # failed meanwhile: what it queued may never be taken
            raise Unavailable("the engine failed; the server is not serving")
        return submission

    def abort(self, submission: Submission) -> None:
        """End the submission's unfinished samples (finish_reason "abort") in the next iteration."""
        self._inbox.put(("abort", submission))

    def drain(self, grace_s: float) -> None:
        """Take no new requests; end those still running after `grace_s` seconds. Safe from a
        signal handler (SimpleQueue.put is reentrant)."""
        self.accepting = False
        self._inbox.put(("drain", time.monotonic() + grace_s))

    def stop(self, timeout_s: float = 30.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished()):
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    self._end_all()
                if self.engine.has_unfinished():
                    self._publish(self.engine.step())
                self._observe_engine()
        except Exception:
            logger.exception("the engine failed: ending every request")
            self.healthy = False
            self._end_all(error=FAILED)
            self._refuse_queued()

    def _take_commands(self, block: bool) -> bool:
        """Apply every queued command (waiting for one when `block`); False on stop."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for kind, arg in commands:
            if kind == "stop":
                return False
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "drain":
                self._deadline = arg
        return True

    def _add(self, submission: Submission) -> None:
        updates = []
        for index, (prompt, params) in enumerate(submission.samples):
            try:
                req = self.engine.add_request(prompt, params, submission.arrival_time)
            except RequestError as e:  # checked before submitting: only a bug reaches this
                updates.append(Update(index, [], True, "error", str(e)))
                continue
            submission.request_ids.append(req.id)
            self._live[req.id] = _Live(submission, index, req)
            self.metrics.admitted(len(req.prompt))
        self._deliver([(submission, u) for u in updates])

    def _abort(self, submission: Submission) -> None:
        aborted = [self.engine.abort(i) for i in submission.request_ids if i in self._live]
        self._publish([req for req in aborted if req is not None])

    def _end_all(self, error: str | None = None) -> None:
        """Abort every live sample (with `error`: end it as failed, the engine left as it is)."""
        if error is None:
            self._publish([req for i in list(self._live) if (req := self.engine.abort(i)) is not None])
            return
        ended = [(live.submission, Update(live.index, [], True, "error", error)) for live in self._live.values()]
        self._live.clear()
        self._deliver(ended)

    def _refuse_queued(self) -> None:
        """End the samples still queued for the engine as failed."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._deliver([(arg, Update(i, [], True, "error", FAILED)) for i in range(len(arg.samples))])

    def _publish(self, changed: list[Request]) -> None:
        """Hand the changed requests' new tokens over, one event-loop call for all."""
        batch = []
        for req in changed:
            live = self._live.get(req.id)
            if live is None:
                continue
            new = req.output[live.sent:]
            scores = {"logprobs": None if req.logprobs is None else req.logprobs[live.sent:len(req.output)]}
            if req.prompt_logprobs is not None and not live.prompt_sent:
                scores["prompt_logprobs"], live.prompt_sent = req.prompt_logprobs, True
            live.sent = len(req.output)
            if new:
                self.metrics.tokens(req.metrics.arrival_time, req.metrics.last_token_time, len(new), live.last_time)
                live.last_time = req.metrics.last_token_time
            if req.finished:
                del self._live[req.id]
                self.metrics.finish(req.finish_reason, req.metrics)
                self._log_finished(req)
                batch.append((live.submission, Update(live.index, new, True, req.finish_reason, req.error, req.text,
                                                      req.metrics, **scores)))
            elif new:
                batch.append((live.submission, Update(live.index, new, **scores)))
        self._deliver(batch)

    def _deliver(self, batch: list[tuple[Submission, Update]]) -> None:
        if batch and self._event_loop is not None and not self._event_loop.is_closed():
            self._event_loop.call_soon_threadsafe(put_all, batch)

    def _observe_engine(self) -> None:
        pool = self.engine.scheduler.pool
        self.metrics.engine_state(self.engine.num_running, self.num_waiting, pool.num_free, pool.capacity,
                                  self.engine.stats)
        now = time.monotonic()
        if now - self._policy_read < POLICY_REFRESH_S or not self.engine.proposals:
            return
        self._policy_read = now
        table = {row.bucket: row.choice for row in self.engine.speculation.table()}
        labels = [p.facts.label for p in self.engine.proposals] + ["target-only"]
        for bucket, choice in self.metrics.choices(table, labels).items():
            # The rates the rule compared, so that a log of changes says why each came.
            rates = ", ".join(f"{label} {1e-3 * r:.2f}" for label, r in self.engine.speculation.rates(bucket).items())
            logger.info("speculation: batch bucket %d runs %s (tokens a row a ms: %s)", bucket, choice, rates or "-")

    @staticmethod
    def _log_finished(req: Request) -> None:
        if not logger.isEnabledFor(logging.DEBUG):
            return
        m = req.metrics
        ttft = (m.first_token_time - m.arrival_time) if m.first_token_time is not None else float("nan")
        logger.debug("request %d: %s, %d prompt + %d tokens, first token %.1f ms, acceptance length %.2f",
                     req.id, req.finish_reason, len(req.prompt), len(req.output), 1e3 * ttft, m.acceptance_length)


def put_all(batch: list[tuple[Submission, Update]]) -> None:
    for submission, update in batch:
        submission.put(update)
