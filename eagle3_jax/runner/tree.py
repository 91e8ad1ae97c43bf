r"""EAGLE-2's dynamic draft tree as pure functions over arrays (device side, jittable).

An iteration can draft a tree instead of a chain: the target verifies every node in one forward
under an ancestor mask, and the row keeps the longest accepted path from the root. Everything is
batched over rows [B], with shapes fixed by a static `TreeSpec(steps, top_k, tokens)` (config.py); nothing
branches on data.

Building (k = top_k), as the EAGLE reference's `topK_genrate` builds it
------------------------------------------------------------------------
  level 1      the draft at the verified position: its k most likely tokens (log-softmax over
               the draft vocabulary) are the root's children, each scored by its log-prob.
  level l > 1  the draft runs on level l-1's k beams (`draft_attention`: each sees the context
               and its own ancestors); each beam's k most likely children score the beam's score
               plus their log-prob. All k^2 are candidates; the k best are level l's beams.
  select       the `tokens` best candidates, in candidate order. A child never scores above its
               parent (log-probs are <= 0) and ties go to the lower slot (lax.top_k's order, the
               reference's), which the parent has: the set is closed under ancestors, parents
               before children.
Candidate slots (N = k + (steps-1) k^2): level 1 at [0, k), level l at [k + (l-2) k^2,
k + (l-1) k^2), beam-major (slot = offset + beam * k + rank), as the reference flattens them.

The tree (T = tokens, the verify layout): index 0 is the root, the row's last token, stored at
position `length`; node i in 1..T is stored at length + i and rotated at length + depth[i]
(`verify_attention`). The target's logits at index i are its distribution after node i.

Acceptance
----------
Greedy: the longest root-to-node path on which every node is the target's argmax after its
parent; the row emits the path's tokens and the target's argmax after the path's last node.

Sampling (lossless), the multi-draft rule of SpecInfer and of the reference's
`evaluate_posterior`: at a node with target distribution p, try its children in order; child c,
drawn from q_c, is accepted with probability min(1, p(c) / q_c(c)); on rejection
p <- norm((p - q_c)^+) and the next child is tried; if all are rejected the token is drawn from
the last p. Each step is the chain's one-step argument (sampling.py), so the emitted tokens have
the target's distribution, provided q_c is the distribution c was really drawn from, given its
earlier siblings. The tree above picks children deterministically (top-k), so q_c is the point
mass on c, the reference's rule (it sets q = 1): accept with probability p(c), else zero p(c) and
renormalise. Accepting on the draft's own distribution instead is biased on such a tree
(tests/test_tree.py measures it). Siblings drawn without replacement from a draft distribution q
have q_c = q with the earlier siblings zeroed, renormalised (`sample_accept`'s node_q).
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


# --------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------
class Candidates(NamedTuple):
    """The tree being built: each level's candidates, and the current level's k beams.

    Each level appends its candidates rather than writing them into [B, N] buffers: on the GPU
    every such write was a kernel of its own, three a level (BENCHMARKS.md, "Trees end to end").
    `tokens`, `scores` and `parents` are the slots so far, [B, N'] with N' <= N."""

    level_tokens: tuple[Array, ...]  # per level [B, k] (level 1), then [B, k^2] i32 target ids
    level_scores: tuple[Array, ...]  # per level, f32 sum of log-probs from the root
    level_parents: tuple[Array, ...]  # per level, i32 the parent's slot; -1 for the root's children
    beams: Array  # [B, k] i32 slots of the current level's beams, best first
    beam_scores: Array  # [B, k] f32 their scores
    beam_parents: Array  # [B, k] i32 the previous level's beam each descends from (0 at level 1)
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


VOCAB_CHUNK = 128  # stage one of `vocab_top_k`: the top k of each run of this many entries


def vocab_top_k(x: Array, k: int) -> tuple[Array, Array]:
    """lax.top_k over a vocabulary-sized last axis, in two stages: x [..., V] -> (values, indices)
    [..., k], the same as lax.top_k's, ties included. Why: on the GPU one lax.top_k over a few rows
    of 16,384 entries took 15-43 us a call (k = 4, 8; a SmolLM2 tree level, on the H200), one block
    walking each row; as the top k of every run of VOCAB_CHUNK entries, then of those, many
    blocks share the walk. Ties keep lax.top_k's lower-index-first order: stage one's candidates
    are laid out in index order, and each run's equal values come out by index."""
    v = x.shape[-1]
    if v <= 4 * VOCAB_CHUNK or k > VOCAB_CHUNK:
        return lax.top_k(x, k)
    runs = -(-v // VOCAB_CHUNK)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, runs * VOCAB_CHUNK - v)], constant_values=-jnp.inf)
    values, local = lax.top_k(padded.reshape(*x.shape[:-1], runs, VOCAB_CHUNK), k)  # [..., runs, k]
    index = local + VOCAB_CHUNK * jnp.arange(runs, dtype=local.dtype)[:, None]
    values, best = lax.top_k(values.reshape(*x.shape[:-1], runs * k), k)
    return values, jnp.take_along_axis(index.reshape(*x.shape[:-1], runs * k), best, axis=-1)


def top_children(x: Array, k: int, normalize: bool = False, kernel: bool = False) -> tuple[Array, Array]:
    """Each row's k best children: x [..., Vd] -> (log-probs [..., k], draft ids [..., k]), best
    first, ties to the lower id. normalize: x are logits and the log-probs log_softmax(x)'s; else
    x are log-probs. kernel: the two Pallas kernels of model/pallas_top_k.py (the GPU's), the
    logsumexp folded in (its log-probs equal log_softmax's up to f32 rounding); else XLA's form."""
    if kernel:
        values, ids, lse = pallas_top_k.top_k(x, k)
        return (values - lse[..., None] if normalize else values), ids
    return vocab_top_k(jax.nn.log_softmax(x, axis=-1) if normalize else x, k)


def _target_ids(ids: Array, d2t: Array | None) -> Array:
    return ids if d2t is None else ids + d2t[ids]


def first_level(spec: TreeSpec, children: tuple[Array, Array], d2t: Array | None = None) -> Candidates:
    """The root's children from the draft at the verified position.

    children: (log-probs, draft ids) [B, k] each, the draft's k most likely tokens there
    (`top_children`); d2t [Vd] i32 offsets to target ids (None: the same vocabulary) ->
    Candidates; the beams are the k children, best first."""
    lp, ids = children  # [B, k]
    b, k = lp.shape[0], spec.top_k
    return Candidates(
        level_tokens=(_target_ids(ids, d2t),), level_scores=(lp,), level_parents=(jnp.full((b, k), -1, jnp.int32),),
        beams=jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k)), beam_scores=lp,
        beam_parents=jnp.zeros((b, k), jnp.int32),
        beam_masks=jnp.broadcast_to(jnp.eye(k, spec.draft_slots, dtype=bool), (b, k, spec.draft_slots)))


def next_level(spec: TreeSpec, cand: Candidates, level: int, children: tuple[Array, Array],
               d2t: Array | None = None, kernel: bool = False) -> Candidates:
    """Level `level` (static, 2..steps) from the draft at level level-1's beams.

    children: (log-probs, draft ids) [B, k, k] each: row j the draft's k most likely tokens after
    beam j (`draft_attention`, `top_children`) -> Candidates with level's k^2 candidates appended
    and its k best as the beams (kernel: ranked by model/pallas_top_k.py's kernel, one launch
    where XLA's top-k is a sort with a copy and a slice)."""
    lp, ids = children  # [B, k, k]: beam, rank
    b, k = lp.shape[0], spec.top_k
    scores = (cand.beam_scores[:, :, None] + lp).reshape(b, k * k)  # beam-major, as the slots
    values, best = (pallas_top_k.top_k(scores, k) if kernel else lax.top_k(scores, k))[:2]  # [B, k] of the k^2
    from_beam = best // k
    # A new beam sees what its parent beam saw, and its own draft slot (none at the last level).
    own = jnp.eye(k, spec.draft_slots, (level - 1) * k, dtype=bool)  # [k, W]
    masks = jnp.take_along_axis(cand.beam_masks, from_beam[:, :, None], axis=1) | own
    return Candidates(
        level_tokens=(*cand.level_tokens, _target_ids(ids, d2t).reshape(b, k * k)),
        level_scores=(*cand.level_scores, scores),
        level_parents=(*cand.level_parents, jnp.repeat(cand.beams, k, axis=1)),
        beams=k + (level - 2) * k * k + best, beam_scores=values, beam_parents=from_beam, beam_masks=masks)


def draft_attention(spec: TreeSpec, cand: Candidates, level: int,
                    position: Array) -> tuple[Array, Array, TreeAttention]:
    """The draft forward on the beams of depth `level` (static, 1..steps-1).

    position [B]: where the draft ran at the root (the verified position t) -> (tokens [B, k],
    positions [B, k] where their KV is stored, the forward's TreeAttention). Beam j of level l is
    stored at t + 1 + (l-1) k + j, rotated at t + l (the chain's position for depth l), and sees
    the context (positions <= t) and its ancestors' slots. Its hidden input is the draft's output
    at beam cand.beam_parents[:, j] of the level before (at level 1, the root's)."""
    k = spec.top_k
    start = position + 1
    stored = start[:, None] + (level - 1) * k + jnp.arange(k)
    rope = jnp.broadcast_to((position + level)[:, None], stored.shape)
    tokens = jnp.take_along_axis(cand.tokens, cand.beams, axis=1)
    return tokens, stored, TreeAttention(rope, start, cand.beam_masks)


# --------------------------------------------------------------------------
# The tree
# --------------------------------------------------------------------------
class Tree(NamedTuple):
    """A tree in the verify layout: index 0 is the root, nodes 1..T follow their parents."""

    tokens: Array  # [B, T+1] i32; [:, 0] the root's (the row's last token)
    parent: Array  # [B, T+1] i32 index of the parent; -1 for the root
    depth: Array  # [B, T+1] i32; 0 for the root
    mask: Array  # [B, T+1, T+1] bool: mask[b, i, j] iff j is i or one of its ancestors


def tree_from_parents(tokens: Array, parent: Array, max_depth: int) -> Tree:
    """tokens, parent [B, T+1] (parent[:, 0] = -1, else parent[:, i] < i) -> Tree."""
    index = jnp.arange(parent.shape[1])
    up = jnp.broadcast_to(index, parent.shape)
    mask = up[:, :, None] == index
    step = jnp.maximum(parent, 0)  # the root stays at the root
    for _ in range(max_depth):
        up = jnp.take_along_axis(step, up, axis=1)
        mask = mask | (up[:, :, None] == index)
    depth = jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
    return Tree(tokens=tokens, parent=parent, depth=depth, mask=mask)


def select(spec: TreeSpec, cand: Candidates, root_token: Array) -> Tree:
    """The `tokens` best candidates, in candidate order, under the root token [B] -> Tree.

    Best as lax.top_k ranks them (higher score first, ties to the lower slot), counted by
    comparisons rather than sorted: a few fused kernels where top-k, a sort and a scatter were
    one each (N = spec.candidates: the [B, N, N] comparisons are small)."""
    scores, t = cand.scores, spec.tokens  # [B, N]
    slot = jnp.arange(scores.shape[1])
    ahead = (scores[:, None, :] > scores[:, :, None]) | (
        (scores[:, None, :] == scores[:, :, None]) & (slot[None, :] < slot[:, None]))  # [B, i, j]: j ranks before i
    chosen = jnp.sum(ahead, axis=-1) < t  # [B, N]
    index_of = jnp.where(chosen, jnp.cumsum(chosen, axis=1, dtype=jnp.int32), 0)  # slot -> node index 1..T
    pick = index_of[:, None, :] == jnp.arange(1, t + 1)[:, None]  # [B, T, N]: node i's slot
    tokens = jnp.sum(jnp.where(pick, cand.tokens[:, None, :], 0), axis=-1)
    parent_slot = jnp.sum(jnp.where(pick, cand.parents[:, None, :], 0), axis=-1)  # [B, T]
    parent = jnp.where(parent_slot < 0, 0, jnp.take_along_axis(index_of, jnp.maximum(parent_slot, 0), axis=1))
    b = root_token.shape[0]
    tokens = jnp.concatenate([root_token[:, None], tokens], axis=1)
    parent = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parent], axis=1)
    return tree_from_parents(tokens, parent, spec.max_depth)


def verify_attention(tree: Tree, length: Array) -> tuple[Array, TreeAttention]:
    """The target's forward over the tree: length [B] (the root's position) -> (positions
    [B, T+1] where the tokens' KV is stored, TreeAttention: rotated at length + depth, each
    seeing the context, the root and its ancestors)."""
    stored = length[:, None] + jnp.arange(tree.tokens.shape[1])
    return stored, TreeAttention(length[:, None] + tree.depth, length, tree.mask)


# --------------------------------------------------------------------------
# Acceptance
# --------------------------------------------------------------------------
def _earlier_siblings(tree: Tree) -> Array:
    """[B, T+1, T+1] bool: j < i share a parent (the root has no siblings)."""
    index = jnp.arange(tree.parent.shape[1])
    same = (tree.parent[:, :, None] == tree.parent[:, None, :]) & (tree.parent[:, :, None] >= 0)
    return same & (index[None, None, :] < index[None, :, None])


def _walk(spec: TreeSpec, tree: Tree, accept: Array) -> tuple[Array, Array]:
    """accept [B, T+1]: node i's verdict were it tried (entry 0 ignored) -> (num_accepted [B],
    path [B, steps+1]: the accepted nodes by depth, path[:, 0] = 0, -1 past num_accepted).
    A node is taken when accepted and no earlier sibling was; the path is the taken nodes whose
    ancestors were all taken."""
    first = accept & ~jnp.any(_earlier_siblings(tree) & accept[:, None, :], axis=-1)
    taken = first.at[:, 0].set(True)
    on_path = jnp.all(taken[:, None, :] | ~tree.mask, axis=-1)  # [B, T+1]
    at_depth = on_path[:, None, :] & (tree.depth[:, None, :] == jnp.arange(spec.max_depth + 1)[:, None])
    path = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), -1).astype(jnp.int32)
    return jnp.sum(on_path, axis=-1, dtype=jnp.int32) - 1, path


def top1_accepted(tree: Tree, path: Array, n: Array) -> Array:
    """What a chain of the draft's most likely tokens would have accepted of this verify: the
    accepted path's leading nodes that are their parent's first child. path [B, steps+1], n [B]
    (`_walk`'s) -> [B] i32 in 0..n.

    Why it is the chain's: a node's children are its k best draft tokens, best first, and `select`
    keeps them in that order and never a child without its better siblings, so a parent's first
    child is the draft's top-1 after it: the path of first children is the chain the draft
    proposes from the same position (greedy: argmaxes; coupled rows: the Gumbel-top-1, the chain's
    coupled draw). The chain accepts its proposals while they are the target's tokens: down the
    accepted path while it follows first children. Exact when the run stops at a later child (the
    target took a sibling over the chain's token) or at a first child the target rejected; a lower
    bound when the path ends at a node none of whose children `select` kept, the chain's next
    proposal unverified (the tree pruned it, or the tree's depth ends there)."""
    first = ~jnp.any(_earlier_siblings(tree), axis=-1)  # [B, T+1]
    on_path = jnp.take_along_axis(first, jnp.maximum(path[:, 1:], 0), axis=1)  # [B, steps]
    within = jnp.arange(path.shape[1] - 1) < n[:, None]
    return jnp.sum(jnp.cumprod(on_path & within, axis=1), axis=1, dtype=jnp.int32)


def _emitted(tree: Tree, path: Array, n: Array, last: Array) -> Array:
    """The path's tokens after the root, then `last` [B] -> emitted [B, steps+1], PAD-padded."""
    drafts = jnp.take_along_axis(tree.tokens, jnp.maximum(path[:, 1:], 0), axis=1)
    return sampling.assemble_emitted(drafts, n, last)


def greedy_accept(spec: TreeSpec, tree: Tree, target_ids: Array, valid: Array | None = None
                  ) -> tuple[Array, Array, Array]:
    """target_ids [B, T+1]: the target's argmax after each node; valid [B] bool (None: all): rows
    whose tree is not to be verified accept nothing -> (num_accepted [B] in 0..steps, path
    [B, steps+1] (`_walk`), emitted [B, steps+1]: row b emits emitted[b, :num_accepted[b] + 1])."""
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
    """Where the walk stopped (stop [B], p there [B, V]) every child was rejected: p with their
    tokens zeroed (p itself if that leaves less than RESIDUAL_EPS, or where no child was tried:
    tried [B] bool) -> [B, V], unnormalised."""
    b, v = p_stop.shape
    children = ((tree.parent == stop[:, None]) & tried[:, None]).astype(p_stop.dtype)  # [B, T+1]
    zeroed = jnp.zeros((b, v), p_stop.dtype).at[jnp.arange(b)[:, None], tree.tokens].max(children)
    resid = jnp.where(zeroed > 0, 0.0, p_stop)
    return jnp.where(jnp.sum(resid, -1, keepdims=True) >= sampling.RESIDUAL_EPS, resid, p_stop)


def _draft_q_verdicts(spec: TreeSpec, tree: Tree, p: Array, q: Array, u: Array) -> tuple[Array, Array]:
    """Sibling by sibling, for all nodes at once: p, q [B, T+1, V] (q[:, i] node i's draft
    distribution), u [B, T+1] -> (verdicts [B, T+1], residual [B, T+1, V] after each node's
    children, unnormalised). Up to top_k children a node."""
    b, t1, _ = p.shape
    rows, index = jnp.arange(b)[:, None], jnp.arange(t1)
    parent = jnp.maximum(tree.parent, 0)
    rank = jnp.sum(_earlier_siblings(tree), axis=-1)  # [B, T+1] place among its siblings
    q_c = q[rows, index, tree.tokens]  # [B, T+1] q_c(c)
    resid, mass = p, jnp.ones((b, t1), p.dtype)  # residual after each node and its mass (1: p itself)
    verdicts = jnp.zeros((b, t1), bool)
    for r in range(spec.top_k):
        # u < resid(c) / (mass q_c(c)): the chain's test u q < p when mass is 1.
        ok = u * q_c * mass[rows, parent] < resid[rows, parent, tree.tokens]
        child = (rank == r) & (tree.parent >= 0)
        verdicts = jnp.where(child, ok, verdicts)
        # Each node's rank-r child (if any) leaves (resid - mass q_child)^+.
        is_rth = child[:, None, :] & (parent[:, None, :] == index[:, None])  # [B, node, child]
        has = jnp.any(is_rth, axis=-1)
        q_r = jnp.take_along_axis(q, jnp.argmax(is_rth, axis=-1)[:, :, None], axis=1)  # [B, T+1, V]
        new = jnp.maximum(resid - mass[:, :, None] * q_r, 0.0)
        new_mass = jnp.sum(new, axis=-1)
        keep = has & (new_mass >= sampling.RESIDUAL_EPS * mass)
        resid = jnp.where(keep[:, :, None], new, resid)
        mass = jnp.where(keep, new_mass, mass)
    return verdicts, resid


def sample_accept(spec: TreeSpec, tree: Tree, target_logits: Array, params: sampling.RowSampling,
                  keys: Array, node_q: Array | None = None, noise: Array | None = None,
                  valid: Array | None = None) -> tuple[Array, Array, Array]:
    """Lossless tree speculative sampling (module docstring), vectorised over the nodes.

    target_logits [B, T+1, V] raw (filtered here, as sampling.verify_chain does); params [B];
    keys [B, 2] u32, this step's (node i's uniform is the one verify_chain gives proposal i-1,
    so a chain gives verify_chain's verdicts bit for bit); node_q [B, T+1, V] or None: node i's
    q_c at node_q[:, i] (entry 0 ignored; rows with params.one_hot use the point mass). None:
    every row uses the point mass, the rule for the deterministic tree `select` builds. noise
    [B, T+1, V]: the coupling noise of the token after each node (sampling.coupling_noise, at
    length + depth + 1), or None: no row is coupled; coupled rows accept greedily on the perturbed
    log-probs (sampling.py's coupled rule). valid [B] bool (None: all): a row whose tree is not
    to be verified (drafted by another speculator) accepts nothing and draws from p itself.
    -> (num_accepted [B], path [B, steps+1], emitted [B, steps+1]) as `greedy_accept`'s; greedy
    rows take `greedy_accept`'s verdict exactly."""
    target_logits = jnp.asarray(target_logits, jnp.float32)
    b, t1, v = target_logits.shape
    col = lambda a: jnp.asarray(a)[:, None]
    p = sampling.filtered_probs(target_logits, col(params.temperature), col(params.top_k), col(params.top_p),
                                col(params.min_p))  # [B, T+1, V]
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
    """Where the accepted path's KV goes: path [B, steps+1] (`_walk`), length [B] (the root's
    position) -> (src, dst [B, steps+1] positions, for layers.move_kv): the node at depth d,
    verified at length + path[d], belongs at length + d. Past the path, src = dst (no move)."""
    depth = jnp.arange(path.shape[1])
    dst = length[:, None] + depth
    return length[:, None] + jnp.where(path >= 0, path, depth), dst
