"""The engine loop: schedule, dispatch, collect, postprocess.

Overlap: `step()` dispatches this step's prefills and iteration before it reads the previous
step's results, so the host's scheduling, detokenization and stop checks run while the device
works. Every dispatch threads the donated `DeviceState`, so the device runs them in order; a
request that finished in the results being read was already dispatched once more, and that
surplus iteration is discarded (its pages reserve room for it).

Speculation per bucket: with `EngineConfig.speculation == "auto"` each iteration speculates or runs
the target alone by engine/policy.py's rule, from the step costs timed in warm-up and the
acceptance length measured from the iterations collected here.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import ConfigError, DraftConfig, EngineConfig, ModelConfig, check_draft_fits, smallest_bucket
from eagle3_jax.engine import policy
from eagle3_jax.runner import sampling
from eagle3_jax.engine.scheduler import Request, Scheduler
from eagle3_jax.runner.state import DUMMY_SLOT, init_state, state_shardings
from eagle3_jax.runner.steps import (StepConfig, chain_step_jit, commit_step, iterate_head_step,
                                    iterate_in_place_step, prefill_step, read_first_token_step, read_verdicts_step,
                                    split_verdicts)
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import LlamaParams, fold_norm_gains
from eagle3_jax.parallel import sharding
from eagle3_jax.sampling_params import SamplingParams


class CompileCounter:
    """Counts executables JAX builds (backend compiles and persistent-cache loads), process-wide."""

    count = 0
    _registered = False

    @classmethod
    def install(cls) -> None:
        if cls._registered:
            return
        cls._registered = True

        def on_duration(event: str, _duration: float, **_kw) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                cls.count += 1

        def on_event(event: str, **_kw) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls.count += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)


@dataclasses.dataclass
class EngineStats:
    """Per-step timings: host time is Python work, device wait is time blocked on results.
    Dispatch time is the part of host time spent inside the calls that enqueue compiled programs
    (JAX's argument handling and the runtime's launch), the rest is the engine's own Python.
    Iterations dispatched per batch bucket, speculative and target-only, show what the policy did."""

    steps: int = 0
    iterations: int = 0
    prefill_calls: int = 0  # prefill programs dispatched (several requests' chunks may share one)
    host_s: float = 0.0
    dispatch_s: float = 0.0
    device_wait_s: float = 0.0
    warmup_s: float = 0.0
    speculative_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count
    target_only_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / max(self.steps, 1)

    @property
    def dispatch_ms_per_step(self) -> float:
        return 1e3 * self.dispatch_s / max(self.steps, 1)

    @property
    def device_wait_ms_per_step(self) -> float:
        return 1e3 * self.device_wait_s / max(self.steps, 1)


@dataclasses.dataclass
class _Pending:
    reqs: list[Request]
    result: jax.Array  # prefill: first token [1]; iterate: verdicts [B, 1 + K+1] (`steps.read_verdicts`)
    iteration: bool = False
    speculative: bool = False  # iterate: K drafts verified (else the target alone)
    fresh: np.ndarray | None = None  # iterate: [len(reqs)] bool, proposals drafted at the row's position


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Chunk [start, start + the largest chunk bucket) of a request's prompt, and the request's
    sampling seed (None: its SamplingParams carry one)."""

    req: Request
    start: int
    seed: int | None

    def tokens(self, largest: int) -> list[int]:
        return self.req.prompt[self.start:self.start + largest]


_PADDING_PARAMS = SamplingParams(max_tokens=1)  # greedy: a padding row never makes a call sample


@dataclasses.dataclass
class PrefillInputs:
    """The host arrays of one prefill call (`steps.prefill`'s), P rows of T-token chunks."""

    tokens: np.ndarray  # [P, T]
    next_tokens: np.ndarray  # [P, T]
    num_valid: np.ndarray  # [P]
    start: np.ndarray  # [P]
    slot: np.ndarray  # [P]
    block_table: np.ndarray  # [P, nb]

    @classmethod
    def padding(cls, rows: int, size: int, num_blocks: int) -> PrefillInputs:
        """Padding rows only: each a last chunk of one token (next_tokens -1) into the dummy slot,
        its block table all scratch."""
        next_tokens = np.zeros((rows, size), np.int32)
        next_tokens[:, 0] = -1
        return cls(np.zeros((rows, size), np.int32), next_tokens, np.ones(rows, np.int32), np.zeros(rows, np.int32),
                   np.full(rows, DUMMY_SLOT, np.int32), np.zeros((rows, num_blocks), np.int32))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.tokens, self.next_tokens, self.num_valid, self.start, self.slot, self.block_table


# Overwrite device arrays with new values at their own addresses: the donated `old` is the output
# buffer (keep_unused: jit would otherwise drop the unread `old`, and with it the aliasing).
_overwrite = jax.jit(lambda old, new: new, donate_argnums=0, keep_unused=True)


class PinnedBatch:
    """The iteration's per-call arguments, slots [B] and block tables [B, nb], kept on the device at
    one address per bucket; two buffers per bucket its verdicts are copied into in turn; and one
    buffer per slot a prefill's first token is copied into.

    XLA launches a compiled iteration as a CUDA graph that records every buffer address it uses,
    and rewrites the graph nodes that use a moved buffer before the next launch (see
    `steps.iterate_in_place`). A host array passed as an argument is a new device buffer on every
    call. So the engine keeps one device copy per bucket and overwrites it in place (a donated
    copy, a program with no graph of its own) only when the scheduler's values change: a request
    joined or left. Nor may anything be allocated between two iterations (`steps.read_verdicts`),
    so the verdicts and first tokens go into buffers held here, written over.
    """

    def __init__(self, mesh: Mesh | None):
        self._placement = sharding.replicated_placement(mesh)  # like every per-row input under tp
        self._by_bucket: dict[int, tuple[np.ndarray, np.ndarray, tuple[jax.Array, jax.Array]]] = {}
        self._verdicts: dict[int, tuple[jax.Array, jax.Array]] = {}  # bucket -> (oldest, newest)
        self._first_tokens: list[list[jax.Array]] = []  # slot -> [slot index [1], first token [1]]

    def get(self, slots: np.ndarray, tables: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """Device arrays holding these slots [B] and tables [B, nb], at the bucket's address."""
        held = self._by_bucket.get(len(slots))
        if held is not None and np.array_equal(held[0], slots) and np.array_equal(held[1], tables):
            return held[2]
        if held is None:
            # Buffers of their own (the CPU backend may alias host memory, which a donation cannot
            # reuse); overwritten once already, so the bucket's first call (warm-up) compiles that.
            held = (None, None, jax.device_put((slots, tables), self._placement, may_alias=False))
        device = _overwrite(held[2], (slots, tables))
        self._by_bucket[len(slots)] = (slots.copy(), tables.copy(), device)
        return device

    def read_verdicts(self, state, rows: jax.Array) -> jax.Array:
        """The verdicts [B, 1 + K+1] of the iteration just dispatched over `rows` [B] (from `get`),
        without waiting. They go into the bucket's older buffer, so each array returned here must
        be read (or dropped) before the bucket's next iteration but one: that call writes over it,
        and reading it after raises "Array has been deleted". The engine reads every iteration's
        verdicts during the step that dispatches the next."""
        pair = self._verdicts.get(rows.shape[0])
        if pair is None:
            empty = np.zeros((rows.shape[0], 1 + state.slots.emitted.shape[1]), np.int32)
            pair = tuple(jax.device_put(empty, self._placement, may_alias=False) for _ in range(2))
        verdicts = read_verdicts_step(pair[0], state.slots.num_accepted, state.slots.emitted, rows)
        self._verdicts[rows.shape[0]] = (pair[1], verdicts)
        return verdicts

    def read_first_token(self, state, slot: int) -> jax.Array:
        """The first token [1] the prefill just dispatched sampled into `slot`, without waiting.
        The gather takes the slot's index from a held buffer and writes over the slot's own
        buffer, so nothing is allocated. One buffer per slot rather than two taken in turn: one
        step may admit many requests, all read in the next step, but a slot is admitted again only
        after its request finished, and a request finishes only once its first token was read. So
        each array returned here must be read (or dropped) before the slot's next prefill, which
        writes over it; the engine reads it in the step after the one that dispatched it."""
        if not self._first_tokens:  # every slot's at once: none is allocated while serving
            held = [(np.array([s], np.int32), np.zeros(1, np.int32)) for s in range(state.slots.last_token.shape[0])]
            self._first_tokens = [list(pair) for pair in jax.device_put(held, self._placement, may_alias=False)]
        index, buffer = self._first_tokens[slot]
        first = read_first_token_step(buffer, state.slots.last_token, index)
        self._first_tokens[slot][1] = first
        return first


def attention_kind(cfg: EngineConfig, mesh: Mesh | None) -> str:
    """EngineConfig.attention resolved: "auto" is the Pallas kernel on a GPU without tensor
    parallelism (a pallas_call is not partitioned by XLA's sharding propagation)."""
    if cfg.attention == "pallas" and mesh is not None:
        raise ConfigError("engine config: attention 'pallas' does not run under tensor parallelism "
                          "(use 'auto' or 'xla')")
    if cfg.attention != "auto":
        return cfg.attention
    return "pallas" if jax.default_backend() == "gpu" and mesh is None else "xla"


def gemv_kind(cfg: EngineConfig, mesh: Mesh | None) -> str:
    """EngineConfig.gemv, checked: the Mosaic GPU kernel needs a Hopper GPU (wgmma, TMA copies)
    and one device (a kernel is not partitioned by XLA's sharding propagation)."""
    device = jax.devices()[0]
    hopper = device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")
    if cfg.gemv == "mosaic" and (mesh is not None or not hopper):
        where = " under tensor parallelism" if mesh is not None else ""
        raise ConfigError(f"engine config: gemv 'mosaic' runs on one Hopper GPU only, not on "
                          f"{device.device_kind}{where} (use 'xla')")
    return cfg.gemv


def iterate_pinned(params: LlamaParams, dparams: DraftParams | None, state, pinned: PinnedBatch,
                   slots: np.ndarray, tables: np.ndarray, cfg: StepConfig):
    """One fused iteration as the engine dispatches it, every buffer at a stable address:
    -> (state, verdicts [B, 1 + K+1]), without waiting."""
    slots, tables = pinned.get(slots, tables)
    state = iterate_in_place_step(params, dparams, state, slots, tables, cfg=cfg)
    return state, pinned.read_verdicts(state, slots)


class Engine:
    """Continuous-batching EAGLE-3 engine over fixed-shape compiled steps."""

    def __init__(self, target: ModelConfig, params: LlamaParams, draft: DraftConfig | None,
                 draft_params: DraftParams | None, cfg: EngineConfig, eos_token_ids: Sequence[int] = (),
                 detokenize=None, overlap: bool = True, mesh: Mesh | None = None):
        if draft is not None:
            check_draft_fits(target, draft, has_own_embedding=draft_params.embed is not None)
        self.cfg = cfg
        self.overlap = overlap  # False: read each step's results before returning (for measuring)
        k = cfg.num_speculative_tokens if draft is not None else 0
        self.step_cfg = StepConfig(target=target, draft=draft if k else None, num_draft=k, mesh=mesh,
                                   attention=attention_kind(cfg, mesh), gemv=gemv_kind(cfg, mesh))
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize  # list[int] -> str, for stop strings and .text
        self.scheduler = Scheduler(cfg, target.vocab_size, k)
        self.state = init_state(target, self.step_cfg.draft, cfg, params.embed.dtype)
        if mesh is not None:  # weights already placed by their loader stay where they are
            tp = mesh.shape[sharding.TP]
            params = sharding.shard_params(params, mesh, sharding.llama_param_specs(target, tp))
            if draft_params is not None:
                specs = sharding.draft_param_specs(draft, tp, own_embedding=draft_params.embed is not None)
                draft_params = sharding.shard_params(draft_params, mesh, specs)
            self.state = jax.device_put(self.state, state_shardings(self.state, target, self.step_cfg.draft, mesh))
        # Two argument buffers fewer per layer at every dispatch (the caller's params are untouched).
        self.params, self.draft_params = fold_norm_gains(params), draft_params
        self.pinned = PinnedBatch(mesh)
        self.stats = EngineStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._seed_rng = np.random.default_rng()
        # The speculation policy's inputs: costs per bucket (injected, or timed in warm-up), the
        # acceptance estimate (updated as iterations are collected), and per slot whether its
        # proposals were drafted at its current position (false after a target-only iteration:
        # the next verify checks stale proposals, no measure of the drafter).
        self.policy = policy.SpeculationPolicy()
        self.acceptance = policy.AcceptanceEstimate.prior(k)
        self.step_costs: dict[int, policy.BucketCost] = {
            b: policy.BucketCost(t0, tk) for b, t0, tk in cfg.step_costs or () if b in cfg.batch_buckets}
        self._fresh = np.zeros(cfg.max_num_seqs + 1, bool)  # [S]
        CompileCounter.install()

    # ---- speculation per bucket --------------------------------------------------------------
    def may_speculate(self, bucket: int) -> bool:
        """Whether a bucket can speculate at all: a drafter, K > 0, within speculative_max_batch."""
        limit = self.cfg.speculative_max_batch
        return self.step_cfg.speculative and (limit is None or bucket <= limit)

    def speculates(self, bucket: int) -> bool:
        """This bucket's choice now: "always" speculates wherever it may; "auto" asks the policy."""
        if not self.may_speculate(bucket):
            return False
        if self.cfg.speculation == "always":
            return True
        return policy.speculate(self.step_costs.get(bucket), self.acceptance, self.step_cfg.num_draft, self.policy)

    def iterate_config(self, bucket: int, greedy: bool = True) -> StepConfig:
        """The iteration's config for a batch bucket: K drafts, or none when it runs the target
        alone (the proposals in the slots then wait unverified; any proposal is safe to verify
        later, since each was drawn from the q stored with it); the greedy program when every
        request of the batch is greedy (`StepConfig.greedy`)."""
        k = self.step_cfg.num_draft if self.speculates(bucket) else 0
        return dataclasses.replace(self.step_cfg, num_draft=k, greedy=greedy)

    def speculation_table(self) -> tuple[policy.BucketChoice, ...]:
        """Every bucket's cost and current choice; `policy.format_table(table, engine.acceptance)`
        prints it."""
        return tuple(policy.BucketChoice(b, self.step_costs.get(b), self.speculates(b)) for b in self.cfg.batch_buckets)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams, arrival_time: float | None = None) -> Request:
        """Queue a request; raise RequestError naming the problem (nothing else is affected).
        `arrival_time` (time.perf_counter() seconds, default now) is when it reached the server:
        its metrics measure the time to the first token from there."""
        return self.scheduler.add(list(prompt), params, arrival_time)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, dispatch, then collect the previous step: returns requests that changed."""
        start = time.perf_counter()
        wait_before = self.stats.device_wait_s
        before = len(self._pending)
        admitted = self.scheduler.admit()
        if admitted:
            self._dispatch_prefills(admitted)
        if self.scheduler.running:
            self._dispatch_iterate()
        # With new work queued, read only what was dispatched before it (the overlap); with none,
        # drain everything so the loop can end.
        to_collect = before if self.overlap and len(self._pending) > before else len(self._pending)
        changed = []
        for _ in range(to_collect):
            changed.extend(self._collect(self._pending.popleft()))
        self.stats.steps += 1
        self.stats.host_s += time.perf_counter() - start - (self.stats.device_wait_s - wait_before)
        return changed

    def _dispatch_prefills(self, reqs: list[Request]) -> None:
        """Prefill the requests admitted in this step. A prompt longer than the largest chunk
        bucket first runs its leading chunks alone; then the last chunks of all of them run
        together, grouped by chunk bucket, up to the largest prefill batch bucket per call: a
        burst of arrivals costs a few prefills, not one per request."""
        largest = self.cfg.prefill_buckets[-1]
        by_bucket: dict[int, list[PrefillChunk]] = collections.defaultdict(list)
        for req in reqs:
            # One seed per request, drawn in admission order whatever the grouping (seeded
            # requests draw none): the same requests sample the same tokens however they are batched.
            seed = None if req.params.seed is not None else int(self._seed_rng.integers(0, 2**63 - 1))
            starts = range(0, len(req.prompt), largest)
            for start in starts[:-1]:
                self._dispatch_prefill_call([PrefillChunk(req, start, seed)])
            last = PrefillChunk(req, starts[-1], seed)
            by_bucket[self._chunk_bucket(len(last.tokens(largest)))].append(last)
        most = self.cfg.prefill_batch_buckets[-1]
        for chunks in by_bucket.values():
            for i in range(0, len(chunks), most):
                self._dispatch_prefill_call(chunks[i:i + most])
        t = time.perf_counter()
        for req in reqs:
            self._fresh[req.slot] = self.step_cfg.speculative  # its last chunk drafted K proposals
            first = self.pinned.read_first_token(self.state, req.slot)  # [1], the last chunk's sample
            first.copy_to_host_async()
            self._pending.append(_Pending([req], first))
        self.stats.dispatch_s += time.perf_counter() - t

    def _chunk_bucket(self, length: int) -> int:
        return smallest_bucket(self.cfg.prefill_buckets, length)

    def _dispatch_prefill_call(self, chunks: list[PrefillChunk]) -> None:
        """One prefill program over `chunks`, one row each, padded to the smallest batch bucket
        and chunk bucket that hold them."""
        rows = smallest_bucket(self.cfg.prefill_batch_buckets, len(chunks))
        largest = self.cfg.prefill_buckets[-1]
        pieces = [c.tokens(largest) for c in chunks]
        inputs = PrefillInputs.padding(rows, self._chunk_bucket(max(map(len, pieces))), self.cfg.max_blocks_per_seq)
        for i, (chunk, piece) in enumerate(zip(chunks, pieces)):
            prompt, start = chunk.req.prompt, chunk.start
            following = prompt[start + 1:start + len(piece) + 1]  # the ids shifted left by one
            inputs.next_tokens[i] = 0  # a real row: no padding marker
            inputs.tokens[i, :len(piece)] = piece
            inputs.next_tokens[i, :len(following)] = following
            if start + len(piece) == len(prompt):
                inputs.next_tokens[i, len(piece) - 1] = -1  # the first generated token goes here
            inputs.num_valid[i], inputs.start[i] = len(piece), start
            inputs.slot[i], inputs.block_table[i] = chunk.req.slot, self.scheduler.block_tables[chunk.req.slot]
        params = [c.req.params for c in chunks] + [_PADDING_PARAMS] * (rows - len(chunks))
        seeds = [c.seed for c in chunks] + [0] * (rows - len(chunks))
        row = sampling.row_sampling_from_params(params, seeds)
        cfg = dataclasses.replace(self.step_cfg, greedy=all(p.greedy for p in params))
        t = time.perf_counter()
        self.state = prefill_step(self.params, self.draft_params, self.state, *inputs.arrays(), row, cfg=cfg)
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.prefill_calls += 1

    def _dispatch_iterate(self) -> None:
        reqs, slots, tables = self.scheduler.batch()
        bucket = len(slots)
        cfg = self.iterate_config(bucket, greedy=all(r.params.greedy for r in reqs))
        # Device order is dispatch order, so freshness at dispatch is what this iteration verifies.
        rows = slots[:len(reqs)]
        fresh = self._fresh[rows].copy()
        self._fresh[rows] = cfg.speculative
        t = time.perf_counter()
        self.state, verdicts = self.dispatch_iteration(slots, tables, cfg)
        verdicts.copy_to_host_async()
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.iterations += 1
        counts = self.stats.speculative_iterations if cfg.speculative else self.stats.target_only_iterations
        counts[bucket] = counts.get(bucket, 0) + 1
        self._pending.append(_Pending(reqs, verdicts, True, cfg.speculative, fresh))

    def dispatch_iteration(self, slots: np.ndarray, tables: np.ndarray, cfg: StepConfig):
        """Dispatch one iteration over `slots` [B] with block `tables` [B, nb], fused or as K + 1
        programs, without waiting: -> (new state, verdicts [B, 1 + K+1]: `steps.split_verdicts`).
        The caller stores the state (the old one was donated). Every buffer the iteration reads or
        writes keeps its address from call to call (`PinnedBatch`, `steps.iterate_in_place`)."""
        if self.cfg.fused_iteration or not cfg.speculative:
            return iterate_pinned(self.params, self.draft_params, self.state, self.pinned, slots, tables, cfg)
        slots, tables = self.pinned.get(slots, tables)
        state, _, _, carry = iterate_head_step(self.params, self.draft_params, self.state, slots, tables, cfg=cfg)
        for j in range(1, cfg.num_draft):
            state, carry = chain_step_jit(self.draft_params, self.params.embed, state, carry, tables, j, cfg=cfg)
        state = commit_step(state, slots, carry, cfg=cfg)
        return state, self.pinned.read_verdicts(state, slots)

    def _collect(self, pending: _Pending) -> list[Request]:
        t = time.perf_counter()
        result = np.asarray(pending.result)
        collected = time.perf_counter()
        self.stats.device_wait_s += collected - t
        accepted, tokens = split_verdicts(result) if pending.iteration else (None, result)
        if accepted is not None:
            # Measured: running rows (not the surplus iteration of a finished one) of a speculative
            # iteration whose proposals were fresh. Read before _append finishes any request.
            measured = [pending.speculative and bool(fresh) and not req.finished
                        for req, fresh in zip(pending.reqs, pending.fresh)]
            self.acceptance = policy.observe(self.acceptance, accepted[:len(pending.reqs)], measured, self.policy)
        changed = []
        for i, req in enumerate(pending.reqs):
            if req.finished:
                continue  # the surplus iteration dispatched before we knew
            if accepted is None:
                new = tokens[:1].tolist()
            else:
                req.metrics.record(int(accepted[i]), speculative=pending.speculative)
                new = tokens[i, :accepted[i] + 1].tolist()
            self._append(req, new)
            req.metrics.collected(collected)
            changed.append(req)
        return changed

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
        text = self.detokenize(req.output)
        for stop in req.params.stop:
            if (i := text.find(stop)) >= 0:
                req.text = text[:i]
                return True
        return False

    # ---- batch use ---------------------------------------------------------------------------
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

    # ---- compilation -------------------------------------------------------------------------
    @property
    def num_compilations(self) -> int:
        return CompileCounter.count

    def iteration_configs(self, bucket: int, greedy: bool | None = None) -> list[StepConfig]:
        """The iterations a bucket may run: speculative, target-only, or (in "auto") both; each as
        the greedy program and the sampling one (`greedy` picks one of the two)."""
        ks = [self.step_cfg.num_draft] if self.may_speculate(bucket) else []
        if not ks or self.cfg.speculation == "auto":
            ks.append(0)
        kinds = (True, False) if greedy is None else (greedy,)
        return [dataclasses.replace(self.step_cfg, num_draft=k, greedy=g) for k in ks for g in kinds]

    def prefill_configs(self, greedy: bool | None = None) -> list[StepConfig]:
        """The prefill programs: the greedy one and the sampling one (`greedy` picks one)."""
        return [dataclasses.replace(self.step_cfg, greedy=g) for g in ((True, False) if greedy is None else (greedy,))]

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """(rows, chunk tokens) of every prefill program."""
        return [(rows, size) for size in self.cfg.prefill_buckets for rows in self.cfg.prefill_batch_buckets]

    def padding_prefill_args(self, rows: int, size: int) -> tuple:
        """`prefill_step`'s arguments for a call of padding rows only (warm-up)."""
        row = sampling.row_sampling_from_params([_PADDING_PARAMS] * rows, seeds=[0] * rows)
        inputs = PrefillInputs.padding(rows, size, self.cfg.max_blocks_per_seq)
        return (self.params, self.draft_params, self.state, *inputs.arrays(), row)

    def _padding_rows(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """A bucket of padded rows: (slots [B] all the dummy slot, block tables [B, nb] all scratch)."""
        return np.full(bucket, DUMMY_SLOT, np.int32), np.zeros((bucket, self.cfg.max_blocks_per_seq), np.int32)

    def _time_iteration(self, bucket: int, cfg: StepConfig, rounds: int = 3, calls: int = 3) -> float:
        """Median over rounds of seconds per iteration, `calls` dispatched back to back per round
        (as serving dispatches them), on padded rows at context 0."""
        slots, tables = self._padding_rows(bucket)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                self.state, _ = self.dispatch_iteration(slots, tables, cfg)
            jax.block_until_ready(self.state)  # the per-step path ends in commit, not in num_accepted
            samples.append((time.perf_counter() - start) / calls)
        return statistics.median(samples)

    def warmup(self, progress: bool = True, greedy: bool | None = None) -> float:
        """Compile every step function for every bucket now, so serving never compiles. In "auto",
        both iterations of each bucket that may speculate, then time them (buckets missing from
        `step_costs`) for the speculation policy. `greedy` True (or False) builds only the greedy
        (or sampling) programs, for a workload known to need only those: the others then compile
        on first use."""
        start = time.perf_counter()
        shapes = [("iterate", b, c) for b in self.cfg.batch_buckets for c in self.iteration_configs(b, greedy)]
        shapes += [("prefill", shape, c) for shape in self.prefill_shapes() for c in self.prefill_configs(greedy)]
        for kind, size, cfg in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            if kind == "iterate":
                self.state, n = self.dispatch_iteration(*self._padding_rows(size), cfg)
            else:
                self.state = prefill_step(*self.padding_prefill_args(*size), cfg=cfg)
                n = self.pinned.read_first_token(self.state, DUMMY_SLOT)  # as serving reads it
            n.block_until_ready()
        for b in self.cfg.batch_buckets:
            # The policy's costs come from the greedy programs (the sampling ones add the same
            # sampling work to both iterations).
            configs = self.iteration_configs(b, greedy=True)
            if len(configs) == 2 and b not in self.step_costs:
                spec, target_only = (self._time_iteration(b, c) for c in configs)
                self.step_costs[b] = policy.BucketCost(target_only_s=target_only, speculative_s=spec)
        self.stats.warmup_s = time.perf_counter() - start
        return self.stats.warmup_s
