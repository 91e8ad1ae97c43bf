"""The compiled, fixed-shape step functions: our CUDA graphs.

Two executables per shape bucket, both pure `DeviceState -> DeviceState` functions that donate the
state (the KV pool is updated in place):

  prefill(chunk [1, T])     target prefill of one prompt chunk + the draft prefill over the same
                            chunk (ids shifted left by one, the target's captures); on the last
                            chunk it also samples the first token and drafts the first K proposals.
  iterate(rows [B])         one whole speculative iteration: target verify of K+1 tokens, lossless
                            acceptance, draft extend over the verified positions (overwriting the
                            draft KV its own chain wrote, with the target's captures), K-1 chain
                            steps for the next proposals. No host round trip inside.

Draft positions: the draft pairs the target capture at position t with the embedding of token
t+1 and uses RoPE position t; chain step j runs at position t+j (../shared/EAGLE3.md, section 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jax.sharding import Mesh

from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.engine import sampling
from eagle3_jax.engine.state import DUMMY_SLOT, DeviceState, Slots, state_shardings
from eagle3_jax.model import eagle3, llama
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import LlamaParams
from eagle3_jax.parallel.sharding import replicate, vocab_logits

# Independent PRNG streams under each (row key, tokens generated) pair.
_STREAM_DRAFT, _STREAM_VERIFY, _STREAM_FIRST = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static part of every step function (hashable: one executable per distinct value)."""

    target: ModelConfig
    draft: DraftConfig | None
    num_draft: int  # K; 0 without a drafter
    mesh: Mesh | None = None  # tensor parallelism: pins the Megatron layout of activations

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.num_draft > 0


def _target(params: LlamaParams, cfg: StepConfig, tokens, positions, kv, block_tables):
    """Target forward with the residual stream replicated across tensor-parallel devices."""
    hidden, captures, kv = llama.forward(params, cfg.target, tokens, positions, kv, block_tables)
    return (*replicate((hidden, captures), cfg.mesh), kv)


def _finish(state: DeviceState, cfg: StepConfig) -> DeviceState:
    """The state leaves in the layout it came in, so donation lines up and nothing recompiles."""
    if cfg.mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, cfg.target, cfg.draft, cfg.mesh))


def _gather(tree, rows: jax.Array):
    return jax.tree_util.tree_map(lambda x: x[rows], tree)


def _write_slots(slots: Slots, rows: jax.Array, values: Slots) -> Slots:
    slots = jax.tree_util.tree_map(lambda x, v: x.at[rows].set(v), slots, values)
    # Padded rows all wrote the dummy slot: reset it so its positions never grow.
    return slots.replace(length=slots.length.at[DUMMY_SLOT].set(0))


def _draft_token(logits: jax.Array, row: sampling.RowSampling, keys: jax.Array):
    """Draft logits [B, Vd] -> (draft ids [B], q [B, Vd]). Greedy rows take the argmax."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        q = sampling.filtered_probs(logits, row.temperature, row.top_k, row.top_p, row.min_p)
        return jnp.where(row.greedy, greedy_ids, sampling.sample_rows(q, keys)), q

    # Greedy batches skip the sort over the vocabulary entirely.
    return jax.lax.cond(jnp.all(row.greedy), lambda _: (greedy_ids, jnp.zeros_like(logits)), sampled, None)


def propose(dparams: DraftParams, cfg: StepConfig, target_embed: jax.Array, h: jax.Array,
            token: jax.Array, position: jax.Array, draft_kv: llama.KVCache, block_table: jax.Array,
            row: sampling.RowSampling, keys: jax.Array):
    """K proposals from the draft state at the last verified position.

    h [B, H] pre-norm draft hidden at `position` [B]; token [B] is the token after it (already in
    the output, not yet in the target cache). -> (drafts [B, K] target ids, q [B, K, Vd], draft_kv).
    """
    dcfg = cfg.draft
    drafts, qs = [], []
    for j in range(cfg.num_draft):
        if j > 0:  # chain step: the previous proposal at the next position, fed our own h
            out, draft_kv = eagle3.draft_forward(dparams, dcfg, target_embed, token[:, None], h[:, None],
                                                 (position + j)[:, None], draft_kv, block_table)
            h = out[:, 0]
        logits = vocab_logits(eagle3.draft_logits(dparams, dcfg, h), cfg.mesh)
        ids, q = _draft_token(logits, row, sampling.fold_in_rows(keys, j))
        token = eagle3.to_target_ids(dparams, ids)
        drafts.append(token)
        qs.append(q)
    return jnp.stack(drafts, axis=1), jnp.stack(qs, axis=1), draft_kv


def _target_probs(dparams: DraftParams, q: jax.Array, vocab_size: int) -> jax.Array:
    """q over the draft vocabulary [B, K, Vd] -> the same mass at target ids [B, K, V]."""
    ids = jnp.arange(q.shape[-1]) + dparams.d2t
    return jnp.zeros((*q.shape[:-1], vocab_size), q.dtype).at[..., ids].set(q)


def _verify(cfg: StepConfig, dparams, logits, drafts, draft_probs, row, keys):
    """Accept/reject the proposals: (num_accepted [B], emitted [B, K+1])."""
    if not cfg.speculative:
        return sampling.verify_chain(logits, drafts, None, row, keys)

    def sampled(_):
        q = _target_probs(dparams, draft_probs, cfg.target.vocab_size)
        return sampling.verify_chain(logits, drafts, q, row, keys)

    return jax.lax.cond(jnp.all(row.greedy), lambda _: sampling.greedy_verify(logits, drafts), sampled, None)


def iterate(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
            block_tables: jax.Array, cfg: StepConfig) -> tuple[DeviceState, jax.Array, jax.Array]:
    """One speculative iteration for the slots `rows` [B] with block tables [B, nb].

    -> (state, num_accepted [B] i32, emitted [B, K+1] i32): row b emitted
    emitted[b, :num_accepted[b] + 1]; entries after are padding.
    """
    k = cfg.num_draft if cfg.speculative else 0
    s = _gather(state.slots, rows)
    tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :k]], axis=1)  # [B, K+1]
    positions = s.length[:, None] + jnp.arange(k + 1)  # [B, K+1]
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_tables)
    logits = vocab_logits(llama.logits(params, hidden), cfg.mesh)  # [B, K+1, V]
    step_keys = sampling.fold_in_rows(s.sampling.key, s.num_generated)
    n, emitted = _verify(cfg, dparams, logits, s.drafts[:, :k], s.draft_probs,
                         s.sampling, sampling.fold_in_rows(step_keys, _STREAM_VERIFY))
    last = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]  # correction or bonus token
    num_generated = s.num_generated + n + 1
    drafts, draft_probs, draft_kv = s.drafts, s.draft_probs, state.draft_kv
    if cfg.draft is not None:
        # Draft extend: position t pairs capture t with the token at t+1, for t = length..length+n.
        # It runs in target-only buckets too (one position), so the draft's KV has no holes when
        # speculation resumes.
        ext_tokens = jnp.where(jnp.arange(k + 1) <= n[:, None], emitted, 0)
        h, draft_kv = eagle3.draft_forward(dparams, cfg.draft, params.embed, ext_tokens,
                                           eagle3.fuse_captures(dparams, captures), positions,
                                           draft_kv, block_tables)
    if cfg.speculative:
        h_last = jnp.take_along_axis(h, n[:, None, None], axis=1)[:, 0]  # [B, H] at length + n
        draft_keys = sampling.fold_in_rows(sampling.fold_in_rows(s.sampling.key, num_generated), _STREAM_DRAFT)
        drafts, draft_probs, draft_kv = propose(dparams, cfg, params.embed, h_last, last, s.length + n,
                                                draft_kv, block_tables, s.sampling, draft_keys)
    new = s.replace(last_token=last, length=s.length + n + 1, drafts=drafts, draft_probs=draft_probs,
                    num_generated=num_generated)
    slots = _write_slots(state.slots, rows, new)
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg), n, emitted


def prefill(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, tokens: jax.Array,
            next_tokens: jax.Array, num_valid: jax.Array, start: jax.Array, slot: jax.Array,
            block_table: jax.Array, row: sampling.RowSampling,
            cfg: StepConfig) -> tuple[DeviceState, jax.Array]:
    """Prefill one chunk of one prompt into `slot`.

    tokens [1, T] (padded after num_valid [1]), next_tokens [1, T]: the same ids shifted left by
    one; its entry num_valid-1 is the next prompt token, or -1 on the last chunk, where the
    sampled first token goes; start [1]: position of tokens[0]; block_table
    [1, nb]; row: the request's sampling parameters [1].
    -> (state, first generated token [1]; meaningful on the last chunk only).
    The slot's state is written on every chunk; the last chunk's write is the one that stays.
    """
    t = tokens.shape[1]
    positions = start[:, None] + jnp.arange(t)  # [1, T]
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_table)
    last_idx = num_valid - 1
    last_hidden = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]  # [1, D]
    base_keys = sampling.fold_in_rows(row.key, 0)
    first = sampling.sample_logits(vocab_logits(llama.logits(params, last_hidden), cfg.mesh), row,
                                   sampling.fold_in_rows(base_keys, _STREAM_FIRST))  # [1]
    length = start + num_valid
    k = cfg.num_draft if cfg.speculative else 0
    drafts = jnp.zeros((1, k), jnp.int32)
    draft_probs = jnp.zeros((1, k, state.slots.draft_probs.shape[-1]), jnp.float32)
    draft_kv = state.draft_kv
    if cfg.speculative:
        # next_tokens holds -1 where the token the target just produced belongs (last chunk).
        shifted = jnp.where(next_tokens < 0, first[:, None], next_tokens)
        h, draft_kv = eagle3.draft_forward(dparams, cfg.draft, params.embed, shifted,
                                           eagle3.fuse_captures(dparams, captures), positions,
                                           draft_kv, block_table)
        h_last = jnp.take_along_axis(h, last_idx[:, None, None], axis=1)[:, 0]
        draft_keys = sampling.fold_in_rows(sampling.fold_in_rows(row.key, 1), _STREAM_DRAFT)
        drafts, draft_probs, draft_kv = propose(dparams, cfg, params.embed, h_last, first, length - 1,
                                                draft_kv, block_table, row, draft_keys)
    new = Slots(last_token=first, length=length, drafts=drafts, draft_probs=draft_probs, sampling=row,
                num_generated=jnp.ones_like(length))
    slots = _write_slots(state.slots, slot, new)
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg), first


# One executable per input shape (batch bucket, chunk bucket) and StepConfig; state donated.
prefill_step = jax.jit(prefill, static_argnames="cfg", donate_argnames="state")
iterate_step = jax.jit(iterate, static_argnames="cfg", donate_argnames="state")
