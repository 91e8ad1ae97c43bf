"""The speculator seam: the shape of a proposal and how the target verifies it.

A speculator answers four questions for the step functions (`steps.py`), which call nothing
chain- or tree-specific themselves:
  layout:  which tokens the target verifies, at which positions, under which attention mask
           (`verify_layout`);
  accept:  which of them the target's logits accept, the tokens the row emits, and the accepted
           path (`accept`), and what the draft extend reads of the verify (`extend_inputs`);
  draft:   the draft steps that build the next proposal from the verified position (`start`,
           `draft_step`, `propose`);
  commit:  what the accepted proposal leaves in the target's KV (`commit_kv`) and the new one in
           the slots (`commit`).

`Chain(K)` is K proposals in a line, proposal j continuing proposal j-1: verified at positions
n..n+K under the causal mask, accepted by the longest matching prefix (greedy) or by rejection
sampling on the draft's own q, its KV already where the accepted tokens belong.

`Tree(spec)` is EAGLE-2's dynamic tree (runner/tree.py, `TreeSpec(steps, top_k, tokens)`): the
draft expands the top_k best beams a level, `steps` levels deep, and the `tokens` best-scoring
candidates become the tree; the target verifies the root (the last token) and those nodes in one
forward under the ancestor mask, stored at length..length+tokens and rotated at length + depth;
a row accepts the longest root path the target agrees with (greedy), or by the multi-draft
rejection rule with point-mass q (sampling: lossless for the deterministic top-k tree, so no q is
kept); the path's KV then moves to the contiguous positions it belongs at, and the draft extend
reads the verify's captures along the path. Slots keep the nodes' tokens and parents.

An engine may serve a tree and a chain side by side ("auto" picks per bucket): the slots then
hold room for either proposal (`SlotLayout.union`), each commit records its speculator's `kind`
in `Slots.drafted_by`, and a verify treats a row whose pending proposal the other speculator
drafted as having none (it accepts nothing and samples as the target alone): the two lay their
proposals out differently. A proposal of the verify's own kind is verified even when stale
(drafted before some target-only iterations): each was drawn as its rule requires, so any is
lossless to verify.

Draft positions: the draft pairs the target capture at position t with the embedding of token
t+1 and runs at RoPE position t; chain step j runs at position t+j (docs/EAGLE3.md, "The draft
forward pass").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import DraftConfig, TreeSpec
from eagle3_jax.model import eagle3, layers
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner import sampling
from eagle3_jax.runner import tree as T
from eagle3_jax.runner.state import SlotLayout, Slots


@struct.dataclass
class DraftCarry:
    """What one draft step hands the next: the hidden-state pytree of the chain."""

    h: jax.Array  # [B, H] pre-norm draft hidden at `position`
    token: jax.Array  # [B] the token after `position` (target id): the next step's input
    position: jax.Array  # [B]
    drafts: jax.Array  # [B, K] proposals so far (target ids)
    q: jax.Array  # [B, K, Vd] the distributions they were drawn from
    row: sampling.RowSampling  # [B] the rows' sampling parameters
    keys: jax.Array  # [B, 2] this iteration's draft PRNG keys


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """The static half of a draft step: the drafter, how its forward runs, and whether the
    program is greedy (a greedy program keeps no q)."""

    draft: DraftConfig
    attention: str
    gemv: str
    greedy: bool
    pin_kv: object  # the draft forward's `pin_kv` (None on one device)

    @property
    def pallas(self) -> bool:
        """The draft runs on the Pallas kernels (attention, a tree level's top-k): the GPU's default."""
        return self.attention == "pallas"


def _draft_noise(dparams: DraftParams, keys: jax.Array, index: jax.Array, vocab_size: int) -> jax.Array:
    """The coupling noise of the token at `index` [B] (or [B, ...]) over the draft vocabulary
    [B, (...,) Vd]: the target vocabulary's noise (`sampling.coupling_noise`) at the draft tokens'
    target ids, so the draft perturbs each token exactly as the target's verify will."""
    ids = jnp.arange(dparams.d2t.shape[0]) + dparams.d2t  # [Vd] target ids
    return jnp.take(sampling.coupling_noise(keys, index, vocab_size), ids, axis=-1)


def _draft_token(logits: jax.Array, row: sampling.RowSampling, keys: jax.Array, greedy: bool,
                 noise: jax.Array | None = None):
    """Draft logits [B, Vd] -> (draft ids [B], q [B, Vd]). Greedy rows take the argmax, coupled
    rows the coupled draw under `noise` [B, Vd] (`_draft_noise`), the others a sample of q; a greedy
    program has no q (None: greedy verification never reads it)."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return greedy_ids, None
    q = sampling.filtered_probs(logits, row.temperature, row.top_k, row.top_p, row.min_p)
    ids = sampling.sample_rows(q, keys)
    if noise is not None:
        ids = jnp.where(row.coupled, sampling.coupled_ids(q, noise), ids)
    return jnp.where(row.greedy, greedy_ids, ids), q


def _target_probs(dparams: DraftParams, q: jax.Array, vocab_size: int) -> jax.Array:
    """q over the draft vocabulary [B, K, Vd] -> the same mass at target ids [B, K, V]."""
    ids = jnp.arange(q.shape[-1]) + dparams.d2t
    return jnp.zeros((*q.shape[:-1], vocab_size), q.dtype).at[..., ids].set(q)


@dataclasses.dataclass(frozen=True)
class Chain:
    """K proposals in a line; a chain of 0 is the target alone (it verifies the last token)."""

    k: int
    kind = 1  # Slots.drafted_by of a chain's proposals

    @property
    def spec(self) -> TreeSpec:
        """The chain as a TreeSpec(K, 1, K) (EngineConfig.speculative_proposals' form)."""
        return TreeSpec.chain(self.k)

    @property
    def num_proposals(self) -> int:
        """Proposal tokens a slot holds between iterations (`Slots.drafts` [S, K])."""
        return self.k

    @property
    def num_draft_steps(self) -> int:
        """Draft forwards per iteration after the extend, one per proposal."""
        return self.k

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per row: the last token and the K proposals."""
        return self.k + 1

    @property
    def emitted_width(self) -> int:
        """The most tokens one iteration emits: the K proposals and the target's next token."""
        return self.k + 1

    @property
    def positions_per_iteration(self) -> int:
        """KV positions past a row's length the scheduler reserves per iteration in flight."""
        return self.k + 1

    @property
    def slot_layout(self) -> SlotLayout:
        """The proposals and their q, per slot (`state.init_state`)."""
        return SlotLayout(proposals=self.k, q_rows=self.k, parents=False, emitted=self.k + 1)

    # ---- layout ---------------------------------------------------------------------------
    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, None]:
        """-> (tokens [B, K+1], positions [B, K+1], attention mask: None, the causal one)."""
        tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :self.k]], axis=1)
        return tokens, s.length[:, None] + jnp.arange(self.k + 1), None

    # ---- accept ---------------------------------------------------------------------------
    def accept(self, greedy: bool, dparams: DraftParams, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int, measure_chain: bool = False) -> tuple[jax.Array, jax.Array, None, jax.Array]:
        """Target logits [B, K+1, V] -> (num_accepted [B], emitted [B, K+1], path: None, the
        accepted proposals are the first ones, top1_accepted [B]: a chain's is num_accepted, see
        `Tree.accept`): row b emits emitted[b, :num_accepted[b] + 1]. measure_chain: unused (a
        chain measures itself)."""
        drafts = s.drafts[:, :self.k]
        valid = s.drafted_by == self.kind  # [B]: the row's pending proposals are a chain's
        if greedy:
            n, emitted = sampling.greedy_verify(logits, drafts, valid)
        else:
            q = _target_probs(dparams, s.draft_probs[:, :self.k], vocab_size) if self.k else None
            # Logits row i chooses the token at position length + 1 + i.
            noise = sampling.coupling_noise(s.sampling.key, s.length[:, None] + 1 + jnp.arange(self.k + 1),
                                            vocab_size)
            n, emitted = sampling.verify_chain(logits, drafts, q, s.sampling, keys, noise, valid)
        return n, emitted, None, n

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: None,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the draft extend reads: the verify's captures [B, K+1, C] and positions [B, K+1]
        as they are (the accepted tokens were verified where they stay)."""
        return captures, positions

    # ---- draft ----------------------------------------------------------------------------
    def start(self, h: jax.Array, token: jax.Array, position: jax.Array, row: sampling.RowSampling,
              keys: jax.Array, draft_vocab: int) -> DraftCarry:
        """The carry at the verified position: h [B, H] there, `token` [B] the token after it."""
        b = h.shape[0]
        return DraftCarry(h=h, token=token, position=position, drafts=jnp.zeros((b, self.k), jnp.int32),
                          q=jnp.zeros((b, self.k, draft_vocab), jnp.float32), row=row, keys=keys)

    def draft_step(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: DraftCarry,
                   draft_kv, block_table: jax.Array, j: int) -> tuple[DraftCarry, object]:
        """Proposal j (static) of the chain. Step 0 reads the verified position's hidden state;
        step j > 0 first runs the draft on proposal j-1 at the next position, fed its own h."""
        h, position = carry.h, carry.position
        if j > 0:
            out, draft_kv = eagle3.draft_forward(dparams, ctx.draft, target_embed, carry.token[:, None], h[:, None],
                                                 (position + 1)[:, None], draft_kv, block_table, ctx.attention,
                                                 ctx.pin_kv, ctx.gemv)
            h, position = out[:, 0], position + 1
        # An argmax needs no all-gather of the logits: only per-shard (max, index) pairs move.
        logits = eagle3.draft_logits(dparams, ctx.draft, h, ctx.gemv)  # [B, Vd]
        # The proposal is the token at position + 2 (the draft pairs capture t with token t + 1).
        noise = None if ctx.greedy else _draft_noise(dparams, carry.row.key, position + 2, ctx.draft.vocab_size)
        ids, q = _draft_token(logits, carry.row, sampling.fold_in_rows(carry.keys, j), ctx.greedy, noise)
        token = eagle3.to_target_ids(dparams, ids)
        carry = carry.replace(h=h, token=token, position=position, drafts=carry.drafts.at[:, j].set(token))
        return (carry if q is None else carry.replace(q=carry.q.at[:, j].set(q))), draft_kv

    def propose(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: DraftCarry,
                draft_kv, block_table: jax.Array, start: int = 0) -> tuple[DraftCarry, object]:
        """Draft steps start..K-1 inside one program."""
        for j in range(start, self.num_draft_steps):
            carry, draft_kv = self.draft_step(ctx, dparams, target_embed, carry, draft_kv, block_table, j)
        return carry, draft_kv

    # ---- commit ---------------------------------------------------------------------------
    def commit_kv(self, target_kv: KVCache, path: None, length: jax.Array, block_tables: jax.Array) -> KVCache:
        """The chain's KV needs no move: proposal j was verified at the position it drafted for."""
        return target_kv

    def commit(self, slots: Slots, rows: jax.Array, carry: DraftCarry, greedy: bool) -> Slots:
        """Store the proposals and their q in the slots for the next iteration to verify. A
        greedy program keeps the slots' q as they are: its rows are verified greedily, which never
        reads q, and a sampled row only ever runs in sampling programs, which write its q. The
        chain's KV needs no move: proposal j was verified at the position it drafted for."""
        slots = slots.replace(drafts=slots.drafts.at[rows, :self.k].set(carry.drafts),
                              drafted_by=slots.drafted_by.at[rows].set(self.kind))
        if not greedy:
            slots = slots.replace(draft_probs=slots.draft_probs.at[rows].set(carry.q))  # [S, K, Vd] f32
        return slots


@struct.dataclass
class TreeCarry:
    """What one tree level hands the next."""

    h: jax.Array  # [B, k, H] pre-norm draft hidden at the level's beams ([B, 1, H]: the root's)
    token: jax.Array  # [B] the tree's root token (target id): the token after `position`
    position: jax.Array  # [B] the verified position t the tree grows from
    row: sampling.RowSampling  # [B] the rows' sampling parameters (coupled rows perturb the tree)
    cand: T.Candidates | None  # the candidates so far (None before the first level)


@dataclasses.dataclass(frozen=True)
class Tree:
    """EAGLE-2's dynamic tree of `spec` (module docstring): T = spec.tokens nodes verified, up to
    spec.steps accepted."""

    spec: TreeSpec
    kind = 2  # Slots.drafted_by of a tree's proposals

    @property
    def num_proposals(self) -> int:
        """Nodes a slot holds between iterations (`Slots.drafts`, `Slots.parents` [S, T])."""
        return self.spec.tokens

    @property
    def num_draft_steps(self) -> int:
        """Draft steps after the extend: the first level (from the extend's hidden state), then a
        forward over each level's beams."""
        return self.spec.steps

    @property
    def verify_width(self) -> int:
        """Tokens the target verifies per row: the root and the T nodes."""
        return self.spec.verify_width

    @property
    def emitted_width(self) -> int:
        """The most tokens one iteration emits: a path of `steps` nodes and the target's next token."""
        return self.spec.steps + 1

    @property
    def positions_per_iteration(self) -> int:
        """KV positions past a row's length one iteration writes (TreeSpec.positions_per_iteration)."""
        return self.spec.positions_per_iteration

    @property
    def slot_layout(self) -> SlotLayout:
        """The nodes' tokens and parents per slot; no q (the point-mass rule needs none)."""
        return SlotLayout(proposals=self.spec.tokens, q_rows=0, parents=True, emitted=self.spec.steps + 1)

    def tree(self, s: Slots) -> T.Tree:
        """The slots' tree in the verify layout, the last token at the root: [B, T+1] each."""
        tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :self.spec.tokens]], axis=1)
        parent = jnp.concatenate([jnp.full_like(s.last_token[:, None], -1), s.parents[:, :self.spec.tokens]], axis=1)
        return T.tree_from_parents(tokens, parent, self.spec.max_depth)

    # ---- layout ---------------------------------------------------------------------------
    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, layers.TreeAttention]:
        """-> (tokens [B, T+1], positions [B, T+1] where their KV is stored (length + i), the
        tree's attention: rotated at length + depth, each node seeing the context and its ancestors)."""
        tree = self.tree(s)
        stored, attention = T.verify_attention(tree, s.length)
        return tree.tokens, stored, attention

    # ---- accept ---------------------------------------------------------------------------
    def accept(self, greedy: bool, dparams: DraftParams, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int, measure_chain: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """Target logits [B, T+1, V] -> (num_accepted [B] in 0..steps, emitted [B, steps+1],
        path [B, steps+1]: the accepted nodes by depth, -1 past num_accepted, top1_accepted [B]).
        measure_chain (static): top1_accepted is what a chain of the draft's top-1 tokens would
        have accepted of this verify (`tree.top1_accepted`), -1 on rows of the draft-q rule, whose
        chain would have sampled its proposals: the engine measures its chain on the tree's
        traffic without running it. Else -1 everywhere, not computed."""
        tree = self.tree(s)
        valid = s.drafted_by == self.kind  # [B]: the row's pending proposals are a tree's
        if greedy:
            n, path, emitted = T.greedy_accept(self.spec, tree, jnp.argmax(logits, axis=-1).astype(jnp.int32), valid)
            measurable = True
        else:
            # Logits row i chooses the token after node i: at position length + depth[i] + 1.
            noise = sampling.coupling_noise(s.sampling.key, s.length[:, None] + tree.depth + 1, vocab_size)
            n, path, emitted = T.sample_accept(self.spec, tree, logits, s.sampling, keys, noise=noise, valid=valid)
            measurable = s.sampling.greedy | s.sampling.coupled
        top1 = jnp.where(measurable, T.top1_accepted(tree, path, n), -1) if measure_chain else jnp.full_like(n, -1)
        return n, emitted, path, top1

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: jax.Array,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The verify's captures [B, T+1, C] along the accepted path -> (captures [B, steps+1, C],
        positions length..length+steps), where the path's tokens now are (past the path, whatever:
        the extend's entries there are rewritten before they are read)."""
        depth = jnp.arange(path.shape[1])
        index = jnp.minimum(jnp.where(path >= 0, path, depth), captures.shape[1] - 1)
        return jnp.take_along_axis(captures, index[:, :, None], axis=1), length[:, None] + depth

    # ---- draft ----------------------------------------------------------------------------
    def start(self, h: jax.Array, token: jax.Array, position: jax.Array, row: sampling.RowSampling,
              keys: jax.Array, draft_vocab: int) -> TreeCarry:
        """The carry at the verified position: h [B, H] there, `token` [B] the root. The tree is
        the draft's top-k, deterministic: no keys enter it; coupled rows perturb it (`_children`)."""
        return TreeCarry(h=h[:, None], token=token, position=position, row=row, cand=None)

    def _children(self, ctx: DraftContext, dparams: DraftParams, h: jax.Array, row: sampling.RowSampling,
                  index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, H] or [B, k, H] -> the draft's k most likely tokens (`tree.top_children`:
        log-probs, draft ids [B, (k,) k]) by its log-softmax over the whole draft vocabulary
        (gathered under tensor parallelism), as the EAGLE reference builds its tree. Coupled rows
        (a sampling program) rank by the log-softmax of the perturbed log-probs at the children's
        position `index` [B] instead: their top-k is the Gumbel-top-k, holding the draft's guess of
        the target's coupled draw first."""
        k, kernel = self.spec.top_k, ctx.pallas
        logits = eagle3.draft_logits(dparams, ctx.draft, h, ctx.gemv)  # [B, (k,) Vd]
        if ctx.greedy:
            return T.top_children(logits, k, normalize=True, kernel=kernel)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lead = (slice(None),) + (None,) * (logits.ndim - 2)  # [B] -> broadcast over the beams
        q = sampling.filtered_probs(logits, row.temperature[lead], row.top_k[lead], row.top_p[lead], row.min_p[lead])
        noise = _draft_noise(dparams, row.key, index, ctx.draft.vocab_size)[lead]  # [B, (1,) Vd]
        coupled = jax.nn.log_softmax(sampling.perturbed_log_probs(q, noise), axis=-1)
        return T.top_children(jnp.where(row.coupled[lead][..., None], coupled, logp), k, kernel=kernel)

    def draft_step(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: TreeCarry,
                   draft_kv, block_table: jax.Array, j: int) -> tuple[TreeCarry, object]:
        """Level j+1 (j static): step 0 takes the root's top-k children; step j > 0 first runs the
        draft on level j's k beams (each seeing the context and its ancestors, stored at
        t + 1 + (j-1) k + beam, rotated at t + j), fed its parent beam's hidden state."""
        # Level j+1's children are the tokens at position t + 2 + j.
        index = carry.position + 2 + j
        if j == 0:
            children = self._children(ctx, dparams, carry.h[:, 0], carry.row, index)
            return carry.replace(cand=T.first_level(self.spec, children, dparams.d2t)), draft_kv
        tokens, stored, attention = T.draft_attention(self.spec, carry.cand, j, carry.position)  # [B, k] each
        h_in = jnp.take_along_axis(carry.h, carry.cand.beam_parents[:, :, None], axis=1)  # [B, k, H]
        h, draft_kv = eagle3.draft_forward(dparams, ctx.draft, target_embed, tokens, h_in, stored, draft_kv,
                                           block_table, ctx.attention, ctx.pin_kv, ctx.gemv, tree=attention)
        cand = T.next_level(self.spec, carry.cand, j + 1, self._children(ctx, dparams, h, carry.row, index),
                            dparams.d2t, kernel=ctx.pallas)
        return carry.replace(h=h, cand=cand), draft_kv

    def propose(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: TreeCarry,
                draft_kv, block_table: jax.Array, start: int = 0) -> tuple[TreeCarry, object]:
        """Draft steps start..steps-1 inside one program."""
        for j in range(start, self.num_draft_steps):
            carry, draft_kv = self.draft_step(ctx, dparams, target_embed, carry, draft_kv, block_table, j)
        return carry, draft_kv

    # ---- commit ---------------------------------------------------------------------------
    def commit_kv(self, target_kv: KVCache, path: jax.Array, length: jax.Array,
                  block_tables: jax.Array) -> KVCache:
        """The accepted path's target KV, verified at length + path[d], moved to length + d (every
        layer's k and v; path [B, steps+1], length [B] the root's position)."""
        src, dst = T.accepted_kv_moves(path, length)
        return KVCache(k=layers.move_kv(target_kv.k, src, dst, block_tables),
                       v=layers.move_kv(target_kv.v, src, dst, block_tables))

    def commit(self, slots: Slots, rows: jax.Array, carry: TreeCarry, greedy: bool) -> Slots:
        """The `tokens` best candidates become the rows' next tree: nodes [B, T] and their
        parents (0: the root) in the verify layout."""
        tree = T.select(self.spec, carry.cand, carry.token)  # [B, T+1] each
        return slots.replace(drafts=slots.drafts.at[rows, :self.spec.tokens].set(tree.tokens[:, 1:]),
                             parents=slots.parents.at[rows, :self.spec.tokens].set(tree.parent[:, 1:]),
                             drafted_by=slots.drafted_by.at[rows].set(self.kind))
