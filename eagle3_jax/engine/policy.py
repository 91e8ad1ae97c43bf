"""When to speculate: per batch bucket, from measured step costs and the measured acceptance.

The rule. At a batch bucket b, one target-only iteration emits one token per row in t0[b]
seconds; one speculative iteration emits L tokens per row (the acceptance length, 1..K+1) in
tK[b] seconds. Both run the same rows, so the row count cancels and speculation pays iff

    L / tK[b] > (1 + margin) / t0[b],   i.e.   L > (1 + margin) * tK[b] / t0[b].

tK[b] / t0[b] is the bucket's break-even acceptance length. It grows with the batch (a step
stops being memory-bound, so verifying K+1 tokens per row stops being nearly free), while L is a
property of the drafter and the traffic, the same at every bucket: one estimate serves them all.
The engine times t0 and tK in warm-up at context 0 with greedy rows; a long context adds the same
KV reads to both (the ratio moves toward speculation), sampled rows add more to tK (their draft
steps and verify sort the vocabulary): for sampled traffic, inject costs measured on it.

The margin (default 5%) keeps the choice on the target's side near break-even: the costs are
measured medians, the estimate lags the traffic, and every switch from target-only back to
speculation costs one iteration whose proposals are stale (drafted before the target-only
stretch; see `steps.iterate_head`), so a near-tie is not worth flipping for.

The estimate. Tokens emitted per speculative row-iteration, averaged: it starts at the prior
K+1 (the most optimistic value), so before anything is measured every bucket where speculation
could pay at all speculates and the drafter gets measured rather than assumed. The prior counts
as `prior_weight` row-iterations, so the first measurements outweigh it quickly (a weak drafter
costs a few iterations, not dozens, before its buckets switch off); past `window` row-iterations
the mean becomes an exponential moving average with weight 1/window, so it follows drifting
traffic. Only rows whose proposals were fresh count (a row's first speculative iteration after
target-only ones verifies stale proposals and says nothing about the drafter), and only rows
still running (the surplus iteration of a finished request and padded rows are no measurement).

Probing. The estimate only moves while some bucket speculates. When none has for `probe_every`
collected iterations, buckets where speculation could pay at L = K+1 speculate again until a
fresh measurement arrives (about three iterations: the first verifies stale proposals), so a
drafter whose acceptance rose with the traffic is noticed; buckets where even K+1 tokens cannot
pay never probe. The cost is bounded by a few iterations in `probe_every`.

Everything here is pure: frozen dataclasses in, values out; the engine owns the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class BucketCost:
    """Measured seconds per iteration at one batch bucket. Frozen: a table entry is a
    measurement, replaced whole (warm-up, an injected table), never edited in place."""

    target_only_s: float  # t0: verify 1 token per row (+ the one-position draft extend)
    speculative_s: float  # tK: verify K+1, the draft extend, K draft steps

    def __post_init__(self):
        if not (self.target_only_s > 0 and self.speculative_s > 0):
            raise ValueError(f"step costs must be positive seconds, got {self}")

    @property
    def break_even(self) -> float:
        """The acceptance length at which speculation and target-only emit tokens equally fast."""
        return self.speculative_s / self.target_only_s


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """The decision's constants. Frozen and hashable, so a policy is a value a test or a user
    swaps whole (`dataclasses.replace`), never a knob edited behind the engine's back."""

    margin: float = 0.05  # speculation must beat target-only by this fraction
    prior_weight: int = 8  # row-iterations the prior K+1 counts as
    # Row-iterations the moving average spans (weight 1/window each). Long: L belongs to the
    # drafter and the traffic, while one request's acceptance swings widely; a window of 64 kept
    # bucket 2 target-only although speculating paid there (BENCHMARKS.md, "Tried and rejected").
    window: int = 1024
    probe_every: int = 256  # collected iterations without a measurement before probing


@dataclasses.dataclass(frozen=True)
class AcceptanceEstimate:
    """L, tokens emitted per speculative row-iteration. Frozen: every update returns a new
    value, so the engine's state is one assignment and a decision never sees half an update."""

    mean: float  # 1..K+1; the prior until measurements arrive
    rows: int = 0  # row-iterations measured so far
    unmeasured: int = 0  # collected iterations since the last measurement (for probing)

    @staticmethod
    def prior(num_draft: int) -> AcceptanceEstimate:
        """Optimistic: every proposal accepted, so speculation gets tried (and measured)."""
        return AcceptanceEstimate(mean=float(num_draft + 1))


def observe(est: AcceptanceEstimate, num_accepted: Sequence[int], measured: Sequence[bool],
            policy: SpeculationPolicy) -> AcceptanceEstimate:
    """One collected iteration: num_accepted [B] per row, measured [B] whether the row counts
    (running, fresh proposals, speculative iteration). With no row measured only `unmeasured`
    advances. Each measured row moves the mean by 1/n of its error, n the row-iterations in it
    so far counting the prior's, capped at the window: a running mean, then a moving average."""
    lengths = [int(a) + 1 for a, m in zip(num_accepted, measured, strict=True) if m]
    if not lengths:
        return dataclasses.replace(est, unmeasured=est.unmeasured + 1)
    mean = est.mean
    for i, length in enumerate(lengths):
        mean += (length - mean) / min(policy.prior_weight + est.rows + i + 1, policy.window)
    return AcceptanceEstimate(mean=mean, rows=est.rows + len(lengths))


def pays(cost: BucketCost, acceptance_length: float, margin: float = 0.0) -> bool:
    """The rule: L / tK > (1 + margin) / t0."""
    return acceptance_length * cost.target_only_s > (1.0 + margin) * cost.speculative_s


def speculate(cost: BucketCost | None, est: AcceptanceEstimate, num_draft: int,
              policy: SpeculationPolicy) -> bool:
    """Whether a bucket with this measured cost speculates now. An unmeasured bucket (no warm-up
    ran) speculates, as an engine without a policy would."""
    if cost is None or pays(cost, est.mean, policy.margin):
        return True
    return est.unmeasured >= policy.probe_every and pays(cost, num_draft + 1, policy.margin)


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """One row of the policy's table, for printing (bench, logs)."""

    bucket: int
    cost: BucketCost | None
    speculate: bool


def format_table(table: Sequence[BucketChoice], est: AcceptanceEstimate) -> str:
    """Plain text: per bucket t0 and tK in ms, the break-even L and the choice; then L itself."""
    lines = [f"{'bucket':>6}  {'target-only ms':>14}  {'speculative ms':>14}  {'break-even L':>12}  choice"]
    for c in table:
        cells = (("-", "-", "-") if c.cost is None else
                 (f"{1e3 * c.cost.target_only_s:.3f}", f"{1e3 * c.cost.speculative_s:.3f}", f"{c.cost.break_even:.2f}"))
        lines.append(f"{c.bucket:>6}  {cells[0]:>14}  {cells[1]:>14}  {cells[2]:>12}  "
                     f"{'speculate' if c.speculate else 'target-only'}")
    source = f"{est.rows} row-iterations measured" if est.rows else "prior, nothing measured yet"
    lines.append(f"acceptance length L = {est.mean:.2f} ({source})")
    return "\n".join(lines)
