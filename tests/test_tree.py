"""Tests for eagle3_jax.runner.tree (EAGLE-2's dynamic tree) and the tree attention of
eagle3_jax.model.layers.

The tree's construction and greedy acceptance are checked against a NumPy transcription of the
EAGLE reference (`topK_genrate` in eagle/model/cnets.py, `evaluate_posterior` in
eagle/model/utils.py), with ties broken towards the lower index (lax.top_k's rule; torch.topk
leaves it unspecified). Sampling is checked statistically (chi-square p-value > 1e-3, fixed
seeds), with a negative control the same test rejects.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from scipy.special import log_softmax

from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import eagle3, layers, llama
from eagle3_jax.runner import sampling as S
from eagle3_jax.runner import tree as T

# --------------------------------------------------------------------------
# NumPy transcription of the reference
# --------------------------------------------------------------------------


def _topk(x, k):
    """torch.topk(x, k) on the last axis, ties to the lower index -> (values, indices)."""
    idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, idx, -1), idx


def ref_topk_generate(logp1, later, steps, top_k, total_tokens):
    """topK_genrate for one row with the draft's log-probs given: logp1 [Vd] at the root,
    later[i] [k, Vd] at the beams of draft forward i. -> dict of the reference's outputs."""
    scores_list, parents_list, ss_token = [], [], []
    topk_p, topk_index = _topk(logp1, top_k)
    scores = topk_p
    scores_list.append(scores[None])
    parents_list.append(np.zeros(1, np.int64))
    ss_token.append(topk_index[None])
    tree_mask_init = np.eye(top_k, dtype=bool)
    tree_mask = tree_mask_init
    beam_masks = []
    topk_cs_index = np.arange(top_k)
    for i in range(steps - 1):  # depth = steps - 1
        beam_masks.append(tree_mask)  # self.tree_mask of this draft forward
        bias1 = top_k if i > 0 else 0
        bias2 = max(0, i - 1)
        bias = 1 + top_k ** 2 * bias2 + bias1
        parents_list.append(topk_cs_index + bias)
        topk_p, topk_index = _topk(later[i], top_k)
        cu_scores = topk_p + scores[:, None]
        topk_cs_p, topk_cs_index = _topk(cu_scores.reshape(-1), top_k)
        scores = topk_cs_p
        out_ids = topk_cs_index // top_k
        ss_token.append(topk_index)
        scores_list.append(cu_scores)
        tree_mask = np.concatenate([tree_mask[out_ids], tree_mask_init], axis=1)

    scores_list = np.concatenate(scores_list, 0).reshape(-1)
    ss_token_list = np.concatenate(ss_token, 0).reshape(-1)
    _, top_scores_index = _topk(scores_list, total_tokens)
    top_scores_index = np.sort(top_scores_index)
    draft_tokens = ss_token_list[top_scores_index]
    draft_parents = np.concatenate(parents_list)[top_scores_index // top_k]
    mask_index = np.searchsorted(top_scores_index, draft_parents - 1, side="left")
    closed = (draft_parents == 0) | (top_scores_index[np.minimum(mask_index, total_tokens - 1)] == draft_parents - 1)
    mask_index[draft_parents == 0] = -1
    mask_index = mask_index + 1
    tree_mask = np.eye(total_tokens + 1, dtype=bool)
    tree_mask[:, 0] = True
    for i in range(total_tokens):
        tree_mask[i + 1] |= tree_mask[mask_index[i]]
    tree_position_ids = tree_mask.sum(1) - 1

    noleaf_index = np.unique(mask_index)
    retrieve = []
    for i in range(total_tokens + 1):
        if i not in noleaf_index:
            path = [-1] * (tree_position_ids.max() + 1)
            cid = i
            for j in reversed(range(tree_position_ids[i] + 1)):
                path[j] = cid
                cid = mask_index[cid - 1]
            retrieve.append(path)
    return dict(draft_tokens=draft_tokens, mask_index=mask_index, tree_mask=tree_mask,
                position_ids=tree_position_ids, retrieve=np.array(retrieve), closed=closed, beam_masks=beam_masks)


def ref_evaluate_posterior_greedy(tokens, retrieve, target_ids):
    """evaluate_posterior without a logits processor, for one row: tokens [T+1] (root first),
    retrieve [leaves, depth+1], target_ids [T+1] (argmax of the tree's logits)
    -> (best_candidate, accept_length, next token)."""
    candidates = np.concatenate([tokens, [-1]])[retrieve]  # draft_tokens padded with -1
    argmax = target_ids[retrieve]  # logits[0, retrieve_indices] (-1 reads the last, as torch does)
    posterior_mask = (candidates[:, 1:] == argmax[:, :-1]).astype(int)
    accept_lengths = np.cumprod(posterior_mask, axis=1).sum(axis=1)
    accept_length = accept_lengths.max()
    best = 0 if accept_length == 0 else int(np.argmax(accept_lengths))
    return best, int(accept_length), int(argmax[best, accept_length])


# --------------------------------------------------------------------------
# Shared compiled functions
# --------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="spec")
def build(spec, logp1, later, root):
    """The tree from given draft log-probs: logp1 [B, Vd], later [B, steps-1, k, Vd]
    -> (Tree, each draft forward's (tokens, positions, TreeAttention))."""
    cand = T.first_level(spec, T.top_children(logp1, spec.top_k))
    forwards = []
    for level in range(2, spec.steps + 1):
        forwards.append(T.draft_attention(spec, cand, level - 1, jnp.full(root.shape, 100)))
        cand = T.next_level(spec, cand, level, T.top_children(later[:, level - 2], spec.top_k))
    return T.select(spec, cand, root), forwards


@functools.partial(jax.jit, static_argnames="spec")
def grow(spec, draft_logp, root):
    """The tree of a draft whose log-probs after a node depend on its (depth, token): draft_logp
    [depth, token, Vd], root [B] -> Tree."""
    cand = T.first_level(spec, T.top_children(draft_logp[0, root], spec.top_k))
    for level in range(2, spec.steps + 1):
        beams = jnp.take_along_axis(cand.tokens, cand.beams, axis=1)  # [B, k] tokens at depth level-1
        cand = T.next_level(spec, cand, level, T.top_children(draft_logp[level - 1, beams], spec.top_k))
    return T.select(spec, cand, root)


greedy = jax.jit(T.greedy_accept, static_argnames="spec")
sample = jax.jit(T.sample_accept, static_argnames="spec")
verify_chain = jax.jit(S.verify_chain)
greedy_verify = jax.jit(S.greedy_verify)


def random_logp(rng, spec, b, vd, kind="random"):
    """Draft log-probs for every level: random; "ties": multiples of 0.5 down from 0 (many exact
    ties, children scoring as their parent); "masked": random over a few tokens, -inf elsewhere
    (fewer finite children than top_k in places, so -inf scores tie across levels)."""
    shapes = (b, vd), (b, spec.steps - 1, spec.top_k, vd)
    if kind == "ties":
        return tuple((-0.5 * rng.integers(0, 3, shape)).astype(np.float32) for shape in shapes)
    logits = [2 * rng.standard_normal(shape) for shape in shapes]
    if kind == "masked":
        for x in logits:
            x[rng.random(x.shape) < 0.9] = -np.inf
            x[..., 0] = np.maximum(x[..., 0], 0.0)  # every row keeps a finite entry
    return tuple(log_softmax(x, -1).astype(np.float32) for x in logits)


B = 8  # rows of every `build` (one program per spec)
SPECS = [T.TreeSpec(4, 4, 8), T.TreeSpec(5, 4, 15), T.TreeSpec(6, 8, 31), T.TreeSpec.chain(5), T.TreeSpec(1, 3, 2),
         T.TreeSpec(3, 2, 10)]  # the last selects every candidate


# --------------------------------------------------------------------------
# TreeSpec
# --------------------------------------------------------------------------


def test_tree_spec_sizes_and_validation():
    spec = T.TreeSpec(6, 8, 31)
    assert (spec.candidates, spec.verify_width, spec.max_depth, spec.draft_slots) == (8 + 5 * 64, 32, 6, 40)
    assert T.TreeSpec.chain(4) == T.TreeSpec(4, 1, 4) and T.TreeSpec.chain(4).candidates == 4
    assert hash(spec) == hash(T.TreeSpec(6, 8, 31))
    for args, field in [((0, 2, 2), "steps"), ((2, -1, 2), "top_k"), ((2, 2, 2.0), "tokens"), ((True, 2, 2), "steps")]:
        with pytest.raises(ValueError, match=f"^{field} must be a positive int"):
            T.TreeSpec(*args)
    with pytest.raises(ValueError, match="tokens must be at most the 6 candidates of steps=2, top_k=2, got 7"):
        T.TreeSpec(2, 2, 7)


# --------------------------------------------------------------------------
# Construction against the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "ties", "masked"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_tree_matches_the_reference(spec, kind):
    """Tokens, parents, ancestor mask, depths and every draft forward's mask equal topK_genrate's;
    the selection is closed under ancestors, with parents first."""
    rng = np.random.default_rng(spec.steps * 100 + spec.top_k + len(kind))
    b, vd = B, 40
    logp1, later = random_logp(rng, spec, b, vd, kind)
    root = rng.integers(0, vd, b).astype(np.int32)
    tree, forwards = build(spec, logp1, later, root)
    tree = jax.tree.map(np.asarray, tree)
    for row in range(b):
        ref = ref_topk_generate(logp1[row], later[row], spec.steps, spec.top_k, spec.tokens)
        assert ref["closed"].all()
        np.testing.assert_array_equal(tree.tokens[row], np.concatenate([[root[row]], ref["draft_tokens"]]))
        np.testing.assert_array_equal(tree.parent[row], np.concatenate([[-1], ref["mask_index"]]))
        np.testing.assert_array_equal(tree.mask[row], ref["tree_mask"])
        np.testing.assert_array_equal(tree.depth[row], ref["position_ids"])
        for level, (_, _, attn) in enumerate(forwards):
            want = ref["beam_masks"][level]  # [k, k (level + 1)]
            np.testing.assert_array_equal(np.asarray(attn.window_mask)[row, :, :want.shape[1]], want)
            assert not np.asarray(attn.window_mask)[row, :, want.shape[1]:].any()
    assert np.all(tree.parent[:, 1:] < np.arange(1, spec.tokens + 1))  # parents first
    assert np.all(tree.depth[:, 1:] == np.take_along_axis(tree.depth, tree.parent[:, 1:], 1) + 1)
    assert tree.depth.max() <= spec.max_depth


@pytest.mark.parametrize("shape, k", [((2, 16384), 8), ((2, 4, 16384), 4), ((3, 1000), 5), ((1, 49152), 1)])
def test_vocab_top_k_is_lax_top_k(shape, k):
    """The two-stage top-k over a vocabulary gives lax.top_k's values and indices, ties (many, on a
    coarse grid) and rows with fewer finite entries than k included."""
    rng = np.random.default_rng(0)
    x = np.round(rng.standard_normal(shape) * 4).astype(np.float32) / 4
    x[..., 7] = -np.inf
    few = np.full(shape, -np.inf, np.float32)
    few[..., 3] = 0.0
    for values in (x, few):
        got, want = T.vocab_top_k(jnp.asarray(values), k), jax.lax.top_k(jnp.asarray(values), k)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_mask_and_layouts_from_first_principles():
    """The mask marks exactly the nodes met walking up the parents; the verify stores node i at
    length + i and rotates it at length + depth; draft beams of level l sit at t + 1 + (l-1) k + j,
    rotated at t + l, and see their parent beam's slots."""
    spec = SPECS[1]
    rng = np.random.default_rng(3)
    logp1, later = random_logp(rng, spec, B, 40)
    tree, forwards = build(spec, logp1, later, np.zeros(B, np.int32))
    parent, mask = np.asarray(tree.parent), np.asarray(tree.mask)
    for row, i in itertools.product(range(B), range(spec.verify_width)):
        up, seen = i, {i}
        while parent[row, up] >= 0:
            up = parent[row, up]
            seen.add(up)
        assert set(np.flatnonzero(mask[row, i])) == seen
    length = jnp.asarray(rng.integers(0, 50, B), jnp.int32)
    stored, attn = T.verify_attention(tree, length)
    np.testing.assert_array_equal(stored, np.asarray(length)[:, None] + np.arange(spec.verify_width))
    np.testing.assert_array_equal(attn.rope_positions, np.asarray(length)[:, None] + np.asarray(tree.depth))
    np.testing.assert_array_equal(attn.window_start, length)
    for level, (_, stored, attn) in enumerate(forwards, start=1):
        k = spec.top_k
        np.testing.assert_array_equal(stored, 101 + (level - 1) * k + np.arange(k)[None].repeat(B, 0))
        np.testing.assert_array_equal(attn.rope_positions, np.full((B, k), 100 + level))
        np.testing.assert_array_equal(attn.window_start, np.full(B, 101))
        bits = np.asarray(attn.window_mask)
        assert bits.sum(-1).tolist() == [[level] * k] * B  # one slot per ancestor level, and its own
        np.testing.assert_array_equal(bits[:, np.arange(k), (level - 1) * k + np.arange(k)], True)


# --------------------------------------------------------------------------
# Greedy acceptance
# --------------------------------------------------------------------------


def root_path(parent, i):
    """The nodes from the root to node i, by the parent indices [T+1]."""
    return [i] if i == 0 else root_path(parent, parent[i]) + [i]


def _target_ids_following(rng, tree, vocab, follow=0.8):
    """Target argmax after each node: one of the node's children's tokens with probability
    `follow`, else a random token (so paths of every length are accepted)."""
    tokens, parent = np.asarray(tree.tokens), np.asarray(tree.parent)
    out = rng.integers(0, vocab, tokens.shape)
    for row, i in np.ndindex(tokens.shape):
        children = np.flatnonzero(parent[row] == i)
        if children.size and rng.random() < follow:
            out[row, i] = tokens[row, rng.choice(children)]
    return out.astype(np.int32)


@pytest.mark.parametrize("spec", SPECS[:4], ids=str)
def test_greedy_matches_brute_force_and_the_reference(spec):
    rng = np.random.default_rng(spec.tokens)
    b, vd = B, 40
    logp1, later = random_logp(rng, spec, b, vd)
    tree, _ = build(spec, logp1, later, rng.integers(0, vd, b).astype(np.int32))
    target_ids = _target_ids_following(rng, tree, vd)
    n, path, emitted = map(np.asarray, greedy(spec, tree, target_ids))
    tokens, parent = np.asarray(tree.tokens), np.asarray(tree.parent)
    assert len(set(n.tolist())) > 2  # several acceptance lengths exercised
    for row in range(b):
        # brute force: the deepest node whose every node matches the target after its parent
        paths = [root_path(parent[row], i) for i in range(spec.verify_width)]
        good = [p for p in paths if all(tokens[row, c] == target_ids[row, a] for a, c in itertools.pairwise(p))]
        best = max(good, key=len)
        assert n[row] == len(best) - 1
        np.testing.assert_array_equal(path[row], best + [-1] * (spec.max_depth + 1 - len(best)))
        want = [tokens[row, c] for c in best[1:]] + [target_ids[row, best[-1]]]
        np.testing.assert_array_equal(emitted[row], want + [S.PAD_TOKEN] * (spec.max_depth + 1 - len(want)))
        # evaluate_posterior over the reference's leaf paths
        ref = ref_topk_generate(logp1[row], later[row], spec.steps, spec.top_k, spec.tokens)
        cand, length, token = ref_evaluate_posterior_greedy(tokens[row], ref["retrieve"], target_ids[row])
        assert length == n[row] and token == emitted[row, n[row]]
        np.testing.assert_array_equal(ref["retrieve"][cand, :length + 1], best)


@pytest.mark.parametrize("spec", [T.TreeSpec(4, 4, 8), T.TreeSpec(5, 4, 15), T.TreeSpec(3, 2, 10)], ids=str)
def test_top1_accepted_is_what_the_drafts_chain_accepts(spec):
    """A draft and a target whose next token depends on (depth, token): the draft's greedy chain
    from the root is known without any tree, and so is how far the target accepts it. From the
    tree's verify, `top1_accepted` gives exactly that, or less only where the tree left out the
    chain's next token (the lower bound its docstring states)."""
    vd, b = 48, 64
    rng = np.random.default_rng(spec.tokens)
    draft_logp = log_softmax(3 * rng.standard_normal((spec.steps, vd, vd)), -1).astype(np.float32)
    draft_best = draft_logp.argmax(-1)  # [depth, token]: the draft's top-1 after a node
    # the target agrees with the draft's top-1 mostly, else with its second or a random token
    second = np.argsort(-draft_logp, axis=-1, kind="stable")[..., 1]
    pick = rng.random((spec.steps + 1, vd))
    target_next = np.where(pick < 0.6, np.pad(draft_best, ((0, 1), (0, 0))),
                           np.where(pick < 0.9, np.pad(second, ((0, 1), (0, 0))), rng.integers(0, vd, pick.shape)))
    roots = rng.integers(0, vd, b).astype(np.int32)
    tree = grow(spec, draft_logp, roots)
    tokens, parent, depth = (np.asarray(a) for a in (tree.tokens, tree.parent, tree.depth))
    n, path, _ = map(np.asarray, greedy(spec, tree, target_next[depth, tokens].astype(np.int32)))
    got = np.asarray(jax.jit(T.top1_accepted)(tree, path, n))
    exact = 0
    for row in range(b):
        chain, token = [], roots[row]  # the draft's greedy chain and how far the target takes it
        for d in range(spec.steps):
            token = draft_best[d, token]
            chain.append(token)
        accepted = 0
        while accepted < spec.steps and chain[accepted] == target_next[accepted, ([roots[row]] + chain)[accepted]]:
            accepted += 1
        assert got[row] <= min(accepted, n[row])
        assert [tokens[row, i] for i in path[row, 1:got[row] + 1]] == chain[:got[row]]
        if got[row] < accepted:  # the tree left out the chain's next token
            kept = tokens[row, parent[row] == path[row, got[row]]]
            assert chain[got[row]] not in kept
        exact += int(got[row] == accepted)
    assert exact >= b // 2 and len(set(got.tolist())) > 2
    assert np.any(got < n)  # rows whose tree went past the chain, down a later child


def test_chain_is_todays_chain():
    """TreeSpec.chain(K) builds the draft's argmax chain; on a chain, greedy acceptance is
    sampling.greedy_verify's and sampled acceptance, with the chain's q or with none (the point
    mass), is verify_chain's bit for bit, in a batch mixing greedy, one-hot and draft-q rows."""
    k, b, v = 4, 96, 12
    spec = T.TreeSpec.chain(k)
    rng = np.random.default_rng(11)
    logp1, later = random_logp(rng, SPECS[3], B, 40)
    chain, _ = build(SPECS[3], logp1, later, np.zeros(B, np.int32))
    argmax_chain = np.concatenate([logp1.argmax(-1)[:, None], later[:, :, 0].argmax(-1)], 1)
    np.testing.assert_array_equal(chain.tokens[:, 1:], argmax_chain)
    np.testing.assert_array_equal(chain.parent, np.arange(-1, SPECS[3].tokens)[None].repeat(B, 0))

    drafts = rng.integers(0, v, (b, k)).astype(np.int32)
    tree = T.tree_from_parents(jnp.asarray(np.pad(drafts, ((0, 0), (1, 0)))), jnp.arange(-1, k)[None].repeat(b, 0), k)

    # target logits that often agree with the drafts, so that every length is reached
    logits = rng.standard_normal((b, k + 1, v)).astype(np.float32)
    logits[np.arange(b)[:, None], np.arange(k), drafts] += 3.0 * (rng.random((b, k)) < 0.8)
    n, path, emitted = greedy(spec, tree, logits.argmax(-1).astype(np.int32))
    want_n, want_emitted = greedy_verify(logits, drafts)
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(emitted, want_emitted)
    np.testing.assert_array_equal(path, np.where(np.arange(k + 1) <= np.asarray(n)[:, None], np.arange(k + 1), -1))

    q = np.asarray(jax.nn.softmax(jnp.asarray(rng.standard_normal((b, k, v)), jnp.float32), -1))
    params = S.RowSampling(temperature=np.where(np.arange(b) % 3 == 0, 0.0, 0.8).astype(np.float32),
                           top_k=np.full(b, 6, np.int32), top_p=np.full(b, 0.95, np.float32),
                           min_p=np.zeros(b, np.float32), key=rng.integers(0, 2**32, (b, 2), dtype=np.uint32),
                           one_hot=np.arange(b) % 3 == 1, coupled=np.zeros(b, bool))
    node_q = np.concatenate([np.zeros((b, 1, v), np.float32), q], 1)
    all_one_hot = dataclasses.replace(params, one_hot=np.ones(b, bool))  # verify_chain's rule for q None
    for got_q, rows in [(node_q, params), (None, all_one_hot)]:
        want_n, want_emitted = verify_chain(logits, drafts, q, rows)
        got_n, _, got_emitted = sample(spec, tree, logits, rows, rows.key, got_q)
        np.testing.assert_array_equal(got_n, want_n)
        np.testing.assert_array_equal(got_emitted, want_emitted)
        assert len(set(np.asarray(got_n).tolist())) == k + 1


# --------------------------------------------------------------------------
# Lossless sampling
# --------------------------------------------------------------------------

V_STAT, SPEC_STAT, N_STAT, TEMPERATURE = 4, T.TreeSpec(3, 2, 5), 60_000, 0.8


def _markov_target(seed=5):
    """A target whose next-token logits depend on (depth, last token): L [steps+1, V, V]."""
    return (1.2 * np.random.default_rng(seed).standard_normal((SPEC_STAT.steps + 1, V_STAT, V_STAT))).astype(np.float32)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _stat_params(n, seed):
    keys = np.random.default_rng(seed).integers(0, 2**32, (n, 2), dtype=np.uint32)
    return S.RowSampling(temperature=np.full(n, TEMPERATURE, np.float32), top_k=np.zeros(n, np.int32),
                         top_p=np.ones(n, np.float32), min_p=np.zeros(n, np.float32), key=keys,
                         one_hot=np.zeros(n, bool), coupled=np.zeros(n, bool))


def _sequences(tree, n, emitted, markov, seed):
    """The emitted tokens continued by the target alone to steps + 1 tokens -> [N, steps+1]."""
    rng = np.random.default_rng(seed)
    n, emitted, depth = np.asarray(n), np.asarray(emitted).copy(), np.asarray(tree.depth)
    p = _softmax(markov.astype(np.float64) / TEMPERATURE)  # [depth, last token, V]
    for d in range(1, SPEC_STAT.steps + 1):  # emitted[:, d] follows emitted[:, d-1] at depth d
        todo = n < d
        u = rng.random(todo.sum())
        probs = p[d, emitted[todo, d - 1]]
        emitted[todo, d] = (u[:, None] > np.cumsum(probs, -1)).sum(-1)
    assert depth.max() == SPEC_STAT.steps
    return emitted


def _target_only_pvalue(seqs, markov, root):
    """Chi-square of sequences [N, L] against the target's own distribution of L tokens."""
    p = _softmax(markov.astype(np.float64) / TEMPERATURE)
    length = seqs.shape[1]
    probs = np.zeros((V_STAT,) * length)
    for seq in itertools.product(range(V_STAT), repeat=length):
        prev, pr = root, 1.0
        for d, tok in enumerate(seq):
            pr *= p[d, prev, tok]
            prev = tok
        probs[seq] = pr
    counts = np.bincount(np.ravel_multi_index(seqs.T, probs.shape), minlength=probs.size)
    probs = probs.ravel()
    big = probs * len(seqs) >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(probs[big], probs[~big].sum()) * len(seqs)
    return float(stats.chisquare(observed, expected).pvalue)


def _tree_logits(tree, markov):
    """The target's logits after each node: markov[depth, token] -> [B, T+1, V]."""
    return markov[np.asarray(tree.depth), np.asarray(tree.tokens)]


@pytest.fixture(scope="module")
def top_k_tree():
    """One deterministic top-k tree (depth 3) from a draft unlike the target, repeated over N_STAT
    rows -> (markov, root, rows, q [N, T+1, V]: the draft's distribution after each node's parent)."""
    markov, root = _markov_target(), 2
    rng = np.random.default_rng(0)
    draft = markov + 1.5 * rng.standard_normal(markov.shape).astype(np.float32)  # draft logits by (depth, token)
    tree = grow(SPEC_STAT, log_softmax(draft, -1).astype(np.float32), np.array([root], np.int32))
    parent = np.maximum(np.asarray(tree.parent[0]), 0)
    q = _softmax(draft[np.asarray(tree.depth[0])[parent], np.asarray(tree.tokens[0])[parent]] / TEMPERATURE)
    rows = jax.tree.map(lambda x: np.repeat(np.asarray(x), N_STAT, 0), tree)
    return markov, root, rows, np.broadcast_to(q.astype(np.float32), (N_STAT, *q.shape))


def test_sampling_on_a_top_k_tree_is_lossless(top_k_tree):
    markov, root, rows, _ = top_k_tree
    params = _stat_params(N_STAT, seed=1)
    n, path, emitted = sample(SPEC_STAT, rows, _tree_logits(rows, markov), params, params.key)
    assert np.bincount(np.asarray(n), minlength=4).min() > 1000  # every length reached
    assert np.all(np.asarray(emitted)[np.arange(4)[None] > np.asarray(n)[:, None]] == S.PAD_TOKEN)
    seqs = _sequences(rows, n, emitted, markov, seed=2)
    assert _target_only_pvalue(seqs, markov, root) > 1e-3


def test_draft_q_on_a_top_k_tree_is_biased(top_k_tree):
    """Negative control: accepting with the draft's own q at nodes that were chosen by top-k, not
    drawn from q, changes the distribution; the same test rejects it."""
    markov, root, rows, node_q = top_k_tree
    params = _stat_params(N_STAT, seed=1)
    n, _, emitted = sample(SPEC_STAT, rows, _tree_logits(rows, markov), params, params.key, node_q)
    assert _target_only_pvalue(_sequences(rows, n, emitted, markov, seed=2), markov, root) < 1e-6


def test_sampling_siblings_drawn_without_replacement_is_lossless():
    """A fixed tree shape whose children are drawn one by one without replacement from the
    draft's q, accepted with node_q = q with the earlier siblings zeroed: lossless. On the same
    rows, the point-mass rule (node_q None) agrees with an explicit one-hot node_q."""
    markov, root = _markov_target(), 1
    parent = np.array([-1, 0, 0, 1, 1, 3])  # two children at the root and at node 1, a depth-3 leaf
    depth = np.array([0, 1, 1, 2, 2, 3])
    rng = np.random.default_rng(4)
    draft = _softmax((markov + 1.5 * rng.standard_normal(markov.shape)) / TEMPERATURE)  # q by (depth, token)
    n_rows, t1 = N_STAT, SPEC_STAT.verify_width
    tokens = np.zeros((n_rows, t1), np.int32)
    tokens[:, 0] = root
    node_q = np.zeros((n_rows, t1, V_STAT), np.float32)
    for i in range(1, t1):
        q = draft[depth[parent[i]], tokens[:, parent[i]]].copy()  # [N, V]
        q[np.arange(n_rows)[:, None], tokens[:, [j for j in range(1, i) if parent[j] == parent[i]]]] = 0
        q /= q.sum(-1, keepdims=True)
        node_q[:, i] = q
        tokens[:, i] = (rng.random(n_rows)[:, None] > np.cumsum(q, -1)).sum(-1).clip(0, V_STAT - 1)
    rows = T.tree_from_parents(jnp.asarray(tokens), jnp.asarray(parent[None].repeat(n_rows, 0)), SPEC_STAT.max_depth)
    rows = jax.tree.map(np.asarray, rows)  # host arrays, as the other tests' rows: the same program
    params = _stat_params(n_rows, seed=5)
    logits = _tree_logits(rows, markov)
    n, _, emitted = sample(SPEC_STAT, rows, logits, params, params.key, node_q)
    assert np.bincount(np.asarray(n), minlength=4).min() > 1000
    assert _target_only_pvalue(_sequences(rows, n, emitted, markov, seed=6), markov, root) > 1e-3

    point = np.asarray(jax.nn.one_hot(tokens, V_STAT))
    a = sample(SPEC_STAT, rows, logits, params, params.key)  # as the first test calls it: one program
    b = sample(SPEC_STAT, rows, logits, params, params.key, point)
    for x, y in zip(a, b):
        assert np.mean(np.all(np.asarray(x).reshape(n_rows, -1) == np.asarray(y).reshape(n_rows, -1), 1)) > 0.999


# --------------------------------------------------------------------------
# Tree attention
# --------------------------------------------------------------------------


def _pages(rng, b, blocks, page, g, hd):
    num_pages = b * blocks + 1
    k, v = (jnp.asarray(rng.standard_normal((num_pages, page, g, hd)), jnp.float32) for _ in range(2))
    table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, blocks), jnp.int32)
    return k, v, table


def test_window_attention_matches_a_dense_reference():
    """Query t of row b sees the keys before window_start[b] and the window keys its mask marks:
    softmax over explicitly masked scores in float64."""
    rng = np.random.default_rng(0)
    b, t, w, g, r, hd, page, blocks = 3, 4, 7, 2, 3, 16, 8, 4
    k_pages, v_pages, table = _pages(rng, b, blocks, page, g, hd)
    q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), jnp.float32)
    start = np.array([5, 0, 20])
    mask = rng.random((b, t, w)) < 0.5
    mask[:, :, 0] = True
    attend = jax.jit(layers.paged_attention)
    out = attend(q, k_pages, v_pages, jnp.zeros((b, t), jnp.int32), table,
                 layers.TreeAttention(None, jnp.asarray(start), jnp.asarray(mask)))
    keys = np.asarray(layers.gather_kv(k_pages, table), np.float64)
    values = np.asarray(layers.gather_kv(v_pages, table), np.float64)
    for row, tok, head in itertools.product(range(b), range(t), range(g * r)):
        offsets = np.arange(blocks * page) - start[row]
        seen = [s for s, o in enumerate(offsets) if o < 0 or (o < w and mask[row, tok, o])]
        scores = keys[row, seen, head // r] @ np.asarray(q[row, tok, head], np.float64) / np.sqrt(hd)
        weights = np.exp(scores - scores.max())
        want = (weights / weights.sum()) @ values[row, seen, head // r]
        np.testing.assert_allclose(np.asarray(out[row, tok, head]), want, rtol=1e-5, atol=1e-5)


def test_causal_window_is_the_causal_path_bit_for_bit():
    """attention_block under a window mask that is the causal one, with RoPE at the storage
    positions, gives today's output and pages exactly."""
    rng = np.random.default_rng(1)
    b, t, g, r, hd, page, blocks, d = 2, 5, 2, 2, 16, 8, 4, 24
    k_pages, v_pages, table = _pages(rng, b, blocks, page, g, hd)
    k_pages, v_pages = k_pages[None], v_pages[None]
    h = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
    wqkv = jnp.asarray(rng.standard_normal((d, g, r + 2, hd)) / np.sqrt(d), jnp.float32)
    wo = jnp.asarray(rng.standard_normal((g * r * hd, d)) / np.sqrt(g * r * hd), jnp.float32)
    positions = jnp.asarray(np.array([[6], [13]]) + np.arange(t), jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    inv_freq = layers.rope_inv_freq(hd, 10000.0, None)
    block = jax.jit(functools.partial(layers.attention_block, layer=0, inv_freq=inv_freq))
    want = block(h, wqkv, wo, positions, k_pages, v_pages, block_table=table)
    got = block(h, wqkv, wo, positions, k_pages, v_pages, block_table=table,
                tree=layers.TreeAttention(positions, positions[:, 0], causal))
    for x, y in zip(got, want):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


TINY = ModelConfig.from_hf({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "tie_word_embeddings": False})
forward = jax.jit(llama.forward, static_argnames="cfg")
draft = jax.jit(eagle3.draft_forward, static_argnames="cfg")


def test_tree_verify_equals_each_path_run_alone_and_the_moved_kv_serves_the_next_step():
    """The target's forward over a tree (verify_attention) gives, at every node, the logits of a
    causal forward over the context and the node's root path. After accepting the deepest path,
    accepted_kv_moves + move_kv leave the cache as that causal forward left it: the next step's
    logits agree."""
    cfg, spec = TINY, SPECS[0]
    rng = np.random.default_rng(2)
    # Weights of std 0.5 (attention far from uniform), unit norm gains.
    shapes = jax.eval_shape(lambda: llama.init_params(cfg, jax.random.PRNGKey(0), jnp.float32))
    params = jax.tree.map(lambda s: np.ones(s.shape, np.float32) if s.ndim == 1
                          else (0.5 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    width = spec.max_depth + 2  # every causal call: a root path and one token more, padded
    page, blocks, context = 4, 6, width
    cache = llama.KVCache.zeros(cfg.num_layers, blocks + 1, page, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    table = jnp.arange(1, blocks + 1)[None]

    def causal(tokens, start, cache):  # -> (logits [width, V], cache)
        padded = jnp.asarray([list(tokens) + [0] * (width - len(tokens))], jnp.int32)
        hidden, _, cache = forward(params, cfg, padded, start + jnp.arange(width)[None], cache, table)
        return np.asarray(llama.logits(params, hidden))[0], cache

    _, cache = causal(rng.integers(0, cfg.vocab_size, context), 0, cache)  # the context
    logp1, later = random_logp(rng, spec, B, 40)
    tree, _ = build(spec, logp1, later, jnp.full((B,), 7, jnp.int32))
    tree = jax.tree.map(lambda x: x[:1], tree)
    length = jnp.asarray([context])
    stored, attn = T.verify_attention(tree, length)
    hidden, _, tree_cache = forward(params, cfg, tree.tokens, stored, cache, table, tree=attn)
    tree_logits = np.asarray(llama.logits(params, hidden))[0]

    tokens, parent, depth = (np.asarray(x)[0] for x in (tree.tokens, tree.parent, tree.depth))
    for i in range(spec.verify_width):
        want, _ = causal(tokens[root_path(parent, i)], context, cache)
        np.testing.assert_allclose(tree_logits[i], want[depth[i]], rtol=2e-5, atol=2e-5)
    assert np.ptp(tree_logits, axis=0).max() > 1.0  # the nodes' logits differ: the masks matter

    deepest = int(np.argmax(depth))
    n, nxt = depth[deepest], 11
    path = np.array(root_path(parent, deepest) + [-1] * (spec.max_depth - n))[None]
    src, dst = T.accepted_kv_moves(jnp.asarray(path), length)
    moved = llama.KVCache(*(layers.move_kv(pages, src, dst, table) for pages in (tree_cache.k, tree_cache.v)))
    want, _ = causal(list(tokens[root_path(parent, deepest)]) + [nxt], context, cache)
    got, _ = causal([nxt], context + n + 1, moved)
    np.testing.assert_allclose(got[0], want[n + 1], rtol=2e-5, atol=2e-5)


def test_draft_levels_equal_each_beam_drafted_alone():
    """The draft's tree levels (draft_attention, hidden input from beam_parents) give every beam
    the hidden state a chain drafted along the beam's root path gets, one token a step."""
    spec = T.TreeSpec(3, 2, 4)
    dcfg = DraftConfig.like_target(TINY, draft_vocab_size=48)
    rng = np.random.default_rng(6)
    shapes = jax.eval_shape(lambda: eagle3.init_draft_params(dcfg, jax.random.PRNGKey(0), jnp.float32))
    dparams = jax.tree.map(lambda s: np.zeros(s.shape, np.int32) if s.dtype == jnp.int32 else (
        np.ones(s.shape, np.float32) if s.ndim == 1 else (0.5 * rng.standard_normal(s.shape)).astype(np.float32)),
        shapes)
    embed = (0.5 * rng.standard_normal((TINY.vocab_size, dcfg.hidden_size))).astype(np.float32)
    page, blocks, t = 4, 4, 5  # the context is positions 0..t, the root's hidden state at t
    cache = llama.KVCache.zeros(1, blocks + 1, page, dcfg.num_kv_heads, dcfg.head_dim, jnp.float32)
    table = jnp.arange(1, blocks + 1)[None]
    for position in range(t + 1):  # one token a call: the chain's program serves the context too
        token = jnp.asarray(rng.integers(0, TINY.vocab_size, (1, 1)), jnp.int32)
        h_given = jnp.asarray(rng.standard_normal((1, 1, dcfg.hidden_size)), jnp.float32)
        root_h, cache = draft(dparams, dcfg, embed, token, h_given, jnp.asarray([[position]]), cache, table)
    children = jax.jit(lambda h: T.top_children(eagle3.draft_logits(dparams, dcfg, h), spec.top_k, normalize=True))

    cand, h, tree_cache = T.first_level(spec, children(root_h[:, 0])), root_h, cache
    beams_h = []  # per level: (beam slots [k], their hidden states [k, H])
    for level in range(1, spec.steps):
        beam_tokens, stored, attn = T.draft_attention(spec, cand, level, jnp.asarray([t]))
        h_in = jnp.take_along_axis(h, cand.beam_parents[:, :, None], axis=1)  # [1, k, H]
        h, tree_cache = draft(dparams, dcfg, embed, beam_tokens, h_in, stored, tree_cache, table, tree=attn)
        beams_h.append((np.asarray(cand.beams)[0], np.asarray(h)[0]))
        cand = T.next_level(spec, cand, level + 1, children(h))

    parents, cand_tokens = np.asarray(cand.parents)[0], np.asarray(cand.tokens)[0]
    for slots, hs in beams_h:
        for slot, got in zip(slots, hs):
            path = [slot]
            while parents[path[0]] >= 0:
                path.insert(0, parents[path[0]])
            h_step, chain_cache = root_h, cache
            for depth, s in enumerate(path, start=1):  # the chain: token at depth d drafted at t + d
                h_step, chain_cache = draft(dparams, dcfg, embed, jnp.asarray([[cand_tokens[s]]]), h_step,
                                            jnp.asarray([[t + depth]]), chain_cache, table)
            np.testing.assert_allclose(got, np.asarray(h_step)[0, 0], rtol=2e-5, atol=2e-5)
