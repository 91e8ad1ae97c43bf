"""The engine loop: schedule, dispatch, collect, postprocess.

Overlap: `step()` dispatches this step's prefills and iteration before it reads the previous
step's results, so the host's scheduling, detokenization and stop checks run while the device
works. Every dispatch threads the donated `DeviceState`, so the device runs them in order; a
request that finished in the results being read was already dispatched once more, and that
surplus iteration is discarded (its pages reserve room for it).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import DraftConfig, EngineConfig, ModelConfig, check_draft_fits
from eagle3_jax.engine import sampling
from eagle3_jax.engine.scheduler import Request, Scheduler
from eagle3_jax.engine.state import DUMMY_SLOT, init_state, state_shardings
from eagle3_jax.engine.steps import (StepConfig, chain_step_jit, commit_step, iterate_head_step, iterate_step,
                                    prefill_step)
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import LlamaParams
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
    """Per-step timings: host time is Python work, device wait is time blocked on results."""

    steps: int = 0
    iterations: int = 0
    host_s: float = 0.0
    device_wait_s: float = 0.0
    warmup_s: float = 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / max(self.steps, 1)

    @property
    def device_wait_ms_per_step(self) -> float:
        return 1e3 * self.device_wait_s / max(self.steps, 1)


@dataclasses.dataclass
class _Pending:
    reqs: list[Request]
    tokens: jax.Array  # prefill: first token [1]; iterate: emitted [B, K+1]
    num_accepted: jax.Array | None  # iterate: [B]


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
        self.step_cfg = StepConfig(target=target, draft=draft if k else None, num_draft=k, mesh=mesh)
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
        self.params, self.draft_params = params, draft_params
        self.stats = EngineStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        self._seed_rng = np.random.default_rng()
        CompileCounter.install()

    def iterate_config(self, bucket: int) -> StepConfig:
        """The iteration's config for a batch bucket: K drafts, or none past speculative_max_batch
        (the proposals in the slots then wait unverified; any proposal is safe to verify later,
        since each was drawn from the q stored with it)."""
        limit = self.cfg.speculative_max_batch
        if limit is None or bucket <= limit:
            return self.step_cfg
        return dataclasses.replace(self.step_cfg, num_draft=0)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> Request:
        """Queue a request; raise RequestError naming the problem (nothing else is affected)."""
        return self.scheduler.add(list(prompt), params)

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._pending)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule, dispatch, then collect the previous step: returns requests that changed."""
        start = time.perf_counter()
        wait_before = self.stats.device_wait_s
        before = len(self._pending)
        for req in self.scheduler.admit():
            self._dispatch_prefill(req)
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

    def _dispatch_prefill(self, req: Request) -> None:
        largest = self.cfg.prefill_buckets[-1]
        prompt = req.prompt
        row = sampling.row_sampling_from_params([req.params], rng=self._seed_rng)
        first = None
        for start in range(0, len(prompt), largest):
            chunk = prompt[start:start + largest]
            size = next(b for b in self.cfg.prefill_buckets if b >= len(chunk))
            tokens = np.zeros((1, size), np.int32)
            tokens[0, :len(chunk)] = chunk
            following = prompt[start + 1:start + len(chunk) + 1]
            next_tokens = np.zeros((1, size), np.int32)
            next_tokens[0, :len(following)] = following
            if start + len(chunk) == len(prompt):
                next_tokens[0, len(chunk) - 1] = -1  # the first generated token goes here
            self.state, first = prefill_step(
                self.params, self.draft_params, self.state, tokens, next_tokens,
                np.array([len(chunk)], np.int32), np.array([start], np.int32),
                np.array([req.slot], np.int32), self.scheduler.block_tables[req.slot][None], row,
                cfg=self.step_cfg)
        first.copy_to_host_async()
        self._pending.append(_Pending([req], first, None))

    def _dispatch_iterate(self) -> None:
        reqs, slots, tables = self.scheduler.batch()
        self.state, num_accepted, emitted = self._iterate(slots, tables)
        num_accepted.copy_to_host_async()
        emitted.copy_to_host_async()
        self.stats.iterations += 1
        self._pending.append(_Pending(reqs, emitted, num_accepted))

    def _iterate(self, slots: np.ndarray, tables: np.ndarray):
        """Dispatch one iteration, fused or as K + 1 programs; returns without waiting."""
        cfg = self.iterate_config(len(slots))
        if self.cfg.fused_iteration or not cfg.speculative:
            return iterate_step(self.params, self.draft_params, self.state, slots, tables, cfg=cfg)
        state, num_accepted, emitted, carry = iterate_head_step(self.params, self.draft_params, self.state,
                                                               slots, tables, cfg=cfg)
        for j in range(1, cfg.num_draft):
            state, carry = chain_step_jit(self.draft_params, self.params.embed, state, carry, tables, j, cfg=cfg)
        return commit_step(state, slots, carry, cfg=cfg), num_accepted, emitted

    def _collect(self, pending: _Pending) -> list[Request]:
        t = time.perf_counter()
        tokens = np.asarray(pending.tokens)
        accepted = None if pending.num_accepted is None else np.asarray(pending.num_accepted)
        self.stats.device_wait_s += time.perf_counter() - t
        changed = []
        for i, req in enumerate(pending.reqs):
            if req.finished:
                continue  # the surplus iteration dispatched before we knew
            if accepted is None:
                new = tokens[:1].tolist()
            else:
                req.metrics.record(int(accepted[i]))
                new = tokens[i, :accepted[i] + 1].tolist()
            self._append(req, new)
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

    def warmup(self, progress: bool = True) -> float:
        """Compile every step function for every bucket now, so serving never compiles."""
        start = time.perf_counter()
        shapes = [("iterate", b) for b in self.cfg.batch_buckets] + [("prefill", t) for t in self.cfg.prefill_buckets]
        nb = self.cfg.max_blocks_per_seq
        greedy = sampling.row_sampling_from_params([SamplingParams(max_tokens=1)], seeds=[0])
        for kind, size in tqdm(shapes, desc="warm-up", unit="shape", disable=not progress):
            if kind == "iterate":
                self.state, n, _ = self._iterate(np.full(size, DUMMY_SLOT, np.int32), np.zeros((size, nb), np.int32))
            else:
                next_tokens = np.zeros((1, size), np.int32)
                next_tokens[0, 0] = -1
                self.state, n = prefill_step(
                    self.params, self.draft_params, self.state, np.zeros((1, size), np.int32), next_tokens,
                    np.ones(1, np.int32), np.zeros(1, np.int32), np.full(1, DUMMY_SLOT, np.int32),
                    np.zeros((1, nb), np.int32), greedy, cfg=self.step_cfg)
            n.block_until_ready()
        self.stats.warmup_s = time.perf_counter() - start
        return self.stats.warmup_s
