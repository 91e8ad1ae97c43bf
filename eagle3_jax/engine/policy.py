"""What to run per batch bucket: the target alone or one of the drafter's proposals (a chain, a
tree), from measured step costs and each proposal's measured acceptance.

The rule. At a batch bucket b, one target-only iteration emits one token per row in t0[b]
seconds; an iteration of proposal i emits L_i tokens per row (its acceptance length, 1..steps+1)
in t_i[b] seconds. All run the same rows, so the row count cancels: each emits tokens at the rate
L_i / t_i[b] per row, the target alone at 1 / t0[b]. The fastest runs, but a costlier candidate
must beat a cheaper one by the margin: from the target alone, the candidates are taken in order
of cost, each becoming the choice when

    L_i / t_i[b]  >  (1 + margin) x the rate of the choice so far.

With one proposal this is "speculate when L / t[b] > (1 + margin) / t0[b]".

The costs. Warm-up times each iteration alone, back to back at context 0 with greedy rows. Serving
adds the engine's host work per step, which the device hides only where its iteration is the longer.
On the H200 at 8 rows, in one run, warm-up timed SmolLM2's tree (6, 8, 31) at 1.98 ms and its chain
of 4 at 1.31, where serving's steps took 1.54 and 1.24 (the chain's iteration is shorter than the
host's step, the tree's is not), and "auto" ran the chain where the tree was 1.23x faster
(BENCHMARKS.md, "Trees end to end"). So the engine also times its steps: a step that runs the same
choice as the step before, neither with a prefill, is one sample of that choice's served time at
the bucket (`ServedTime`), and once a choice has one, it replaces warm-up's cost of that choice
(`served_cost`). A choice that has not run at a bucket keeps warm-up's cost until a probe runs it.
Costs a user injected (EngineConfig.step_costs) are kept as given.

t_i[b] / t0[b] is proposal i's break-even acceptance length at the bucket. It grows with the batch
(a step stops being memory-bound, so verifying more tokens per row stops being nearly free), and
faster for a wide tree than for a chain, while L_i is a property of the drafter, the proposal and
the traffic, the same at every bucket: one estimate per proposal serves them all. So a tree may
win at small batches and a chain or the target alone at large ones. The engine times every
iteration in warm-up at context 0 with greedy rows; a long context adds the same KV reads to all
(the ratios move toward speculation), sampled rows add more to the speculative ones (their draft
steps and verify sort the vocabulary): for sampled traffic, inject costs measured on it.

The margin (default 5%) keeps the choice on the cheaper side near break-even: the costs are
measured medians at context 0, the estimates lag the traffic, and every switch costs one
iteration whose proposals are stale or the other speculator's (see `steps.iterate_head`), so a
near-tie is not worth flipping for. Between proposals it matters most where a wide tree nears the
chain: on the H200 at 8 rows, before the cuBLAS GEMMs made the tree the faster there, the tree
(6, 8, 31) and the chain of 4 tied (2.01 against 1.98 tokens a row per millisecond of wall time):
with no margin between proposals "auto" ran the tree at 0.91x the chain end to end; with the
margin, at 0.97-0.98x the faster (BENCHMARKS.md, "Trees end to end").

The estimate. Tokens emitted per row-iteration of a proposal, averaged: it starts at the prior
steps+1 (the most optimistic value), so before anything is measured every proposal that could pay
at all gets run and measured rather than assumed. The prior counts as `prior_weight`
row-iterations, so the first measurements outweigh it quickly (a weak drafter costs a few
iterations, not dozens); past `window` row-iterations the mean becomes an exponential moving
average with weight 1/window, so it follows drifting traffic. Only rows whose proposals were fresh
count (drafted at the row's position by the same proposal: a row's first iteration after a
target-only one, or after the other proposal, verifies stale or foreign proposals and says nothing
about the drafter), and only rows still running (the surplus iteration of a finished request and
padded rows are no measurement).

A tree measures the chain too. In a tree's verify the chain the drafter would have proposed from
the same position is the path of first children (a node's children are the draft's best tokens,
best first), so each tree iteration also says what that chain would have accepted
(runner/speculator.py, `Tree.accept`); the engine feeds it, capped at K, to the chain's estimate
(greedy and coupled rows; a draft-q row's chain would have sampled). Exact except where the tree
pruned the chain's next proposal, where it is a lower bound. An engine running its tree thus
keeps the chain's estimate current without running the chain.

Probing. Otherwise an estimate only moves while its proposal runs. When a proposal has gone unmeasured for
`probe_every` collected iterations and its most optimistic rate (every proposal accepted) beats
the bucket's choice, the bucket runs it until `probe_rows` fresh row-iterations are measured (the
first iteration verifies stale proposals and measures nothing), or until even rows of every
proposal accepted could no longer make it the choice, so a drafter whose acceptance
rose with the traffic is noticed; a proposal that cannot pay even then never probes. An estimate
left unmeasured that long describes older traffic than the choice's, so when its proposal is
measured again it first counts as only `stale_weight` row-iterations: a probe's rows then move it
a good part of the way, as they must. Without that, a proposal whose estimate fell behind on a
stretch of hard requests stayed behind: a probe's few rows, each weighing 1/window, barely moved
it, and an engine whose tree paid ran the chain (tests/test_policy.py simulates it). The cost is
bounded by the probe's iterations (probe_rows / rows per iteration, plus the stale one) in every
`probe_every`.

Everything here is pure: frozen dataclasses in, values out; the engine owns the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class BucketCost:
    """Measured seconds per iteration at one batch bucket. Frozen: a table entry is a
    measurement, replaced whole (warm-up, an injected table), never edited in place."""

    target_only_s: float  # t0: verify 1 token per row (+ the one-position draft extend)
    speculative_s: tuple[float, ...]  # t_i of each proposal, in the engine's order (one float: one proposal)

    def __post_init__(self):
        if not isinstance(self.speculative_s, tuple):
            object.__setattr__(self, "speculative_s", (self.speculative_s,))
        if not (self.target_only_s > 0 and self.speculative_s and all(t > 0 for t in self.speculative_s)):
            raise ValueError(f"step costs must be positive seconds, got {self}")

    @property
    def break_even(self) -> tuple[float, ...]:
        """Per proposal, the acceptance length at which it emits tokens as fast as the target alone."""
        return tuple(t / self.target_only_s for t in self.speculative_s)


@dataclasses.dataclass(frozen=True)
class SpeculationPolicy:
    """The decision's constants. Frozen and hashable, so a policy is a value a test or a user
    swaps whole (`dataclasses.replace`), never a knob edited behind the engine's back."""

    margin: float = 0.05  # speculation must beat target-only by this fraction
    prior_weight: int = 8  # row-iterations the prior steps+1 counts as
    # Row-iterations the moving average spans (weight 1/window each). Long: L belongs to the
    # drafter and the traffic, while one request's acceptance swings widely; a window of 64 kept
    # bucket 2 target-only although speculating paid there (BENCHMARKS.md, "Tried and rejected").
    window: int = 1024
    probe_every: int = 256  # collected iterations without a measurement before probing
    probe_rows: int = 16  # fresh row-iterations a probe measures before the choice is made again
    stale_weight: int = 32  # row-iterations an estimate unmeasured for probe_every iterations counts as
    served_window: int = 32  # steady steps a served time's moving average spans (`ServedTime`)
    time_served: bool = True  # False: the costs stay warm-up's (a test's fixed table)


@dataclasses.dataclass(frozen=True)
class AcceptanceEstimate:
    """L, tokens emitted per row-iteration of one proposal. Frozen: every update returns a new
    value, so the engine's state is one assignment and a decision never sees half an update."""

    mean: float  # 1..steps+1; the prior until measurements arrive
    rows: int = 0  # row-iterations measured so far
    unmeasured: int = 0  # collected iterations since the last measurement (for probing)
    weight: int | None = None  # row-iterations the mean stands for (None: rows); less once stale
    probing: int = 0  # fresh row-iterations a probe under way still measures

    def __post_init__(self):
        if self.weight is None:
            object.__setattr__(self, "weight", self.rows)

    @staticmethod
    def prior(steps: int) -> AcceptanceEstimate:
        """Optimistic: every drafted token accepted (steps + 1 emitted), so the proposal gets
        tried (and measured)."""
        return AcceptanceEstimate(mean=float(steps + 1))


def observe(est: AcceptanceEstimate, num_accepted: Sequence[int], measured: Sequence[bool],
            policy: SpeculationPolicy) -> AcceptanceEstimate:
    """One collected iteration: num_accepted [B] per row, measured [B] whether the row counts
    (an iteration of this proposal, over proposals it drafted fresh, the request still running).
    With no row measured only `unmeasured` advances. Each measured row moves the mean by 1/n of
    its error, n the row-iterations in it so far counting the prior's, capped at the window: a
    running mean, then a moving average. The first measurement after `probe_every` unmeasured
    iterations finds the estimate stale: it then weighs at most `stale_weight` row-iterations, and
    a probe of `probe_rows` starts (module docstring)."""
    num_accepted, measured = np.asarray(num_accepted), np.asarray(measured, bool)
    if num_accepted.shape != measured.shape:
        raise ValueError(f"{measured.size} measured flags for {num_accepted.size} rows: one flag per row")
    # [m] as Python ints: a loop over numpy scalars took 70 us of the host's step at 64 rows.
    lengths = (num_accepted[measured] + 1).tolist()
    if not lengths:
        return dataclasses.replace(est, unmeasured=est.unmeasured + 1)
    m = len(lengths)
    weight, probing = est.weight, max(est.probing - m, 0)
    if est.rows and est.unmeasured >= policy.probe_every:
        weight, probing = min(weight, policy.stale_weight), max(policy.probe_rows - m, 0)
    # Row i moves the mean by (length_i - mean) / n_i, n_i = prior + weight + 1 + i capped at the
    # window: a running mean of the first r rows (one sum), then steps of 1/window.
    n = policy.prior_weight + weight  # row-iterations the mean stands for before these rows
    r = min(max(policy.window - 1 - n, 0), m)
    mean = (est.mean * n + sum(lengths[:r])) / (n + r) if r else est.mean
    for length in lengths[r:]:
        mean += (length - mean) / policy.window
    return AcceptanceEstimate(mean=mean, rows=est.rows + m, weight=weight + m, probing=probing)


@dataclasses.dataclass(frozen=True)
class ServedTime:
    """Seconds a step of one choice at one bucket took in serving (module docstring, "The costs"):
    a running mean of the first `served_window` samples, then a moving average. Frozen, as
    AcceptanceEstimate."""

    mean: float
    samples: int = 1


def observe_time(est: ServedTime | None, seconds: float, policy: SpeculationPolicy) -> ServedTime:
    """One more steady step of `seconds` (None: the first)."""
    if est is None:
        return ServedTime(seconds)
    n = est.samples + 1
    return ServedTime(est.mean + (seconds - est.mean) / min(n, policy.served_window), n)


def served_cost(cost: BucketCost, served: Mapping[int | None, ServedTime]) -> BucketCost:
    """The bucket's cost as the decision takes it: each choice's served time where serving has timed
    it (served[i] proposal i's, served[None] the target alone's), else warm-up's."""
    return BucketCost(served[None].mean if None in served else cost.target_only_s,
                      tuple(served[i].mean if i in served else t for i, t in enumerate(cost.speculative_s)))


def choose(cost: BucketCost | None, estimates: Sequence[AcceptanceEstimate], longest: Sequence[int],
           policy: SpeculationPolicy) -> int | None:
    """What a bucket with this measured cost runs now: the index of a proposal, or None for the
    target alone (module docstring). estimates[i] is proposal i's acceptance estimate, longest[i]
    the most tokens one of its iterations emits (steps + 1). An unmeasured bucket (no warm-up ran)
    runs the first proposal, as an engine without a policy would."""
    if not estimates:
        return None
    if cost is None:
        return 0
    times = cost.speculative_s
    best, best_rate, best_t = None, 1.0 / cost.target_only_s, cost.target_only_s
    for i in sorted(range(len(estimates)), key=times.__getitem__):  # the cheapest first
        rate = estimates[i].mean / times[i]
        if rate > (1.0 + policy.margin) * best_rate:
            best, best_rate, best_t = i, rate, times[i]

    def bar(i: int) -> float:  # the rate at which proposal i would be the choice
        return (1.0 + policy.margin) * best_rate if times[i] >= best_t else best_rate

    for i, (est, t, most) in enumerate(zip(estimates, times, longest, strict=True)):
        if i == best:
            continue
        if est.probing > 0 and _hopeful(est, most, policy) / t > bar(i):
            return i  # a probe under way, which its remaining rows could still win
        if est.unmeasured >= policy.probe_every and most / t > bar(i):
            return i  # a probe: a proposal unmeasured for long that could beat the choice
    return best


def _hopeful(est: AcceptanceEstimate, most: int, policy: SpeculationPolicy) -> float:
    """What the estimate would be if every row still to come in its probe were the longest (`most`
    tokens): a probe ends early once even that cannot make its proposal the choice."""
    return est.mean + (most - est.mean) * est.probing / min(policy.prior_weight + est.weight + est.probing,
                                                             policy.window)


@dataclasses.dataclass(frozen=True)
class BucketChoice:
    """One row of the policy's table, for printing (bench, logs)."""

    bucket: int
    cost: BucketCost | None
    choice: str  # "target-only", or the proposal's label ("chain K=3", "tree 5,4,15")


def format_table(table: Sequence[BucketChoice], estimates: Sequence[tuple[str, AcceptanceEstimate]]) -> str:
    """Plain text: per bucket the target alone's ms, each proposal's ms and break-even L, and the
    choice; then each proposal's L. estimates: (label, estimate) per proposal, in the costs' order."""
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
