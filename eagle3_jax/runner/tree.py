"""EAGLE-2's dynamic draft tree over rows [B], shapes fixed by a static `TreeSpec(steps, top_k, tokens)`,
built as the EAGLE reference's `topK_genrate` (docs/EAGLE3.md, "The speculative loop"). Candidate slots
(k = top_k, N = k + (steps-1) k^2): level by level, beam-major (offset + beam * k + rank). Verify layout
(T = tokens): node 0 the root (the row's last token, at `length`), node i at length + i, rotated at length + depth.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from eagle3_jax.config import TreeSpec
from eagle3_jax.model import pallas_top_k
from eagle3_jax.model.layers import TreeAttention
from eagle3_jax.runner import sampling

Array = jax.Array


class Candidates(NamedTuple):
    """The tree being built. Levels are appended, not written into [B, N] buffers: on the GPU each
    write was a kernel of its own (BENCHMARKS.md, "Trees end to end")."""

    level_tokens: tuple[Array, ...]  # [B, k] at level 1, then [B, k^2] i32 target ids
    level_scores: tuple[Array, ...]
    level_parents: tuple[Array, ...]  # i32 the parent's slot; -1 for the root's children
    beams: Array  # [B, k] i32 slots of the current level's beams, best first
    beam_scores: Array
    beam_parents: Array  # [B, k] i32 the parent beam, whose draft output is the hidden input (level 1: 0)
    beam_masks: Array  # [B, k, W] bool each beam's ancestors and itself among the draft slots

    @property
    def tokens(self) -> Array:
        return jnp.concatenate(self.level_tokens, axis=1)

    @property
    def scores(self) -> Array:
        return jnp.concatenate(self.level_scores, axis=1)

    @property
    def parents(self) -> Array:
        return jnp.concatenate(self.level_parents, axis=1)


VOCAB_CHUNK = 128


def vocab_top_k(x: Array, k: int) -> tuple[Array, Array]:
    """lax.top_k's result over a vocabulary-sized axis, ties included: x [..., V] -> [..., k] each. On
    the GPU lax.top_k walks a row in one block; ranking runs of VOCAB_CHUNK first shares the walk."""
    v = x.shape[-1]
    if v <= 4 * VOCAB_CHUNK or k > VOCAB_CHUNK:
        return lax.top_k(x, k)
    runs = -(-v // VOCAB_CHUNK)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, runs * VOCAB_CHUNK - v)], constant_values=-jnp.inf)
    values, local = lax.top_k(padded.reshape(*x.shape[:-1], runs, VOCAB_CHUNK), k)
    index = local + VOCAB_CHUNK * jnp.arange(runs, dtype=local.dtype)[:, None]
    values, best = lax.top_k(values.reshape(*x.shape[:-1], runs * k), k)
    return values, jnp.take_along_axis(index.reshape(*x.shape[:-1], runs * k), best, axis=-1)


def top_children(x: Array, k: int, normalize: bool = False, kernel: bool = False) -> tuple[Array, Array]:
    """x [..., Vd] (normalize: logits, else log-probs) -> (log-probs, draft ids) [..., k], best first,
    ties to the lower id; kernel: model/pallas_top_k.py's, the logsumexp folded in (the GPU's)."""
    if kernel:
        values, ids, lse = pallas_top_k.top_k(x, k)
        return (values - lse[..., None] if normalize else values), ids
    return vocab_top_k(jax.nn.log_softmax(x, axis=-1) if normalize else x, k)


def _target_ids(ids: Array, d2t: Array | None) -> Array:
    return ids if d2t is None else ids + d2t[ids]


def first_level(spec: TreeSpec, children: tuple[Array, Array], d2t: Array | None = None) -> Candidates:
    """Level 1 from children (log-probs, draft ids) [B, k]; d2t [Vd] i32 offsets to target ids."""
    lp, ids = children
    b, k = lp.shape[0], spec.top_k
    return Candidates(
        level_tokens=(_target_ids(ids, d2t),), level_scores=(lp,), level_parents=(jnp.full((b, k), -1, jnp.int32),),
        beams=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)), beam_scores=lp,
        beam_parents=jnp.zeros((b, k), jnp.int32),
        beam_masks=jnp.broadcast_to(jnp.eye(k, spec.draft_slots, dtype=bool), (b, k, spec.draft_slots)))


def next_level(spec: TreeSpec, cand: Candidates, level: int, children: tuple[Array, Array],
               d2t: Array | None = None, kernel: bool = False) -> Candidates:
    """Level `level` (static, 2..steps) from children [B, k, k] each, row j after beam j; kernel: one
    launch where XLA's top-k sorts, copies and slices."""
    lp, ids = children
    b, k = lp.shape[0], spec.top_k
    scores = (cand.beam_scores[:, :, None] + lp).reshape(b, k * k)  # beam-major, as the slots
    values, best = (pallas_top_k.top_k(scores, k) if kernel else lax.top_k(scores, k))[:2]
    from_beam = best // k
    # A new beam sees what its parent beam saw, and its own draft slot (none at the last level).
    own = jnp.eye(k, spec.draft_slots, (level - 1) * k, dtype=bool)
    masks = jnp.take_along_axis(cand.beam_masks, from_beam[:, :, None], axis=1) | own
    return Candidates(
        level_tokens=(*cand.level_tokens, _target_ids(ids, d2t).reshape(b, k * k)),
        level_scores=(*cand.level_scores, scores),
        level_parents=(*cand.level_parents, jnp.repeat(cand.beams, k, axis=1)),
        beams=k + (level - 2) * k * k + best, beam_scores=values, beam_parents=from_beam, beam_masks=masks)


def draft_attention(spec: TreeSpec, cand: Candidates, level: int,
                    position: Array) -> tuple[Array, Array, TreeAttention]:
    """The draft on level `level`'s beams, position [B] the root's t -> (tokens, KV positions [B, k],
    TreeAttention): beam j stored at t + 1 + (level-1) k + j, rotated at t + level as a chain's."""
    k = spec.top_k
    start = position + 1
    stored = start[:, None] + (level - 1) * k + jnp.arange(k)
    rope = jnp.broadcast_to((position + level)[:, None], stored.shape)
    tokens = jnp.take_along_axis(cand.tokens, cand.beams, axis=1)
    return tokens, stored, TreeAttention(rope, start, cand.beam_masks)


class Tree(NamedTuple):
    """A tree in the verify layout, nodes after their parents: [B, T+1] i32 each, parent -1 at the
    root; mask [B, T+1, T+1] bool, mask[b, i, j] iff j is i or one of its ancestors."""

    tokens: Array
    parent: Array
    depth: Array
    mask: Array


def tree_from_parents(tokens: Array, parent: Array, max_depth: int) -> Tree:
    """tokens, parent [B, T+1] (parent[:, 0] = -1, else parent[:, i] < i) -> Tree."""
    index = jnp.arange(parent.shape[1])
    up = jnp.broadcast_to(index, parent.shape)
    mask = up[:, :, None] == index
    step = jnp.maximum(parent, 0)
    for _ in range(max_depth):
        up = jnp.take_along_axis(step, up, axis=1)
        mask = mask | (up[:, :, None] == index)
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    return Tree(tokens=tokens, parent=parent, depth=depth, mask=mask)


def select(spec: TreeSpec, cand: Candidates, root_token: Array) -> Tree:
    """The `tokens` best candidates in slot order under root_token [B], closed under ancestors (no child
    outscores its parent; ties to the lower slot); ranked by comparisons: no top-k, sort or scatter."""
    scores, t = cand.scores, spec.tokens
    slot = jnp.arange(scores.shape[1])
    ahead = (scores[:, None, :] > scores[:, :, None]) | (
        (scores[:, None, :] == scores[:, :, None]) & (slot[None, :] < slot[:, None]))  # [B, i, j]: j ranks before i
    chosen = jnp.sum(ahead, axis=-1) < t
    index_of = jnp.where(chosen, jnp.cumsum(chosen, axis=1, dtype=jnp.int32), 0)  # slot -> node index 1..T
    pick = index_of[:, None, :] == jnp.arange(1, t + 1)[:, None]
    tokens = jnp.sum(jnp.where(pick, cand.tokens[:, None, :], 0), axis=-1)
    parent_slot = jnp.sum(jnp.where(pick, cand.parents[:, None, :], 0), axis=-1)
    parent = jnp.where(parent_slot < 0, 0, jnp.take_along_axis(index_of, jnp.maximum(parent_slot, 0), axis=1))
    b = root_token.shape[0]
    tokens = jnp.concatenate([root_token[:, None], tokens], axis=1)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    return tree_from_parents(tokens, parent, spec.max_depth)


def verify_attention(tree: Tree, length: Array) -> tuple[Array, TreeAttention]:
    """length [B] the root's position -> (KV positions [B, T+1], the target's TreeAttention)."""
    stored = length[:, None] + jnp.arange(tree.tokens.shape[1])
    return stored, TreeAttention(length[:, None] + tree.depth, length, tree.mask)


def _earlier_siblings(tree: Tree) -> Array:
    """[B, T+1, T+1] bool: j < i share a parent (the root has no siblings)."""
    index = jnp.arange(tree.parent.shape[1])
    same = (tree.parent[:, :, None] == tree.parent[:, None, :]) & (tree.parent[:, :, None] >= 0)
    return same & (index[None, None, :] < index[None, :, None])


def _walk(spec: TreeSpec, tree: Tree, accept: Array) -> tuple[Array, Array]:
    """accept [B, T+1] each node's verdict were it tried -> (num_accepted [B], path [B, steps+1] the
    accepted nodes by depth, -1 past the end). A node counts if no earlier sibling was accepted."""
    first = accept & ~jnp.any(_earlier_siblings(tree) & accept[:, None, :], axis=-1)
    taken = first.at[:, 0].set(True)
    on_path = jnp.all(taken[:, None, :] | ~tree.mask, axis=-1)
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == jnp.arange(spec.max_depth + 1)[:, None])
    path = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), -1).astype(jnp.int32)
    return jnp.sum(on_path, axis=-1, dtype=jnp.int32) - 1, path


def top1_accepted(tree: Tree, path: Array, n: Array) -> Array:
    """What the draft's top-1 chain would have accepted (a first child is the draft's top-1): path, n
    (`_walk`'s) -> [B]; a lower bound where the path ends at a node the tree kept no child of."""
    first = ~jnp.any(_earlier_siblings(tree), axis=-1)
    on_path = jnp.take_along_axis(first, jnp.maximum(path[:, 1:], 0), axis=1)
    within = jnp.arange(path.shape[1] - 1) < n[:, None]
    return jnp.sum(jnp.cumprod(on_path & within, axis=1), axis=1, dtype=jnp.int32)


def _emitted(tree: Tree, path: Array, n: Array, last: Array) -> Array:
    drafts = jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    return sampling.assemble_emitted(drafts, n, last)


def greedy_accept(spec: TreeSpec, tree: Tree, target_ids: Array, valid: Array | None = None
                  ) -> tuple[Array, Array, Array]:
    """target_ids [B, T+1] the argmax after each node; valid [B] (None: all) -> (num_accepted [B],
    path, emitted [B, steps+1]: row b emits emitted[b, :num_accepted[b] + 1])."""
    rows = jnp.arange(target_ids.shape[0])
    wanted = jnp.take_along_axis(target_ids, jnp.maximum(tree.parent, 0), axis=1)
    match = tree.tokens == wanted
    n, path = _walk(spec, tree, match if valid is None else match & jnp.asarray(valid)[:, None])
    return n, path, _emitted(tree, path, n, target_ids[rows, path[rows, n]])


def _one_hot_verdicts(tree: Tree, p: Array, u: Array) -> Array:
    """Point-mass q: after rejecting earlier siblings of mass m, p's residual is p / (1 - m) off
    them, so child c is accepted iff u (1 - m) < p(c). p [B, T+1, V], u [B, T+1] -> [B, T+1]."""
    rows = jnp.arange(p.shape[0])[:, None]
    p_c = p[rows, jnp.maximum(tree.parent, 0), tree.tokens]  # [B, T+1] p(c) after c's parent
    m = jnp.einsum("bij,bj->bi", _earlier_siblings(tree).astype(p.dtype), p_c)
    return u * jnp.maximum(1.0 - m, 0.0) < p_c


def _one_hot_residual(tree: Tree, stop: Array, p_stop: Array, tried: Array) -> Array:
    """p_stop [B, V] at the stop [B], every child rejected: p with their tokens zeroed, unnormalised."""
    b, v = p_stop.shape
    children = ((tree.parent == stop[:, None]) & tried[:, None]).astype(p_stop.dtype)
    zeroed = jnp.zeros((b, v), p_stop.dtype).at[jnp.arange(b)[:, None], tree.tokens].max(children)
    resid = jnp.where(zeroed > 0, 0.0, p_stop)
    return jnp.where(jnp.sum(resid, -1, keepdims=True) >= sampling.RESIDUAL_EPS, resid, p_stop)


def _draft_q_verdicts(spec: TreeSpec, tree: Tree, p: Array, q: Array, u: Array) -> tuple[Array, Array]:
    """Sibling by sibling, all nodes at once: p, q [B, T+1, V], u -> (verdicts, residuals [B, T+1, V])."""
    b, t1, _ = p.shape
    rows, index = jnp.arange(b)[:, None], jnp.arange(t1)
    parent = jnp.maximum(tree.parent, 0)
    rank = jnp.sum(_earlier_siblings(tree), axis=-1)
    q_c = q[rows, index, tree.tokens]
    resid, mass = p, jnp.ones((b, t1), p.dtype)  # residual after each node and its mass (1: p itself)
    verdicts = jnp.zeros((b, t1), bool)
    for r in range(spec.top_k):
        # u < resid(c) / (mass q_c(c)): the chain's test u q < p when mass is 1.
        ok = u * q_c * mass[rows, parent] < resid[rows, parent, tree.tokens]
        child = (rank == r) & (tree.parent >= 0)
        verdicts = jnp.where(child, ok, verdicts)
        is_rth = child[:, None, :] & (parent[:, None, :] == index[:, None])  # [B, node, child]
        has = jnp.any(is_rth, axis=-1)
        q_r = jnp.take_along_axis(q, jnp.argmax(is_rth, axis=-1)[:, :, None], axis=1)
        new = jnp.maximum(resid - mass[:, :, None] * q_r, 0.0)
        new_mass = jnp.sum(new, axis=-1)
        keep = has & (new_mass >= sampling.RESIDUAL_EPS * mass)
        resid = jnp.where(keep[:, :, None], new, resid)
        mass = jnp.where(keep, new_mass, mass)
    return verdicts, resid


def sample_accept(spec: TreeSpec, tree: Tree, target_logits: Array, params: sampling.RowSampling,
                  keys: Array, node_q: Array | None = None, noise: Array | None = None,
                  valid: Array | None = None) -> tuple[Array, Array, Array]:
    """SpecInfer's rule: try a node's children in order, accept c with probability min(1, p(c) / q_c(c)),
    else p <- norm((p - q_c)^+). Lossless if q_c is what c was drawn from given its earlier siblings: on
    `select`'s top-k tree the point mass (node_q None, the reference's); the draft's q would bias it.
    target_logits, node_q, noise [B, T+1, V]; node i takes verify_chain's uniform for proposal i-1
    (a chain gets its verdicts bit for bit); valid as verify_chain's -> as `greedy_accept`."""
    target_logits = jnp.asarray(target_logits, jnp.float32)
    b, t1, v = target_logits.shape
    col = lambda a: jnp.asarray(a)[:, None]
    p = sampling.filtered_probs(target_logits, col(params.temperature), col(params.top_k), col(params.top_p),
                                col(params.min_p))
    u_acc, u_sample = sampling.row_uniforms(keys, t1 - 1)
    u = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), u_acc], axis=1)  # [B, T+1]: node i's at i
    rows = jnp.arange(b)
    tried = jnp.ones((b,), bool) if valid is None else jnp.asarray(valid)
    if node_q is None:
        n, path = _walk(spec, tree, _one_hot_verdicts(tree, p, u) & tried[:, None])
        stop = path[rows, n]
        resid = _one_hot_residual(tree, stop, p[rows, stop], tried)
    else:
        point = jax.nn.one_hot(tree.tokens, v, dtype=jnp.float32)
        q = jnp.where(jnp.asarray(params.one_hot)[:, None, None], point, jnp.asarray(node_q, jnp.float32))
        verdicts, resid_after = _draft_q_verdicts(spec, tree, p, q, u)
        n, path = _walk(spec, tree, verdicts & tried[:, None])
        resid = jnp.where(tried[:, None], resid_after[rows, path[rows, n]], p[:, 0])
    emitted = _emitted(tree, path, n, sampling.sample_from_uniform(resid, u_sample))
    verdicts = [] if noise is None else [(jnp.asarray(params.coupled, bool),
                                          greedy_accept(spec, tree, sampling.coupled_ids(p, noise), valid))]
    verdicts.append((params.greedy,
                     greedy_accept(spec, tree, jnp.argmax(target_logits, axis=-1).astype(jnp.int32), valid)))
    for rule, (r_n, r_path, r_emitted) in verdicts:  # greedy last: it wins
        n, path, emitted = (jnp.where(rule, r_n, n), jnp.where(col(rule), r_path, path),
                            jnp.where(col(rule), r_emitted, emitted))
    return n, path, emitted


def accepted_kv_moves(path: Array, length: Array) -> tuple[Array, Array]:
    """path, length [B] -> (src, dst) [B, steps+1] for layers.move_kv: length + path[d] -> length + d."""
    depth = jnp.arange(path.shape[1])
    dst = length[:, None] + depth
    return length[:, None] + jnp.where(path >= 0, path, depth), dst
