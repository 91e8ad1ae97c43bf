"""Per batch bucket, what an iteration runs, and what that choice rests on (engine/policy.py's rule):
each bucket's costs, timed in warm-up or injected, then each choice's served time; one acceptance
estimate per proposal; per slot, which proposal drafted its pending proposals at its current
position. Host only: the engine reports what it dispatched and collected, this decides.

A choice is the index of a proposal in the engine's order (the engine's own first), or None for the
target alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from eagle3_jax.config import SpeculationConfig, SpeculatorFacts
from eagle3_jax.engine import policy

Choice = int | None


class Speculation:
    """cfg: what iterations may draft (the proposals, the engine's own first), in which mode ("auto":
    the policy chooses; "always": the engine's proposal wherever a bucket may speculate), up to
    which bucket, and the injected step costs, which serving never replaces. buckets: the batch
    buckets; num_slots: the slots, the dummy included."""

    def __init__(self, cfg: SpeculationConfig, buckets: Sequence[int], num_slots: int):
        self.facts: tuple[SpeculatorFacts, ...] = cfg.facts
        self.mode, self.max_batch, self.buckets = cfg.mode, cfg.speculative_max_batch, tuple(buckets)
        self.policy = policy.SpeculationPolicy()
        self.acceptance = tuple(policy.AcceptanceEstimate.prior(f.max_accepted) for f in self.facts)
        self.step_costs: dict[int, policy.BucketCost] = {
            int(c[0]): policy.BucketCost(c[1], tuple(c[2:])) for c in cfg.step_costs or ()
            if c[0] in self.buckets and self.facts}
        self._injected = frozenset(self.step_costs)
        # Per bucket, each choice's served time, and the (bucket, choice) of the last step's iteration
        # when that step ran no prefill.
        self.served: dict[int, dict[Choice, policy.ServedTime]] = {}
        self._last_steady: tuple[int, Choice] | None = None
        # [S] the proposal whose proposals the slot holds fresh, drafted at its current position (-1
        # after a target-only iteration: the next verify checks stale proposals, no measure of the drafter).
        self._drafted = np.full(num_slots, -1)

    # ---- the choice ----------------------------------------------------------------------------
    def may_speculate(self, bucket: int) -> bool:
        """Whether a bucket can speculate at all: a proposal, within max_batch."""
        return bool(self.facts) and (self.max_batch is None or bucket <= self.max_batch)

    def choice(self, bucket: int) -> Choice:
        """This bucket's choice now. "always" runs the engine's proposal wherever it may speculate;
        "auto" asks the policy."""
        if not self.may_speculate(bucket):
            return None
        if self.mode == "always":
            return 0
        return policy.choose(self.bucket_cost(bucket), self.acceptance, [f.max_accepted + 1 for f in self.facts],
                             self.policy)

    def choices(self, bucket: int) -> list[Choice]:
        """What a bucket may run: the engine's proposal ("always"), every proposal and the target
        alone ("auto"), or the target alone where it may not speculate."""
        choices: list[Choice] = []
        if self.may_speculate(bucket):
            choices = [0] if self.mode == "always" else list(range(len(self.facts)))
        if not choices or self.mode == "auto":
            choices.append(None)
        return choices

    def bucket_cost(self, bucket: int) -> policy.BucketCost | None:
        """The bucket's cost as the policy takes it: warm-up's (or injected), each choice's replaced
        by its served time once serving has timed it (`policy.served_cost`)."""
        cost = self.step_costs.get(bucket)
        return policy.served_cost(cost, self.served[bucket]) if cost is not None and bucket in self.served else cost

    def label(self, choice: Choice) -> str:
        return "target-only" if choice is None else self.facts[choice].label

    def table(self) -> tuple[policy.BucketChoice, ...]:
        """Every bucket's cost and current choice (`report` prints it)."""
        return tuple(policy.BucketChoice(b, self.bucket_cost(b), self.label(self.choice(b))) for b in self.buckets)

    def report(self) -> str:
        """The table and each proposal's acceptance estimate, as plain text."""
        return policy.format_table(self.table(), [(f.label, est) for f, est in zip(self.facts, self.acceptance)])

    # ---- what the engine dispatched and collected ----------------------------------------------
    def prefilled(self, slot: int) -> None:
        """A prefill's last chunk drafted the engine's proposal into `slot`."""
        self._drafted[slot] = 0 if self.facts else -1

    def dispatched(self, rows: np.ndarray, choice: Choice) -> np.ndarray:
        """An iteration of `choice` over the slots `rows` [n] -> [n] bool, whether it verifies proposals
        drafted fresh by the proposal it runs. Device order is dispatch order, so freshness at
        dispatch is what the iteration verifies."""
        ran = -1 if choice is None else choice
        fresh = self._drafted[rows] == ran
        self._drafted[rows] = ran
        return fresh

    def observe(self, choice: Choice, accepted: np.ndarray, top1: np.ndarray, measured: np.ndarray) -> None:
        """Update the estimates from one iteration's accepted, top1 [n], over the rows `measured` [n]
        (fresh, still running). The proposal that ran measures its own; a verify that reports the
        top-1 chain's acceptance (`SpeculatorFacts.measures_top1_chain`) measures the chains served
        beside it too, without probing them."""
        ran = None if choice is None else self.facts[choice]
        estimates = []
        for i, (est, facts) in enumerate(zip(self.acceptance, self.facts)):
            if i == choice:
                est = policy.observe(est, accepted, measured, self.policy)
            elif ran is not None and ran.measures_top1_chain and facts.top1_chain:
                longest = facts.top1_chain
                est = policy.observe(est, np.minimum(top1, longest), measured & (top1 >= 0), self.policy)
            else:
                est = policy.observe(est, accepted, np.zeros_like(measured), self.policy)
            estimates.append(est)
        self.acceptance = tuple(estimates)

    def time_step(self, ran: tuple[int, Choice] | None, seconds: float) -> None:
        """A step that ran the iteration `ran` (bucket, choice) and no prefill, after a step that
        ran the same, took `seconds`: in the overlapped loop that is one period of the choice's
        iterations as served, host work included (policy.py, "The costs")."""
        timed = self.policy.time_served and self.mode == "auto"
        if ran is not None and ran == self._last_steady and timed and ran[0] not in self._injected:
            bucket, choice = ran
            times = self.served.setdefault(bucket, {})
            times[choice] = policy.observe_time(times.get(choice), seconds, self.policy)
        self._last_steady = ran

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
