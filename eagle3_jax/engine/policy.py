"""Per batch bucket, what to run: the target alone or one of the drafter's proposals (chain, tree).

The rule. Proposal i emits L_i tokens per row (its acceptance length) in t_i[b] seconds per
iteration at bucket b, the target alone 1 in t0[b]; the bucket runs the best rate L / t. The choice
it ran last by this rule (the incumbent; at first the target alone) keeps running unless another
beats its rate by more than `margin`, the challengers taken cheapest first (costs are estimates, a
switch wastes an iteration): near-equal choices do not flap. L_i does not depend on the bucket, so
one estimate serves all (BENCHMARKS.md, "Trees end to end").

The costs, every choice's measured the same way. Warm-up times each choice at each bucket (context
0, greedy rows): the prior, which misses the host's work and longer contexts. Serving times each
step that ran the same bucket and choice as the step before, neither step dispatching a prefill
(one period of the overlapped loop, host work included: `ServedTime`; batches with a row under a
grammar are timed apart, `speculation.Timings`), and that served time
replaces the choice's warm-up cost. A choice not yet served at the bucket costs its warm-up time
times the mean ratio served / warm-up of the bucket's served choices (`served_cost`), so a served
time is never weighed against a bare warm-up one. Injected costs (step_costs) stay as given.

Timing probes. Only what runs gets a served time, so the alternatives are run on purpose: at each
bucket, a choice with no served time there yet, or one within `probe_range` of the best's rate,
once it has gone `retime_every` of the bucket's iterations untried (at first: at once), runs until
`probe_steps` more of its steps are timed, or for `probe_iterations` iterations (prefills leave
steps untimed); the served time it had weighs `probe_steps` samples against them (`retimed`). So
every choice is timed within tens of iterations of a bucket's first traffic while most steps
dispatch no prefill (tests/test_speculation.py), and each that could win again every
`retime_every` iterations.

The acceptance. Each proposal's estimate counts what it accepted itself, on fresh rows of running
requests only, from a prior of steps+1 weighing `prior_weight` row-iterations, so every proposal
that could pay gets tried. A tree's verify also reports what its top-1 chain accepted (its first
children, `Tree.accept`): a lower bound of the chain's, as the tree may not keep the chain's next
node, which raises the chain's estimate where it is higher and never lowers it
(`Speculation.observe`).

Acceptance probes. A proposal unmeasured for `probe_every` iterations whose best case beats the
choice runs for `probe_rows` fresh rows, its stale estimate reweighted to `stale_weight` so the
probe can move it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BucketCost:
    """Seconds per iteration at one batch bucket, replaced whole, never edited."""

    target_only_s: float  # t0: verify 1 token per row (+ the one-position draft extend)
    speculative_s: tuple[float, ...]  # t_i per proposal, in the engine's order

    def __post_init__(self):
        if not isinstance(self.speculative_s, tuple):
            object.__setattr__(self, "speculative_s", (self.speculative_s,))
        if not (self.target_only_s > 0 and self.speculative_s and all(t > 0 for t in self.speculative_s)):
            raise ValueError(f"step costs must be positive seconds, got {self}")

    @property
    def break_even(self) -> tuple[float, ...]:
        return tuple(t / self.target_only_s for t in self.speculative_s)


Choice = int | None  # a proposal's index in the engine's order, or None for the target alone


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """The decision's constants (module docstring), replaced whole with `dataclasses.replace`."""

    margin: float = 0.05
    prior_weight: int = 8  # row-iterations the prior counts as
    # Long: L belongs to drafter and traffic, not one request (BENCHMARKS.md, "Tried and rejected").
    window: int = 1024
    probe_every: int = 256
    probe_rows: int = 16
    stale_weight: int = 32
    served_window: int = 32  # steps a served time's moving average spans
    time_served: bool = True  # False: the costs stay warm-up's, and nothing is probed for its time
    # Timing probes: which choices, how often (iterations of the bucket), how long.
    probe_range: float = 0.25  # retimed: a choice whose rate x (1 + probe_range) beats the best's
    retime_every: int = 128
    probe_steps: int = 3  # timed steps a probe collects
    probe_iterations: int = 32  # the most iterations a probe runs


@dataclasses.dataclass(frozen=True)
class AcceptanceEstimate:
    """L of one proposal; each update returns a new value."""

    mean: float  # 1..steps+1
    rows: int = 0
    unmeasured: int = 0  # collected iterations since a measurement
    weight: int | None = None  # row-iterations the mean stands for (None: rows); less once stale
    probing: int = 0  # fresh row-iterations the probe under way still measures

    def __post_init__(self):
        if self.weight is None:
            object.__setattr__(self, "weight", self.rows)

    @staticmethod
    def prior(steps: int) -> AcceptanceEstimate:
        return AcceptanceEstimate(mean=float(steps + 1))


def observe(est: AcceptanceEstimate, num_accepted: Sequence[int], measured: Sequence[bool],
            policy: SpeculationPolicy) -> AcceptanceEstimate:
    """One collected iteration: num_accepted [B], measured [B] whether the row counts."""
    num_accepted, measured = np.asarray(num_accepted), np.asarray(measured, bool)
    if num_accepted.shape != measured.shape:
        raise ValueError(f"{measured.size} measured flags for {num_accepted.size} rows: one flag per row")
    # Python ints: a loop over numpy scalars is slow on the host's step.
    lengths = (num_accepted[measured] + 1).tolist()
    if not lengths:
        return dataclasses.replace(est, unmeasured=est.unmeasured + 1)
    m = len(lengths)
    weight, probing = est.weight, max(est.probing - m, 0)
    if est.rows and est.unmeasured >= policy.probe_every:
        weight, probing = min(weight, policy.stale_weight), max(policy.probe_rows - m, 0)
    # Row i moves the mean by (length_i - mean) / min(n + 1 + i, window): one sum, then 1/window.
    n = policy.prior_weight + weight
    r = min(max(policy.window - 1 - n, 0), m)
    mean = (est.mean * n + sum(lengths[:r])) / (n + r) if r else est.mean
    for length in lengths[r:]:
        mean += (length - mean) / policy.window
    return AcceptanceEstimate(mean=mean, rows=est.rows + m, weight=weight + m, probing=probing)


@dataclasses.dataclass(frozen=True)
class ServedTime:
    """Seconds a steady step of one choice took (the same bucket and choice as the step before,
    neither dispatching a prefill), as a moving average over `served_window` steps."""

    mean: float
    samples: int = 1


def observe_time(est: ServedTime | None, seconds: float, policy: SpeculationPolicy) -> ServedTime:
    if est is None:
        return ServedTime(seconds)
    n = est.samples + 1
    return ServedTime(est.mean + (seconds - est.mean) / min(n, policy.served_window), n)


def retimed(est: ServedTime, policy: SpeculationPolicy) -> ServedTime:
    """A choice's served time as a timing probe of it starts: it weighs `probe_steps` samples at
    most, so the probe's own steps move it halfway at least."""
    return ServedTime(est.mean, min(est.samples, policy.probe_steps))


def served_cost(cost: BucketCost, served: Mapping[Choice, ServedTime]) -> BucketCost:
    """Each choice's served time (served[None]: the target alone) where it has one; the others'
    warm-up cost times the mean ratio served / warm-up of those that have (module docstring)."""
    warm = {None: cost.target_only_s, **dict(enumerate(cost.speculative_s))}
    ratios = [est.mean / warm[c] for c, est in served.items() if c in warm]
    scale = sum(ratios) / len(ratios) if ratios else 1.0
    t = {c: served[c].mean if c in served else w * scale for c, w in warm.items()}
    return BucketCost(t.pop(None), tuple(t.values()))


def rates(cost: BucketCost, estimates: Sequence[AcceptanceEstimate]) -> dict[Choice, float]:
    """Tokens per row per second of each choice: L_i / t_i, the target alone's 1 / t0."""
    per_proposal = zip(estimates, cost.speculative_s, strict=True)
    return {None: 1.0 / cost.target_only_s, **{i: est.mean / t for i, (est, t) in enumerate(per_proposal)}}


def best_choice(cost: BucketCost, estimates: Sequence[AcceptanceEstimate], policy: SpeculationPolicy,
                incumbent: Choice = None) -> Choice:
    """The rule (module docstring): the incumbent, unless a challenger's rate beats the best so far
    by the margin; the challengers cheapest first (the target alone, then the proposals by cost)."""
    rate, times = rates(cost, estimates), cost.speculative_s
    best = incumbent
    for c in [None, *sorted(range(len(estimates)), key=times.__getitem__)]:
        if c != incumbent and rate[c] > (1.0 + policy.margin) * rate[best]:
            best = c
    return best


def acceptance_probe(cost: BucketCost, estimates: Sequence[AcceptanceEstimate], longest: Sequence[int],
                     best: Choice, policy: SpeculationPolicy) -> int | None:
    """The proposal whose acceptance probe is due or under way and could still win against `best`
    (module docstring), else None. longest[i]: steps + 1 of proposal i."""
    times = cost.speculative_s
    best_rate = rates(cost, estimates)[best]
    best_t = cost.target_only_s if best is None else times[best]

    def bar(i: int) -> float:  # a costlier proposal must beat the best by the margin, a cheaper one its rate
        return (1.0 + policy.margin) * best_rate if times[i] >= best_t else best_rate

    for i, (est, t, most) in enumerate(zip(estimates, times, longest, strict=True)):
        if i == best:
            continue
        if est.probing > 0 and _hopeful(est, most, policy) / t > bar(i):
            return i  # a probe its remaining rows could still win
        if est.unmeasured >= policy.probe_every and most / t > bar(i):
            return i
    return None


def choose(cost: BucketCost | None, estimates: Sequence[AcceptanceEstimate], longest: Sequence[int],
           policy: SpeculationPolicy, incumbent: Choice = None) -> Choice:
    """The rule's choice or an acceptance probe: a proposal's index, or None for the target alone.
    longest[i]: steps + 1 of proposal i. A bucket without costs runs the engine's proposal."""
    if not estimates:
        return None
    if cost is None:
        return 0
    best = best_choice(cost, estimates, policy, incumbent)
    probe = acceptance_probe(cost, estimates, longest, best, policy)
    return best if probe is None else probe


def timing_due(cost: BucketCost, estimates: Sequence[AcceptanceEstimate], best: Choice, timed: Collection[Choice],
               tried_at: Mapping[Choice, int], iteration: int, policy: SpeculationPolicy) -> list[Choice]:
    """The choices a bucket's timing probe is due for now, the most promising first: those not
    tried there for `retime_every` iterations (tried_at: the bucket's iteration when each was last
    timed or its probe ended; absent: never) that either have no served time there (not in `timed`)
    or are within `probe_range` of the best's rate."""
    rate = rates(cost, estimates)
    return [c for c in sorted(rate, key=rate.__getitem__, reverse=True)
            if c != best and iteration - tried_at.get(c, -policy.retime_every) >= policy.retime_every
            and (c not in timed or rate[c] * (1.0 + policy.probe_range) > rate[best])]


def _hopeful(est: AcceptanceEstimate, most: int, policy: SpeculationPolicy) -> float:
    """The estimate if every row left in its probe emitted `most` tokens."""
    return est.mean + (most - est.mean) * est.probing / min(policy.prior_weight + est.weight + est.probing,
                                                             policy.window)


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    bucket: int
    cost: BucketCost | None
    choice: str  # "target-only", or the proposal's label ("chain K=3", "tree 5,4,15")


def format_table(table: Sequence[BucketChoice], estimates: Sequence[tuple[str, AcceptanceEstimate]]) -> str:
    labels = [label for label, _ in estimates]
    cells = [f"{label} ms / break-even L" for label in labels]
    widths = [max(len(c), 16) for c in cells]
    lines = ["  ".join([f"{'bucket':>6}", f"{'target-only ms':>14}", *(f"{c:>{w}}" for c, w in zip(cells, widths)),
                        "choice"])]
    for row in table:
        if row.cost is None:
            t0, per = "-", ["-"] * len(labels)
        else:
            t0 = f"{1e3 * row.cost.target_only_s:.3f}"
            per = [f"{1e3 * t:.3f} / {be:.2f}" for t, be in zip(row.cost.speculative_s, row.cost.break_even)]
        lines.append("  ".join([f"{row.bucket:>6}", f"{t0:>14}", *(f"{c:>{w}}" for c, w in zip(per, widths)),
                                row.choice]))
    for label, est in estimates:
        source = f"{est.rows} row-iterations measured" if est.rows else "prior, nothing measured yet"
        lines.append(f"{label}: acceptance length L = {est.mean:.2f} ({source})")
    return "\n".join(lines)
