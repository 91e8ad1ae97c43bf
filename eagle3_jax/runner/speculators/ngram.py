"""Prompt lookup: K proposals copied from the row's own history, no drafter.

The proposal is what followed the latest earlier occurrence of the row's last n tokens, for the
longest n in max_n..1 that occurs, repeated with its period past the row's end (a loop of d tokens
is proposed whole); no match proposes the last token K times. A chain in all the target sees,
drafted in one step from `Slots.history`; point mass, so no q is kept.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from eagle3_jax.config import ConfigError, DraftConfig, SlotLayout, SpeculatorFacts, TreeSpec
from eagle3_jax.runner.speculators.chain import Chain
from eagle3_jax.runner.speculators.protocol import DraftContext, DraftStart


@struct.dataclass
class NGramCarry:
    """history [B, M] the row's tokens by position, last [B] its last token's position, drafts [B, K]."""

    history: jax.Array
    last: jax.Array
    drafts: jax.Array


def lookup(history: jax.Array, last: jax.Array, k: int, max_n: int) -> jax.Array:
    """history [B, M], last [B] -> the K proposals [B, K] for positions last+1..last+K."""
    m = history.shape[1]
    ends = jnp.arange(m)
    match = ends < last[:, None]  # [B, M]: candidate ends j of an earlier occurrence
    latest = []  # n = 1..max_n: [B] the end of the latest occurrence of the last n tokens, -1 if none
    for i in range(max_n):  # the n = i + 1 windows are the n = i ones whose token i back matches too
        suffix = jnp.take_along_axis(history, jnp.maximum(last - i, 0)[:, None], axis=1)
        shifted = jnp.pad(history, ((0, 0), (i, 0)), constant_values=-1)[:, :m]  # shifted[:, j] = history[:, j - i]
        match &= (shifted == suffix) & (ends >= i) & (last[:, None] >= i)
        latest.append(jnp.max(jnp.where(match, ends, -1), axis=1))
    end = jnp.full_like(last, -1)
    for found in reversed(latest):  # the longest n that occurs wins
        end = jnp.where(end < 0, found, end)
    period = jnp.maximum(last - end, 1)
    index = end[:, None] + 1 + jnp.arange(k) % period[:, None]
    index = jnp.where(end[:, None] >= 0, index, last[:, None])
    return jnp.take_along_axis(history, index, axis=1)


@dataclasses.dataclass(frozen=True)
class NGram(Chain):
    """K proposals by prompt lookup over suffixes of up to max_n tokens."""

    max_n: int = 4

    @functools.cached_property
    def facts(self) -> SpeculatorFacts:
        """The chain's, but drafted in one step from the row's history, with no drafter and no q; not
        the drafter's chain, so a tree's verify says nothing of it."""
        return dataclasses.replace(Chain(self.k).facts, label=f"ngram K={self.k}", kind=3, uses_drafter=False,
                                   point_mass=True, top1_chain=0, num_draft_steps=1 if self.k else 0,
                                   slot_layout=SlotLayout(proposals=self.k, q_rows=0, parents=False,
                                                          emitted=self.k + 1, history=True))

    def start(self, ctx: DraftContext, at: DraftStart) -> NGramCarry:
        return NGramCarry(history=at.history, last=at.position + 1,
                          drafts=jnp.zeros((at.token.shape[0], self.k), jnp.int32))

    def draft_step(self, ctx: DraftContext, dparams, target_embed: jax.Array, carry: NGramCarry, draft_kv,
                   block_table: jax.Array, j: int) -> tuple[NGramCarry, object]:
        return carry.replace(drafts=lookup(carry.history, carry.last, self.k, self.max_n)), draft_kv


def proposals(specs: tuple[TreeSpec, ...], draft: DraftConfig | None) -> tuple[NGram, ...]:
    """The n-gram speculator of an engine: the chain of K (none for K = 0)."""
    if draft is not None:
        raise ConfigError("speculator ngram drafts from the prompt and needs no drafter: pass draft=None")
    if trees := [s for s in specs if not s.is_chain]:
        raise ConfigError(f"speculator ngram proposes a chain; tree {trees[0].label} needs the EAGLE-3 drafter")
    return tuple(NGram(s.steps) for s in specs[:1])
