"""The engine: requests in, tokens out, over the device runner. Host only.

Each `step()` schedules (pages, preemption, admission), runs (dispatches prefills and one
iteration without waiting), and postprocesses the results dispatched the step before, so the
host's work overlaps the device's. While rows decode, a step prefills one chunk of a long
prompt at most (engine/prefill.py), so a long prompt arriving stalls the running streams no longer. The
device runs dispatches in order (each threads the donated state); results for a request that
finished or was preempted since they were dispatched are dropped (the surplus iteration: its pages
are rewritten only by later dispatches).

A batch with a row under a grammar (`SamplingParams.structured_outputs`) gives up that overlap:
before dispatching, the host reads every result in flight, advances each such row's matcher by
the tokens it emitted, reads the rows' pending proposals, and puts the tokens each row's grammar
forces from there (its braces, quotes, key names) in place of its first drafts (a chain's:
`_force_drafts`; a tree's, on one root path: `_force_tree`; written to the device state in place).
Its iteration is then two programs (runner/steps.py, `verify_in_place`): the verify's forward is
dispatched first, and while the device runs it the host computes the tokens the grammar allows at
each position the verify decides: along a chain's drafts, or at each node of a tree under that
node's own path from the root (engine/structured.py); the second program applies those masks to
the forward's logits before accepting, so a drafted token the grammar refuses is never accepted
and the output is the constrained target's with or without speculation, whichever of the tree,
the chain and the target alone the batch runs.

Under `speculation="auto"` each iteration runs the target alone or one of the proposals by
engine/policy.py's rule, from costs timed in warm-up (then as served) and the acceptance measured
as iterations are collected (engine/speculation.py keeps both). Prefills are packed into calls by
engine/prefill.py.

Logprobs: a program whose batch has a row asking for them is its scoring variant (`StepConfig.logprobs`,
`prompt_logprobs`); an iteration's come back in its verdicts, a prefill call's in one array of its own,
read with the request's first token. A request of max_tokens 0 gives its slot back once its prefill
is dispatched and finishes when that is read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import DraftConfig, EngineConfig, ModelConfig
from eagle3_jax.engine.prefill import PrefillChunk, prefill_call, step_calls
from eagle3_jax.engine.scheduler import Request, Scheduler, TokenLogprobs, stop_reason
from eagle3_jax.engine.speculation import Choice, Speculation
from eagle3_jax.engine.stats import EngineStats
from eagle3_jax.engine.structured import Grammars, Matcher
from eagle3_jax.runner import kv_memory, logprobs
from eagle3_jax.runner.runner import ModelRunner, freeze_heap, place_weights
from eagle3_jax.runner.served import DeviceFacts, served_config, untuned_tiles_line
from eagle3_jax.runner.steps import TARGET_ALONE, StepConfig, split_verdicts
from eagle3_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def check_request(scheduler: Scheduler, grammars: Grammars, prompt: Sequence[int], params: SamplingParams) -> None:
    """RequestError naming what a scheduler of this config would refuse in the request, or
    GrammarError where its structured_outputs do not compile: host work only (`Engine.validate_request`,
    and the server's checks where the engine runs in another process)."""
    scheduler.validate(list(prompt), params)
    if params.structured_outputs is not None:
        grammars.compile(params.structured_outputs)


class EngineClosedError(RuntimeError):
    """Work asked of an engine after `close`."""


@dataclasses.dataclass(frozen=True)
class _ScoredRows:
    """One row of a scoring prefill call's packed logprobs [P, T', F]: the chunk at `start` of
    `count` tokens; `every_position`: T' = T, position start + t's at t, else the last one's at 0."""

    scored: object  # device array
    row: int
    start: int
    count: int
    every_position: bool

    def by_position(self) -> dict[int, np.ndarray]:
        host = np.asarray(self.scored)[self.row]
        if not self.every_position:
            return {self.start + self.count - 1: host[0]}
        return {self.start + t: host[t] for t in range(self.count)}


@dataclasses.dataclass
class _Pending:
    """A dispatched program whose results the host has not read yet."""

    reqs: list[Request]
    result: object  # device array: prefill's first token [1] (None: max_tokens 0); an iteration's verdicts
    admissions: list[int]  # each request's at dispatch: results of an admission since preempted are stale
    iteration: bool = False
    proposal: int | None = None  # iterate: the index of the proposal verified (None: the target alone)
    fresh: np.ndarray | None = None  # iterate: [len(reqs)] bool, that proposal drafted at the row's position
    scored: bool = False  # iterate: its verdicts carry the emitted tokens' logprobs
    prefill_scores: list[_ScoredRows] = dataclasses.field(default_factory=list)  # prefill: its chunks' logprobs


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
        self.scored_fields = logprobs.fields(target.vocab_size)  # int32 per scored token in the results
        self.detokenize = detokenize  # list[int] -> str, for stop strings and .text
        self.grammars = Grammars(tokenizer, target.vocab_size, self.eos_token_ids)
        spec = served.speculation
        self.scheduler = Scheduler(served, target.vocab_size, spec.max_accepted, spec.positions_per_iteration)
        self.speculation = Speculation(spec, served.batch_buckets, served.max_num_seqs + 1)
        log.info(kv_memory.pool_line(served, device.free_bytes, cfg.num_pages is not None, device.held_elsewhere))
        if line := untuned_tiles_line(served.kernels, device):
            log.warning(line)
        self.stats = EngineStats()
        self._pending: collections.deque[_Pending] = collections.deque()
        # request id -> the logprobs of its prefill's chunks dispatched so far (a prefill may span
        # steps), handed to its first token's read once its last chunk is dispatched
        self._prefill_scores: dict[int, list[_ScoredRows]] = collections.defaultdict(list)
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
        for req in {id(r): r for pending in self._pending for r in pending.reqs}.values():
            if not req.finished:  # a max_tokens 0 request, its prefill still unread
                self.scheduler.finish(req, "abort")
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
        check_request(self.scheduler, self.grammars, prompt, params)

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
        self._admit(admitted)
        prefilled = self._run_prefills()
        changed, constrained = [], any(r.grammar is not None and not r.prefilling
                                       for r in self.scheduler.running.values())
        if constrained:  # the masks follow every token emitted so far: read all in flight first
            t = time.perf_counter()
            changed = [req for _ in range(len(self._pending)) for req in self._postprocess(self._pending.popleft())]
            earlier = 0
            self.stats.constrained_steps += 1
            self.stats.constrained_read_s += time.perf_counter() - t
        reqs, slots, tables = self.scheduler.batch()  # (after that read: it may finish requests)
        ran = self._run_iteration(reqs, slots, tables) if reqs else None
        # With new work queued, read only what was dispatched before it (the overlap); with none,
        # drain everything so the loop can end.
        ready = earlier if self.overlap and len(self._pending) > earlier else len(self._pending)
        changed += [req for _ in range(ready) for req in self._postprocess(self._pending.popleft())]
        self.stats.steps += 1
        took = time.perf_counter() - start
        self.stats.host_s += took - (self.stats.device_wait_s - waited)
        # A step that prefilled is no period of the loop (nor is a scoring iteration's: its `ran` is
        # None); a constrained one, which waited for its results, is one of the constrained loop.
        self.speculation.time_step(None if prefilled else ran, took, constrained)
        return changed

    def _admit(self, reqs: list[Request]) -> None:
        """What the requests admitted in this step need before their prefills: a seed, their
        cached prefix in the speculator's token history; the prefix cache's counts."""
        for req in reqs:
            self._prefill_scores.pop(req.id, None)  # readmitted: its prefill starts afresh
            # One seed per request, drawn at its first admission whatever the grouping (seeded
            # requests draw none): the same requests sample the same tokens however they are
            # batched, and preempted.
            if req.params.seed is None and req.seed is None:
                req.seed = int(self._seed_rng.integers(0, 2**63 - 1))
            self.stats.prefix_queried_tokens += req.context_len
            self.stats.prefix_hit_tokens += req.num_cached
            if req.num_cached:  # a speculator's token history has the cached prefix too
                self.runner.write_history(req.slot, req.tokens[:req.num_cached])

    def _run_prefills(self) -> bool:
        """Dispatch this step's prefill calls (engine/prefill.py chooses them), then queue the reads
        of the first tokens of the requests whose prefill ended. -> whether any was dispatched."""
        sched, largest = self.scheduler, self.cfg.prefill_buckets[-1]
        prefilling = sched.prefilling
        # The scores of a request that stopped prefilling before its last chunk (aborted, preempted)
        # are dropped: a readmission prefills afresh.
        ids = {req.id for req in prefilling}
        for stale in [i for i in self._prefill_scores if i not in ids]:
            del self._prefill_scores[stale]
        if not prefilling:
            return False
        calls = step_calls(prefilling, self.cfg, sched.decoding)
        for chunks in calls:
            self._run_prefill_call(chunks)
        t = time.perf_counter()
        for chunk in (chunk for chunks in calls for chunk in chunks):
            req = chunk.req
            sched.prefill_dispatched(req, chunk.end(largest))
            if req.prefilling:
                continue
            scores = self._prefill_scores.pop(req.id, [])  # its chunks', dispatched in this step or before
            self.speculation.prefilled(req.slot)  # its last chunk drafted the engine's proposal
            if req.output:
                continue  # resumed: the token its prefill ends on is its last generated one
            if req.max_tokens == 0:  # a prefill only: nothing to sample, no iteration
                self.scheduler.release(req)
                first = None
            else:
                first = self.runner.first_token(req.slot)  # [1], the last chunk's sample
                first.copy_to_host_async()
            self._pending.append(_Pending([req], first, [req.admissions], prefill_scores=scores))
        self.stats.dispatch_s += time.perf_counter() - t
        return bool(calls)

    def _run_prefill_call(self, chunks: list[PrefillChunk]) -> None:
        """One prefill call; the scoring program where a row asks for logprobs of what it scores (its
        prompt's, or the first token's in a request's last chunk), its rows' logprobs kept by request;
        the masked one where a row samples its first token under a grammar."""
        inputs, params, seeds = prefill_call(chunks, self.cfg, self.scheduler.block_tables)
        # A request under a grammar samples its first token under the grammar's first mask.
        largest = self.cfg.prefill_buckets[-1]
        constrained = [(i, c.req.grammar, ()) for i, c in enumerate(chunks) if c.req.grammar is not None
                       and not c.req.output and c.end(largest) == c.req.context_len]
        mask = self.grammars.masks(constrained, len(params), 1)[:, 0] if constrained else None
        prompt = [c.req.scores_prompt for c in chunks]
        # A row whose last token's logits sample the first generated token (a fresh request's last chunk).
        first = [c.req.params.logprobs is not None and inputs.next_tokens[row, inputs.num_valid[row] - 1] < 0
                 for row, c in enumerate(chunks)]
        t = time.perf_counter()
        scored = self.runner.prefill(inputs, params, seeds, mask, logprobs=any(first), prompt_logprobs=any(prompt))
        if scored is not None:
            scored.copy_to_host_async()
            for row, chunk in enumerate(chunks):
                if prompt[row] or first[row]:
                    self._prefill_scores[chunk.req.id].append(_ScoredRows(scored, row, int(inputs.start[row]),
                                                            int(inputs.num_valid[row]), any(prompt)))
        self.stats.dispatch_s += time.perf_counter() - t
        self.stats.prefill_calls += 1

    def _run_iteration(self, reqs: list[Request], slots: np.ndarray, tables: np.ndarray) -> tuple[int, Choice] | None:
        """Dispatch one iteration of the running requests: -> (its bucket, its choice); None where it
        scored logprobs (its time is not the choice's)."""
        bucket = len(slots)
        constrained = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None]
        choice = self.speculation.choice(bucket, bool(constrained))
        scoring = any(r.logprobs is not None for r in reqs)
        cfg = self._config(choice, greedy=all(r.params.greedy for r in reqs), logprobs=scoring,
                           masked=bool(constrained))
        fresh = self.speculation.dispatched(bucket, slots[:len(reqs)], choice, bool(constrained))
        masks = self._masks(reqs, constrained, slots, cfg) if constrained else None
        t, masking = time.perf_counter(), self.stats.mask_s
        verdicts = self.runner.iterate(slots, tables, cfg, masks)  # calls `masks` while the verify runs
        verdicts.copy_to_host_async()
        self.stats.dispatch_s += time.perf_counter() - t - (self.stats.mask_s - masking)
        self.stats.iterations += 1
        self.stats.count_iteration(bucket, self.speculation.label(choice), speculative=choice is not None)
        self._pending.append(_Pending(reqs, verdicts, [r.admissions for r in reqs], True, choice, fresh, scoring))
        return None if scoring else (bucket, choice)

    def _masks(self, reqs: list[Request], constrained: list[tuple[int, Matcher]], slots: np.ndarray,
               cfg: StepConfig) -> Callable[[], np.ndarray]:
        """The computation of the token masks [B, W, words] of a masked iteration of `cfg`, which the
        runner calls once the verify's forward is dispatched (the host fills them while the device
        runs it): each constrained row's grammar along its pending proposal, read from the device
        now with the tokens its grammar forces put in (a chain's: `_force_drafts`; a tree's:
        `_force_tree`; they change what the verify reads, so they go in before it), a tree's nodes
        each under its own path (`Grammars.tree_masks`)."""
        facts, bucket = cfg.speculator.facts, len(slots)
        width = facts.verify_width
        t = time.perf_counter()
        fill = self.grammars.masks
        if width == 1:  # the target alone
            rows = [(i, m, ()) for i, m in constrained]
        elif facts.verifies_chain:
            drafts = self._force_drafts(reqs, constrained, slots, width - 1, cfg.greedy)
            rows = [(i, m, drafts[i]) for i, m in constrained]
        else:
            tokens, parents = self._force_tree(constrained, slots, width - 1, facts.max_accepted)
            rows, fill = [(i, m, tokens[i], parents[i]) for i, m in constrained], self.grammars.tree_masks
        self.stats.forced_s += time.perf_counter() - t

        def masks() -> np.ndarray:
            start = time.perf_counter()
            mask = fill(rows, bucket, width)
            self.stats.mask_s += time.perf_counter() - start
            return mask

        return masks

    def _force_drafts(self, reqs: list[Request], constrained: list[tuple[int, Matcher]], slots: np.ndarray,
                      k: int, greedy: bool) -> np.ndarray:
        """The pending proposals [B, k] of the batch's `slots`, each constrained row's first m drafts
        replaced by the m tokens its grammar forces from here (`Grammars.forced`), written to the
        device where any changed. The drafter's drafts after them stay: a drafter proposes none of
        a schema's braces and key names, so the verify accepted little there.

        Exact under every rule (runner/sampling.py, `verify_chain`): a greedy row accepts a draft
        iff it is the masked target's argmax, a coupled row iff it is the masked target's coupled
        draw, a one-hot row by q = the point mass on the draft, whatever the drafts were. A draft-q
        row reads the drafter's q (`accept iff u q(d) < p(d)`, else a draw from (p - q)^+), exact
        only for a d drawn from that q; so its forced tokens are only those the grammar allows
        alone, where the masked p is the point mass on d: p(d) = 1 > u q(d) for any q, u < 1, the
        row emits d whatever q. Past them the drafter's d_j is still a draw from the q_j kept
        beside it (neither depended on the verify's uniforms), so the rule stays exact there;
        padding in other tokens would not be. The drafter's next proposal is drafted in the
        iteration from the emitted tokens and the target's hidden states: nothing else changes."""
        drafts = np.array(self.runner.read_drafts(slots, k))  # writable
        if not self.grammars.forced_drafts:
            return drafts
        point_mass = self.runner.speculator.facts.point_mass  # what each row's rule was resolved with
        sole = [not greedy and not reqs[i].params.greedy and reqs[i].params.acceptance_rule(point_mass) == "draft_q"
                for i, _ in constrained]
        forced = self.grammars.forced([(m, alone) for (_, m), alone in zip(constrained, sole)], k)
        changed = False
        for (i, _), tokens in zip(constrained, forced):
            if tokens and list(drafts[i, :len(tokens)]) != tokens:
                drafts[i, :len(tokens)] = tokens
                changed = True
        if changed:  # the whole bucket, one program per bucket (warm-up builds it)
            self.runner.write_drafts(slots, drafts)
        return drafts

    def _force_tree(self, constrained: list[tuple[int, Matcher]], slots: np.ndarray, nodes: int,
                    depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The pending trees of the batch's `slots` (node tokens, parents [B, nodes]: `read_tree`),
        each constrained row's holding the tokens its grammar forces from here on one root path,
        at most `depth` (`_force_path`), written to the device where any changed.

        Exact under every rule a tree's verify runs (runner/tree.py, `sample_accept`): greedy and
        coupled rows accept a node iff it is the masked target's argmax (coupled draw), and a
        one-hot row tries a node's children with q the point mass on each, exact for any tree
        built without the verify's uniforms whose siblings hold distinct tokens, which
        `_force_path` keeps. No row reads the drafter's q there, so every forced token may go in,
        as for a chain's greedy and coupled rows. The drafter's next tree grows from the tokens
        emitted, whatever this one held."""
        tokens, parents = self.runner.read_tree(slots, nodes)
        if not self.grammars.forced_drafts:
            return tokens, parents
        tokens, parents = np.array(tokens), np.array(parents)  # writable
        forced = self.grammars.forced([(m, False) for _, m in constrained], min(depth, nodes))
        changed = False
        for (i, _), path in zip(constrained, forced):
            if path and (tree := _force_path(tokens[i], parents[i], path)) is not None:
                tokens[i], parents[i] = tree
                changed = True
        if changed:  # the whole bucket, one program per bucket (warm-up builds it)
            self.runner.write_drafts(slots, tokens, parents)
        return tokens, parents

    def _postprocess(self, pending: _Pending) -> list[Request]:
        """Read one dispatched program's results and apply them to its requests."""
        t = time.perf_counter()
        result = None if pending.result is None else np.asarray(pending.result)
        collected = time.perf_counter()
        self.stats.device_wait_s += collected - t
        accepted, top1, tokens, scored = (split_verdicts(result, self.scored_fields if pending.scored else 0)
                                          if pending.iteration else (None, None, result, None))
        if accepted is not None:  # read before _append finishes any request
            n = len(pending.reqs)
            measured = np.array([bool(f) and not _stale(pending, i) for i, f in enumerate(pending.fresh)], bool)
            self.speculation.observe(pending.proposal, accepted[:n], top1[:n], measured)
        changed = []
        for i, req in enumerate(pending.reqs):
            if _stale(pending, i):
                continue  # the surplus iteration of a finished request, or one preempted since
            if accepted is None:
                new, new_logprobs = self._prefilled(req, tokens, pending.prefill_scores)
                if req.max_tokens == 0:
                    self.scheduler.finish(req, "length")
            else:
                req.metrics.record(int(accepted[i]), speculative=pending.proposal is not None)
                new = tokens[i, :accepted[i] + 1].tolist()
                new_logprobs = (None if scored is None or req.logprobs is None
                                else _token_logprobs(scored[i, :len(new)], new, req.params.logprobs))
            self._append(req, new, new_logprobs)
            req.metrics.collected(collected)
            changed.append(req)
        return changed

    def _prefilled(self, req: Request, first: np.ndarray | None,
                   scores: list[_ScoredRows]) -> tuple[list[int], list[TokenLogprobs] | None]:
        """A fresh request's prefill read: -> (its first token, none for max_tokens 0; that token's
        logprobs where asked), its prompt's logprobs kept where asked (the first token has none)."""
        new = [] if first is None else first[:1].tolist()
        if not scores:
            return new, None
        scored = {position: row for part in scores for position, row in part.by_position().items()}
        last = len(req.prompt) - 1  # its position scored the first generated token
        if req.scores_prompt:
            req.prompt_logprobs = [None, *_token_logprobs(np.stack([scored[p] for p in range(last)]), req.prompt[1:],
                                                          req.params.prompt_logprobs)] if last else [None]
        if req.logprobs is None or not new:
            return new, None
        return new, _token_logprobs(scored[last][None], new, req.params.logprobs)

    def _append(self, req: Request, new_tokens: list[int], new_logprobs: list[TokenLogprobs] | None = None) -> None:
        for i, tok in enumerate(new_tokens):
            req.output.append(tok)
            if new_logprobs is not None:
                req.logprobs.append(new_logprobs[i])
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
    def _config(self, choice: Choice, greedy: bool, logprobs: bool = False, masked: bool = False) -> StepConfig:
        return self.runner.config(TARGET_ALONE if choice is None else self.proposals[choice], greedy, logprobs,
                                  masked)

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
        iterations = [(b, self._config(c, g, masked=m)) for m in masked for b in self.cfg.batch_buckets
                      for c in self.speculation.choices(b) for g in kinds]
        prefills = [(rows, size, g, m) for size in self.cfg.prefill_buckets for rows in self.cfg.prefill_batch_buckets
                    for g in kinds for m in masked]
        return iterations, prefills

    def warmup(self, progress: bool = True, greedy: bool | None = None) -> float:
        """Compile every program now, so serving never compiles, and in "auto" time each bucket's
        choices for the policy; `greedy` True (False) builds only the greedy (sampling) programs.
        The fused programs are built at once on a thread pool first, or loaded where an earlier
        start kept them, and run from then on (`runner.compile_ahead`; BENCHMARKS.md, "Start-up").
        Then the heap is frozen (`freeze_heap`). -> seconds."""
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


def _token_logprobs(packed: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Packed rows [n, F] (runner/logprobs.py) of `tokens` [n] -> their TokenLogprobs, `top` likeliest each."""
    logprob, rank, ids, top_logprobs = (x.tolist() for x in logprobs.unpack(packed))
    return [TokenLogprobs(int(token), logprob[j], rank[j], tuple(ids[j][:top]), tuple(top_logprobs[j][:top]))
            for j, token in enumerate(tokens)]


def _force_path(tokens: np.ndarray, parents: np.ndarray,
                forced: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """A tree (node i + 1's token tokens[i], its parent parents[i] < i + 1, 0 the root) with `forced`
    on one root path; None where it holds them already. Down from the root the path goes to the
    child holding the next forced token, else to the child with the deepest subtree, which takes
    that token (its siblings hold others: siblings stay distinct); past a leaf, the last leaves off
    the path (the drafter's deepest, least likely candidates) move under it one below another to
    carry the rest. -> (tokens, parents) [T] renumbered depth first, children in their order, so
    that every node comes after its parent."""
    token = [0, *tokens.tolist()]
    parent = [-1, *(p if 0 <= p <= i else 0 for i, p in enumerate(parents.tolist()))]  # each before its nodes
    children: list[list[int]] = [[] for _ in token]
    for node in range(1, len(token)):
        children[parent[node]].append(node)
    height = [0] * len(token)  # the longest way down from each node
    for node in range(len(token) - 1, 0, -1):
        height[parent[node]] = max(height[parent[node]], height[node] + 1)
    path, node, changed = [0], 0, False
    for want in forced:
        if not children[node]:
            break
        holding = [c for c in children[node] if token[c] == want]
        node = holding[0] if holding else max(children[node], key=height.__getitem__)
        changed |= token[node] != want
        token[node] = want
        path.append(node)
    rest = list(forced[len(path) - 1:])
    for leaf in range(len(token) - 1, 0, -1):  # a leaf's children come after it: peeled first
        if not rest:
            break
        if not children[leaf] and leaf not in path:
            children[parent[leaf]].remove(leaf)
            children[node].append(leaf)
            parent[leaf], token[leaf], node = node, rest.pop(0), leaf
            path.append(leaf)
            changed = True
    if not changed:
        return None
    order, stack = [], [0]
    while stack:
        order.append(node := stack.pop())
        stack.extend(reversed(children[node]))
    index = {old: new for new, old in enumerate(order)}
    return (np.array([token[old] for old in order[1:]], tokens.dtype),
            np.array([index[parent[old]] for old in order[1:]], parents.dtype))


def _stale(pending: _Pending, i: int) -> bool:
    """Whether row i's results no longer apply: its request finished, or was preempted since."""
    req = pending.reqs[i]
    return req.finished or req.admissions != pending.admissions[i]
