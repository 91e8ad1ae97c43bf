"""Host-side scheduling: requests -> slots, pages and batch buckets. No device work here.

Admission is first come, first served. A request reserves, when admitted, every page it can
ever need (prompt + max_tokens + two iterations in flight), so a running request can never run
out of pages and nothing is preempted; when the pool is short, new requests wait in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque

import numpy as np

from eagle3_jax.config import DUMMY_SLOT, SCRATCH_PAGE, EngineConfig, smallest_bucket
from eagle3_jax.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message says why. Other requests are unaffected."""


@dataclasses.dataclass
class RequestMetrics:
    iterations: int = 0  # target verify forwards this request took part in
    emitted: int = 0  # tokens those forwards produced (before truncation at a stop)
    # [K] iterations that accepted a proposal at depth j + 1: a chain's proposal j, a tree's node
    # at depth j + 1 (K is then the tree's steps)
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    num_draft: int = 0  # K
    speculative_iterations: int = 0  # those forwards that verified K drafts (the rest ran the target alone)
    # time.perf_counter() seconds: when the request arrived (Scheduler.add), and when the host
    # collected its first and its latest tokens (None before).
    arrival_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def record(self, num_accepted: int, speculative: bool = True) -> None:
        self.iterations += 1
        self.speculative_iterations += speculative
        self.emitted += num_accepted + 1
        for j in range(num_accepted):
            self.accepted_at[j] += 1

    def collected(self, at: float) -> None:
        """New tokens of the request reached the host at `at` (time.perf_counter())."""
        if self.first_token_time is None:
            self.first_token_time = at
        self.last_token_time = at

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (1.0 without speculation)."""
        return self.emitted / self.iterations if self.iterations else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Fraction of speculative iterations whose draft at position j (0-based) was accepted
        (target-only iterations drafted nothing, so they do not dilute the drafter's rates)."""
        n = self.speculative_iterations
        return [a / n if n else 0.0 for a in self.accepted_at]

    @property
    def drafted(self) -> int:
        return self.speculative_iterations * self.num_draft

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, clipped to the context
    metrics: RequestMetrics
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str | None = None  # set when a stop string cut the output text

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PagePool:
    """Free list over pages 1..num_pages-1 (page 0 is the scratch page)."""

    def __init__(self, num_pages: int):
        self.capacity = num_pages - 1
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n free pages (none for n = 0), or None when fewer are free."""
        if n > len(self._free):
            return None
        if n <= 0:
            return []
        taken, self._free = self._free[-n:], self._free[:-n]
        return taken[::-1]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class Scheduler:
    """num_draft: the most proposals an iteration accepts (a chain's K, a tree's steps), the length
    of each request's RequestMetrics.accepted_at. positions_per_iteration: the KV positions past a
    request's length one iteration writes (the speculator's; None: a chain's num_draft + 1)."""

    def __init__(self, cfg: EngineConfig, vocab_size: int, num_draft: int, positions_per_iteration: int | None = None):
        self.cfg = cfg = cfg.resolved()  # the slots and the pool as served
        self.vocab_size = vocab_size
        self.num_draft = num_draft
        self.positions_per_iteration = num_draft + 1 if positions_per_iteration is None else positions_per_iteration
        self.pool = PagePool(cfg.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request
        self._free_slots = list(range(cfg.max_num_seqs, DUMMY_SLOT, -1))
        self._ids = itertools.count()
        # [S, max_blocks] page ids; rows of free slots (and the dummy) point at scratch.
        self.block_tables = np.full((cfg.max_num_seqs + 1, cfg.max_blocks_per_seq), SCRATCH_PAGE, np.int32)

    def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        in_flight = 2 * self.positions_per_iteration  # this iteration and the one dispatched ahead
        return -(-(prompt_len + max_tokens + in_flight) // self.cfg.page_size)

    def add(self, prompt: list[int], params: SamplingParams, arrival_time: float | None = None) -> Request:
        """Validate and queue a request; raise RequestError naming the problem. `arrival_time`
        (time.perf_counter() seconds, default now) is when it reached the server."""
        max_tokens = self.validate(prompt, params)
        metrics = RequestMetrics(accepted_at=[0] * self.num_draft, num_draft=self.num_draft,
                                 arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        req = Request(id=next(self._ids), prompt=[int(t) for t in prompt], params=params, max_tokens=max_tokens,
                      metrics=metrics)
        self.waiting.append(req)
        return req

    def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's max_tokens clipped to the context; raise RequestError naming what the
        engine would refuse. Reads only the static config: safe from any thread."""
        if params.n != 1:
            raise RequestError(f"a request is one sample; split n={params.n} with SamplingParams.samples()")
        if len(prompt) == 0:
            raise RequestError("prompt is empty")
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise RequestError("prompt token ids must be a flat list of integers")
        bad = np.flatnonzero((ids < 0) | (ids >= self.vocab_size))
        if bad.size:
            raise RequestError(f"prompt token id {int(ids[bad[0]])} at index {int(bad[0])} is outside the "
                               f"vocabulary 0..{self.vocab_size - 1}")
        if outside := [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]:
            raise RequestError(f"stop token id {outside[0]} is outside the vocabulary 0..{self.vocab_size - 1}: "
                               "the request could never stop on it")
        room = self.cfg.max_model_len - len(prompt)
        if room < 1:
            raise RequestError(f"prompt has {len(prompt)} tokens; the context holds {self.cfg.max_model_len} "
                               "(prompt plus at least one generated token): shorten the prompt or raise "
                               "EngineConfig.max_model_len")
        max_tokens = min(params.max_tokens, room)
        if self.pages_needed(len(prompt), max_tokens) > self.pool.capacity:
            raise RequestError(f"prompt + max_tokens needs {self.pages_needed(len(prompt), max_tokens)} KV "
                               f"pages; the pool has {self.pool.capacity} (EngineConfig.num_pages)")
        return max_tokens

    def admit(self) -> list[Request]:
        """Move waiting requests into free slots while pages last, in arrival order."""
        admitted = []
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            pages = self.pool.allocate(self.pages_needed(len(req.prompt), req.max_tokens))
            if pages is None:
                break  # first come, first served: later requests wait behind this one
            self.waiting.popleft()
            req.slot, req.pages = self._free_slots.pop(), pages
            self.block_tables[req.slot, :len(pages)] = pages
            self.running[req.slot] = req
            admitted.append(req)
        return admitted

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        if req.slot is not None:
            del self.running[req.slot]
            self.block_tables[req.slot] = SCRATCH_PAGE
            self._free_slots.append(req.slot)
            self.pool.release(req.pages)
            req.slot, req.pages = None, []

    def abort(self, request_id: int) -> Request | None:
        """End a waiting or running request with finish_reason "abort" (a running one's slot and
        pages freed now); None when no such request is unfinished."""
        for req in self.waiting:
            if req.id == request_id:
                self.waiting.remove(req)
                self.finish(req, "abort")
                return req
        for req in self.running.values():
            if req.id == request_id:
                self.finish(req, "abort")
                return req
        return None

    def bucket(self, n: int) -> int:
        return smallest_bucket(self.cfg.batch_buckets, n)

    def batch(self) -> tuple[list[Request], np.ndarray, np.ndarray]:
        """The running requests padded to a bucket: (requests, slots [B], block tables [B, nb])."""
        reqs = list(self.running.values())
        slots = np.full(self.bucket(len(reqs)), DUMMY_SLOT, np.int32)
        slots[:len(reqs)] = [r.slot for r in reqs]
        return reqs, slots, self.block_tables[slots]
