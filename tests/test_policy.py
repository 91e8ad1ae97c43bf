"""engine/policy.py: the rule choosing per batch bucket among the target alone and the drafter's
proposals, the acceptance estimates it reads, probing, and the printed table. Pure Python: no
device, no compile."""

from __future__ import annotations

import dataclasses
import random

import pytest

from eagle3_jax.engine.policy import (
    AcceptanceEstimate,
    BucketChoice,
    BucketCost,
    ServedTime,
    SpeculationPolicy,
    choose,
    format_table,
    observe,
    observe_time,
    served_cost,
)

# Binary-exact seconds, so ties are ties: break-even L = 0.375 / 0.25 = 1.5.
COST = BucketCost(target_only_s=0.25, speculative_s=0.375)


def speculate(cost, est, steps, policy) -> bool:
    """One proposal of `steps`: whether the bucket runs it."""
    return choose(cost, [est], [steps + 1], policy) == 0


def test_bucket_cost_break_even_and_validation():
    assert COST.break_even == (1.5,)
    assert BucketCost(0.25, (0.375,)) == COST  # one proposal's seconds, given bare or as a tuple
    assert BucketCost(0.002, (0.005, 0.003)).break_even == pytest.approx((2.5, 1.5))
    for t0, tk in [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, -2.0), (1.0, (0.5, 0.0)), (1.0, ())]:
        with pytest.raises(ValueError, match="step costs must be positive seconds"):
            BucketCost(t0, tk)
    with pytest.raises(dataclasses.FrozenInstanceError):
        COST.target_only_s = 1.0


def test_one_proposal_is_strict_at_break_even_and_applies_the_margin():
    def runs(length, margin=0.0):
        return speculate(COST, AcceptanceEstimate(mean=length, rows=100), 3, SpeculationPolicy(margin=margin))

    assert runs(1.6)
    assert not runs(1.5)  # a tie runs the target alone
    assert not runs(1.4)
    # margin 0.25: L must beat 1.25 x 1.5 = 1.875
    assert not runs(1.8, margin=0.25)
    assert not runs(1.875, margin=0.25)
    assert runs(1.9, margin=0.25)
    # A bucket where speculation costs less than the target alone pays even at L = 1.
    assert speculate(BucketCost(0.5, 0.25), AcceptanceEstimate(mean=1.0, rows=100), 3, SpeculationPolicy(margin=0.0))


def test_the_fastest_proposal_runs():
    """A tree and a chain: tokens per second L_i / t_i decide, the target alone winning below the margin."""
    cost = BucketCost(0.25, (0.5, 0.375))  # the tree costs 2 decodes, the chain 1.5
    policy = SpeculationPolicy(margin=0.0)
    tree, chain = AcceptanceEstimate(mean=3.2, rows=100), AcceptanceEstimate(mean=2.5, rows=100)
    # Rates: tree 3.2 / 0.5 = 6.4, chain 2.5 / 0.375 = 6.67, the target alone 4: the chain.
    assert choose(cost, [tree, chain], [5, 5], policy) == 1
    tree = AcceptanceEstimate(mean=3.6, rows=100)  # 7.2 beats 6.67: the tree
    assert choose(cost, [tree, chain], [5, 5], policy) == 0
    weak = [AcceptanceEstimate(mean=1.9, rows=100), AcceptanceEstimate(mean=1.4, rows=100)]  # 3.8, 3.73 < 4
    assert choose(cost, weak, [5, 5], policy) is None
    assert choose(cost, [], [], policy) is None  # no drafter: the target alone
    assert choose(None, weak, [5, 5], policy) == 0  # an unmeasured bucket runs the engine's proposal


def test_a_costlier_proposal_must_beat_a_cheaper_one_by_the_margin():
    """The margin holds between proposals as against the target alone: the cheaper wins near-ties."""
    cost = BucketCost(0.25, (0.5, 0.375))  # the tree costs 2 decodes, the chain 1.5
    policy = SpeculationPolicy(margin=0.25)
    chain = AcceptanceEstimate(mean=2.5, rows=100)  # 6.67 > 1.25 x 4: the chain beats the target alone
    # The tree at 7.5 beats the chain by 12.5%, less than the margin: the chain runs.
    assert choose(cost, [AcceptanceEstimate(mean=3.75, rows=100), chain], [5, 5], policy) == 1
    assert choose(cost, [AcceptanceEstimate(mean=3.75, rows=100), chain], [5, 5], SpeculationPolicy(margin=0.0)) == 0
    # At 8.5, 27.5% ahead: the tree.
    assert choose(cost, [AcceptanceEstimate(mean=4.25, rows=100), chain], [5, 5], policy) == 0
    # Order is by cost, not by the engine's order: the cheaper chain listed first changes nothing.
    assert choose(BucketCost(0.25, (0.375, 0.5)), [chain, AcceptanceEstimate(mean=3.75, rows=100)], [5, 5],
                  policy) == 0
    # A probe of the costlier proposal needs an optimistic rate beyond the margin too: the tree's
    # 5 / 0.5 = 10 clears 1.25 x 6.67 = 8.33, a longest of 4 (8) does not.
    stale = AcceptanceEstimate(mean=3.0, rows=100, unmeasured=policy.probe_every)
    assert choose(cost, [stale, chain], [5, 5], policy) == 0
    assert choose(cost, [stale, chain], [4, 5], policy) == 1


def test_prior_is_every_proposal_accepted():
    est = AcceptanceEstimate.prior(3)
    assert (est.mean, est.rows, est.unmeasured) == (4.0, 0, 0)
    assert AcceptanceEstimate.prior(0).mean == 1.0


def test_observe_is_a_running_mean_that_counts_the_prior():
    policy = SpeculationPolicy(prior_weight=8, window=1024)
    est = observe(AcceptanceEstimate.prior(3), [0, 1], [True, True], policy)
    # (8 x 4 + 1 + 2) / 10: the prior weighs 8 row-iterations, then lengths 1 and 2.
    assert est.mean == pytest.approx(3.5)
    assert (est.rows, est.unmeasured) == (2, 0)
    est = observe(est, [3, 3, 2], [True, True, True], policy)
    assert est.mean == pytest.approx((8 * 4 + 1 + 2 + 4 + 4 + 3) / 13)
    assert est.rows == 5


def test_observe_counts_only_measured_rows():
    policy = SpeculationPolicy(prior_weight=1, window=1024)
    est = observe(AcceptanceEstimate.prior(3), [0, 3, 2], [True, False, False], policy)
    assert est.mean == pytest.approx((4 + 1) / 2)
    assert est.rows == 1
    with pytest.raises(ValueError, match="one flag per row"):
        observe(est, [0, 1], [True], policy)  # one flag per row


def test_observe_without_a_measurement_only_advances_unmeasured():
    policy = SpeculationPolicy()
    est = AcceptanceEstimate(mean=2.25, rows=7)
    for i in range(1, 4):
        est = observe(est, [1, 1], [False, False], policy)
        assert (est.mean, est.rows, est.unmeasured) == (2.25, 7, i)
    est = observe(est, [], [], policy)
    assert est.unmeasured == 4
    # A measurement resets the count that probing waits on.
    est = observe(est, [1], [True], policy)
    assert est.unmeasured == 0
    assert est.rows == 8


def test_observe_becomes_a_moving_average_past_the_window():
    policy = SpeculationPolicy(prior_weight=2, window=4)
    est = observe(AcceptanceEstimate.prior(3), [0, 0], [True, True], policy)
    assert est.mean == pytest.approx((2 * 4 + 1 + 1) / 4)  # 2.5: still the running mean (n = 4)
    est = observe(est, [0], [True], policy)
    # n would be 5; capped at the window, the row moves the mean by 1/4 of its error (the running
    # mean would give 11 / 5 = 2.2).
    assert est.mean == pytest.approx(2.5 + (1 - 2.5) / 4)
    for _ in range(200):
        est = observe(est, [2], [True], policy)
    assert est.mean == pytest.approx(3.0)  # follows the traffic, the prior forgotten
    assert est.rows == 203


def test_observe_of_many_rows_equals_one_row_at_a_time():
    """A batch of rows moves the estimate as the same rows one iteration each, also when the batch
    crosses from the running mean into the window's moving average."""
    policy = SpeculationPolicy(prior_weight=2, window=8)
    rows = [1, 1, 1, 0, 3, 1, 2, 2, 0, 3]
    together = observe(AcceptanceEstimate.prior(3), rows, [True] * len(rows), policy)
    one_by_one = AcceptanceEstimate.prior(3)
    for accepted in rows:
        one_by_one = observe(one_by_one, [accepted], [True], policy)
    assert together.mean == pytest.approx(one_by_one.mean)
    assert (together.rows, together.weight) == (one_by_one.rows, one_by_one.weight) == (10, 10)
    # Rows 0..4 (n = 3..7) are a running mean with the prior's 2: (2 x 4 + 2 + 2 + 2 + 1 + 4) / 7;
    # from row 5 n reaches the window, and each row moves the mean by an eighth of its error.
    expected = 19 / 7
    for accepted in rows[5:]:
        expected += (accepted + 1 - expected) / 8
    assert together.mean == pytest.approx(expected)


def test_speculate_measured_bucket_follows_the_policy_margin():
    est = AcceptanceEstimate(mean=1.55, rows=100)
    assert not speculate(COST, est, 3, SpeculationPolicy(margin=0.05))  # 1.55 < 1.05 x 1.5
    assert speculate(COST, est, 3, SpeculationPolicy(margin=0.0))
    assert not speculate(COST, AcceptanceEstimate(mean=1.2, rows=100), 3, SpeculationPolicy(margin=0.0))


def test_speculate_unmeasured_bucket_always_speculates():
    poor = AcceptanceEstimate(mean=1.0, rows=1000)
    assert speculate(None, poor, 3, SpeculationPolicy())
    assert speculate(None, poor, 0, SpeculationPolicy(margin=10.0))


def test_speculate_probes_after_probe_every_unmeasured_iterations():
    policy = SpeculationPolicy(margin=0.05, probe_every=16)
    for unmeasured, want in [(0, False), (15, False), (16, True), (40, True)]:
        est = AcceptanceEstimate(mean=1.0, rows=50, unmeasured=unmeasured)
        assert speculate(COST, est, 3, policy) is want
    # A bucket where even K + 1 accepted tokens cannot pay never probes: break-even 5 > K + 1 = 4.
    hopeless = BucketCost(0.1, 0.5)
    assert not speculate(hopeless, AcceptanceEstimate(mean=1.0, rows=50, unmeasured=10_000), 3, policy)
    # With K = 5, L = 6 would pay there, so it probes.
    assert speculate(hopeless, AcceptanceEstimate(mean=1.0, rows=50, unmeasured=16), 5, policy)


def test_a_proposal_left_unmeasured_is_probed_when_it_could_beat_the_choice():
    cost = BucketCost(0.25, (0.5, 0.375))
    policy = SpeculationPolicy(margin=0.0, probe_every=16)
    chain = AcceptanceEstimate(mean=2.5, rows=500)  # rate 6.67: the choice
    stale_tree = AcceptanceEstimate(mean=3.0, rows=50, unmeasured=16)  # 6.0 now, at most 7 / 0.5 = 14
    assert choose(cost, [stale_tree, chain], [7, 5], policy) == 0
    assert choose(cost, [dataclasses.replace(stale_tree, unmeasured=15), chain], [7, 5], policy) == 1
    # A tree whose every token accepted (3 tokens) could not beat the chain never probes.
    assert choose(cost, [stale_tree, chain], [3, 5], policy) == 1


def test_format_table():
    table = [BucketChoice(2, BucketCost(0.004, (0.005, 0.0045)), "tree 4,4,8"),
             BucketChoice(4, BucketCost(0.0045, (0.009, 0.0054)), "target-only"), BucketChoice(8, None, "tree 4,4,8")]
    text = format_table(table, [("tree 4,4,8", AcceptanceEstimate(mean=1.875, rows=42)),
                                ("chain K=3", AcceptanceEstimate.prior(3))])
    assert text.splitlines() == [
        "bucket  target-only ms  tree 4,4,8 ms / break-even L  chain K=3 ms / break-even L  choice",
        "     2           4.000                  5.000 / 1.25                 4.500 / 1.12  tree 4,4,8",
        "     4           4.500                  9.000 / 2.00                 5.400 / 1.20  target-only",
        "     8               -                             -                            -  tree 4,4,8",
        "tree 4,4,8: acceptance length L = 1.88 (42 row-iterations measured)",
        "chain K=3: acceptance length L = 4.00 (prior, nothing measured yet)",
    ]
    alone = format_table([BucketChoice(2, None, "target-only")], [])
    assert alone.splitlines() == ["bucket  target-only ms  choice", "     2               -  target-only"]


def test_a_stale_estimate_weighs_little_against_a_probe():
    policy = SpeculationPolicy(prior_weight=8, window=1024, probe_every=256, probe_rows=16, stale_weight=32)
    fresh = AcceptanceEstimate(mean=2.9, rows=500)
    stale = dataclasses.replace(fresh, unmeasured=256)
    rows = [3] * 16  # 16 row-iterations of length 4
    # Unmeasured for probe_every iterations: the 500 rows count as 32, so 16 rows of 4 move the mean
    # to (40 x 2.9 + 16 x 4) / 56; fresh, they barely move it: (508 x 2.9 + 16 x 4) / 524.
    moved = observe(stale, rows, [True] * 16, policy)
    assert moved.mean == pytest.approx((40 * 2.9 + 16 * 4) / 56)
    assert (moved.rows, moved.weight, moved.unmeasured, moved.probing) == (516, 48, 0, 0)
    assert observe(fresh, rows, [True] * 16, policy).mean == pytest.approx((508 * 2.9 + 16 * 4) / 524)
    # A never-measured estimate is the prior, not stale: its weight stays 0 and no probe starts.
    prior = dataclasses.replace(AcceptanceEstimate.prior(3), unmeasured=1000)
    assert observe(prior, [1], [True], policy).probing == 0


def test_a_probe_runs_until_probe_rows_are_measured_or_it_cannot_win():
    cost = BucketCost(0.25, (0.5, 0.375))  # tree, chain
    policy = SpeculationPolicy(margin=0.0, probe_every=16, probe_rows=4, stale_weight=8)
    stale, chain = AcceptanceEstimate(mean=3.0, rows=50, unmeasured=16), AcceptanceEstimate(mean=2.5, rows=500)

    def probe(length):  # -> iterations the tree ran, and its estimate after
        tree = stale
        assert choose(cost, [tree, chain], [7, 5], policy) == 0  # the probe starts: the chain is the choice
        tree = observe(tree, [length - 1], [False], policy)  # its first iteration verifies the chain's proposals
        runs = 0
        while choose(cost, [tree, chain], [7, 5], policy) == 0 and runs < 10:
            tree = observe(tree, [length - 1], [True], policy)  # one fresh row an iteration
            runs += 1
        return runs, tree

    # Rows of 5 tokens: the probe measures its rows, and the tree becomes the choice (rate above
    # 6.67): it keeps running, to the loop's cap.
    runs, tree = probe(5)
    assert runs == 10 and tree.probing == 0 and tree.mean / 0.5 > 2.5 / 0.375
    # Rows of 2: after two, even two rows of 7 could not lift it past the chain: the probe ends.
    runs, tree = probe(2)
    assert runs == 2 and tree.probing == 2 and tree.mean < 3.0
    assert choose(cost, [tree, chain], [7, 5], policy) == 1


def _serve(costs: BucketCost, acceptance, iterations: int, policy: SpeculationPolicy,
           estimates) -> tuple[list, list]:
    """One row served `iterations` times as the engine serves it (engine.Engine): the choice, then
    the chosen proposal observed (a row's first iteration after another choice verifies stale
    proposals: unmeasured), the others unmeasured. acceptance(i, proposal) -> tokens emitted.
    -> (choices, estimates)."""
    choices, drafted = [], None
    for i in range(iterations):
        c = choose(costs, estimates, [6, 5], policy)
        fresh = c is not None and drafted == c
        drafted = c
        choices.append(c)
        estimates = [observe(est, [acceptance(i, j) - 1], [fresh and j == c], policy)
                     for j, est in enumerate(estimates)]
    return choices, estimates


def test_a_tree_that_fell_behind_on_hard_requests_is_chosen_again():
    """One row, a tree (5, 4, 15) and a chain of 4 at costs like SmolLM2's at batch 1 on the H200.
    The tree is faster (L 3.6 / 1.46 ms against 2.6 / 1.24) except on a stretch of 3,000
    iterations of hard requests (2.8 against 2.54), where the chain takes over. After it, probes
    measure the tree on the new traffic: with a stale estimate weighing `stale_weight` rows the
    tree is the choice again within two probes. The rule before (a probe of one fresh measurement,
    the estimate weighing all its rows) kept running the chain."""
    costs = BucketCost(1.10e-3, (1.46e-3, 1.24e-3))
    hard, end = range(2000, 5000), 8000

    def acceptance(i, proposal):  # tokens emitted: seeded draws with the stated means
        r = random.Random(2 * i + proposal).random()
        if i in hard:
            cuts = (0.9, 0.6, 0.3) if proposal == 0 else (0.8, 0.5, 0.24)  # 2.8, 2.54
        else:
            cuts = (0.9, 0.75, 0.55, 0.4) if proposal == 0 else (0.8, 0.5, 0.3)  # 3.6, 2.6
        return 1 + sum(r < c for c in cuts)

    estimates = [AcceptanceEstimate.prior(5), AcceptanceEstimate.prior(4)]
    policy = SpeculationPolicy(probe_every=256)
    choices, _ = _serve(costs, acceptance, end, policy, estimates)
    assert choices[1000:2000].count(0) > 900  # the tree (the rest: the chain's probes)
    assert choices[hard.stop - 400:hard.stop].count(1) > 300  # the chain, probing the tree
    assert choices[hard.stop + 512:].count(0) > 0.9 * (end - hard.stop - 512)  # the tree again
    old = dataclasses.replace(policy, probe_rows=1, stale_weight=10**9)
    stuck, _ = _serve(costs, acceptance, end, old, estimates)
    assert stuck[hard.stop + 512:].count(1) > 0.95 * (end - hard.stop - 512)


def test_served_time_is_a_running_mean_then_a_moving_average():
    policy = SpeculationPolicy(served_window=4)
    t = None
    for seconds in (1.0, 2.0, 3.0):
        t = observe_time(t, seconds, policy)
    assert (t.mean, t.samples) == (pytest.approx(2.0), 3)
    t = observe_time(t, 6.0, policy)  # the 4th: still the mean of all
    assert t.mean == pytest.approx(3.0)
    t = observe_time(t, 7.0, policy)  # past the window: weight 1/4
    assert (t.mean, t.samples) == (pytest.approx(4.0), 5)


def test_served_cost_replaces_the_choices_served_and_scales_the_others_alike():
    """A served time replaces its choice's warm-up cost; a choice not served is priced at its
    warm-up cost times the mean ratio served / warm-up of those served, so a served time is never
    weighed against a bare warm-up one."""
    warm = BucketCost(target_only_s=0.010, speculative_s=(0.020, 0.013))

    def seconds(served):  # (t0, t_tree, t_chain)
        cost = served_cost(warm, served)
        return (cost.target_only_s, *cost.speculative_s)

    assert served_cost(warm, {}) == warm
    # The chain served at 0.015 (15/13 of warm-up): the target alone and the tree scaled by 15/13.
    assert seconds({1: ServedTime(0.015, 3)}) == pytest.approx((0.010 * 15 / 13, 0.020 * 15 / 13, 0.015))
    # Two served, ratios 1.2 and 0.8: the chain's warm-up cost as it was (mean ratio 1).
    assert seconds({None: ServedTime(0.012), 0: ServedTime(0.016)}) == pytest.approx((0.012, 0.016, 0.013))
    assert seconds({None: ServedTime(0.012), 0: ServedTime(0.016), 1: ServedTime(0.01)}) == (0.012, 0.016, 0.01)
    # The served times can turn the choice: the tree (L 4) at 20 ms loses to the chain (L 2.7) at
    # 13 ms by warm-up's costs, and wins once serving found it at 16 ms and the chain at 15.
    estimates = [AcceptanceEstimate(mean=4.0, rows=100), AcceptanceEstimate(mean=2.7, rows=100)]
    policy = SpeculationPolicy()
    assert choose(warm, estimates, [7, 5], policy) == 1
    assert choose(served_cost(warm, {0: ServedTime(0.016), 1: ServedTime(0.015)}), estimates, [7, 5], policy) == 0
    # Served alone, the tree at 16 ms (0.8 of warm-up) prices the chain at 0.8 x 13 too: still the chain.
    assert choose(served_cost(warm, {0: ServedTime(0.016)}), estimates, [7, 5], policy) == 1
