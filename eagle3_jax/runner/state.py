"""Device state the step functions thread and donate from call to call: nothing returns to the host
between iterations. Slot 0 is the dummy padded rows read and write; its block table is scratch pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from eagle3_jax.config import DUMMY_SLOT, DraftConfig, ModelConfig, ServedConfig, SlotLayout
from eagle3_jax.model.llama import KVCache
from eagle3_jax.runner.sampling import RowSampling

__all__ = ["DUMMY_SLOT", "DeviceState", "SlotLayout", "Slots", "init_state", "state_shardings", "with_drafts",
           "with_history", "with_lengths"]


@struct.dataclass
class Slots:
    """Per-slot state, S = max_num_seqs + 1 rows (row 0 is the dummy)."""

    last_token: jax.Array  # [S] i32, the token at position `length`, not yet in the target cache
    length: jax.Array  # [S] i32, tokens in the target cache
    drafts: jax.Array  # [S, P] i32, proposals in target ids: a chain's K, a tree's T nodes
    draft_probs: jax.Array  # [S, K, V_draft] f32, q a chain's proposals were drawn from ([S, 0, Vd]: a tree)
    sampling: RowSampling
    num_generated: jax.Array  # [S] i32, tokens emitted so far (keys fold it in)
    accepted: jax.Array  # [S, 2] i32: the last iteration's accepted, then the top-1 chain's, for the host
    emitted: jax.Array  # [S, E] i32: emitted[:accepted[:, 0] + 1] are the tokens it emitted
    parents: jax.Array | None = None  # [S, T] i32: a tree's node i+1's parent in the verify layout (0: root)
    drafted_by: jax.Array | None = None  # [S] i32: the `kind` of the pending proposal (0: none yet)
    history: jax.Array | None = None  # [S, M] i32: the row's tokens by position (`SlotLayout.history`)


@struct.dataclass
class DeviceState:
    target_kv: KVCache
    draft_kv: KVCache | None
    slots: Slots


def init_state(target: ModelConfig, draft: DraftConfig | None, served: ServedConfig,
               dtype, layout: SlotLayout) -> DeviceState:
    """Zeros for `served`'s slots (max_num_seqs and the dummy) and KV pool, the slots as `layout` keeps them."""
    s = served.max_num_seqs + 1
    vd = draft.draft_vocab_size if draft else 1
    pages = (served.pool.num_pages, served.pool.page_size)
    target_kv = KVCache.zeros(target.num_layers, *pages, target.num_kv_heads, target.head_dim, dtype)
    draft_kv = (KVCache.zeros(1, *pages, draft.num_kv_heads, draft.head_dim, dtype) if draft else None)
    def zeros_i():  # a fresh buffer each: donated leaves must not alias
        return jnp.zeros((s,), jnp.int32)

    sampling = RowSampling(temperature=jnp.zeros((s,), jnp.float32), top_k=zeros_i(),
                           top_p=jnp.ones((s,), jnp.float32), min_p=jnp.zeros((s,), jnp.float32),
                           key=jnp.zeros((s, 2), jnp.uint32), one_hot=jnp.zeros((s,), bool),
                           coupled=jnp.zeros((s,), bool))
    # A fresh slot's tree (parents 0) is every node under the root: a valid tree to verify.
    parents = jnp.zeros((s, layout.proposals), jnp.int32) if layout.parents else None
    slots = Slots(last_token=zeros_i(), length=zeros_i(), drafts=jnp.zeros((s, layout.proposals), jnp.int32),
                  draft_probs=jnp.zeros((s, layout.q_rows, vd), jnp.float32), sampling=sampling,
                  num_generated=zeros_i(), accepted=jnp.zeros((s, 2), jnp.int32),
                  emitted=jnp.zeros((s, layout.emitted), jnp.int32), parents=parents, drafted_by=zeros_i(),
                  history=jnp.zeros((s, history_width(served)), jnp.int32) if layout.history else None)
    return DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots)


def history_width(served: ServedConfig) -> int:
    return served.pool.max_blocks_per_seq * served.pool.page_size


def with_history(state: DeviceState, slot, row) -> DeviceState:
    """The state with `slot`'s token history set to `row` [M] (the slots keep one)."""
    slots = state.slots
    return state.replace(slots=slots.replace(history=slots.history.at[slot].set(row)))


def with_drafts(state: DeviceState, rows, drafts, parents=None) -> DeviceState:
    """The state with the first w pending proposals of `rows` [B] set to `drafts` [B, w] (target ids;
    their q rows are left as they are), and a tree's node parents to `parents` [B, w] where given."""
    slots = state.slots
    slots = slots.replace(drafts=slots.drafts.at[rows, :drafts.shape[1]].set(drafts))
    if parents is not None:
        slots = slots.replace(parents=slots.parents.at[rows, :parents.shape[1]].set(parents))
    return state.replace(slots=slots)


def with_lengths(state: DeviceState, rows, length: int) -> DeviceState:
    """The state with `rows`' cached lengths set to `length` (for timing a step at a context)."""
    slots = state.slots
    return state.replace(slots=slots.replace(length=slots.length.at[rows].set(length)))


def state_shardings(state: DeviceState, target: ModelConfig, draft: DraftConfig | None, mesh: Mesh):
    """Under tensor parallelism the target's KV pages split by kv heads (where they divide), the rest replicated."""
    from eagle3_jax.parallel import sharding

    tp = mesh.shape[sharding.TP]
    specs = DeviceState(target_kv=sharding.llama_cache_specs(target, tp),
                        draft_kv=sharding.draft_cache_specs(draft, tp) if draft else None,
                        slots=sharding.replicated_like(state.slots))
    return sharding.named(mesh, specs)
