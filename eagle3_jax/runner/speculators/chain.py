"""The EAGLE-3 chain: K proposals in a line, proposal j continuing proposal j-1.

Verified at positions n..n+K under the causal mask, accepted by the longest matching prefix
(greedy) or by rejection sampling on the draft's own q, its KV already where the accepted tokens
belong. Draft positions: the draft pairs the target capture at position t with the embedding of
token t+1 and runs at RoPE position t; step j runs at t+j (docs/EAGLE3.md, "The draft forward pass").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import SlotLayout, SpeculatorFacts, TreeSpec
from eagle3_jax.model import eagle3
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner import sampling
from eagle3_jax.runner.speculators.protocol import DraftContext, DraftStart
from eagle3_jax.runner.state import Slots


@struct.dataclass
class DraftCarry:
    """What one chain step hands the next."""

    h: jax.Array | None  # [B, H] pre-norm draft hidden at `position` (None: a drafter-free chain)
    token: jax.Array  # [B] the token after `position` (target id): the next step's input
    position: jax.Array  # [B]
    drafts: jax.Array  # [B, K] proposals so far (target ids)
    q: jax.Array  # [B, K, Vd] the distributions they were drawn from
    row: sampling.RowSampling  # [B]
    keys: jax.Array  # [B, 2]


def draft_noise(dparams: DraftParams, keys: jax.Array, index: jax.Array, vocab_size: int) -> jax.Array:
    """The coupling noise of the token at `index` [B] (or [B, ...]) over the draft vocabulary
    [B, (...,) Vd]: the target's noise (`sampling.coupling_noise`) at the draft tokens' target ids,
    so the draft perturbs each token exactly as the target's verify will."""
    ids = jnp.arange(dparams.d2t.shape[0]) + dparams.d2t  # [Vd] target ids
    return jnp.take(sampling.coupling_noise(keys, index, vocab_size), ids, axis=-1)


def _draft_token(logits: jax.Array, row: sampling.RowSampling, keys: jax.Array, greedy: bool,
                 noise: jax.Array | None = None):
    """Draft logits [B, Vd] -> (draft ids [B], q [B, Vd], None in a greedy program). Greedy rows
    take the argmax, coupled rows the coupled draw under `noise`, the others a sample of q."""
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

    @functools.cached_property
    def facts(self) -> SpeculatorFacts:
        """Each proposal drawn from q, which the slots keep for the verify."""
        return SpeculatorFacts(label=f"chain K={self.k}", spec=TreeSpec.chain(self.k) if self.k else None, kind=1,
                               uses_drafter=True, point_mass=False, top1_chain=self.k, measures_top1_chain=False,
                               num_draft_steps=self.k, max_accepted=self.k, verify_width=self.k + 1,
                               positions_per_iteration=self.k + 1,
                               slot_layout=SlotLayout(proposals=self.k, q_rows=self.k, parents=False,
                                                      emitted=self.k + 1))

    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, None]:
        tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :self.k]], axis=1)
        return tokens, s.length[:, None] + jnp.arange(self.k + 1), None

    def accept(self, greedy: bool, dparams: DraftParams | None, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int) -> tuple[jax.Array, jax.Array, None, jax.Array]:
        drafts = s.drafts[:, :self.k]
        valid = s.drafted_by == self.facts.kind  # [B]: the row's pending proposals are this kind's
        if greedy:
            n, emitted = sampling.greedy_verify(logits, drafts, valid)
        else:
            keeps_q = self.k and self.facts.slot_layout.q_rows
            q = _target_probs(dparams, s.draft_probs[:, :self.k], vocab_size) if keeps_q else None
            # Logits row i chooses the token at position length + 1 + i.
            noise = sampling.coupling_noise(s.sampling.key, s.length[:, None] + 1 + jnp.arange(self.k + 1),
                                            vocab_size)
            n, emitted = sampling.verify_chain(logits, drafts, q, s.sampling, keys, noise, valid)
        return n, emitted, None, n

    def commit_kv(self, target_kv: KVCache, path: None, length: jax.Array, block_tables: jax.Array) -> KVCache:
        return target_kv  # proposal j was verified at the position it was drafted for

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: None,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        return captures, positions

    def start(self, ctx: DraftContext, at: DraftStart) -> DraftCarry:
        b, vd = at.token.shape[0], ctx.draft.draft_vocab_size if ctx.draft else 1
        return DraftCarry(h=at.h, token=at.token, position=at.position, drafts=jnp.zeros((b, self.k), jnp.int32),
                          q=jnp.zeros((b, self.k, vd), jnp.float32), row=at.row, keys=at.keys)

    def draft_step(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: DraftCarry,
                   draft_kv, block_table: jax.Array, j: int) -> tuple[DraftCarry, object]:
        """Proposal j. Step 0 reads the verified position's hidden state; step j > 0 first runs
        the draft on proposal j-1 at the next position, fed its own h."""
        h, position = carry.h, carry.position
        if j > 0:
            out, draft_kv = eagle3.draft_forward(dparams, ctx.draft, target_embed, carry.token[:, None], h[:, None],
                                                 (position + 1)[:, None], draft_kv, block_table, ctx.attention,
                                                 ctx.pin_kv, ctx.gemv)
            h, position = out[:, 0], position + 1
        logits = eagle3.draft_logits(dparams, ctx.draft, h, ctx.gemv)  # [B, Vd]
        # The proposal is the token at position + 2 (the draft pairs capture t with token t + 1).
        noise = None if ctx.greedy else draft_noise(dparams, carry.row.key, position + 2, ctx.draft.vocab_size)
        ids, q = _draft_token(logits, carry.row, sampling.fold_in_rows(carry.keys, j), ctx.greedy, noise)
        token = eagle3.to_target_ids(dparams, ids)
        carry = carry.replace(h=h, token=token, position=position, drafts=carry.drafts.at[:, j].set(token))
        return (carry if q is None else carry.replace(q=carry.q.at[:, j].set(q))), draft_kv

    def propose(self, ctx: DraftContext, dparams: DraftParams, target_embed: jax.Array, carry: DraftCarry,
                draft_kv, block_table: jax.Array, start: int = 0) -> tuple[DraftCarry, object]:
        for j in range(start, self.facts.num_draft_steps):
            carry, draft_kv = self.draft_step(ctx, dparams, target_embed, carry, draft_kv, block_table, j)
        return carry, draft_kv

    def commit(self, slots: Slots, rows: jax.Array, carry: DraftCarry, greedy: bool) -> Slots:
        """A greedy program leaves q as it is: greedy verification never reads it, and a sampled
        row only ever runs in sampling programs, which write its q."""
        slots = slots.replace(drafts=slots.drafts.at[rows, :self.k].set(carry.drafts),
                              drafted_by=slots.drafted_by.at[rows].set(self.facts.kind))
        if not greedy and self.facts.slot_layout.q_rows:
            slots = slots.replace(draft_probs=slots.draft_probs.at[rows].set(carry.q))  # [S, K, Vd] f32
        return slots
