"""The coupled acceptance rule (runner/sampling.py): Gumbel noise keyed by (seed, position) makes a
seeded request's tokens a function of the prompt and the seed alone. Here, on the sampling math:
the coupled draw has the target's distribution; the noise depends on the key and the position
only; generation with a drafter, chain or tree, gives exactly the target-alone tokens, whatever
the drafter. The engine's version of the last claim is in tests/test_tree_engine.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from test_sampling import chi2_pvalue, ref_filtered

from eagle3_jax.config import TreeSpec
from eagle3_jax.runner import sampling as S
from eagle3_jax.runner import tree as T

V = 7
TEMPERATURE = 0.8


def _rows(n: int, seed: int, temperature: float = TEMPERATURE, top_p: float = 1.0) -> S.RowSampling:
    keys = np.random.default_rng(seed).integers(0, 2**32, (n, 2), dtype=np.uint32)
    return S.RowSampling(temperature=np.full(n, temperature, np.float32), top_k=np.zeros(n, np.int32),
                         top_p=np.full(n, top_p, np.float32), min_p=np.zeros(n, np.float32), key=keys,
                         one_hot=np.zeros(n, bool), coupled=np.ones(n, bool))


def test_the_coupled_draw_has_the_target_distribution():
    """Over many keys, the coupled token at one position is distributed as the filtered p."""
    n = 40_000
    logits = np.random.default_rng(3).normal(size=V).astype(np.float32) * 1.5
    rows = _rows(n, seed=11, top_p=0.9)
    noise = S.coupling_noise(rows.key, np.full(n, 17, np.int32), V)
    tokens = np.asarray(jax.jit(S.sample_logits)(np.broadcast_to(logits, (n, V)), rows, rows.key, noise))
    assert chi2_pvalue(tokens, ref_filtered(logits, TEMPERATURE, 0, 0.9, 0.0)) > 1e-3
    # The same draws under another temperature would fail: the test has power.
    assert chi2_pvalue(tokens, ref_filtered(logits, 1.3, 0, 0.9, 0.0)) < 1e-6


def test_coupling_noise_is_a_function_of_the_key_and_the_position():
    keys = np.random.default_rng(0).integers(0, 2**32, (3, 2), dtype=np.uint32)
    index = np.array([[5, 6, 9], [5, 5, 5], [0, 1, 2]], np.int32)
    noise = np.asarray(S.coupling_noise(keys, index, V))  # [3, 3, V]
    assert noise.shape == (3, 3, V)
    for b in range(3):
        for t in range(3):  # the same noise computed alone, or in another arrangement
            alone = np.asarray(S.coupling_noise(keys[b:b + 1], index[b:b + 1, t], V))[0]
            np.testing.assert_array_equal(noise[b, t], alone)
    np.testing.assert_array_equal(noise[1, 0], noise[1, 2])  # same key, same position
    assert not np.allclose(noise[0, 0], noise[0, 1])  # another position
    assert not np.allclose(noise[0, 0], noise[1, 0])  # another key
    # Standard Gumbel: mean Euler's gamma, variance pi^2 / 6; neighbouring tokens and positions
    # uncorrelated (the per-token hash, not a sequence).
    wide = np.asarray(S.coupling_noise(keys, np.arange(12, dtype=np.int32).reshape(3, 4), 8192)).reshape(12, 8192)
    assert abs(wide.mean() - np.euler_gamma) < 0.01 and abs(wide.var() - np.pi**2 / 6) < 0.03
    assert abs(np.corrcoef(wide[:, :-1].ravel(), wide[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(wide[:-1].ravel(), wide[1:].ravel())[0, 1]) < 0.01


# ---- generation: with any drafter, exactly the target alone's tokens -------------------------------
def _markov(seed: int, scale: float) -> np.ndarray:
    """Next-token logits that depend on the last token: [V, V]."""
    return (scale * np.random.default_rng(seed).standard_normal((V, V))).astype(np.float32)


@jax.jit
def _draft_choice(logits: jax.Array, rows: S.RowSampling, position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The coupled proposal for the token at `position` [1]: draft logits [1, V] -> (token [1], q [1, V])."""
    probs = S.filtered_probs(logits, rows.temperature, rows.top_k, rows.top_p, rows.min_p)
    return S.coupled_ids(probs, S.coupling_noise(rows.key, position, V)), probs


@jax.jit
def _verify(logits: jax.Array, drafts: jax.Array, q: jax.Array, rows: S.RowSampling, position: jax.Array):
    """The chain verify of logits [1, K+1, V] choosing the tokens at position + 1 .. position + K+1."""
    noise = S.coupling_noise(rows.key, position + 1 + jnp.arange(logits.shape[1])[None], V)
    return S.verify_chain(logits, drafts, q, rows, rows.key, noise)


def _generate(target: np.ndarray, draft: np.ndarray | None, k: int, rows: S.RowSampling, length: int,
              prompt_last: int, position: int) -> tuple[list[int], int]:
    """Tokens after `prompt_last` (at `position`) by chained iterations of K drafts (draft None: the
    target alone), with the engine's position arithmetic: the token chosen by the logits at position
    t sits at t + 1. -> (tokens, drafts accepted)."""
    seq, accepted = [prompt_last], 0
    k = k if draft is not None else 0
    while len(seq) <= length:
        pos = position + len(seq) - 1  # the last token's position
        drafts, q, tok = [], [], seq[-1]
        for j in range(k):  # draft step j proposes the token at pos + 1 + j
            ids, probs = _draft_choice(draft[tok][None], rows, np.array([pos + 1 + j]))
            tok = int(ids[0])
            drafts.append(tok)
            q.append(np.asarray(probs[0]))
        logits = target[np.array([seq[-1], *drafts])][None]  # [1, K+1, V]
        n, emitted = _verify(logits, np.array(drafts, np.int32).reshape(1, k),
                             np.array(q, np.float32).reshape(1, k, V), rows, np.array([pos]))
        n = int(n[0])
        accepted += n
        seq += np.asarray(emitted[0, :n + 1]).tolist()
    return seq[1:length + 1], accepted


def test_chain_generation_with_any_drafter_gives_the_target_alone_tokens():
    target = _markov(1, 1.0)
    rows = _rows(1, seed=21)
    alone, _ = _generate(target, None, 0, rows, 40, prompt_last=3, position=9)
    good = target + 0.3 * _markov(2, 1.0)  # a drafter close to the target
    for draft, k in [(target, 3), (good, 1), (good, 3), (_markov(3, 1.0), 3)]:
        tokens, accepted = _generate(target, draft, k, rows, 40, prompt_last=3, position=9)
        assert tokens == alone
        if draft is target:  # the target as its own drafter: every proposal accepted
            assert accepted == 40 - 40 // (k + 1)
    # Another seed gives other tokens: the seed, not the drafter, decides them.
    assert _generate(target, None, 0, _rows(1, seed=22), 40, 3, 9)[0] != alone


def test_a_tree_accepts_the_coupled_path_and_emits_the_coupled_draw_after_it():
    """A tree holding the target's coupled draws as a root path on a side branch, each node's other
    children different: the row accepts exactly that path, then emits the coupled draw after it."""
    spec = TreeSpec(3, 2, 6)
    depth_logits = (1.3 * np.random.default_rng(4).standard_normal((spec.steps + 1, V))).astype(np.float32)
    rows, length, root = _rows(1, seed=5), 30, 2
    noise = S.coupling_noise(rows.key, length + 1 + np.arange(spec.steps + 1)[None], V)[0]  # [steps+1, V]
    probs = S.filtered_probs(depth_logits, TEMPERATURE, 0, 1.0, 0.0)
    truth = np.asarray(S.coupled_ids(probs, noise)).tolist()  # the target's draw after depth d
    # Nodes: 1 = wrong child of the root, 2 = truth[0], 3 = wrong child of 2, 4 = truth[1] under 2,
    # 5 = truth[2] under 4, 6 = a child of 1 that equals truth[1] (not on the path: never taken).
    wrong = [(t + 1) % V for t in truth]
    tokens = [root, wrong[0], truth[0], wrong[1], truth[1], truth[2], truth[1]]
    parent = [-1, 0, 0, 2, 2, 4, 1]
    tree = T.tree_from_parents(np.array([tokens], np.int32), np.array([parent], np.int32), spec.max_depth)
    depth = np.asarray(tree.depth[0])
    logits = depth_logits[depth][None]  # [1, T+1, V]: the target's logits after each node
    node_noise = S.coupling_noise(rows.key, (length + 1 + depth)[None], V)
    accept = jax.jit(T.sample_accept, static_argnums=0)
    n, path, emitted = accept(spec, tree, logits, rows, rows.key, noise=node_noise)
    assert int(n[0]) == 3
    assert np.asarray(path[0]).tolist() == [0, 2, 4, 5]
    assert np.asarray(emitted[0]).tolist() == truth
