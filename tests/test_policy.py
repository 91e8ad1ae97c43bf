"""engine/policy.py: the speculate-or-not rule per batch bucket, the acceptance estimate it reads,
probing, and the printed table. Pure Python: no device, no compile."""

from __future__ import annotations

import dataclasses

import pytest

from eagle3_jax.engine.policy import (
    AcceptanceEstimate,
    BucketChoice,
    BucketCost,
    SpeculationPolicy,
    format_table,
    observe,
    pays,
    speculate,
)

# Binary-exact seconds, so ties are ties: break-even L = 0.375 / 0.25 = 1.5.
COST = BucketCost(target_only_s=0.25, speculative_s=0.375)


def test_bucket_cost_break_even_and_validation():
    assert COST.break_even == 1.5
    assert BucketCost(0.002, 0.005).break_even == pytest.approx(2.5)
    for t0, tk in [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0), (1.0, -2.0)]:
        with pytest.raises(ValueError, match="step costs must be positive seconds"):
            BucketCost(t0, tk)
    with pytest.raises(dataclasses.FrozenInstanceError):
        COST.target_only_s = 1.0


def test_pays_is_strict_at_break_even_and_applies_the_margin():
    assert pays(COST, 1.6)
    assert not pays(COST, 1.5)  # a tie runs the target alone
    assert not pays(COST, 1.4)
    # margin 0.25: L must beat 1.25 x 1.5 = 1.875
    assert not pays(COST, 1.8, margin=0.25)
    assert not pays(COST, 1.875, margin=0.25)
    assert pays(COST, 1.9, margin=0.25)
    # A bucket where speculation costs less than the target alone pays even at L = 1.
    assert pays(BucketCost(0.5, 0.25), 1.0)


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
    with pytest.raises(ValueError, match="shorter"):
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


def test_speculate_measured_bucket_follows_pays_with_the_policy_margin():
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


def test_format_table():
    table = [BucketChoice(2, BucketCost(0.004, 0.005), True), BucketChoice(4, BucketCost(0.0045, 0.009), False),
             BucketChoice(8, None, True)]
    text = format_table(table, AcceptanceEstimate(mean=1.875, rows=42))
    assert text.splitlines() == [
        "bucket  target-only ms  speculative ms  break-even L  choice",
        "     2           4.000           5.000          1.25  speculate",
        "     4           4.500           9.000          2.00  target-only",
        "     8               -               -             -  speculate",
        "acceptance length L = 1.88 (42 row-iterations measured)",
    ]
    prior = format_table([], AcceptanceEstimate.prior(3))
    assert prior.splitlines()[-1] == "acceptance length L = 4.00 (prior, nothing measured yet)"
    assert len(prior.splitlines()) == 2  # header and L
