"""Host-side scheduling: requests -> slots, pages and batch buckets. No device work here.

Admission is first come, first served. Before each step dispatches (`schedule`), every running
request gets the pages its known tokens fill plus two iterations in flight, oldest first; when the
pool is short the latest admitted is preempted (its pages back, itself first in the queue) and
nothing is admitted that step. Readmitted, it prefills its prompt and generated tokens but the last, with the
sampling key schedule where it stopped, so its tokens are those of never stopping; results of
programs dispatched before are dropped (`admissions`).

An admitted request holds its slot and pages while it prefills, and joins the batch (`batch`)
once its prefill's last chunk is dispatched; `prefilling` lists those still prefilling, in
admission order (engine/prefill.py decides how many of their chunks a step dispatches).

Prefix caching (engine/pages.py): an admitted request reuses its longest cached prefix and prefills
the rest, at least one token (its logits and the next proposal come from the last). Pages are
published once the programs writing them were dispatched (a prefilling request's, chunk by chunk):
requests admitted in one step share none. A request asking for prompt_logprobs takes no cached
prefix until they are read: its prefill scores every prompt position, so it computes them all.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque

import numpy as np

from eagle3_jax.config import DUMMY_SLOT, SCRATCH_PAGE, ServedConfig, smallest_bucket
from eagle3_jax.engine.pages import PagePool, page_keys
from eagle3_jax.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message says why. Other requests are unaffected."""


@dataclasses.dataclass
class RequestMetrics:
    iterations: int = 0  # target verify forwards this request took part in
    emitted: int = 0  # tokens those forwards produced (before truncation at a stop)
    # [K] iterations that accepted a proposal at depth j + 1 (a tree's K: its steps)
    accepted_at: list[int] = dataclasses.field(default_factory=list)
    num_draft: int = 0
    speculative_iterations: int = 0  # those forwards that verified K drafts (the rest ran the target alone)
    # time.perf_counter() seconds: arrival (Scheduler.add), first and latest tokens collected.
    arrival_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    preemptions: int = 0  # times the pool ran short and it gave its pages back
    cached_tokens: int = 0  # tokens its prefills found in the prefix cache instead of computing

    def record(self, num_accepted: int, speculative: bool = True) -> None:
        self.iterations += 1
        self.speculative_iterations += speculative
        self.emitted += num_accepted + 1
        for j in range(num_accepted):
            self.accepted_at[j] += 1

    def collected(self, at: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = at
        self.last_token_time = at

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per target forward (1.0 without speculation)."""
        return self.emitted / self.iterations if self.iterations else 0.0

    @property
    def acceptance_rates(self) -> list[float]:
        """Per depth j, accepted / speculative iterations (target-only ones drafted nothing)."""
        n = self.speculative_iterations
        return [a / n if n else 0.0 for a in self.accepted_at]

    @property
    def drafted(self) -> int:
        return self.speculative_iterations * self.num_draft

    @property
    def accepted(self) -> int:
        return sum(self.accepted_at)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The target's log-probability of `token` where it was scored, its rank there (1: the
    likeliest; ties count as ahead) and the likeliest tokens' ids and log-probabilities, best first,
    as many as the request asked for."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]


@dataclasses.dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, clipped to the context
    metrics: RequestMetrics
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)  # its block table's row
    output: list[int] = dataclasses.field(default_factory=list)
    keys: list[bytes] = dataclasses.field(default_factory=list)  # its full pages' content keys (pages.py)
    published: int = 0  # its first pages offered to the prefix cache
    num_cached: int = 0  # tokens its last admission found in the prefix cache: its prefill starts there
    # Where its next prefill chunk starts; None when not admitted, or once its last chunk is dispatched.
    next_chunk: int | None = None
    admissions: int = 0  # results of a program dispatched before the latest admission are stale
    seed: int | None = None  # the engine's draw for a request without SamplingParams.seed, kept through preemption
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    text: str | None = None  # set when a stop string cut the output text
    logprobs: list[TokenLogprobs] | None = None  # one per output token where params.logprobs is set
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token (the first None), once read
    grammar: object | None = None  # its structured output's matcher (engine/structured.py), advanced by its tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def scores_prompt(self) -> bool:
        """Its prefill scores every prompt position: it asks for prompt_logprobs not read yet."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs is None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def prefilling(self) -> bool:
        """Admitted, with prefill chunks not dispatched yet."""
        return self.next_chunk is not None

    @property
    def context_len(self) -> int:
        """Tokens in its KV: all it knows but the last, which the next iteration verifies from."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


def stop_reason(req: Request, token: int, eos_token_ids: frozenset[int], detokenize=None) -> str | None:
    """Whether `token`, just appended to `req.output`, ends the request: "stop" (an EOS unless
    ignore_eos, a stop token, a stop string: `detokenize`, list[int] -> str, decodes), "length"
    (max_tokens), or None."""
    params = req.params
    if (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
        return "stop"
    if params.stop and detokenize is not None and hit_stop_string(req, detokenize):
        return "stop"
    return "length" if len(req.output) >= req.max_tokens else None


def hit_stop_string(req: Request, detokenize) -> bool:
    """Whether the last token completed a stop string (then `req.text` is cut before it). It is
    checked after every token, so it can only end in the last one's text: a tail of enough
    tokens to hold the longest stop's bytes is decoded, not the whole output each time."""
    tail = 4 * max(map(len, req.params.stop)) + 8  # tokens: each at least a byte, a char at most 4
    recent = detokenize(req.output[-tail:])
    if not any(stop in recent for stop in req.params.stop):
        return False
    text = detokenize(req.output)
    found = [i for stop in req.params.stop if (i := text.find(stop)) >= 0]
    if found:  # (a tail decoded alone can differ at its start: the whole text decides)
        req.text = text[:min(found)]
    return bool(found)


class Scheduler:
    """num_draft: the most proposals an iteration accepts (len of accepted_at). positions_per_iteration:
    KV positions past a request's length one iteration writes (None: num_draft + 1, a chain's)."""

    def __init__(self, cfg: ServedConfig, vocab_size: int, num_draft: int, positions_per_iteration: int | None = None):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.num_draft = num_draft
        self.positions_per_iteration = num_draft + 1 if positions_per_iteration is None else positions_per_iteration
        self.pool = PagePool(cfg.pool.num_pages, cfg.pool.prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}  # slot -> request, in admission order
        self._free_slots = list(range(cfg.max_num_seqs, DUMMY_SLOT, -1))
        self._ids = itertools.count()
        # [S, max_blocks] page ids; rows of free slots (and the dummy) point at scratch.
        self.block_tables = np.full((cfg.max_num_seqs + 1, cfg.pool.max_blocks_per_seq), SCRATCH_PAGE, np.int32)

    @property
    def in_flight(self) -> int:
        """KV positions past the known length the device may write: the iteration in flight and the next."""
        return 2 * self.positions_per_iteration

    def pages_needed(self, prompt_len: int, max_tokens: int) -> int:
        return -(-(prompt_len + max_tokens + self.in_flight) // self.cfg.pool.page_size)

    def pages_to_hold(self, req: Request) -> int:
        """The pages `req` holds before the next iteration is dispatched."""
        if self.cfg.pool.page_reservation == "whole":
            return self.pages_needed(len(req.prompt), req.max_tokens)
        return -(-(req.context_len + self.in_flight) // self.cfg.pool.page_size)

    def add(self, prompt: list[int], params: SamplingParams, arrival_time: float | None = None) -> Request:
        """Validate and queue a request (RequestError names the problem); arrival_time default now."""
        max_tokens = self.validate(prompt, params)
        metrics = RequestMetrics(accepted_at=[0] * self.num_draft, num_draft=self.num_draft,
                                 arrival_time=time.perf_counter() if arrival_time is None else arrival_time)
        req = Request(id=next(self._ids), prompt=[int(t) for t in prompt], params=params, max_tokens=max_tokens,
                      metrics=metrics, logprobs=None if params.logprobs is None else [])
        self.waiting.append(req)
        return req

    def validate(self, prompt: list[int], params: SamplingParams) -> int:
        """The request's max_tokens clipped to the context; raise RequestError naming what the
        engine would refuse. Reads only the static config and the pool's capacity: safe from any thread."""
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
        if (needed := self.pages_needed(len(prompt), max_tokens)) > self.pool.capacity:
            raise RequestError(f"prompt + max_tokens needs {needed} KV pages; the whole pool has "
                               f"{self.pool.capacity} (EngineConfig.num_pages, or kv_memory_fraction of the free "
                               "memory): lower max_tokens or shorten the prompt")
        return max_tokens

    def schedule(self) -> tuple[list[Request], list[Request]]:
        """Before a step dispatches: publish filled pages, give each running request the pages its next
        iteration can write (preempting the newest while short), admit unless one was. -> (admitted, preempted)"""
        for req in self.running.values():
            self._publish(req)
        preempted = []
        for req in list(self.running.values()):
            while req.slot is not None and not self._extend(req):
                victim = next(reversed(self.running.values()))
                self.preempt(victim)
                preempted.append(victim)
        return ([] if preempted else self.admit()), preempted

    def admit(self) -> list[Request]:
        """Waiting requests into free slots in arrival order while pages last, each from its cached prefix."""
        admitted = []
        while self.waiting and self._free_slots:
            req = self.waiting[0]
            self._publish(req)
            cacheable = 0 if req.scores_prompt else (req.context_len - 1) // self.cfg.pool.page_size
            hit = self.pool.match(req.keys[:cacheable])
            fresh = self.pool.allocate(self.pages_to_hold(req) - len(hit))
            if fresh is None:
                self.pool.release(hit)
                break
            self.waiting.popleft()
            req.slot, req.admissions = self._free_slots.pop(), req.admissions + 1
            req.num_cached = len(hit) * self.cfg.pool.page_size
            req.next_chunk = req.num_cached
            req.metrics.cached_tokens += req.num_cached
            self._hold(req, hit + fresh)
            req.published = len(hit)
            self.running[req.slot] = req
            admitted.append(req)
        return admitted

    def preempt(self, req: Request) -> None:
        """Give a running request's slot and pages back and queue it first (module docstring)."""
        self._vacate(req)
        req.metrics.preemptions += 1
        self.waiting.appendleft(req)

    def prefill_dispatched(self, req: Request, end: int) -> None:
        """A prefill chunk of `req` ending at position `end` was dispatched: the next starts there,
        or, the last dispatched, the request decodes."""
        req.next_chunk = end if end < req.context_len else None

    @property
    def prefilling(self) -> list[Request]:
        """The running requests still prefilling, in admission order."""
        return [req for req in self.running.values() if req.prefilling]

    @property
    def decoding(self) -> list[Request]:
        """The running requests done prefilling, in admission order: the batch's."""
        return [req for req in self.running.values() if not req.prefilling]

    def release(self, req: Request) -> None:
        """A request of max_tokens 0, its prefill dispatched: its slot and pages back now, so that no
        iteration runs for it; the engine finishes it once its prompt's logprobs are read."""
        self._vacate(req)

    def finish(self, req: Request, reason: str, error: str | None = None) -> None:
        req.finish_reason, req.error = reason, error
        if req.slot is not None:
            self._vacate(req)

    def _extend(self, req: Request) -> bool:
        """Whether `req` holds, or could take, the pages its next iteration can write."""
        pages = self.pool.allocate(self.pages_to_hold(req) - len(req.pages))
        if pages:
            self._hold(req, pages)
        return pages is not None

    def _hold(self, req: Request, pages: list[int]) -> None:
        self.block_tables[req.slot, len(req.pages):len(req.pages) + len(pages)] = pages
        req.pages.extend(pages)

    def _publish(self, req: Request) -> None:
        """Key the request's full pages (tokens known) and cache those it holds whose KV a program
        already dispatched writes: every token the host knows but those a prefill has yet to reach."""
        page = self.cfg.pool.page_size
        if (len(req.prompt) + len(req.output) - 1) // page > len(req.keys):
            req.keys = page_keys(req.tokens, page, req.keys)
        written = req.context_len if req.next_chunk is None else req.next_chunk
        done, req.published = req.published, min(len(req.keys), len(req.pages), written // page)
        self.pool.publish(req.pages[done:req.published], req.keys[done:req.published])

    def _vacate(self, req: Request) -> None:
        self._publish(req)
        del self.running[req.slot]
        self.block_tables[req.slot] = SCRATCH_PAGE
        self._free_slots.append(req.slot)
        self.pool.release(req.pages)
        req.slot, req.pages, req.published, req.next_chunk = None, [], 0, None

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
        """The running requests done prefilling, padded to a bucket: (requests, slots [B], block
        tables [B, nb])."""
        reqs = self.decoding
        slots = np.full(self.bucket(len(reqs)), DUMMY_SLOT, np.int32)
        slots[:len(reqs)] = [r.slot for r in reqs]
        return reqs, slots, self.block_tables[slots]
