"""EAGLE-2's dynamic tree, drafted by the EAGLE-3 head (`TreeSpec(steps, top_k, tokens)`).

The draft expands the top_k best beams a level, `steps` levels deep; the `tokens` best candidates
become the tree (its math: runner/tree.py). Greedy rows accept the longest root path the target
agrees with, sampled rows by the multi-draft rejection rule with point-mass q (lossless for the
deterministic top-k tree, so no q is kept); the path's KV then moves to contiguous positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import SlotLayout, SpeculatorFacts, TreeSpec
from eagle3_jax.model import eagle3, layers
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner import sampling
from eagle3_jax.runner import tree as T
from eagle3_jax.runner.speculators.chain import draft_noise
from eagle3_jax.runner.speculators.protocol import DraftContext, DraftStart
from eagle3_jax.runner.state import Slots


@struct.dataclass
class TreeCarry:
    """What one tree level hands the next."""

    h: jax.Array  # [B, k, H] pre-norm draft hidden at the level's beams ([B, 1, H]: the root's)
    token: jax.Array  # [B] the root token: the token after `position`
    position: jax.Array  # [B] the verified position t the tree grows from
    row: sampling.RowSampling  # [B] (coupled rows perturb the tree)
    cand: T.Candidates | None  # the candidates so far (None before the first level)


@dataclasses.dataclass(frozen=True)
class Tree:
    """T = spec.tokens nodes verified, up to spec.steps accepted; measures_top1_chain: the verify also
    reports what the draft's top-1 chain would have accepted (an engine serving both)."""

    spec: TreeSpec
    measures_top1_chain: bool = False

    @functools.cached_property
    def facts(self) -> SpeculatorFacts:
        """Point mass: the deterministic top-k tree keeps no q."""
        spec = self.spec
        return SpeculatorFacts(label=spec.label, spec=spec, kind=2, uses_drafter=True, point_mass=True, top1_chain=0,
                               measures_top1_chain=self.measures_top1_chain, num_draft_steps=spec.steps,
                               max_accepted=spec.steps, verify_width=spec.verify_width,
                               positions_per_iteration=spec.positions_per_iteration,
                               slot_layout=SlotLayout(proposals=spec.tokens, q_rows=0, parents=True,
                                                      emitted=spec.steps + 1))

    def tree(self, s: Slots) -> T.Tree:
        """The slots' tree in the verify layout, the last token at the root: [B, T+1] each."""
        tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :self.spec.tokens]], axis=1)
        parent = jnp.concatenate([jnp.full_like(s.last_token[:, None], -1), s.parents[:, :self.spec.tokens]], axis=1)
        return T.tree_from_parents(tokens, parent, self.spec.max_depth)

    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, layers.TreeAttention]:
        tree = self.tree(s)
        stored, attention = T.verify_attention(tree, s.length)
        return tree.tokens, stored, attention

    def accept(self, greedy: bool, dparams: DraftParams, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """path [B, steps+1]: the accepted nodes by depth, -1 past n. top1 (measures_top1_chain): what the
        draft's top-1 chain would have accepted; -1 on draft-q rows, whose chain would have sampled."""
        tree = self.tree(s)
        valid = s.drafted_by == self.facts.kind
        if greedy:
            n, path, emitted = T.greedy_accept(self.spec, tree, jnp.argmax(logits, axis=-1).astype(jnp.int32), valid)
            measurable = True
        else:
            # Logits row i chooses the token after node i: at position length + depth[i] + 1.
            noise = sampling.coupling_noise(s.sampling.key, s.length[:, None] + tree.depth + 1, vocab_size)
            n, path, emitted = T.sample_accept(self.spec, tree, logits, s.sampling, keys, noise=noise, valid=valid)
            measurable = s.sampling.greedy | s.sampling.coupled
        if not self.measures_top1_chain:
            return n, emitted, path, jnp.full_like(n, -1)
        return n, emitted, path, jnp.where(measurable, T.top1_accepted(tree, path, n), -1)

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: jax.Array,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The captures along the accepted path, at length..length+steps (past the path whatever:
        the extend's entries there are rewritten before they are read)."""
        depth = jnp.arange(path.shape[1])
        index = jnp.minimum(jnp.where(path >= 0, path, depth), captures.shape[1] - 1)
        return jnp.take_along_axis(captures, index[:, :, None], axis=1), length[:, None] + depth

    def start(self, ctx: DraftContext, at: DraftStart) -> TreeCarry:
        """No keys enter the tree (the draft's top-k is deterministic); coupled rows perturb it."""
        return TreeCarry(h=at.h[:, None], token=at.token, position=at.position, row=at.row, cand=None)

    def _children(self, ctx: DraftContext, dparams: DraftParams, h: jax.Array, row: sampling.RowSampling,
                  index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """h [B, (k,) H] -> the k most likely (log-probs, draft ids [B, (k,) k]) over the whole draft
        vocabulary, as the EAGLE reference builds its tree. Coupled rows rank by the log-probs perturbed
        at position `index` [B]: a Gumbel-top-k, the draft's guess of the target's coupled draw first."""
        k, kernel = self.spec.top_k, ctx.pallas
        logits = eagle3.draft_logits(dparams, ctx.draft, h, ctx.gemv)  # [B, (k,) Vd]
        if ctx.greedy:
            return T.top_children(logits, k, normalize=True, kernel=kernel)
        logp = jax.nn.log_softmax(logits, axis=-1)
        lead = (slice(None),) + (None,) * (logits.ndim - 2)  # [B] -> broadcast over the beams
        q = sampling.filtered_probs(logits, row.temperature[lead], row.top_k[lead], row.top_p[lead], row.min_p[lead])
        noise = draft_noise(dparams, row.key, index, ctx.draft.vocab_size)[lead]  # [B, (1,) Vd]
        coupled = jax.nn.log_softmax(sampling.perturbed_log_probs(q, noise), axis=-1)
        return T.top_children(jnp.where(row.coupled[lead][..., None], coupled, logp), k, kernel=kernel)

    def draft_step(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: TreeCarry,
                   draft_kv, block_table: jax.Array, j: int) -> tuple[TreeCarry, object]:
        """Level j+1: step 0 takes the root's top-k children; step j > 0 first runs the draft on
        level j's k beams (stored at t + 1 + (j-1) k + beam, rotated at t + j), fed their parents' h."""
        index = carry.position + 2 + j  # level j+1's children are the tokens at t + 2 + j
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
        for j in range(start, self.facts.num_draft_steps):
            carry, draft_kv = self.draft_step(ctx, dparams, target_embed, carry, draft_kv, block_table, j)
        return carry, draft_kv

    def commit_kv(self, target_kv: KVCache, path: jax.Array, length: jax.Array,
                  block_tables: jax.Array) -> KVCache:
        """Every layer's KV of the path, verified at length + path[d], moved to length + d."""
        src, dst = T.accepted_kv_moves(path, length)
        return KVCache(k=layers.move_kv(target_kv.k, src, dst, block_tables),
                       v=layers.move_kv(target_kv.v, src, dst, block_tables))

    def commit(self, slots: Slots, rows: jax.Array, carry: TreeCarry, greedy: bool) -> Slots:
        """The `tokens` best candidates become the rows' next tree: nodes [B, T] and their parents
        (0: the root) in the verify layout."""
        tree = T.select(self.spec, carry.cand, carry.token)  # [B, T+1] each
        return slots.replace(drafts=slots.drafts.at[rows, :self.spec.tokens].set(tree.tokens[:, 1:]),
                             parents=slots.parents.at[rows, :self.spec.tokens].set(tree.parent[:, 1:]),
                             drafted_by=slots.drafted_by.at[rows].set(self.facts.kind))
