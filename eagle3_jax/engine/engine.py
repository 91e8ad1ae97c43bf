"""The engine: requests in, tokens out, over the device runner. Host only.

Each `step()` schedules (pages, preemption, admission), runs (dispatches prefills and one
iteration without waiting), and postprocesses the results dispatched the step before, so the
host's work overlaps the device's. The device runs dispatches in order (each threads the donated
state); results for a request that finished or was preempted since they were dispatched are
dropped (the surplus iteration: its pages are rewritten only by later dispatches).

A batch with a row under a grammar (`SamplingParams.structured_outputs`) gives up that overlap:
before dispatching, the host reads every result in flight, advances each such row's matcher by
the tokens it emitted, reads the rows' pending proposals and computes the tokens the grammar allows
at each position the verify decides (engine/structured.py); the program applies those masks to the
target's logits before accepting, so the output is the constrained target's with or without
speculation. Such a batch verifies a chain (or the target alone), never a tree.

Under `speculation="auto"` each iteration runs the target alone or one of the proposals by
engine/policy.py's rule, from costs timed in warm-up (then as served) and the acceptance measured
as iterations are collected (engine/speculation.py keeps both). Prefills are packed into calls by
engine/prefill.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from collections.abc import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import DraftConfig, EngineConfig, ModelConfig
from eagle3_jax.engine.prefill import PrefillChunk, chunks_of, group_last_chunks, prefill_call
from eagle3_jax.engine.scheduler import Request, Scheduler, stop_reason
from eagle3_jax.engine.speculation import Choice, Speculation
from eagle3_jax.engine.stats import EngineStats
from eagle3_jax.engine.structured import Grammars
from eagle3_jax.runner import kv_memory
from eagle3_jax.runner.runner import ModelRunner, freeze_heap, place_weights
from eagle3_jax.runner.served import DeviceFacts, served_config
from eagle3_jax.runner.steps import TARGET_ALONE, StepConfig, split_verdicts
from eagle3_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """Work asked of an engine after `close`."""


@dataclasses.dataclass
class _Pending:
    """A dispatched program whose results the host has not read yet."""

    reqs: list[Request]
    result: object  # device array: prefill's first token [1]; an iteration's verdicts [B, 2 + K+1]
    admissions: list[int]  # each request's at dispatch: results of an admission since preempted are stale
    iteration: bool = False
    proposal: int | None = None  # iterate: the index of the proposal verified (None: the target alone)
    fresh: np.ndarray | None = None  # iterate: [len(reqs)] bool, that proposal drafted at the row's position


class Engine:
    """Continuous-batching EAGLE-3 engine over the runner's fixed-shape compiled steps."""

    def __init__(self, target: ModelConfig, params, draft: DraftConfig | None, draft_params, cfg: EngineConfig,
                 eos_token_ids: Sequence[int] = (), detokenize=None, overlap: bool = True, mesh: Mesh | None = None,
                 tokenizer=None):
        """`params`, `draft_params`: weight pytrees as `weights/` loads them; placed on the devices here.
        `cfg` is served as `served_config` settles it, read from `self.cfg` by every part. `tokenizer`:
        the target's (a transformers fast tokenizer), for structured outputs (None: refused)."""
        weights = place_weights(target, params, draft, draft_params, mesh)
        # The pool is sized from the memory free once the weights are placed (the caller's still held: a margin).
        self.device = device = DeviceFacts.of(mesh, weights.arrays() if cfg.num_pages is None else None)
        self.cfg = served = served_config(cfg, target, draft, device, weights.placed.embed.dtype)
        self.runner = ModelRunner(served, target, draft, weights, mesh)
        self.proposals = served.speculation.proposals  # what an iteration may draft, the engine's proposal first
        self.overlap = overlap  # False: read each step's results before returning (for measuring)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize  # list[int] -> str, for stop strings and .text
        self.grammars = Grammars(tokenizer, target.vocab_size, self.eos_token_ids)
        spec = served.speculation
        self.scheduler = Scheduler(served, target.vocab_size, spec.max_accepted, spec.positions_per_iteration)
        self.speculation = Speculation(spec, served.batch_buckets, served.max_num_seqs + 1)
        log.info(kv_memory.pool_line(served, device.free_bytes, cfg.num_pages is not None, device.held_elsewhere))
        self.stats = EngineStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._seed_rng = np.random.default_rng()

    @property
    def step_cfg(self) -> StepConfig:
        """The static config every program shares (target, drafter, K, attention, mesh)."""
        return self.runner.step_cfg

    @property
    def num_compilations(self) -> int:
        return self.runner.num_compilations

    def close(self) -> None:
        """End every unfinished request ("abort") and free the device memory now; the engine
        refuses work after. Closing twice does nothing."""
        for req in [*self.scheduler.waiting, *self.scheduler.running.values()]:
            self.scheduler.abort(req.id)
        self._pending.clear()
        self.runner.close()

    def _check_open(self) -> None:
        if self.runner.closed:
            raise EngineClosedError("this engine is closed (LLM.close released its device memory): build another")

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams, arrival_time: float | None = None) -> Request:
        """Queue a request, or raise RequestError naming the problem. `arrival_time`
        (time.perf_counter(), default now): when it reached the server, for its time to first token."""
        self._check_open()
        self.scheduler.validate(list(prompt), params)
        grammar = None if params.structured_outputs is None else self.grammars.matcher(params.structured_outputs)
        req = self.scheduler.add(list(prompt), params, arrival_time)
        req.grammar = grammar
        return req

    def validate_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError naming what `add_request` would refuse (structured_outputs that do not
        compile: its subclass GrammarError); safe from any thread."""
        self.scheduler.validate(list(prompt), params)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)

    def abort(self, request_id: int) -> Request | None:
        """End a request now (finish_reason "abort"), freeing its slot and pages; an iteration
        already dispatched for it is discarded. -> the request, or None if it had finished."""
        return self.scheduler.abort(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    def reset_stats(self) -> None:
        """Start the step statistics afresh (warm-up time kept)."""
        self.stats = EngineStats(warmup_s=self.stats.warmup_s)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, run, postprocess: returns the requests that changed."""
        self._check_open()
        start, waited = time.perf_counter(), self.stats.device_wait_s
        earlier = len(self._pending)  # dispatched in earlier steps
        admitted, preempted = self.scheduler.schedule()
        self.stats.preemptions += len(preempted)
        if admitted:
            self._run_prefills(admitted)
        changed, constrained = [], any(r.grammar is not None for r in self.scheduler.running.values())
        if constrained:  # the masks follow every token emitted so far: read all in flight first
            changed = [req for _ in range(len(self._pending)) for req in self._postprocess(self._pending.popleft())]
            earlier = 0
        ran = self._run_iteration(*self.scheduler.batch()) if self.scheduler.running else None
        # With new work queued, read only what was dispatched before it (the overlap); with none,
        # drain everything so the loop can end.
        ready = earlier if self.overlap and len(self._pending) > earlier else len(self._pending)
        changed += [req for _ in range(ready) for req in self._postprocess(self._pending.popleft())]
        self.stats.steps += 1
        took = time.perf_counter() - start
        self.stats.host_s += took - (self.stats.device_wait_s - waited)
        # A step that waited for its results is no period of the overlapped loop.
        self.speculation.time_step(None if admitted or constrained else ran, took)
        return changed

    def _run_prefills(self, reqs: list[Request]) -> None:
        """Prefill the requests admitted in this step (engine/prefill.py packs the calls), then queue
        the reads of their first tokens."""
        cfg, lasts = self.cfg, []
        for req in reqs:
            # One seed per request, drawn at its first admission whatever the grouping (seeded
            # requests draw none): the same requests sample the same tokens however they are
            # batched, and preempted.
            if req.params.seed is None and req.seed is None:
                req.seed = int(self._seed_rng.integers(0, 2**63 - 1))
            self.stats.prefix_queried_tokens += req.context_len
            self.stats.prefix_hit_tokens += req.num_cached
            if req.num_cached:  # a speculator's token history has the cached prefix too
                self.runner.write_history(req.slot, req.tokens[:req.num_cached])
            *leading, last = chunks_of(req, cfg.prefill_buckets[-1])
            for chunk in leading:
                self._run_prefill_call([chunk])
            lasts.append(last)
        for chunks in group_last_chunks(lasts, cfg):
            self._run_prefill_call(chunks)
        t = time.perf_counter()
        for req in reqs:
            self.speculation.prefilled(req.slot)  # its last chunk drafted the engine's proposal
            if req.output:
                continue  # resumed: the token its prefill ends on is its last generated one
            first = self.runner.first_token(req.slot)  # [1], the last chunk's sample
            first.copy_to_host_async()
            self._pending.append(_Pending([req], first, [req.admissions]))
        self.stats.dispatch_s += time.perf_counter() - t

    def _run_prefill_call(self, chunks: list[PrefillChunk]) -> None:
        inputs, params, seeds = prefill_call(chunks, self.cfg, self.scheduler.block_tables)
        # A request under a grammar samples its first token under the grammar's first mask.
        largest = self.cfg.prefill_buckets[-1]
        first = [(i, c.req.grammar, ()) for i, c in enumerate(chunks) if c.req.grammar is not None
                 and not c.req.output and c.start + len(c.tokens(largest)) == c.req.context_len]
        mask = self.grammars.masks(first, len(params), 1)[:, 0] if first else None
        t = time.perf_counter()
        self.runner.prefill(inputs, params, seeds, mask)
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.prefill_calls += 1

    def _run_iteration(self, reqs: list[Request], slots: np.ndarray, tables: np.ndarray) -> tuple[int, Choice]:
        """Dispatch one iteration of the running requests: -> (its bucket, its choice)."""
        bucket = len(slots)
        constrained = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        choice = self.speculation.choice(bucket)
        if constrained:
            choice = self._chain_choice(choice)
        cfg = self._config(choice, greedy=all(r.params.greedy for r in reqs), masked=bool(constrained))
        fresh = self.speculation.dispatched(slots[:len(reqs)], choice)
        mask = None
        if constrained:  # the grammar along each row's proposal: its drafts are read first
            width = cfg.speculator.facts.verify_width
            drafts = self.runner.read_drafts(slots[:len(reqs)], width - 1) if width > 1 else None
            mask = self.grammars.masks([(i, m, () if drafts is None else drafts[i]) for i, m in constrained],
                                       bucket, width)
        t = time.perf_counter()
        verdicts = self.runner.iterate(slots, tables, cfg, mask)
        verdicts.copy_to_host_async()
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.iterations += 1
        self.stats.count_iteration(bucket, self.speculation.label(choice), speculative=choice is not None)
        self._pending.append(_Pending(reqs, verdicts, [r.admissions for r in reqs], True, choice, fresh))
        return bucket, choice

    def _postprocess(self, pending: _Pending) -> list[Request]:
        """Read one dispatched program's results and apply them to its requests."""
        t = time.perf_counter()
        result = np.asarray(pending.result)
        collected = time.perf_counter()
        self.stats.device_wait_s += collected - t
        accepted, top1, tokens = split_verdicts(result) if pending.iteration else (None, None, result)
        if accepted is not None:  # read before _append finishes any request
            n = len(pending.reqs)
            measured = np.array([bool(f) and not _stale(pending, i) for i, f in enumerate(pending.fresh)], bool)
            self.speculation.observe(pending.proposal, accepted[:n], top1[:n], measured)
        changed = []
        for i, req in enumerate(pending.reqs):
            if _stale(pending, i):
                continue  # the surplus iteration of a finished request, or one preempted since
            if accepted is None:
                new = tokens[:1].tolist()
            else:
                req.metrics.record(int(accepted[i]), speculative=pending.proposal is not None)
                new = tokens[i, :accepted[i] + 1].tolist()
            self._append(req, new)
            req.metrics.collected(collected)
            changed.append(req)
        return changed

    def _append(self, req: Request, new_tokens: list[int]) -> None:
        for tok in new_tokens:
            req.output.append(tok)
            reason = stop_reason(req, tok, self.eos_token_ids, self.detokenize)
            if reason is None and req.grammar is not None and req.grammar.advance(tok):
                reason = "stop"  # the grammar is complete: nothing may follow
            if reason:
                self.scheduler.finish(req, reason)
                break

    def run(self, requests: Iterable[Request], progress: bool = False) -> None:
        """Step until every given request has finished."""
        requests = list(requests)
        bar = tqdm(total=len(requests), desc="generate", unit="req", disable=not progress)
        done = 0
        while self.has_unfinished():
            self.step()
            now = sum(r.finished for r in requests)
            bar.update(now - done)
            done = now
        bar.close()

    # ---- programs ----------------------------------------------------------------------------
    def _config(self, choice: Choice, greedy: bool, masked: bool = False) -> StepConfig:
        return self.runner.config(TARGET_ALONE if choice is None else self.proposals[choice], greedy, masked)

    def _chain_choice(self, choice: Choice) -> Choice:
        """`choice`, or for a tree the engine's first chain (else the target alone): a batch under a
        grammar verifies one line of tokens, which the host's matchers can follow."""
        if choice is None or self.proposals[choice].facts.verifies_chain:
            return choice
        return next((i for i, p in enumerate(self.proposals) if p.facts.verifies_chain), None)

    def iterate_config(self, bucket: int, greedy: bool = True) -> StepConfig:
        """The iteration a bucket runs now: its choice's proposal, or the target alone (pending
        proposals then wait: each was drawn as its rule requires, so any is safe to verify later)."""
        return self._config(self.speculation.choice(bucket), greedy)

    def programs(self, greedy: bool | None = None
                 ) -> tuple[list[tuple[int, StepConfig]], list[tuple[int, int, bool, bool]]]:
        """Every program serving may run, greedy and sampling (`greedy`: one of them): iterations
        (bucket, config), each bucket's choices (`Speculation.choices`), and prefills (rows, chunk,
        greedy, masked); with `structured_warmup` the masked ones too (a grammar's batches)."""
        kinds = (True, False) if greedy is None else (greedy,)
        masked = (False, True) if self.cfg.structured_warmup else (False,)
        iterations = [(b, self._config(c, g)) for b in self.cfg.batch_buckets for c in self.speculation.choices(b)
                      for g in kinds]
        if self.cfg.structured_warmup:
            chains = {b: list(dict.fromkeys(map(self._chain_choice, self.speculation.choices(b))))
                      for b in self.cfg.batch_buckets}
            iterations += [(b, self._config(c, g, masked=True)) for b in self.cfg.batch_buckets for c in chains[b]
                           for g in kinds]
        prefills = [(rows, size, g, m) for size in self.cfg.prefill_buckets for rows in self.cfg.prefill_batch_buckets
                    for g in kinds for m in masked]
        return iterations, prefills

    def warmup(self, progress: bool = True, greedy: bool | None = None) -> float:
        """Compile every program now, so serving never compiles, and in "auto" time each bucket's
        choices for the policy; `greedy` True (False) builds only the greedy (sampling) programs.
        The fused programs compile at once on a thread pool first (`runner.compile_ahead`;
        BENCHMARKS.md, "Start-up"). Then the heap is frozen (`freeze_heap`). -> seconds."""
        start = time.perf_counter()
        iterations, prefills = self.programs(greedy)
        if self.cfg.speculation.fused_iteration:
            self.runner.compile_ahead(iterations, prefills, progress)
        shapes = [("iterate", *job) for job in iterations] + [("prefill", *job) for job in prefills]
        for kind, *job in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            (self.runner.compile_iteration if kind == "iterate" else self.runner.compile_prefill)(*job)
        self.speculation.time_buckets(lambda b, c: statistics.median(
            self.runner.time_iteration(*self.runner.padding_rows(b), self._config(c, greedy=True))))
        if self.cfg.freeze_heap:
            freeze_heap()
        self.stats.warmup_s = time.perf_counter() - start
        log.info("warm-up: %d programs ready in %.1f s", len(shapes), self.stats.warmup_s)
        return self.stats.warmup_s


def _stale(pending: _Pending, i: int) -> bool:
    """Whether row i's results no longer apply: its request finished, or was preempted since."""
    req = pending.reqs[i]
    return req.finished or req.admissions != pending.admissions[i]
