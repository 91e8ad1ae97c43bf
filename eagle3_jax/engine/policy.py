"""Per batch bucket, what to run: the target alone or one of the drafter's proposals (chain, tree).

The rule. Proposal i emits L_i tokens per row (its acceptance length) in t_i[b] seconds, the target
alone 1 in t0[b]; cheapest first, a proposal becomes the choice when L_i / t_i[b] > (1 + margin) x the
rate so far (the margin because costs are medians, estimates lag, and a switch wastes an iteration).
L_i does not depend on the bucket, so one estimate serves all (BENCHMARKS.md, "Trees end to end").

The costs. Warm-up's (context 0, greedy rows) miss host work that outlasts a short iteration, so a
choice's served time replaces them once it has one (`ServedTime`); injected costs (step_costs) stay.

The estimate starts at steps+1, so every proposal that could pay gets measured, and counts only fresh
rows of running requests. A tree's verify also measures the chain (its first children, `Tree.accept`).

Probing. A proposal unmeasured for `probe_every` iterations whose best case beats the choice runs for
`probe_rows` fresh rows, its stale estimate reweighted to `stale_weight` so the probe can move it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

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
    time_served: bool = True  # False: the costs stay warm-up's


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
    """Seconds a steady step (same choice as the step before, no prefill) of one choice took."""

    mean: float
    samples: int = 1


def observe_time(est: ServedTime | None, seconds: float, policy: SpeculationPolicy) -> ServedTime:
    if est is None:
        return ServedTime(seconds)
    n = est.samples + 1
    return ServedTime(est.mean + (seconds - est.mean) / min(n, policy.served_window), n)


def served_cost(cost: BucketCost, served: Mapping[int | None, ServedTime]) -> BucketCost:
    """Each choice's served time (served[None]: the target alone) where it has one, else warm-up's."""
    return BucketCost(served[None].mean if None in served else cost.target_only_s,
                      tuple(served[i].mean if i in served else t for i, t in enumerate(cost.speculative_s)))


def choose(cost: BucketCost | None, estimates: Sequence[AcceptanceEstimate], longest: Sequence[int],
           policy: SpeculationPolicy) -> int | None:
    """A proposal's index, or None for the target alone. longest[i]: steps + 1 of proposal i."""
    if not estimates:
        return None
    if cost is None:
        return 0
    times = cost.speculative_s
    best, best_rate, best_t = None, 1.0 / cost.target_only_s, cost.target_only_s
    for i in sorted(range(len(estimates)), key=times.__getitem__):
        rate = estimates[i].mean / times[i]
        if rate > (1.0 + policy.margin) * best_rate:
            best, best_rate, best_t = i, rate, times[i]

    def bar(i: int) -> float:
        return (1.0 + policy.margin) * best_rate if times[i] >= best_t else best_rate

    for i, (est, t, most) in enumerate(zip(estimates, times, longest, strict=True)):
        if i == best:
            continue
        if est.probing > 0 and _hopeful(est, most, policy) / t > bar(i):
            return i  # a probe its remaining rows could still win
        if est.unmeasured >= policy.probe_every and most / t > bar(i):
            return i
    return best


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
