"""Per batch bucket, what an iteration runs, and what that choice rests on (engine/policy.py's rule):
each bucket's costs, timed in warm-up or injected, then each choice's served time, its incumbent
and its timing probe; per proposal, the acceptance its own iterations measured, and for a chain the
lower bound a tree's verifies measure; per slot, which proposal drafted its pending proposals at
its current position. Host only: the engine reports what it dispatched and collected, this decides.

A choice is the index of a proposal in the engine's order (the engine's own first), or None for the
target alone.

Batches with a row under a grammar are timed apart (`constrained`): the host computes their masks
each step and reads every result before the next dispatch, so their steps cost otherwise than free
ones, and most for the proposal with the most masks (a tree's, a mask a node). Each bucket has a
second set of served times, probes and incumbent for them, from the same warm-up costs; the
acceptance estimates stay shared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from eagle3_jax.config import SpeculationConfig, SpeculatorFacts
from eagle3_jax.engine import policy
from eagle3_jax.engine.policy import Choice


@dataclasses.dataclass
class BucketState:
    """What one bucket's choice rests on besides the costs and the acceptance estimates."""

    incumbent: Choice = None  # what the rule chose last (the target alone at first)
    iterations: int = 0  # dispatched at this bucket
    tried_at: dict[Choice, int] = dataclasses.field(default_factory=dict)  # when each was last timed or probed
    probe: Choice = None  # the choice a timing probe under way runs (when probing)
    probing: bool = False
    probe_start: int = 0  # iterations when the probe started
    probe_samples: int = 0  # the probed choice's timed steps then
    timings: int = 0  # changes to its served times (what `Speculation.bucket_cost` keeps to)


@dataclasses.dataclass
class Timings:
    """Per bucket, for one kind of batch (free, or with a row under a grammar): each choice's served
    time, what its choice rests on besides, and its cost as last computed, with the warm-up cost and
    the count of served timings it came from."""

    state: dict[int, BucketState]
    served: dict[int, dict[Choice, policy.ServedTime]] = dataclasses.field(default_factory=dict)
    costs: dict[int, tuple[policy.BucketCost | None, int, policy.BucketCost | None]] = dataclasses.field(
        default_factory=dict)

    @classmethod
    def of(cls, buckets: Sequence[int]) -> Timings:
        """Nothing timed yet at any of `buckets`."""
        return cls({b: BucketState() for b in buckets})


class Speculation:
    """cfg: what iterations may draft (the proposals, the engine's own first), in which mode ("auto":
    the policy chooses; "always": the engine's proposal wherever a bucket may speculate), up to
    which bucket, and the injected step costs, which serving never replaces. buckets: the batch
    buckets; num_slots: the slots, the dummy included."""

    def __init__(self, cfg: SpeculationConfig, buckets: Sequence[int], num_slots: int):
        self.facts: tuple[SpeculatorFacts, ...] = cfg.facts
        self.mode, self.max_batch, self.buckets = cfg.mode, cfg.speculative_max_batch, tuple(buckets)
        self.policy = policy.SpeculationPolicy()
        # Per proposal: L as its own fresh rows measured it (from the optimistic prior), and for a
        # chain, what the top-1 chain inside another proposal's verifies accepted (None before any).
        self.own = tuple(policy.AcceptanceEstimate.prior(f.max_accepted) for f in self.facts)
        self.top1: tuple[policy.AcceptanceEstimate | None, ...] = (None,) * len(self.facts)
        self.acceptance = self.own
        self._longest = [f.max_accepted + 1 for f in self.facts]
        self.step_costs: dict[int, policy.BucketCost] = {
            int(c[0]): policy.BucketCost(c[1], tuple(c[2:])) for c in cfg.step_costs or ()
            if c[0] in self.buckets and self.facts}
        self._injected = frozenset(self.step_costs)
        # Per bucket, each choice's served time and the rest of what its choice rests on, for free
        # batches and for those with a row under a grammar; the (constrained, bucket, choice) of the
        # last step's iteration when that step dispatched no prefill.
        self.free, self.constrained = Timings.of(self.buckets), Timings.of(self.buckets)
        self._last_steady: tuple[bool, int, Choice] | None = None
        # [S] the proposal whose proposals the slot holds fresh, drafted at its current position (-1
        # after a target-only iteration: the next verify checks stale proposals, no measure of the drafter).
        self._drafted = np.full(num_slots, -1)

    # ---- the choice ----------------------------------------------------------------------------
    def may_speculate(self, bucket: int) -> bool:
        """Whether a bucket can speculate at all: a proposal, within max_batch."""
        return bool(self.facts) and (self.max_batch is None or bucket <= self.max_batch)

    @property
    def state(self) -> dict[int, BucketState]:
        """Free batches' state per bucket."""
        return self.free.state

    @property
    def served(self) -> dict[int, dict[Choice, policy.ServedTime]]:
        """Free batches' served times per bucket."""
        return self.free.served

    def timings(self, constrained: bool) -> Timings:
        """What a bucket's choice rests on for batches with a row under a grammar, or for free ones."""
        return self.constrained if constrained else self.free

    def choice(self, bucket: int, constrained: bool = False) -> Choice:
        """What the bucket's next iteration runs (`constrained`: a row of the batch is under a
        grammar). "always": the engine's proposal wherever it may speculate; "auto": a timing probe
        under way or due, else the policy's choice, which becomes the bucket's incumbent. Asking
        starts the probe that is due: asked again, it gives the same answer until an iteration is
        dispatched or collected."""
        t = self.timings(constrained)
        choice, why = self._plan(bucket, constrained)
        if why == "rule":
            t.state[bucket].incumbent = choice
        elif why == "timing probe" and not (state := t.state[bucket]).probing:
            times = t.served.setdefault(bucket, {})
            if choice in times:
                times[choice] = policy.retimed(times[choice], self.policy)
                state.timings += 1
            state.probing, state.probe, state.probe_start = True, choice, state.iterations
            state.probe_samples = times[choice].samples if choice in times else 0
        return choice

    def best(self, bucket: int, constrained: bool = False) -> Choice:
        """The bucket's choice by the rule, probes left out (what `table` reports)."""
        return self._plan(bucket, constrained, probes=False)[0]

    def _plan(self, bucket: int, constrained: bool = False, probes: bool = True) -> tuple[Choice, str]:
        """(what the bucket's next iteration runs, why: "fixed", "rule", "acceptance probe" or
        "timing probe"); changes nothing."""
        if not self.may_speculate(bucket):
            return None, "fixed"
        cost = self.bucket_cost(bucket, constrained)
        if self.mode == "always" or cost is None:
            return 0, "fixed"
        t = self.timings(constrained)
        state = t.state[bucket]
        if state.probing and probes:
            return state.probe, "timing probe"
        best = policy.best_choice(cost, self.acceptance, self.policy, state.incumbent)
        if not probes:
            return best, "rule"
        probe = policy.acceptance_probe(cost, self.acceptance, self._longest, best, self.policy)
        if probe is not None:
            return probe, "acceptance probe"
        if self._timed(bucket) and (due := policy.timing_due(cost, self.acceptance, best, t.served.get(bucket, {}),
                                                             state.tried_at, state.iterations, self.policy)):
            return due[0], "timing probe"
        return best, "rule"

    def _timed(self, bucket: int) -> bool:
        """Whether serving times the bucket's steps: "auto", time_served, costs not injected."""
        return self.policy.time_served and self.mode == "auto" and bucket not in self._injected

    def choices(self, bucket: int) -> list[Choice]:
        """What a bucket may run: the engine's proposal ("always"), every proposal and the target
        alone ("auto"), or the target alone where it may not speculate."""
        choices: list[Choice] = []
        if self.may_speculate(bucket):
            choices = [0] if self.mode == "always" else list(range(len(self.facts)))
        if not choices or self.mode == "auto":
            choices.append(None)
        return choices

    def bucket_cost(self, bucket: int, constrained: bool = False) -> policy.BucketCost | None:
        """The bucket's cost as the policy takes it: warm-up's (or injected), each choice's replaced
        by its served time once serving has timed it, the others' scaled alike (`policy.served_cost`),
        for free batches or constrained ones."""
        t = self.timings(constrained)
        warm, timings = self.step_costs.get(bucket), t.state[bucket].timings
        kept = t.costs.get(bucket)
        if kept is None or kept[0] is not warm or kept[1] != timings:
            cost = policy.served_cost(warm, t.served[bucket]) if warm is not None and bucket in t.served else warm
            kept = t.costs[bucket] = (warm, timings, cost)
        return kept[2]

    def label(self, choice: Choice) -> str:
        return "target-only" if choice is None else self.facts[choice].label

    def table(self, constrained: bool = False) -> tuple[policy.BucketChoice, ...]:
        """Every bucket's cost and choice by the rule, for free batches or constrained ones (`report`
        prints the free ones')."""
        return tuple(policy.BucketChoice(b, self.bucket_cost(b, constrained), self.label(self.best(b, constrained)))
                     for b in self.buckets)

    def rates(self, bucket: int, constrained: bool = False) -> dict[str, float]:
        """Each choice's tokens a row a second at `bucket` as the rule weighs them (`policy.rates`:
        costs as served, acceptance as estimated), by label; empty where the bucket has no costs."""
        cost = self.bucket_cost(bucket, constrained) if self.may_speculate(bucket) else None
        if cost is None:
            return {}
        return {self.label(c): r for c, r in policy.rates(cost, self.acceptance).items()}

    def report(self) -> str:
        """The table and each proposal's acceptance estimate, as plain text."""
        return policy.format_table(self.table(), [(f.label, est) for f, est in zip(self.facts, self.acceptance)])

    # ---- what the engine dispatched and collected ----------------------------------------------
    def prefilled(self, slot: int) -> None:
        """A prefill's last chunk drafted the engine's proposal into `slot`."""
        self._drafted[slot] = 0 if self.facts else -1

    def dispatched(self, bucket: int, rows: np.ndarray, choice: Choice, constrained: bool = False) -> np.ndarray:
        """An iteration of `choice` at `bucket` over the slots `rows` [n] -> [n] bool, whether it
        verifies proposals drafted fresh by the proposal it runs. Device order is dispatch order, so
        freshness at dispatch is what the iteration verifies."""
        state = self.timings(constrained).state[bucket]
        state.iterations += 1
        if state.probing and state.iterations - state.probe_start >= self.policy.probe_iterations:
            self._end_probe(state)
        ran = -1 if choice is None else choice
        fresh = self._drafted[rows] == ran
        self._drafted[rows] = ran
        return fresh

    def observe(self, choice: Choice, accepted: np.ndarray, top1: np.ndarray, measured: np.ndarray) -> None:
        """Update the estimates from one iteration's accepted, top1 [n], over the rows `measured` [n]
        (fresh, still running). The proposal that ran measures its own. A verify that reports the
        top-1 chain's acceptance (`SpeculatorFacts.measures_top1_chain`) measures a lower bound for
        the chains served beside it (a first child the tree did not keep ends it early), which
        raises a chain's estimate above its own where it is higher, never lowers it: the rule reads
        `acceptance`, what each proposal accepted when it ran, at least that bound."""
        ran = None if choice is None else self.facts[choice]
        bounds = ran is not None and ran.measures_top1_chain
        own, lower, acceptance = [], [], []
        for i, (est, bound, facts) in enumerate(zip(self.own, self.top1, self.facts)):
            est = policy.observe(est, accepted, measured if i == choice else np.zeros_like(measured), self.policy)
            if bounds and facts.top1_chain:
                bound = self._bound(bound, facts.top1_chain, top1, measured & (top1 >= 0))
            own.append(est)
            lower.append(bound)
            raised = bound is not None and bound.mean > est.mean
            acceptance.append(dataclasses.replace(est, mean=bound.mean) if raised else est)
        self.own, self.top1, self.acceptance = tuple(own), tuple(lower), tuple(acceptance)

    def _bound(self, bound: policy.AcceptanceEstimate | None, longest: int, top1: np.ndarray,
               measured: np.ndarray) -> policy.AcceptanceEstimate | None:
        """A chain's lower bound after one verify's top1 [n] over the rows `measured` [n]; its first
        measurement is its prior, so no optimistic prior inflates a bound."""
        if bound is None:
            if not measured.any():
                return None
            bound = policy.AcceptanceEstimate(mean=float(np.minimum(top1, longest)[measured].mean()) + 1.0)
        return policy.observe(bound, np.minimum(top1, longest), measured, self.policy)

    def time_step(self, ran: tuple[int, Choice] | None, seconds: float, constrained: bool = False) -> None:
        """A step that ran the iteration `ran` (bucket, choice) and dispatched no prefill (else None)
        took `seconds`: after a step that ran the same on the same kind of batch (`constrained`), in
        the loop that is one period of the choice's iterations as served, host work included
        (policy.py, "The costs"). A constrained step's period reads its results before the next
        dispatch: it is timed among the constrained ones only."""
        steady = None if ran is None else (constrained, *ran)
        if steady is not None and steady == self._last_steady and self._timed(ran[0]):
            bucket, choice = ran
            t = self.timings(constrained)
            times, state = t.served.setdefault(bucket, {}), t.state[bucket]
            times[choice] = policy.observe_time(times.get(choice), seconds, self.policy)
            state.tried_at[choice] = state.iterations
            state.timings += 1
            if (state.probing and state.probe == choice
                    and times[choice].samples - state.probe_samples >= self.policy.probe_steps):
                self._end_probe(state)
        self._last_steady = steady

    @staticmethod
    def _end_probe(state: BucketState) -> None:
        """The probe ends, timed or not (prefills may leave every step of it untimed): its choice
        is not due again for `retime_every` iterations."""
        state.tried_at[state.probe] = state.iterations
        state.probing = False

    # ---- warm-up ---------------------------------------------------------------------------------
    def time_buckets(self, seconds: Callable[[int, Choice], float]) -> None:
        """The costs of every bucket with a choice to make and none injected, from `seconds(bucket,
        choice)`: one greedy iteration's (the sampling ones add about the same sampling work to every
        iteration)."""
        for b in self.buckets:
            choices = self.choices(b)
            if len(choices) > 1 and b not in self.step_costs:
                times = [seconds(b, c) for c in choices]  # the proposals', then the target alone's
                self.step_costs[b] = policy.BucketCost(target_only_s=times[-1], speculative_s=tuple(times[:-1]))
