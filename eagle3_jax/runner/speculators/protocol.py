"""The speculator's contract: `facts`, what the host reads (config.SpeculatorFacts), and the device
methods through which alone steps.py verifies, accepts and drafts. B batch, W `facts.verify_width`,
E = `facts.max_accepted` + 1 (the most tokens emitted), C the target's 3 captures, H the drafter's
hidden size."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
from flax import struct

from eagle3_jax.config import DraftConfig, Proposal, SpeculatorFacts
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner import sampling
from eagle3_jax.runner.state import Slots


@dataclasses.dataclass(frozen=True)
class DraftContext:
    """The static half of a draft step (`draft` None: no drafter); a greedy program keeps no q."""

    draft: DraftConfig | None
    attention: str
    gemv: str
    greedy: bool
    pin_kv: object

    @property
    def pallas(self) -> bool:
        return self.attention == "pallas"


@struct.dataclass
class DraftStart:
    """Where the next proposal grows: token [B] (its root) after the last verified position [B], h [B, H]
    the drafter's pre-norm hidden state there, history [B, M] (h, history None if not kept), keys [B, 2]."""

    token: jax.Array
    position: jax.Array
    h: jax.Array | None
    history: jax.Array | None
    row: sampling.RowSampling
    keys: jax.Array


class Speculator(Proposal, Protocol):
    """One kind of proposal; frozen and hashable (part of every StepConfig). A new one is a file
    here and a line in `SPECULATORS` (__init__.py)."""

    @property
    def facts(self) -> SpeculatorFacts:
        """What the host reads of it, fixed at construction."""

    def verify_layout(self, s: Slots) -> tuple[jax.Array, jax.Array, object]:
        """-> tokens [B, W], positions [B, W] their KV is stored at, mask (None: causal; a TreeAttention)."""

    def accept(self, greedy: bool, dparams: DraftParams | None, logits: jax.Array, s: Slots, keys: jax.Array,
               vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array]:
        """logits [B, W, V] -> n accepted [B], emitted [B, E], path [B, E] verify indices (None: 0..n), top1 [B]."""

    def commit_kv(self, target_kv: KVCache, path: jax.Array | None, length: jax.Array,
                  block_tables: jax.Array) -> KVCache:
        """The accepted tokens' target KV moved to length..length+n [B]."""

    def extend_inputs(self, captures: jax.Array, positions: jax.Array, path: jax.Array | None,
                      length: jax.Array) -> tuple[jax.Array, jax.Array]:
        """-> what the drafter's extend reads of the verify: captures [B, E, C], positions [B, E]."""

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
