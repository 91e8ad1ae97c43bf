"""The engine: requests in, tokens out, over the device runner. Host only.

Each `step()` schedules (pages, preemption, admission), runs (dispatches prefills and one
iteration without waiting), and postprocesses the results dispatched the step before, so the
host's work overlaps the device's. The device runs dispatches in order (each threads the donated
state); results for a request that finished or was preempted since they were dispatched are
dropped (the surplus iteration: its pages are rewritten only by later dispatches).

Under `speculation="auto"` each iteration runs the target alone or one of the proposals by
engine/policy.py's rule, from costs timed in warm-up (then as served) and acceptance measured here.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Iterable, Sequence

import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import DraftConfig, EngineConfig, ModelConfig, default_batch_buckets, smallest_bucket
from eagle3_jax.engine import policy
from eagle3_jax.engine.scheduler import Request, Scheduler
from eagle3_jax.runner.runner import PADDING_PARAMS, ModelRunner, PrefillInputs
from eagle3_jax.runner.steps import TARGET_ALONE, StepConfig, split_verdicts
from eagle3_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineStats:
    """Per-step timings (host: Python work, of which dispatch: inside the calls that enqueue
    programs; device wait: blocked on results) and what the policy ran, per bucket and proposal."""

    steps: int = 0
    iterations: int = 0
    prefill_calls: int = 0  # prefill programs dispatched (several requests' chunks may share one)
    host_s: float = 0.0
    dispatch_s: float = 0.0
    device_wait_s: float = 0.0
    warmup_s: float = 0.0
    speculative_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count
    target_only_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count
    proposal_iterations: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # label -> bucket -> count
    preemptions: int = 0
    # Tokens admitted requests had in their KV once prefilled, and those of them found in the prefix cache.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / max(self.steps, 1)

    @property
    def dispatch_ms_per_step(self) -> float:
        return 1e3 * self.dispatch_s / max(self.steps, 1)

    @property
    def device_wait_ms_per_step(self) -> float:
        return 1e3 * self.device_wait_s / max(self.steps, 1)


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


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Chunk [start, start + the largest chunk bucket) of what a request's prefill writes (its
    prompt; resumed, its generated tokens too but the last)."""

    req: Request
    start: int

    def tokens(self, largest: int) -> list[int]:
        return self.req.tokens[self.start:min(self.start + largest, self.req.context_len)]


class Engine:
    """Continuous-batching EAGLE-3 engine over the runner's fixed-shape compiled steps."""

    def __init__(self, target: ModelConfig, params, draft: DraftConfig | None, draft_params, cfg: EngineConfig,
                 eos_token_ids: Sequence[int] = (), detokenize=None, overlap: bool = True, mesh: Mesh | None = None):
        """`params`, `draft_params`: weight pytrees as `weights/` loads them; the runner places them."""
        size_pool = cfg.num_pages is None
        cfg = cfg.resolved()
        self.runner = ModelRunner(target, params, draft, draft_params, cfg, mesh, size_pool)
        cfg = dataclasses.replace(cfg, num_pages=self.runner.cfg.num_pages)
        self.proposals = self.runner.proposals  # what an iteration may draft, the engine's proposal first
        if cfg.batch_buckets is None:
            cfg = dataclasses.replace(cfg, batch_buckets=default_batch_buckets([p.facts.spec for p in self.proposals]))
        self.cfg = cfg
        self.overlap = overlap  # False: read each step's results before returning (for measuring)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize  # list[int] -> str, for stop strings and .text
        most = max((p.facts.max_accepted for p in self.proposals), default=0)
        self.scheduler = Scheduler(cfg, target.vocab_size, most, self.runner.positions_per_iteration)
        log.info(pool_line(cfg, self.runner.free_bytes, explicit=not size_pool, elsewhere=self.runner.held_elsewhere))
        self.stats = EngineStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._seed_rng = np.random.default_rng()
        # The speculation policy's inputs: costs per bucket (injected, or timed in warm-up), one
        # acceptance estimate per proposal (updated as iterations are collected), and per slot the
        # proposal whose proposals it holds fresh, drafted at its current position (-1 after a
        # target-only iteration: the next verify checks stale proposals, no measure of the drafter).
        self.policy = policy.SpeculationPolicy()
        self.acceptance = tuple(policy.AcceptanceEstimate.prior(p.facts.max_accepted) for p in self.proposals)
        self.step_costs: dict[int, policy.BucketCost] = {
            int(c[0]): policy.BucketCost(c[1], tuple(c[2:])) for c in cfg.step_costs or ()
            if c[0] in cfg.batch_buckets and self.proposals}
        self._injected = frozenset(self.step_costs)  # the user's costs: serving does not replace them
        self._drafted = np.full(cfg.max_num_seqs + 1, -1)  # [S] proposal index, or -1
        # Per bucket, each choice's served time (proposal index, None the target alone), and the
        # (bucket, choice) of the last step's iteration when that step ran no prefill.
        self.served: dict[int, dict[int | None, policy.ServedTime]] = {}
        self._last_steady: tuple[int, int | None] | None = None

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
        return self.scheduler.add(list(prompt), params, arrival_time)

    def validate_request(self, prompt: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError naming what `add_request` would refuse; safe from any thread."""
        self.scheduler.validate(list(prompt), params)

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
        ran = self._run_iteration(*self.scheduler.batch()) if self.scheduler.running else None
        # With new work queued, read only what was dispatched before it (the overlap); with none,
        # drain everything so the loop can end.
        ready = earlier if self.overlap and len(self._pending) > earlier else len(self._pending)
        changed = [req for _ in range(ready) for req in self._postprocess(self._pending.popleft())]
        self.stats.steps += 1
        took = time.perf_counter() - start
        self.stats.host_s += took - (self.stats.device_wait_s - waited)
        self._time_step(None if admitted else ran, took)
        return changed

    def _time_step(self, ran: tuple[int, int | None] | None, seconds: float) -> None:
        """A step that ran the iteration `ran` (bucket, choice) and no prefill, after a step that
        ran the same, took `seconds`: in the overlapped loop that is one period of the choice's
        iterations as served, host work included (policy.py, "The costs")."""
        timed = self.policy.time_served and self.cfg.speculation == "auto"
        if ran is not None and ran == self._last_steady and timed and ran[0] not in self._injected:
            bucket, choice = ran
            times = self.served.setdefault(bucket, {})
            times[choice] = policy.observe_time(times.get(choice), seconds, self.policy)
        self._last_steady = ran

    def _run_prefills(self, reqs: list[Request]) -> None:
        """Prefill the requests admitted in this step: each long prompt's leading chunks alone,
        then every last chunk grouped by chunk bucket, up to the largest prefill batch bucket a
        call, so a burst of arrivals costs a few prefills, not one per request."""
        largest = self.cfg.prefill_buckets[-1]
        by_bucket: dict[int, list[PrefillChunk]] = collections.defaultdict(list)
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
            starts = range(req.num_cached, req.context_len, largest)
            for start in starts[:-1]:
                self._run_prefill_call([PrefillChunk(req, start)])
            last = PrefillChunk(req, starts[-1])
            by_bucket[self._chunk_bucket(len(last.tokens(largest)))].append(last)
        most = self.cfg.prefill_batch_buckets[-1]
        for chunks in by_bucket.values():
            for i in range(0, len(chunks), most):
                self._run_prefill_call(chunks[i:i + most])
        t = time.perf_counter()
        for req in reqs:
            self._drafted[req.slot] = 0 if self.proposals else -1  # its last chunk drafted the first proposal
            if req.output:
                continue  # resumed: the token its prefill ends on is its last generated one
            first = self.runner.first_token(req.slot)  # [1], the last chunk's sample
            first.copy_to_host_async()
            self._pending.append(_Pending([req], first, [req.admissions]))
        self.stats.dispatch_s += time.perf_counter() - t

    def _chunk_bucket(self, length: int) -> int:
        return smallest_bucket(self.cfg.prefill_buckets, length)

    def _run_prefill_call(self, chunks: list[PrefillChunk]) -> None:
        """One prefill program over `chunks`, one row each, padded to the smallest batch bucket
        and chunk bucket that hold them."""
        rows = smallest_bucket(self.cfg.prefill_batch_buckets, len(chunks))
        largest = self.cfg.prefill_buckets[-1]
        pieces = [c.tokens(largest) for c in chunks]
        inputs = PrefillInputs.padding(rows, self._chunk_bucket(max(map(len, pieces))), self.cfg.max_blocks_per_seq)
        for i, (chunk, piece) in enumerate(zip(chunks, pieces)):
            known, start = chunk.req.tokens, chunk.start
            following = known[start + 1:start + len(piece) + 1]  # the ids shifted left by one
            inputs.next_tokens[i] = 0  # a real row: no padding marker
            inputs.tokens[i, :len(piece)] = piece
            inputs.next_tokens[i, :len(following)] = following
            if start + len(piece) == len(known):
                inputs.next_tokens[i, len(piece) - 1] = -1  # the first generated token goes here
            inputs.num_valid[i], inputs.start[i] = len(piece), start
            inputs.slot[i], inputs.block_table[i] = chunk.req.slot, self.scheduler.block_tables[chunk.req.slot]
            inputs.num_generated[i] = max(len(chunk.req.output), 1)
        params = [c.req.params for c in chunks] + [PADDING_PARAMS] * (rows - len(chunks))
        seeds = [c.req.seed for c in chunks] + [0] * (rows - len(chunks))
        t = time.perf_counter()
        self.runner.prefill(inputs, params, seeds)
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.prefill_calls += 1

    def _run_iteration(self, reqs: list[Request], slots: np.ndarray, tables: np.ndarray) -> tuple[int, int | None]:
        """Dispatch one iteration of the running requests: -> (its bucket, its choice)."""
        bucket = len(slots)
        choice = self.choice(bucket)
        cfg = self._config(choice, greedy=all(r.params.greedy for r in reqs))
        # Device order is dispatch order, so freshness at dispatch is what this iteration verifies.
        rows = slots[:len(reqs)]
        fresh = self._drafted[rows] == (-1 if choice is None else choice)
        self._drafted[rows] = -1 if choice is None else choice
        t = time.perf_counter()
        verdicts = self.runner.iterate(slots, tables, cfg)
        verdicts.copy_to_host_async()
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.iterations += 1
        counts = self.stats.target_only_iterations if choice is None else self.stats.speculative_iterations
        counts[bucket] = counts.get(bucket, 0) + 1
        by_bucket = self.stats.proposal_iterations.setdefault(self._label(choice), {})
        by_bucket[bucket] = by_bucket.get(bucket, 0) + 1
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
            self._observe(pending, accepted[:len(pending.reqs)], top1[:len(pending.reqs)])
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

    def _observe(self, pending: _Pending, accepted: np.ndarray, top1: np.ndarray) -> None:
        """Update the acceptance estimates from one iteration's accepted, top1 [n], over rows still
        running whose proposals were drafted fresh. The proposal that ran measures its own; a
        verify that reports the top-1 chain's acceptance (`SpeculatorFacts.measures_top1_chain`)
        measures the chains served beside it too, without probing them."""
        measured = np.array([bool(fresh) and not _stale(pending, i) for i, fresh in enumerate(pending.fresh)], bool)
        ran = None if pending.proposal is None else self.proposals[pending.proposal]
        estimates = []
        for i, (est, proposal) in enumerate(zip(self.acceptance, self.proposals)):
            if i == pending.proposal:
                est = policy.observe(est, accepted, measured, self.policy)
            elif ran is not None and ran.facts.measures_top1_chain and proposal.facts.top1_chain:
                longest = proposal.facts.top1_chain
                est = policy.observe(est, np.minimum(top1, longest), measured & (top1 >= 0), self.policy)
            else:
                est = policy.observe(est, accepted, np.zeros_like(measured), self.policy)
            estimates.append(est)
        self.acceptance = tuple(estimates)

    def _append(self, req: Request, new_tokens: list[int]) -> None:
        params = req.params
        stops = self.eos_token_ids if not params.ignore_eos else frozenset()
        for tok in new_tokens:
            req.output.append(tok)
            if tok in stops or tok in params.stop_token_ids:
                self.scheduler.finish(req, "stop")
                break
            if params.stop and self.detokenize is not None and self._hit_stop_string(req):
                self.scheduler.finish(req, "stop")
                break
            if len(req.output) >= req.max_tokens:
                self.scheduler.finish(req, "length")
                break

    def _hit_stop_string(self, req: Request) -> bool:
        """Whether the last token completed a stop string (then `req.text` is cut before it). It is
        checked after every token, so it can only end in the last one's text: a tail of enough
        tokens to hold the longest stop's bytes is decoded, not the whole output each time."""
        tail = 4 * max(map(len, req.params.stop)) + 8  # tokens: each at least a byte, a char at most 4
        recent = self.detokenize(req.output[-tail:])
        if not any(stop in recent for stop in req.params.stop):
            return False
        text = self.detokenize(req.output)
        found = [i for stop in req.params.stop if (i := text.find(stop)) >= 0]
        if found:  # (a tail decoded alone can differ at its start: the whole text decides)
            req.text = text[:min(found)]
        return bool(found)

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

    # ---- speculation per bucket --------------------------------------------------------------
    def may_speculate(self, bucket: int) -> bool:
        """Whether a bucket can speculate at all: a drafter, a proposal, within speculative_max_batch."""
        limit = self.cfg.speculative_max_batch
        return bool(self.proposals) and (limit is None or bucket <= limit)

    def choice(self, bucket: int) -> int | None:
        """This bucket's choice now: the index of a proposal in `proposals`, or None for the target
        alone. "always" runs the engine's proposal wherever it may speculate; "auto" asks the policy."""
        if not self.may_speculate(bucket):
            return None
        if self.cfg.speculation == "always":
            return 0
        return policy.choose(self.bucket_cost(bucket), self.acceptance,
                             [p.facts.max_accepted + 1 for p in self.proposals], self.policy)

    def bucket_cost(self, bucket: int) -> policy.BucketCost | None:
        """The bucket's cost as the policy takes it: warm-up's (or injected), each choice's replaced
        by its served time once serving has timed it (`policy.served_cost`)."""
        cost = self.step_costs.get(bucket)
        return policy.served_cost(cost, self.served[bucket]) if cost is not None and bucket in self.served else cost

    def _config(self, choice: int | None, greedy: bool) -> StepConfig:
        return self.runner.config(TARGET_ALONE if choice is None else self.proposals[choice], greedy)

    def _label(self, choice: int | None) -> str:
        return "target-only" if choice is None else self.proposals[choice].facts.label

    def iterate_config(self, bucket: int, greedy: bool = True) -> StepConfig:
        """The iteration a bucket runs now: its choice's proposal, or the target alone (pending
        proposals then wait: each was drawn as its rule requires, so any is safe to verify later)."""
        return self._config(self.choice(bucket), greedy)

    def speculation_table(self) -> tuple[policy.BucketChoice, ...]:
        """Every bucket's cost and current choice (`policy_report` prints it)."""
        return tuple(policy.BucketChoice(b, self.bucket_cost(b), self._label(self.choice(b)))
                     for b in self.cfg.batch_buckets)

    def policy_report(self) -> str:
        """The speculation table and each proposal's acceptance estimate, as plain text."""
        labels = [p.facts.label for p in self.proposals]
        return policy.format_table(self.speculation_table(), list(zip(labels, self.acceptance)))

    # ---- compilation -------------------------------------------------------------------------
    def _choices(self, bucket: int) -> list[int | None]:
        """What a bucket may run: the engine's proposal ("always"), every proposal and the target
        alone ("auto"), or the target alone where it may not speculate."""
        choices: list[int | None] = []
        if self.may_speculate(bucket):
            choices = [0] if self.cfg.speculation == "always" else list(range(len(self.proposals)))
        if not choices or self.cfg.speculation == "auto":
            choices.append(None)
        return choices

    def iteration_configs(self, bucket: int, greedy: bool | None = None) -> list[StepConfig]:
        """The iterations a bucket may run (`_choices`), greedy and sampling (`greedy`: one of them)."""
        kinds = (True, False) if greedy is None else (greedy,)
        return [self._config(c, g) for c in self._choices(bucket) for g in kinds]

    def programs(self, greedy: bool | None = None) -> tuple[list[tuple[int, StepConfig]], list[tuple[int, int, bool]]]:
        """Every program serving may run: (iterations (bucket, config), prefills (rows, chunk, greedy))."""
        kinds = (True, False) if greedy is None else (greedy,)
        iterations = [(b, c) for b in self.cfg.batch_buckets for c in self.iteration_configs(b, greedy)]
        prefills = [(rows, size, g) for size in self.cfg.prefill_buckets for rows in self.cfg.prefill_batch_buckets
                    for g in kinds]
        return iterations, prefills

    def warmup(self, progress: bool = True, greedy: bool | None = None) -> float:
        """Compile every program now, so serving never compiles, and in "auto" time each bucket's
        choices for the policy; `greedy` True (False) builds only the greedy (sampling) programs.
        The fused programs compile at once on a thread pool first (`runner.compile_ahead`;
        BENCHMARKS.md, "Start-up"). Then the heap is frozen (`freeze_heap`). -> seconds."""
        start = time.perf_counter()
        iterations, prefills = self.programs(greedy)
        if self.cfg.fused_iteration:
            self.runner.compile_ahead(iterations, prefills, progress)
        shapes = [("iterate", *job) for job in iterations] + [("prefill", *job) for job in prefills]
        for kind, *job in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            (self.runner.compile_iteration if kind == "iterate" else self.runner.compile_prefill)(*job)
        for b in self.cfg.batch_buckets:
            # The policy's costs come from the greedy programs (the sampling ones add about the
            # same sampling work to every iteration).
            choices = self._choices(b)
            if len(choices) > 1 and b not in self.step_costs:
                seconds = [statistics.median(self.runner.time_iteration(*self.runner.padding_rows(b),
                                                                        self._config(c, greedy=True)))
                           for c in choices]  # the proposals', then the target alone's
                self.step_costs[b] = policy.BucketCost(target_only_s=seconds[-1], speculative_s=tuple(seconds[:-1]))
        if self.cfg.freeze_heap:
            freeze_heap()
        self.stats.warmup_s = time.perf_counter() - start
        log.info("warm-up: %d programs ready in %.1f s", len(shapes), self.stats.warmup_s)
        return self.stats.warmup_s


def _stale(pending: _Pending, i: int) -> bool:
    """Whether row i's results no longer apply: its request finished, or was preempted since."""
    req = pending.reqs[i]
    return req.finished or req.admissions != pending.admissions[i]


# Memory held on the device beyond an engine's own weights when its pool is sized, from which the
# start-up line says so: another engine of the process, most often, shrinking this one's pool.
HELD_ELSEWHERE_NOTE_BYTES = 1 << 30


def pool_line(cfg: EngineConfig, sized_from: int | None, explicit: bool, elsewhere: int | None = None) -> str:
    """The start-up line on the KV pool: its size in tokens and in rows at max_model_len, and what
    sized it (`sized_from`: the free bytes it was taken from; `elsewhere`: bytes in use on the
    device beyond the engine's weights then)."""
    tokens = (cfg.num_pages - 1) * cfg.page_size
    source = ("EngineConfig.num_pages" if explicit
              else f"{cfg.kv_memory_fraction:g} of {sized_from / 2**30:.2f} GiB free" if sized_from is not None
              else "no memory reported: every slot at min(max_model_len, 1024) tokens")
    if elsewhere is not None and elsewhere >= HELD_ELSEWHERE_NOTE_BYTES:
        source += (f"; {elsewhere / 2**30:.2f} GiB of the device was already held by something else, another "
                   "engine of this process perhaps (LLM.close() releases one)")
    return (f"KV pool: {cfg.num_pages - 1} pages of {cfg.page_size} tokens = {tokens} tokens, "
            f"{tokens // cfg.max_model_len} rows at max_model_len {cfg.max_model_len} ({source}); "
            f"pages {cfg.page_reservation.replace('_', ' ')}, prefix caching {'on' if cfg.prefix_caching else 'off'}")


def freeze_heap() -> None:
    """Collect, then move every tracked object out of the cyclic collector's reach (`gc.freeze`),
    as vLLM and SGLang do after start-up: a compiled engine leaves hundreds of thousands of objects
    (JAX's caches, traced programs) that every full collection would walk while requests wait.
    Frozen objects are still freed by reference counting; the next warm-up unfreezes first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
