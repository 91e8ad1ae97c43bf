"""engine/speculation.py: the policy per batch bucket as the engine drives it (choice, dispatched,
observe, time_step each step), on a scripted clock: warm-up's costs, each choice's served seconds
per step and each proposal's acceptance per row are injected. The bucket must settle on the choice
that emits the most tokens per second as served, within tens of iterations, whichever warm-up's
costs favoured, and stay there between near-equal choices. Host only: no device, no compile."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from eagle3_jax.config import SpeculationConfig, TreeSpec
from eagle3_jax.engine.speculation import Speculation
from eagle3_jax.runner.speculators import Chain, Tree

TREE, CHAIN = 0, 1  # the engine's order: its tree first, the chain of 4 beside it
BUCKET = 64
ROWS = np.arange(1, BUCKET + 1)  # every slot of the bucket running


def speculation(warm: dict) -> Speculation:
    """The tree (6, 8, 31) and the chain of 4 under "auto" at one bucket, `warm` {choice: seconds}
    as warm-up timed it."""
    cfg = SpeculationConfig(speculator="eagle3", num_speculative_tokens=4, tree=TreeSpec(6, 8, 31),
                            proposals=(Tree(TreeSpec(6, 8, 31), measures_top1_chain=True), Chain(4)), mode="auto",
                            speculative_max_batch=None, step_costs=None, fused_iteration=True)
    spec = Speculation(cfg, (BUCKET,), BUCKET + 1)
    spec.time_buckets(lambda bucket, choice: warm[choice])
    return spec


def draw(choice, lengths: dict, rng) -> tuple[np.ndarray, np.ndarray]:
    """One iteration's (accepted, top1) [B]: each row's accepted drafts with the mean lengths[choice]
    - 1; the tree's top-1 chain measure a lower bound of what the chain accepts (a third of the
    rows fall one short: the tree did not keep the chain's next node)."""
    none = np.full(BUCKET, -1)
    if choice is None:
        return np.zeros(BUCKET, int), none
    chain = rng.binomial(4, (lengths[CHAIN] - 1) / 4, BUCKET)
    if choice == CHAIN:
        return chain, none
    return rng.binomial(6, (lengths[TREE] - 1) / 6, BUCKET), np.maximum(chain - rng.binomial(1, 1 / 3, BUCKET), 0)


def serve(spec: Speculation, served: dict, lengths: dict, steps: int, seed: int = 0, prefills: float = 0.0,
          jitter: float = 0.0, constrained: bool = False) -> tuple[list, list]:
    """`steps` of Engine.step at a full bucket: dispatch the bucket's choice, collect the iteration
    dispatched the step before, and time the step at the served seconds of the iteration it waited
    for (times 1 +- jitter); a share `prefills` of the steps also dispatch a prefill, which leaves
    them untimed; `constrained`: a row of every batch is under a grammar. -> (what each step ran, the
    bucket's choice by the rule, its incumbent, after each)."""
    rng = np.random.default_rng(seed)
    ran, rule, pending = [], [], None
    for _ in range(steps):
        choice = spec.choice(BUCKET, constrained)
        fresh = spec.dispatched(BUCKET, ROWS, choice, constrained)
        waited = choice if pending is None else pending[0]
        if pending is not None:
            spec.observe(*pending)
        pending = (choice, *draw(choice, lengths, rng), fresh)
        seconds = served[waited] * (1 + jitter * rng.uniform(-1, 1))
        spec.time_step(None if rng.random() < prefills else (BUCKET, choice), seconds, constrained)
        ran.append(choice)
        rule.append(spec.timings(constrained).state[BUCKET].incumbent)
    return ran, rule


def settled(rule: list, choice) -> int:
    """The step from which the rule's choice is `choice` to the end."""
    if rule[-1] != choice:
        return len(rule) + 1
    return next((i for i in range(len(rule), 0, -1) if rule[i - 1] != choice), 0)


# Tokens per row per iteration (L): the tree's and the chain's.
LENGTHS = {TREE: 4.0, CHAIN: 2.7}


@pytest.mark.parametrize("prefills", [0.0, 0.4])
def test_a_tree_cheap_in_warm_up_but_dear_as_served_gives_way_to_the_chain(prefills):
    """The measured case at batch 64: warm-up (context 0, no host work) has the tree at 4.0 / 1.5 ms
    against the chain's 2.7 / 1.2 ms, 18% ahead; as served the tree takes 3.3 ms and the chain 1.6,
    which emits 1.4x the tree's tokens per second. The bucket starts on the tree, runs the chain
    within 30 iterations, within 60 when 40% of the steps prefill (untimed), and then stays on it
    but for short probes. With the costs left at warm-up's it would run the tree throughout."""
    warm = {None: 1.0e-3, TREE: 1.5e-3, CHAIN: 1.2e-3}
    served = {None: 1.5e-3, TREE: 3.3e-3, CHAIN: 1.6e-3}
    spec = speculation(warm)
    assert spec.best(BUCKET) == TREE
    ran, rule = serve(spec, served, LENGTHS, 1000, prefills=prefills)
    assert settled(rule, CHAIN) <= (60 if prefills else 30)
    assert ran[100:].count(CHAIN) >= 0.9 * 900
    assert spec.acceptance[CHAIN].rows > 0 and spec.acceptance[CHAIN].mean == pytest.approx(2.7, abs=0.1)
    assert spec.acceptance[TREE].mean == pytest.approx(4.0, abs=0.3)  # its few iterations and the prior
    stuck = speculation(warm)
    stuck.policy = dataclasses.replace(stuck.policy, time_served=False)
    ran, rule = serve(stuck, served, LENGTHS, 300, prefills=prefills)
    assert set(rule[20:]) == {TREE} and ran.count(TREE) >= 0.95 * 300  # the chain: acceptance probes


def test_a_chain_cheap_in_warm_up_gives_way_to_the_tree_faster_as_served():
    """The reverse: warm-up has the chain ahead (2.7 / 1.0 ms against the tree's 4.0 / 2.0), as
    served the tree emits 1.21x the chain's tokens per second (2.2 ms against 1.8): the tree within
    30 iterations, and it stays."""
    warm = {None: 0.8e-3, TREE: 2.0e-3, CHAIN: 1.0e-3}
    served = {None: 1.4e-3, TREE: 2.2e-3, CHAIN: 1.8e-3}
    spec = speculation(warm)
    assert spec.best(BUCKET) == CHAIN
    ran, rule = serve(spec, served, LENGTHS, 1000)
    assert settled(rule, TREE) <= 30
    assert ran[100:].count(TREE) >= 0.9 * 900


def test_batches_under_a_grammar_are_timed_apart_and_settle_on_their_own_choice():
    """Free, the tree emits the most (2.2 ms against the chain's 1.8, as in the test above); under a
    grammar the host computes a mask a node before each verify, and the tree's step takes 6.0 ms
    against the chain's 2.4: constrained batches run the chain within 30 iterations while free ones
    stay on the tree, alternating runs of each kind timing neither with the other's steps."""
    warm = {None: 0.8e-3, TREE: 2.0e-3, CHAIN: 1.0e-3}
    free = {None: 1.4e-3, TREE: 2.2e-3, CHAIN: 1.8e-3}
    masked = {None: 1.9e-3, TREE: 6.0e-3, CHAIN: 2.4e-3}
    spec = speculation(warm)
    serve(spec, free, LENGTHS, 300)
    assert spec.best(BUCKET) == TREE and not spec.constrained.served
    ran, rule = serve(spec, masked, LENGTHS, 300, constrained=True)
    assert settled(rule, CHAIN) <= 30 and ran[60:].count(CHAIN) >= 0.9 * 240
    assert spec.best(BUCKET) == TREE and spec.best(BUCKET, constrained=True) == CHAIN
    for seed in range(6):  # runs of 20 steps of each kind in turn
        serve(spec, free, LENGTHS, 20, seed=seed)
        serve(spec, masked, LENGTHS, 20, seed=seed, constrained=True)
    assert spec.served[BUCKET][TREE].mean < 3e-3 and spec.constrained.served[BUCKET][CHAIN].mean > 2e-3
    assert spec.best(BUCKET) == TREE and spec.best(BUCKET, constrained=True) == CHAIN


def test_rates_are_what_the_rule_compares():
    """`Speculation.rates` (the server's log of each change) gives each choice's tokens a row a second
    from the costs and estimates the rule reads: before serving, warm-up's costs and the priors
    (steps + 1), so the target alone 1 / t0 and each proposal L / t."""
    warm = {None: 1.0e-3, TREE: 2.0e-3, CHAIN: 1.25e-3}
    spec = speculation(warm)
    rates = spec.rates(BUCKET)
    assert rates == pytest.approx({"target-only": 1000.0, spec.label(TREE): 7 / 2.0e-3, spec.label(CHAIN): 5 / 1.25e-3})
    assert max(rates, key=rates.get) == spec.label(spec.best(BUCKET))


def test_near_equal_choices_do_not_flap():
    """The tree 4% ahead of the chain as served (4.0 / 2.85 ms against 2.7 / 2.0), less than the
    margin, every step's time off by up to 5% and 30% of the steps untimed: over 3,000 iterations
    the rule's choice changes at most once after settling (it flips some fifty times when each
    iteration compares the two afresh, cheapest first), and probes take a tenth of the iterations
    at most."""
    warm = {None: 1.0e-3, TREE: 1.6e-3, CHAIN: 1.2e-3}
    served = {None: 1.5e-3, TREE: 2.85e-3, CHAIN: 2.0e-3}
    for seed in range(3):
        ran, rule = serve(speculation(warm), served, LENGTHS, 3000, seed=seed, prefills=0.3, jitter=0.05)
        assert sum(a != b for a, b in itertools.pairwise(rule[100:])) <= 1
        assert sum(r != b for r, b in zip(ran[100:], rule[100:])) <= 0.1 * 2900


def test_the_target_alone_wins_where_speculating_costs_too_much_as_served():
    """Warm-up has both proposals well ahead of the target alone at 1.0 ms; as served each costs
    more than its tokens are worth (the tree 5 ms, the chain 3.5 ms), and the target alone, at the
    1.0 ms of warm-up, emits 1.25x the tree's tokens per second, though the proposals' served
    times price it at 3 ms until it is timed: the bucket runs the target alone within 30 iterations."""
    warm = {None: 1.0e-3, TREE: 1.6e-3, CHAIN: 1.2e-3}
    served = {None: 1.0e-3, TREE: 5.0e-3, CHAIN: 3.5e-3}
    spec = speculation(warm)
    assert spec.best(BUCKET) is not None
    ran, rule = serve(spec, served, LENGTHS, 600)
    assert settled(rule, None) <= 30
    assert ran[100:].count(None) >= 0.9 * 500


def test_the_chain_is_judged_by_its_own_rows_a_tree_only_raising_it_to_its_lower_bound():
    """A tree's verify reports what the chain inside it accepted: a lower bound of the chain's own
    acceptance (a node the tree did not keep ends it). The chain's estimate is what its own
    iterations accepted, from its optimistic prior (5 tokens); the bound replaces neither, and
    raises the estimate only where it is higher."""
    spec = speculation({None: 1.0e-3, TREE: 1.5e-3, CHAIN: 1.2e-3})
    measured = np.ones(4, bool)
    spec.observe(TREE, np.array([3, 3, 2, 4]), np.array([1, 1, 0, 2]), measured)  # the chain inside: L 2
    assert spec.top1[CHAIN].mean == pytest.approx(2.0) and spec.top1[CHAIN].rows == 4 and spec.top1[TREE] is None
    assert spec.acceptance[CHAIN] == spec.own[CHAIN] and (spec.own[CHAIN].mean, spec.own[CHAIN].rows) == (5.0, 0)
    for _ in range(200):  # the chain's own iterations accept 2 a row: L 3, above the bound
        spec.observe(CHAIN, np.full(4, 2), np.full(4, -1), measured)
    assert spec.acceptance[CHAIN].mean == pytest.approx(3.0, abs=0.03) and spec.acceptance[CHAIN].rows == 800
    for _ in range(200):  # easier traffic: the tree finds the chain's top-1 accepting all 4
        spec.observe(TREE, np.full(4, 5), np.full(4, 4), measured)
    assert spec.own[CHAIN].mean == pytest.approx(3.0, abs=0.03)
    assert spec.acceptance[CHAIN].mean == spec.top1[CHAIN].mean > 4.0  # raised to the bound
    assert spec.acceptance[CHAIN].rows == 800  # its own record
