"""Tests for eagle3_jax.runner.sampling and eagle3_jax.sampling_params.

The statistical tests are deterministic (fixed seeds).  Positive tests require
chi-square p-values > 1e-3; negative controls show that the same test, with the
same sample sizes, rejects 5%-size distortions.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from eagle3_jax.runner import sampling as S
from eagle3_jax.sampling_params import SamplingParams

# --------------------------------------------------------------------------
# NumPy reference
# --------------------------------------------------------------------------


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ref_filtered(logits, temperature, top_k, top_p, min_p):
    """Straightforward float64 reference for one row (argsort based, no ties)."""
    logits = np.asarray(logits, np.float64)
    V = logits.shape[-1]
    if temperature == 0:
        out = np.zeros(V)
        out[np.argmax(logits)] = 1.0
        return out
    p = _softmax(logits / temperature)
    order = np.argsort(-p, kind="stable")
    keep = np.ones(V, bool)
    if 0 < top_k < V:
        keep[:] = False
        keep[order[:top_k]] = True
    if top_p < 1.0:
        p1 = np.where(keep, p, 0.0)
        p1 /= p1.sum()
        keep2 = np.zeros(V, bool)
        mass = 0.0
        for idx in order:
            if mass >= top_p or not keep[idx]:
                break
            keep2[idx] = True
            mass += p1[idx]
        keep &= keep2
    if min_p > 0.0:
        p2 = np.where(keep, p, 0.0)
        p2 /= p2.sum()
        keep &= p2 >= min_p * p2.max()
    out = np.where(keep, p, 0.0)
    return out / out.sum()


def chi2_pvalue(tokens, probs, min_expected=5.0):
    """Goodness of fit of integer samples `tokens` to `probs` [V].

    Any sample on a zero-probability token => p-value 0.  Categories with an
    expected count below `min_expected` are pooled into one bin.
    """
    tokens = np.asarray(tokens)
    probs = np.asarray(probs, np.float64)
    n = tokens.size
    assert n > 0
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    assert counts.size == probs.size, "token out of range"
    if counts[probs == 0].sum() > 0:
        return 0.0
    nz = probs > 0
    counts, probs = counts[nz], probs[nz] / probs[nz].sum()
    expected = n * probs
    small = expected < min_expected
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    if counts.size < 2:
        return 1.0
    return float(stats.chisquare(counts, expected).pvalue)


# --------------------------------------------------------------------------
# filtered_probs
# --------------------------------------------------------------------------

FILTER_COMBOS = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.8, 0, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.6, 0, 1.0, 0.5),
    (0.9, 10, 0.8, 0.02),
    (1.2, 20, 0.95, 0.05),
    (0.0, 7, 0.5, 0.2),  # greedy: filters ignored
    (2.0, 49, 0.99, 0.0),
    (1.0, 100, 1.0, 0.0),  # top_k > V: off
]


def test_filtered_probs_matches_reference():
    rng = np.random.default_rng(0)
    V = 50
    combos = FILTER_COMBOS * 3
    B = len(combos)
    logits = (rng.normal(size=(B, V)) * 2.5).astype(np.float32)
    t, k, tp, mp = (np.array(c) for c in zip(*combos))
    got = np.asarray(
        jax.jit(S.filtered_probs)(
            logits, t.astype(np.float32), k.astype(np.int32), tp.astype(np.float32), mp.astype(np.float32)
        )
    )
    for b in range(B):
        want = ref_filtered(logits[b], t[b], k[b], tp[b], mp[b])
        np.testing.assert_allclose(got[b], want, atol=2e-6, rtol=1e-4, err_msg=str(combos[b]))
        assert np.array_equal(got[b] > 0, want > 0), combos[b]
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_filtered_probs_known_values():
    # p = [0.5, 0.25, 0.15, 0.1]
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]] * 8, np.float32))
    t = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 1.0], np.float32)
    k = np.array([0, 2, 0, 0, 0, 0, 0, 3], np.int32)
    tp = np.array([1.0, 1.0, 0.7, 0.5, 1.0, 1.0, 1.0, 0.8], np.float32)
    mp = np.array([0.0, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0], np.float32)
    got = np.asarray(S.filtered_probs(logits, t, k, tp, mp))
    want = np.array(
        [
            [0.5, 0.25, 0.15, 0.1],  # no filter
            [2 / 3, 1 / 3, 0, 0],  # top-k 2
            [2 / 3, 1 / 3, 0, 0],  # top-p 0.7: mass before 3rd = 0.75 >= 0.7
            [1.0, 0, 0, 0],  # top-p 0.5: mass before 2nd = 0.5, not < 0.5
            [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0],  # min-p 0.3: p >= 0.15
            np.array([0.25, 0.0625, 0.0225, 0.01]) / 0.345,  # T = 0.5: p^2
            [1.0, 0, 0, 0],  # greedy
            # top-k 3 -> [.5,.25,.15]/.9 ; top-p 0.8 on that: mass before 3rd
            # = .75/.9 = .833 >= .8 -> keep 2
            [2 / 3, 1 / 3, 0, 0],
        ]
    )
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_filtered_probs_ties_and_greedy_ties():
    logits = np.array([[1.0, 3.0, 3.0, 3.0, 0.0], [3.0, 1.0, 3.0, 0.0, 3.0]], np.float32)
    # top-k 2 with a 3-way tie at the threshold: all tied tokens kept (documented).
    got = np.asarray(S.filtered_probs(logits[:1], 1.0, 2, 1.0, 0.0))
    np.testing.assert_allclose(got[0], [0, 1 / 3, 1 / 3, 1 / 3, 0], atol=1e-6)
    # greedy: first index on ties, like jnp.argmax.
    got = np.asarray(S.filtered_probs(logits, 0.0, 0, 1.0, 0.0))
    np.testing.assert_array_equal(got, [[0, 1, 0, 0, 0], [1, 0, 0, 0, 0]])


def test_filtered_probs_broadcasting_3d():
    rng = np.random.default_rng(1)
    B, T, V = 3, 4, 16
    logits = rng.normal(size=(B, T, V)).astype(np.float32) * 2
    t = np.array([0.0, 0.8, 1.0], np.float32)[:, None]  # [B, 1]
    k = np.array([0, 5, 0], np.int32)[:, None]
    tp = np.array([1.0, 1.0, 0.6], np.float32)[:, None]
    mp = np.array([0.0, 0.0, 0.05], np.float32)[:, None]
    got = np.asarray(S.filtered_probs(logits, t, k, tp, mp))
    assert got.shape == (B, T, V)
    for b in range(B):
        for i in range(T):
            want = ref_filtered(logits[b, i], t[b, 0], k[b, 0], tp[b, 0], mp[b, 0])
            np.testing.assert_allclose(got[b, i], want, atol=2e-6, rtol=1e-4)


def test_filtered_probs_with_masked_vocab():
    # -inf logits (padded vocabulary) never get mass, also under top-k > #finite.
    logits = np.array([[0.0, 1.0, -np.inf, 2.0, -np.inf]], np.float32)
    got = np.asarray(S.filtered_probs(logits, 1.0, 4, 1.0, 0.0))
    np.testing.assert_allclose(got[0], ref_filtered([0.0, 1.0, -1e30, 2.0, -1e30], 1.0, 0, 1.0, 0.0), atol=1e-6)


# --------------------------------------------------------------------------
# sample / sample_from_uniform
# --------------------------------------------------------------------------


def test_sample_never_draws_zero_probability_and_fits():
    probs = np.array([0.0, 0.3, 0.0, 0.0, 0.5, 0.2, 0.0], np.float32)
    # extreme uniforms, including exactly 0 and the largest float32 below 1
    u = np.array([0.0, 1e-12, 0.3, 0.29999998, 0.8, 0.99999994, np.nextafter(np.float32(1), 0)], np.float32)
    tok = np.asarray(S.sample_from_uniform(np.broadcast_to(probs, (u.size, 7)), u))
    assert np.all(probs[tok] > 0), tok
    assert tok[0] == 1 and tok[-1] == 5
    N = 100_000
    tok = np.asarray(jax.jit(S.sample)(np.broadcast_to(probs, (N, 7)), jax.random.key(3)))
    assert chi2_pvalue(tok, probs) > 1e-3
    # per-row keys
    keys = np.random.default_rng(0).integers(0, 2**32, size=(N, 2), dtype=np.uint32)
    tok = np.asarray(jax.jit(S.sample_rows)(np.broadcast_to(probs, (N, 7)), keys))
    assert chi2_pvalue(tok, probs) > 1e-3


# --------------------------------------------------------------------------
# Statistical losslessness of verify_chain
# --------------------------------------------------------------------------

VERIFY = jax.jit(S.verify_chain)  # shared, so equal shapes compile once

V_STAT = 10
K_STAT = 3
N_STAT = 200_000


def _synthetic(seed=1234):
    """Fixed target logits [K+1, V] and draft distributions q [K, V]."""
    rng = np.random.default_rng(seed)
    tl = rng.normal(size=(K_STAT + 1, V_STAT)) * 0.8
    ql = 0.5 * tl[:K_STAT] + rng.normal(size=(K_STAT, V_STAT)) * 1.2
    return tl.astype(np.float32), _softmax(ql)


def _params(B, temperature, top_k=0, top_p=1.0, min_p=0.0, one_hot=False, seed=0):
    keys = np.random.default_rng(seed).integers(0, 2**32, size=(B, 2), dtype=np.uint32)
    full = lambda v, dt: np.full((B,), v, dt)
    return S.RowSampling(
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        min_p=full(min_p, np.float32),
        key=keys,
        one_hot=full(one_hot, bool),
        coupled=full(False, bool),
    )


def _draw_drafts(q, N, seed):
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(q.shape[1], size=N, p=q[i]) for i in range(q.shape[0])], 1).astype(np.int32)


def _run_chain(cfg, one_hot, *, N=N_STAT, seed=0, q_given=None, fn=None):
    """Draft d_i ~ q_i, verify with q_given (default q).  Returns (n, emitted, p_ref, q)."""
    tl, q = _synthetic()
    drafts = _draw_drafts(q, N, seed + 1)
    q_pass = q if q_given is None else q_given(q)
    target_logits = np.broadcast_to(tl, (N,) + tl.shape)
    draft_probs = np.broadcast_to(q_pass.astype(np.float32), (N,) + q.shape)
    params = _params(N, one_hot=one_hot, seed=seed + 2, **cfg)
    fn = VERIFY if fn is None else fn
    n, emitted = fn(target_logits, drafts, draft_probs, params)
    p_ref = np.stack([ref_filtered(tl[i], **_ref_kw(cfg)) for i in range(K_STAT + 1)])
    return np.asarray(n), np.asarray(emitted), p_ref, q


def _ref_kw(cfg):
    return dict(
        temperature=cfg["temperature"],
        top_k=cfg.get("top_k", 0),
        top_p=cfg.get("top_p", 1.0),
        min_p=cfg.get("min_p", 0.0),
    )


def _position_pvalues(n, emitted, p_ref):
    """p-value of emitted[:, j] | n >= j  ~  p_ref[j], for j = 0..K."""
    out = []
    for j in range(K_STAT + 1):
        reached = n >= j
        out.append(chi2_pvalue(emitted[reached, j], p_ref[j]))
    return out


def _independence_pvalue(a, b):
    """Chi-square test of independence of two token columns."""
    table = np.zeros((V_STAT, V_STAT))
    np.add.at(table, (a, b), 1)
    table = table[table.sum(1) > 0][:, table.sum(0) > 0]
    if min(table.shape) < 2:
        return 1.0
    return float(stats.chi2_contingency(table).pvalue)


STAT_CONFIGS = {
    "T1.0": dict(temperature=1.0),
    "T0.7": dict(temperature=0.7),
    "T1.0_topk4": dict(temperature=1.0, top_k=4),
    "T0.7_topp0.8": dict(temperature=0.7, top_p=0.8),
    "T0.9_topk6_topp0.9_minp0.05": dict(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_q", "one_hot"])
@pytest.mark.parametrize("cfg_name", list(STAT_CONFIGS))
def test_verify_chain_lossless(cfg_name, one_hot):
    cfg = STAT_CONFIGS[cfg_name]
    n, emitted, p_ref, q = _run_chain(cfg, one_hot, seed=100 * list(STAT_CONFIGS).index(cfg_name) + 10 * one_hot)
    N = n.size
    # structure: accepted drafts, then one real token, then PAD
    assert n.min() >= 0 and n.max() <= K_STAT
    pos = np.arange(K_STAT + 1)[None]
    assert np.all((emitted >= 0) == (pos <= n[:, None]))
    assert np.all(emitted[pos > n[:, None]] == S.PAD_TOKEN)
    # every position reached has the target's filtered distribution
    pvals = _position_pvalues(n, emitted, p_ref)
    assert min(pvals) > 1e-3, pvals
    # given position j+1 is reached, its token is independent of the token at j
    for j in range(K_STAT):
        pv = _independence_pvalue(emitted[n >= j + 1, j], emitted[n >= j + 1, j + 1])
        assert pv > 1e-3, (j, pv)
    # acceptance probabilities match theory: alpha_i = sum min(p, q) (draft q)
    # or sum p q (one-hot); P(n >= j) = prod_{i<j} alpha_i
    alpha = (p_ref[:K_STAT] * q).sum(-1) if one_hot else np.minimum(p_ref[:K_STAT], q).sum(-1)
    for j in range(1, K_STAT + 1):
        pj = np.prod(alpha[:j])
        z = ((n >= j).mean() - pj) / math.sqrt(pj * (1 - pj) / N)
        assert abs(z) < 4.5, (j, (n >= j).mean(), pj, z)


@pytest.mark.parametrize("one_hot", [False, True], ids=["draft_q", "one_hot"])
def test_chi2_has_power_against_5pct_distortion(one_hot):
    """Same samples as the positive test, compared with a distribution that is
    distorted by +-5% (relative): rejected at every position (one-hot: at the
    K correction positions; its bonus position is reached by only ~1% of rows
    here, and the bonus path is shared with draft_q)."""
    cfg = STAT_CONFIGS["T1.0"]
    n, emitted, p_ref, _ = _run_chain(cfg, one_hot, seed=10 * one_hot)
    for j in range(K_STAT + (0 if one_hot else 1)):
        sign = np.where(np.argsort(np.argsort(-p_ref[j])) % 2 == 0, 1.0, -1.0)
        distorted = p_ref[j] * (1 + 0.05 * sign)
        distorted /= distorted.sum()
        pv = chi2_pvalue(emitted[n >= j, j], distorted)
        assert pv < 1e-3, (j, pv)


def test_negative_control_scaled_acceptance():
    """Bug: accept with min(1, 1.05 p/q) (and residual (p - q/1.05)^+)."""
    n, emitted, p_ref, _ = _run_chain(STAT_CONFIGS["T1.0"], False, seed=77, q_given=lambda q: q / 1.05)
    pvals = _position_pvalues(n, emitted, p_ref)
    assert min(pvals) < 1e-8, pvals


def test_negative_control_mismatched_q():
    """Bug: verifying with a q that is not the one the drafts came from
    (0.95 q + 0.05 uniform, e.g. a forgotten draft temperature)."""
    n, emitted, p_ref, _ = _run_chain(
        STAT_CONFIGS["T0.7"], False, seed=78, q_given=lambda q: 0.95 * q + 0.05 / q.shape[1]
    )
    pvals = _position_pvalues(n, emitted, p_ref)
    assert min(pvals) < 1e-8, pvals


def test_negative_control_unfiltered_target(monkeypatch):
    """Bug: using the unfiltered target p (temperature only) under top-k/top-p."""
    real = S.filtered_probs

    def unfiltered(logits, temperature, top_k, top_p, min_p):
        return real(logits, temperature, 0, 1.0, 0.0)

    monkeypatch.setattr(S, "filtered_probs", unfiltered)
    fn = jax.jit(lambda *a: S.verify_chain(*a))  # fresh trace
    n, emitted, p_ref, _ = _run_chain(STAT_CONFIGS["T0.7_topp0.8"], True, seed=79, fn=fn)
    pvals = _position_pvalues(n, emitted, p_ref)
    assert max(pvals) < 1e-8, pvals


def test_negative_control_shared_uniforms(monkeypatch):
    """Bug: one acceptance uniform reused for every chain position."""
    real = S.row_uniforms

    def shared(keys, num):
        u_acc, u_samp = real(keys, num)
        return jnp.broadcast_to(u_acc[:, :1], u_acc.shape), u_samp

    monkeypatch.setattr(S, "row_uniforms", shared)
    fn = jax.jit(lambda *a: S.verify_chain(*a))  # fresh trace
    n, emitted, p_ref, _ = _run_chain(STAT_CONFIGS["T1.0"], False, seed=80, fn=fn)
    pvals = _position_pvalues(n, emitted, p_ref)
    assert min(pvals) < 1e-8, pvals


def test_residual_fallback_when_p_equals_q_mass():
    """Unnormalised q = 2p: acceptance 1/2 and residual (p - 2p)^+ = 0 ->
    falls back to p; output still exactly p."""
    cfg = dict(temperature=1.0)
    tl, _ = _synthetic()
    p = np.stack([ref_filtered(tl[i], 1.0, 0, 1.0, 0.0) for i in range(K_STAT)])
    N = 50_000
    drafts = _draw_drafts(p, N, 5)
    n, emitted = VERIFY(
        np.broadcast_to(tl, (N,) + tl.shape),
        drafts,
        np.broadcast_to((2 * p).astype(np.float32), (N,) + p.shape),
        _params(N, seed=6, **cfg),
    )
    n, emitted = np.asarray(n), np.asarray(emitted)
    assert abs((n >= 1).mean() - 0.5) < 0.01
    p_full = np.stack([ref_filtered(tl[i], 1.0, 0, 1.0, 0.0) for i in range(K_STAT + 1)])
    assert min(_position_pvalues(n, emitted, p_full)) > 1e-3


# --------------------------------------------------------------------------
# Greedy rows
# --------------------------------------------------------------------------


def _onehot_logits(argmaxes, V=6):
    lg = np.zeros((len(argmaxes), V), np.float32)
    lg[np.arange(len(argmaxes)), argmaxes] = 5.0
    return lg


def test_greedy_exact_acceptance_lengths():
    # target argmax per position: [3, 1, 4, 2]
    tl = _onehot_logits([3, 1, 4, 2])
    drafts = np.array(
        [
            [0, 1, 4],  # none accepted -> emit 3
            [3, 1, 0],  # 2 accepted -> emit 4
            [3, 1, 4],  # all accepted -> bonus 2
            [3, 0, 4],  # 1 accepted -> emit 1
        ],
        np.int32,
    )
    B = drafts.shape[0]
    target = np.broadcast_to(tl, (B,) + tl.shape).copy()
    # q is garbage for greedy rows and must be ignored
    q = np.full((B, 3, 6), 1 / 6, np.float32)
    params = _params(B, temperature=0.0, seed=3)
    n, emitted = VERIFY(target, drafts, q, params)
    np.testing.assert_array_equal(np.asarray(n), [0, 2, 3, 1])
    np.testing.assert_array_equal(
        np.asarray(emitted), [[3, -1, -1, -1], [3, 1, 4, -1], [3, 1, 4, 2], [3, 1, -1, -1]]
    )
    n2, emitted2 = S.greedy_verify(target, drafts)
    np.testing.assert_array_equal(n2, n)
    np.testing.assert_array_equal(emitted2, emitted)


def test_greedy_rows_exact_in_mixed_batch_and_ties():
    rng = np.random.default_rng(5)
    B, K, V = 64, 4, 32
    target = rng.normal(size=(B, K + 1, V)).astype(np.float32)
    target[0, 0, 7] = target[0, 0, 9] = target[0, 0].max() + 1  # tie -> first index (7)
    g = target.argmax(-1)
    # drafts agree with argmax for a random prefix length, then disagree
    L = rng.integers(0, K + 1, size=B)
    drafts = g[:, :K].copy()
    for b in range(B):
        if L[b] < K:
            drafts[b, L[b]] = (g[b, L[b]] + 1) % V
    drafts[0, 0] = 9  # tied token, but not the first index: rejected
    L[0] = 0
    params = _params(B, temperature=1.0, top_k=5, seed=9)
    temp = params.temperature.copy()
    temp[::2] = 0.0  # even rows greedy, odd rows sampled
    params = S.RowSampling(**{**vars(params), "temperature": temp})
    q = np.full((B, K, V), 1 / V, np.float32)
    n, emitted = VERIFY(target, drafts, q, params)
    n, emitted = np.asarray(n), np.asarray(emitted)
    for b in range(0, B, 2):
        assert n[b] == L[b]
        np.testing.assert_array_equal(emitted[b, : L[b]], g[b, : L[b]])
        assert emitted[b, L[b]] == g[b, L[b]]
        assert np.all(emitted[b, L[b] + 1 :] == S.PAD_TOKEN)
    assert emitted[0, 0] == 7


# --------------------------------------------------------------------------
# Acceptance: draft q vs one-hot
# --------------------------------------------------------------------------


def test_draft_q_accepts_more_than_one_hot():
    rng = np.random.default_rng(11)
    tl = (rng.normal(size=(K_STAT + 1, V_STAT)) * 0.8).astype(np.float32)
    q = _softmax(tl[:K_STAT] + rng.normal(size=(K_STAT, V_STAT)) * 0.2)  # q close to p
    N = 50_000
    drafts = _draw_drafts(q, N, 12)
    args = (np.broadcast_to(tl, (N,) + tl.shape), drafts, np.broadcast_to(q.astype(np.float32), (N,) + q.shape))
    f = VERIFY
    n_q, _ = f(*args, _params(N, temperature=1.0, one_hot=False, seed=13))
    n_1, _ = f(*args, _params(N, temperature=1.0, one_hot=True, seed=13))
    mean_q, mean_1 = float(np.mean(n_q)), float(np.mean(n_1))
    p = _softmax(tl)
    a_q, a_1 = np.minimum(p[:K_STAT], q).sum(-1), (p[:K_STAT] * q).sum(-1)
    theory = lambda a: sum(np.prod(a[:j]) for j in range(1, K_STAT + 1))
    assert mean_q > mean_1 + 0.5, (mean_q, mean_1)
    assert abs(mean_q - theory(a_q)) < 0.05 and abs(mean_1 - theory(a_1)) < 0.05
    # draft_probs=None == one-hot for every row
    n_none, e_none = f(args[0], args[1], None, _params(N, temperature=1.0, one_hot=False, seed=13))
    n_1b, e_1 = f(*args, _params(N, temperature=1.0, one_hot=True, seed=13))
    np.testing.assert_array_equal(n_none, n_1b)
    np.testing.assert_array_equal(e_none, e_1)


# --------------------------------------------------------------------------
# Batch independence, K = 0, host helpers
# --------------------------------------------------------------------------


def test_batch_independence():
    rng = np.random.default_rng(21)
    K, V = 3, 12
    B1, B2 = 8, 13
    t1 = rng.normal(size=(B1, K + 1, V)).astype(np.float32) * 2
    t2 = rng.normal(size=(B2, K + 1, V)).astype(np.float32) * 2
    q1 = _softmax(rng.normal(size=(B1, K, V))).astype(np.float32)
    q2 = _softmax(rng.normal(size=(B2, K, V))).astype(np.float32)
    d1 = rng.integers(0, V, size=(B1, K)).astype(np.int32)
    d2 = rng.integers(0, V, size=(B2, K)).astype(np.int32)
    p1 = _params(B1, temperature=0.9, top_k=6, seed=1)
    p2 = _params(B2, temperature=0.0, seed=2)  # completely different other rows
    p2.temperature[1::2] = 1.3
    p2.top_p[:] = 0.7
    p2.one_hot[::3] = True
    # put row r of batch 1 at index 5 of batch 2
    r, at = 3, 5
    t2[at], q2[at], d2[at] = t1[r], q1[r], d1[r]
    for f in ("temperature", "top_k", "top_p", "min_p", "key", "one_hot"):
        getattr(p2, f)[at] = getattr(p1, f)[r]
    f = VERIFY
    outs_r = []
    for _trial in range(2):
        n1, e1 = f(t1, d1, q1, p1)
        n2, e2 = f(t2, d2, q2, p2)
        assert int(n1[r]) == int(n2[at])
        np.testing.assert_array_equal(e1[r], e2[at])
        outs_r.append(np.asarray(e1[r]))
    # and a batch of one
    n3, e3 = f(t1[r : r + 1], d1[r : r + 1], q1[r : r + 1], jax.tree.map(lambda a: a[r : r + 1], p1))
    np.testing.assert_array_equal(e3[0], outs_r[0])
    # same inputs, different keys -> different draws somewhere
    pm = _params(B2, temperature=1.0, seed=4)
    nm, em = f(np.broadcast_to(t1[r], (B2, K + 1, V)), np.broadcast_to(d1[r], (B2, K)),
               np.broadcast_to(q1[r], (B2, K, V)), pm)
    assert len({tuple(x) for x in np.asarray(em)}) > 1


def test_k_zero_samples_from_p():
    tl, _ = _synthetic()
    N = 50_000
    target = np.broadcast_to(tl[:1], (N, 1, V_STAT))
    n, emitted = VERIFY(
        target, np.zeros((N, 0), np.int32), np.zeros((N, 0, V_STAT), np.float32), _params(N, temperature=0.7, top_k=5)
    )
    assert np.all(np.asarray(n) == 0) and emitted.shape == (N, 1)
    assert chi2_pvalue(np.asarray(emitted)[:, 0], ref_filtered(tl[0], 0.7, 5, 1.0, 0.0)) > 1e-3


def test_sample_logits_and_fold_in():
    tl, _ = _synthetic()
    N = 50_000
    params = _params(N, temperature=0.7, top_p=0.8, seed=8)
    params.temperature[:10] = 0.0
    logits = np.broadcast_to(tl[0], (N, V_STAT))
    keys = S.fold_in_rows(params.key, 1)
    assert keys.shape == (N, 2) and keys.dtype == jnp.uint32
    assert not np.array_equal(np.asarray(keys), params.key)
    tok = np.asarray(jax.jit(S.sample_logits)(logits, params, keys))
    assert np.all(tok[:10] == np.argmax(tl[0]))
    assert chi2_pvalue(tok[10:], ref_filtered(tl[0], 0.7, 0, 0.8, 0.0)) > 1e-3


def test_row_sampling_from_params_and_seed_keys():
    sps = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, seed=123, draft_acceptance="one_hot"),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, seed=5),  # seeded: coupled by default
        SamplingParams(seed=5),  # greedy: no rule applies
        SamplingParams(temperature=0.7, seed=5, draft_acceptance="draft_q"),
    ]
    rs = S.row_sampling_from_params(sps, seeds=[7, 8, None, None, None, None], rng=np.random.default_rng(0))
    np.testing.assert_allclose(rs.temperature, [0.0, 0.8, 1.0, 0.7, 0.0, 0.7])
    np.testing.assert_array_equal(rs.top_k, [0, 50, 0, 0, 0, 0])
    np.testing.assert_allclose(rs.top_p, [1.0, 0.9, 1.0, 1.0, 1.0, 1.0])
    np.testing.assert_allclose(rs.min_p, [0.0, 0.05, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(rs.one_hot, [False, True, False, False, False, False])
    np.testing.assert_array_equal(rs.coupled, [False, False, False, True, False, False])
    assert [sp.acceptance_rule() for sp in sps] == ["draft_q", "one_hot", "draft_q", "coupled", "coupled", "draft_q"]
    # On an engine drafting a tree, unseeded "auto" requests are coupled too; explicit rules stay.
    on_tree = S.row_sampling_from_params(sps, seeds=[7, 8, None, None, None, None], point_mass=True)
    np.testing.assert_array_equal(on_tree.coupled, [False, False, True, True, False, False])
    assert rs.key.shape == (6, 2) and rs.key.dtype == np.uint32
    np.testing.assert_array_equal(rs.key[0], jax.random.key_data(jax.random.key(7)))  # seeds[0]
    np.testing.assert_array_equal(rs.key[1], jax.random.key_data(jax.random.key(123)))  # params seed wins
    np.testing.assert_array_equal(np.asarray(rs.greedy), [True, False, False, False, True, False])
    # pytree round trip
    leaves, tree = jax.tree.flatten(rs)
    assert len(leaves) == 7
    assert isinstance(jax.tree.unflatten(tree, leaves), S.RowSampling)


# --------------------------------------------------------------------------
# SamplingParams validation
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.01), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(draft_acceptance="greedy"), "draft_acceptance"),
        (dict(seed=-1), "seed"),
        (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs must be an int in 0..20"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs=True), "logprobs"),
        (dict(prompt_logprobs=2.0), "prompt_logprobs"),
        (dict(max_tokens=0, logprobs=1), "0 \\(a prefill only\\) needs prompt_logprobs"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_messages_name_value_and_conversions():
    with pytest.raises(ValueError, match=r"temperature.*-0\.5"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p.*1\.5"):
        SamplingParams(top_p=1.5)
    sp = SamplingParams(stop=["a", "bc"], stop_token_ids=[2, 3], temperature=1, top_p=1)
    assert sp.stop == ("a", "bc") and sp.stop_token_ids == (2, 3)
    assert isinstance(sp.temperature, float) and not sp.greedy
    assert SamplingParams().greedy
    assert SamplingParams(top_p=1.0, min_p=1.0, draft_acceptance="one_hot").top_p == 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 0.5  # frozen
