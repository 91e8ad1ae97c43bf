"""The speculator seam: the shape of a proposal and how the target verifies it.

A speculator answers four questions for the step functions (`steps.py`), which call nothing
chain-specific themselves:
  layout:  which tokens the target verifies, at which positions, under which attention mask;
  accept:  which of them the target's logits accept, and the tokens the row emits;
  draft:   the draft steps that build the next proposal from the verified position;
  commit:  what the accepted proposal leaves in the KV caches and slots.

`Chain(K)` is K proposals in a line, proposal j continuing proposal j-1: verified at positions
n..n+K under the causal mask, accepted by the longest matching prefix (greedy) or by rejection
sampling on the draft's own q, its KV already where the accepted tokens belong. A tree (EAGLE-2's
dynamic tree) implements the same four with an ancestor mask and a KV move of the accepted path.

Draft positions: the draft pairs the target capture at position t with the embedding of token
t+1 and runs at RoPE position t; chain step j runs at position t+j (docs/EAGLE3.md, "The draft
forward pass").
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import DraftConfig
from eagle3_jax.model import eagle3
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.parallel.sharding import vocab_logits
from eagle3_jax.runner import sampling
from eagle3_jax.runner.state import Slots


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
    mesh: object  # jax.sharding.Mesh | None: pins the drafter's KV and logits under tensor parallelism
    pin_kv: object  # the draft forward's `pin_kv` (None on one device)


def _draft_token(logits: jax.Array, row: sampling.RowSampling, keys: jax.Array, greedy: bool):
    """Draft logits [B, Vd] -> (draft ids [B], q [B, Vd]). Greedy rows take the argmax; a greedy
    program has no q (None: greedy verification never reads it)."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return greedy_ids, None
    q = sampling.filtered_probs(logits, row.temperature, row.top_k, row.top_p, row.min_p)
    return jnp.where(row.greedy, greedy_ids, sampling.sample_rows(q, keys)), q


def _target_probs(dparams: DraftParams, q: jax.Array, vocab_size: int) -> jax.Array:
    """q over the draft vocabulary [B, K, Vd] -> the same mass at target ids [B, K, V]."""
    ids = jnp.arange(q.shape[-1]) + dparams.d2t
    return jnp.zeros((*q.shape[:-1], vocab_size), q.dtype).at[..., ids].set(q)


@dataclasses.dataclass(frozen=True)
class Chain:
    """K proposals in a line; a chain of 0 is the target alone (it verifies the last token)."""

    k: int

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

    # ---- layout ---------------------------------------------------------------------------
    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, None]:
        """-> (tokens [B, K+1], positions [B, K+1], attention mask: None, the causal one)."""
        tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :self.k]], axis=1)
        return tokens, s.length[:, None] + jnp.arange(self.k + 1), None

    # ---- accept ---------------------------------------------------------------------------
    def accept(self, greedy: bool, dparams: DraftParams, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int) -> tuple[jax.Array, jax.Array]:
        """Target logits [B, K+1, V] -> (num_accepted [B], emitted [B, K+1]): row b emits
        emitted[b, :num_accepted[b] + 1]."""
        drafts = s.drafts[:, :self.k]
        if greedy:
            return sampling.greedy_verify(logits, drafts)
        q = _target_probs(dparams, s.draft_probs, vocab_size) if self.k else None
        return sampling.verify_chain(logits, drafts, q, s.sampling, keys)

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
        logits = vocab_logits(eagle3.draft_logits(dparams, ctx.draft, h, ctx.gemv), ctx.mesh, gather=not ctx.greedy)
        ids, q = _draft_token(logits, carry.row, sampling.fold_in_rows(carry.keys, j), ctx.greedy)
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
    def commit(self, slots: Slots, rows: jax.Array, carry: DraftCarry, greedy: bool) -> Slots:
        """Store the proposals and their q in the slots for the next iteration to verify. A
        greedy program keeps the slots' q as they are: its rows are verified greedily, which never
        reads q, and a sampled row only ever runs in sampling programs, which write its q. The
        chain's KV needs no move: proposal j was verified at the position it drafted for."""
        slots = slots.replace(drafts=slots.drafts.at[rows].set(carry.drafts))
        if not greedy:
            slots = slots.replace(draft_probs=slots.draft_probs.at[rows].set(carry.q))  # [S, K, Vd] f32
        return slots
