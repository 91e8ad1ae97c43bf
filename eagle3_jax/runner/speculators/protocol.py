"""The speculator's contract with the step functions (`runner/steps.py`).

An iteration verifies the row's pending proposal, accepts part of it, and drafts the next one;
steps.py does exactly that through the methods below and calls nothing chain-, tree- or
n-gram-specific itself. B is the batch, W = `verify_width`, E = `emitted_width`, C the target's
captures (3 hidden states), H the drafter's hidden size.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
from flax import struct

from eagle3_jax.config import DraftConfig, TreeSpec
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner import sampling
from eagle3_jax.runner.state import SlotLayout, Slots


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """The static half of a draft step: the drafter (None when the speculator needs none), how
    its forward runs, and whether the program is greedy (a greedy program keeps no q)."""

    draft: DraftConfig | None
    attention: str
    gemv: str
    greedy: bool
    pin_kv: object  # the draft forward's `pin_kv` (None on one device)

    @property
    def pallas(self) -> bool:
        """The draft runs on the Pallas kernels (attention, a tree level's top-k)."""
        return self.attention == "pallas"


@struct.dataclass
class DraftStart:
    """Where the next proposal grows from, after the verify (or a prefill's last chunk)."""

    token: jax.Array  # [B] the row's last token, at position + 1: the proposal's root
    position: jax.Array  # [B] the last verified position
    h: jax.Array | None  # [B, H] the drafter's pre-norm hidden state at `position` (None: no drafter)
    history: jax.Array | None  # [B, M] the row's tokens by position, through position + 1 (None: not kept)
    row: sampling.RowSampling  # [B]
    keys: jax.Array  # [B, 2] this iteration's draft PRNG keys


class Speculator(Protocol):
    """What one kind of proposal is: frozen and hashable (part of every StepConfig).

    Shape: `num_proposals` tokens per slot between iterations, `verify_width` tokens verified per
    row, up to `max_accepted` of them accepted, `emitted_width` tokens emitted at most, and
    `positions_per_iteration` KV positions written past the row's length (the scheduler's
    footprint). `slot_layout` says what the slots keep for it; `kind` tags its proposals in
    `Slots.drafted_by`, so a verify of one kind treats another kind's pending proposal as none.
    """

    kind: int
    label: str  # how tables and logs name it: "chain K=4", "tree 6,8,31", "ngram K=4"
    spec: TreeSpec  # its shape as EngineConfig names proposals
    uses_drafter: bool  # whether it drafts with the EAGLE-3 head (else it needs none)
    point_mass: bool  # its proposals are a function of the context: no q is kept, one-hot or coupled rules
    # A chain of the drafter's top-1 tokens of this length (0: not one): a tree's verify can say
    # what it would have accepted, so the engine measures it without running it.
    top1_chain: int
    measures_top1_chain: bool  # its verify reports `top1_chain` acceptance (`accept`'s top1)
    num_proposals: int
    num_draft_steps: int  # draft programs per iteration (the per-step path runs 1..n-1 apart)
    max_accepted: int
    verify_width: int
    emitted_width: int
    positions_per_iteration: int
    slot_layout: SlotLayout

    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, object]:
        """-> (tokens [B, W], positions [B, W] where their KV is stored, mask: None for causal or a
        layers.TreeAttention)."""

    def accept(self, greedy: bool, dparams: DraftParams | None, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
        """Target logits [B, W, V] -> (num_accepted [B], emitted [B, E], path [B, E] of the accepted
        verify indices or None where they are 0..n, top1 [B]: `top1_chain` acceptance or -1)."""

    def commit_kv(self, target_kv: KVCache, path: jax.Array | None, length: jax.Array,
                  block_tables: jax.Array) -> KVCache:
        """The accepted tokens' target KV moved to length..length+n, where they belong."""

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: jax.Array | None,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """What the drafter's extend reads of the verify: (captures [B, E, C], positions [B, E])."""

    def start(self, ctx: DraftContext, at: DraftStart) -> object:
        """The draft carry (a pytree) at `at`."""

    def draft_step(self, ctx: DraftContext, dparams: DraftParams | None, target_embed: jax.Array, carry,
                   draft_kv: KVCache | None, block_table: jax.Array, j: int) -> tuple[object, KVCache | None]:
        """Draft step j (static) of `num_draft_steps`."""

    def propose(self, ctx: DraftContext, dparams: DraftParams | None, target_embed: jax.Array, carry,
                draft_kv: KVCache | None, block_table: jax.Array, start: int = 0) -> tuple[object, KVCache | None]:
        """Draft steps start..num_draft_steps-1 in one program."""

    def commit(self, slots: Slots, rows: jax.Array, carry, greedy: bool) -> Slots:
        """Store the new proposal in the rows' slots (and tag it with `kind`)."""
