"""The compiled, fixed-shape step functions: our CUDA graphs.

Two executables per shape bucket, both pure `DeviceState -> DeviceState` functions that donate the
state (the KV pool is updated in place):

  prefill(chunks [P, T])    target prefill of one chunk of each of P prompts + the draft prefill
                            over the same chunks (ids shifted left by one, the target's captures);
                            on a prompt's last chunk it also samples the first token (left in the
                            slot's last_token, `read_first_token` copies it out) and drafts the
                            first K proposals.
  iterate(rows [B])         one whole speculative iteration: target verify of K+1 tokens, lossless
                            acceptance, draft extend over the verified positions (overwriting the
                            draft KV its own chain wrote, with the target's captures), K-1 chain
                            steps for the next proposals. No host round trip inside.

The same iteration also exists as K + 1 programs (`iterate_head`, `chain_step` per proposal,
`commit_proposals`), dispatched back to back by the driver with the `DraftCarry` pytree threaded
between them, for `EngineConfig(fused_iteration=False)`: both paths run the same functions.

Draft positions: the draft pairs the target capture at position t with the embedding of token
t+1 and uses RoPE position t; chain step j runs at position t+j (../shared/EAGLE3.md, section 2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.runner import sampling
from eagle3_jax.runner.state import DUMMY_SLOT, DeviceState, Slots, state_shardings
from eagle3_jax.model import eagle3, llama
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import LlamaParams
from eagle3_jax.parallel.sharding import cache_pin, replicate, vocab_logits

# Independent PRNG streams under each (row key, tokens generated) pair.
_STREAM_DRAFT, _STREAM_VERIFY, _STREAM_FIRST = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static part of every step function (hashable: one executable per distinct value)."""

    target: ModelConfig
    draft: DraftConfig | None
    num_draft: int  # K; 0 without a drafter
    mesh: Mesh | None = None  # tensor parallelism: pins the Megatron layout of activations
    # Every row of the batch is greedy: argmax only, no sampling code. The host knows each
    # request's parameters, so it picks the program, as vLLM's sampler checks `all_greedy` on the
    # host. Deciding on the device instead (`lax.cond(all(greedy), ...)`) costs a host-device
    # synchronization per cond on the GPU: XLA's ConditionalThunk copies the predicate to the host
    # and blocks until the stream reaches it, which stalls the overlapped loop K + 1 times an
    # iteration. The steps below branch only on this static flag.
    greedy: bool = False
    attention: str = "xla"  # paged attention of these steps: "xla" or "pallas" (EngineConfig.attention)
    gemv: str = "xla"  # few-row weight projections: "xla" or "mosaic" (EngineConfig.gemv)

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.num_draft > 0

    def pin_target_kv(self):
        """The target forward's `pin_kv` (None on one device)."""
        return cache_pin(self.mesh, self.target.num_kv_heads)

    def pin_draft_kv(self):
        """The draft forward's `pin_kv` (None on one device)."""
        return cache_pin(self.mesh, self.draft.num_kv_heads)


def _target(params: LlamaParams, cfg: StepConfig, tokens, positions, kv, block_tables):
    """Target forward with the residual stream replicated across tensor-parallel devices."""
    hidden, captures, kv = llama.forward(params, cfg.target, tokens, positions, kv, block_tables, cfg.attention,
                                         cfg.pin_target_kv(), cfg.gemv)
    return (*replicate((hidden, captures), cfg.mesh), kv)


def _finish(state: DeviceState, cfg: StepConfig) -> DeviceState:
    """The state leaves in the layout it came in, so donation lines up and nothing recompiles."""
    if cfg.mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, cfg.target, cfg.draft, cfg.mesh))


def _keys(row_key: jax.Array, num_generated, stream: int) -> jax.Array:
    """Per-row PRNG keys [B, 2] for one (tokens generated so far, stream) pair: a row's randomness
    never depends on what else is in the batch, and the streams are independent."""
    return sampling.fold_in_rows(sampling.fold_in_rows(row_key, num_generated), stream)


def _draft_extend(dparams: DraftParams, cfg: StepConfig, target_embed: jax.Array, next_tokens: jax.Array,
                  captures: jax.Array, positions: jax.Array, draft_kv: llama.KVCache, block_tables: jax.Array,
                  index: jax.Array) -> tuple[jax.Array, llama.KVCache]:
    """The draft over target-verified positions: capture t paired with the token at t+1
    (next_tokens [B, T]), RoPE position t. -> (pre-norm h [B, H] at `index` [B], draft_kv)."""
    h, draft_kv = eagle3.draft_forward(dparams, cfg.draft, target_embed, next_tokens,
                                       eagle3.fuse_captures(dparams, captures, cfg.gemv), positions, draft_kv,
                                       block_tables, cfg.attention, cfg.pin_draft_kv(), cfg.gemv)
    return jnp.take_along_axis(h, index[:, None, None], axis=1)[:, 0], draft_kv


def _gather(tree, rows: jax.Array):
    return jax.tree_util.tree_map(lambda x: x[rows], tree)


def _write_slots(slots: Slots, rows: jax.Array, values: Slots) -> Slots:
    slots = jax.tree_util.tree_map(lambda x, v: x.at[rows].set(v), slots, values)
    # Padded rows all wrote the dummy slot: reset it so its positions never grow.
    return slots.replace(length=slots.length.at[DUMMY_SLOT].set(0))


def _draft_token(logits: jax.Array, row: sampling.RowSampling, keys: jax.Array, greedy: bool):
    """Draft logits [B, Vd] -> (draft ids [B], q [B, Vd]). Greedy rows take the argmax; a greedy
    program (`StepConfig.greedy`) has no q (None: greedy verification never reads it)."""
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy:
        return greedy_ids, None
    q = sampling.filtered_probs(logits, row.temperature, row.top_k, row.top_p, row.min_p)
    return jnp.where(row.greedy, greedy_ids, sampling.sample_rows(q, keys)), q


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


def start_chain(cfg: StepConfig, h: jax.Array, token: jax.Array, position: jax.Array,
                row: sampling.RowSampling, keys: jax.Array, draft_vocab: int) -> DraftCarry:
    b = h.shape[0]
    return DraftCarry(h=h, token=token, position=position, drafts=jnp.zeros((b, cfg.num_draft), jnp.int32),
                      q=jnp.zeros((b, cfg.num_draft, draft_vocab), jnp.float32), row=row, keys=keys)


def draft_step(dparams: DraftParams, cfg: StepConfig, target_embed: jax.Array, carry: DraftCarry,
               draft_kv: llama.KVCache, block_table: jax.Array, j: int) -> tuple[DraftCarry, llama.KVCache]:
    """Proposal j (static) of the chain. Step 0 reads the verified position's hidden state; step
    j > 0 first runs the draft on proposal j-1 at the next position, fed its own h."""
    h, position = carry.h, carry.position
    if j > 0:
        out, draft_kv = eagle3.draft_forward(dparams, cfg.draft, target_embed, carry.token[:, None], h[:, None],
                                             (position + 1)[:, None], draft_kv, block_table, cfg.attention,
                                             cfg.pin_draft_kv(), cfg.gemv)
        h, position = out[:, 0], position + 1
    # An argmax needs no all-gather of the logits: only per-shard (max, index) pairs move.
    logits = vocab_logits(eagle3.draft_logits(dparams, cfg.draft, h, cfg.gemv), cfg.mesh, gather=not cfg.greedy)
    ids, q = _draft_token(logits, carry.row, sampling.fold_in_rows(carry.keys, j), cfg.greedy)
    token = eagle3.to_target_ids(dparams, ids)
    carry = carry.replace(h=h, token=token, position=position, drafts=carry.drafts.at[:, j].set(token))
    return (carry if q is None else carry.replace(q=carry.q.at[:, j].set(q))), draft_kv


def propose(dparams: DraftParams, cfg: StepConfig, target_embed: jax.Array, carry: DraftCarry,
            draft_kv: llama.KVCache, block_table: jax.Array, start: int = 0) -> tuple[DraftCarry, llama.KVCache]:
    """Proposals start..K-1 inside one program (the fused path)."""
    for j in range(start, cfg.num_draft):
        carry, draft_kv = draft_step(dparams, cfg, target_embed, carry, draft_kv, block_table, j)
    return carry, draft_kv


def _target_probs(dparams: DraftParams, q: jax.Array, vocab_size: int) -> jax.Array:
    """q over the draft vocabulary [B, K, Vd] -> the same mass at target ids [B, K, V]."""
    ids = jnp.arange(q.shape[-1]) + dparams.d2t
    return jnp.zeros((*q.shape[:-1], vocab_size), q.dtype).at[..., ids].set(q)


def _verify(cfg: StepConfig, dparams, logits, drafts, draft_probs, row, keys):
    """Accept/reject the proposals (none in a target-only iteration): (num_accepted [B],
    emitted [B, K+1])."""
    if cfg.greedy:
        return sampling.greedy_verify(logits, drafts)
    q = _target_probs(dparams, draft_probs, cfg.target.vocab_size) if cfg.speculative else None
    return sampling.verify_chain(logits, drafts, q, row, keys)


def iterate_head(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                 block_tables: jax.Array, cfg: StepConfig):
    """Verify, accept, extend the draft, and draft proposal 0.

    rows [B], block_tables [B, nb] -> (state, num_accepted [B] i32, emitted [B, K+1] i32, carry):
    row b emitted emitted[b, :num_accepted[b] + 1]; entries after are padding. `carry` is None
    when this bucket does not speculate; else the chain continues from it (`draft_step`) and
    `commit_proposals` stores its drafts.
    """
    k = cfg.num_draft if cfg.speculative else 0
    s = _gather(state.slots, rows)
    tokens = jnp.concatenate([s.last_token[:, None], s.drafts[:, :k]], axis=1)  # [B, K+1]
    positions = s.length[:, None] + jnp.arange(k + 1)  # [B, K+1]
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_tables)
    logits = vocab_logits(llama.logits(params, hidden, cfg.gemv), cfg.mesh, gather=not cfg.greedy)  # [B, K+1, V]
    n, emitted = _verify(cfg, dparams, logits, s.drafts[:, :k], s.draft_probs, s.sampling,
                         _keys(s.sampling.key, s.num_generated, _STREAM_VERIFY))
    last = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]  # correction or bonus token
    num_generated = s.num_generated + n + 1
    draft_kv, carry = state.draft_kv, None
    if cfg.draft is not None:
        # Draft extend: position t pairs capture t with the token at t+1, for t = length..length+n.
        # It runs in target-only buckets too (one position), so the draft's KV has no holes when
        # speculation resumes.
        ext_tokens = jnp.where(jnp.arange(k + 1) <= n[:, None], emitted, 0)
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, ext_tokens, captures, positions, draft_kv,
                                         block_tables, n)  # h at length + n
    if cfg.speculative:
        carry = start_chain(cfg, h_last, last, s.length + n, s.sampling,
                            _keys(s.sampling.key, num_generated, _STREAM_DRAFT), s.draft_probs.shape[-1])
        carry, draft_kv = draft_step(dparams, cfg, params.embed, carry, draft_kv, block_tables, 0)
    width = state.slots.emitted.shape[1]  # K+1 of the engine; a target-only iteration emits 1
    new = s.replace(last_token=last, length=s.length + n + 1, num_generated=num_generated, num_accepted=n,
                    emitted=jnp.pad(emitted, ((0, 0), (0, width - emitted.shape[1]))))
    slots = _write_slots(state.slots, rows, new)
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg), n, emitted, carry


def chain_step(dparams: DraftParams, target_embed: jax.Array, state: DeviceState, carry: DraftCarry,
               block_tables: jax.Array, j: int, cfg: StepConfig) -> tuple[DeviceState, DraftCarry]:
    """Draft proposal j >= 1 as its own program (the per-step path), threading the carry."""
    carry, draft_kv = draft_step(dparams, cfg, target_embed, carry, state.draft_kv, block_tables, j)
    return _finish(state.replace(draft_kv=draft_kv), cfg), carry


def commit_proposals(state: DeviceState, rows: jax.Array, carry: DraftCarry, cfg: StepConfig) -> DeviceState:
    """Store the chain's proposals and their q in the slots for the next iteration to verify.
    A greedy program keeps the slots' q as they are: its rows are verified greedily, which never
    reads q, and a sampled row only ever runs in sampling programs, which write its q."""
    slots = state.slots.replace(drafts=state.slots.drafts.at[rows].set(carry.drafts))
    if not cfg.greedy:
        slots = slots.replace(draft_probs=slots.draft_probs.at[rows].set(carry.q))  # [S, K, Vd] f32
    return _finish(state.replace(slots=slots), cfg)


def iterate(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
            block_tables: jax.Array, cfg: StepConfig) -> tuple[DeviceState, jax.Array, jax.Array]:
    """One whole speculative iteration in one program (the fused path); see `iterate_head`."""
    state, n, emitted, carry = iterate_head(params, dparams, state, rows, block_tables, cfg)
    if carry is not None:
        carry, draft_kv = propose(dparams, cfg, params.embed, carry, state.draft_kv, block_tables, start=1)
        state = commit_proposals(state.replace(draft_kv=draft_kv), rows, carry, cfg)
    return state, n, emitted


def iterate_in_place(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                     block_tables: jax.Array, cfg: StepConfig) -> DeviceState:
    """`iterate` as the engine runs it: the verdicts stay in the slots (`Slots.num_accepted`,
    `Slots.emitted`), so the program's only output is the donated state, which XLA aliases to its
    input. Why: XLA runs the program as a CUDA graph (a command buffer) that records the address of
    every buffer it touches, and rewrites the nodes that touch a buffer whose address changed before
    the next launch. A returned array is a new buffer on every call; so is a host array passed in.
    On the H200 that rewrite cost about as much host time as the whole SmolLM2 iteration took on
    the device (BENCHMARKS.md, fourth session). `read_verdicts` copies the verdicts out, into
    buffers of their own for the same reason."""
    return iterate(params, dparams, state, rows, block_tables, cfg)[0]


def read_verdicts(buffer: jax.Array, num_accepted: jax.Array, emitted: jax.Array, rows: jax.Array) -> jax.Array:
    """The rows' verdicts, copied out of the slots in one array, so the host reads them with one
    device-to-host copy: num_accepted [S], emitted [S, K+1], rows [B] -> verdicts [B, 1 + K+1],
    column 0 the proposals accepted, then the tokens emitted (`split_verdicts`).

    Written over `buffer` [B, 1 + K+1] (donated; only its address is used), so the program
    allocates nothing. Why: a device buffer allocated between two iterations, even one this small,
    can move the next iteration's temporary buffer, and XLA then updates every node of its CUDA
    graph before the launch (`scripts/graph_launch_probe.py`). On the H200 a fresh verdicts array
    did so at batch buckets 16-64: 1,225 graph updates in 2,800 SmolLM2 EAGLE-3 iterations, 1,200
    of them at those buckets; 2.0-2.3 ms of host time per iteration there, against 0.9-1.3 ms now
    (BENCHMARKS.md, ninth session)."""
    del buffer
    return jnp.concatenate([num_accepted[rows][:, None], emitted[rows]], axis=1)


def read_first_token(buffer: jax.Array, last_token: jax.Array, slot: jax.Array) -> jax.Array:
    """The first token a prefill sampled into `slot` [1], copied out of the slots: last_token [S]
    -> [1]. Written over `buffer` [1] (donated; only its address is used), so the program
    allocates nothing, for the reason `read_verdicts` gives: a prefill admitted between two
    iterations would otherwise leave a new buffer on the device, kept until the host reads it."""
    del buffer
    return last_token[slot]


def split_verdicts(verdicts):
    """verdicts [B, 1 + K+1] (`read_verdicts`; a device or host array) -> (num_accepted [B],
    emitted [B, K+1]): row b emitted emitted[b, :num_accepted[b] + 1]."""
    return verdicts[:, 0], verdicts[:, 1:]


def prefill(params: LlamaParams, dparams: DraftParams | None, state: DeviceState, tokens: jax.Array,
            next_tokens: jax.Array, num_valid: jax.Array, start: jax.Array, slot: jax.Array,
            block_table: jax.Array, row: sampling.RowSampling,
            cfg: StepConfig) -> DeviceState:
    """Prefill one chunk of each of P prompts, row p into `slot[p]`.

    tokens [P, T] (row p padded after num_valid[p]), next_tokens [P, T]: the same ids shifted left
    by one; entry num_valid-1 of a row is the next prompt token, or -1 on the prompt's last chunk,
    where the sampled first token goes; start [P]: position of each row's tokens[0]; block_table
    [P, nb]; row: each request's sampling parameters [P]. Padding rows (a bucket larger than the
    prompts admitted) name the dummy slot with num_valid 1 and an all-scratch block table.
    -> state, its only output (aliased to the donated input: nothing new stays on the device). The
    slot's state is written on every chunk; the last chunk's write is the one that stays, its
    `last_token` the first generated token (`read_first_token` copies it out).
    """
    # XLA's dots for every projection of a prefill, whatever its rows: the KV and hidden states a
    # prompt leaves must not depend on how many prompts shared its call (a call of one 32-token
    # chunk fits the Mosaic GEMV, eight of them do not), or EAGLE-3 and the target alone could
    # part ways at a near tie.
    cfg = dataclasses.replace(cfg, gemv="xla")
    p, t = tokens.shape
    positions = start[:, None] + jnp.arange(t)  # [P, T]
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_table)
    last_idx = num_valid - 1
    last_hidden = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]  # [P, D]
    logits = vocab_logits(llama.logits(params, last_hidden, cfg.gemv), cfg.mesh, gather=not cfg.greedy)  # [P, V]
    first = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if cfg.greedy
             else sampling.sample_logits(logits, row, _keys(row.key, 0, _STREAM_FIRST)))  # [P]
    length = start + num_valid
    k = cfg.num_draft if cfg.speculative else 0
    drafts = jnp.zeros((p, k), jnp.int32)
    draft_probs = jnp.zeros((p, k, state.slots.draft_probs.shape[-1]), jnp.float32)
    draft_kv = state.draft_kv
    if cfg.speculative:
        # next_tokens holds -1 where the token the target just produced belongs (last chunk).
        shifted = jnp.where(next_tokens < 0, first[:, None], next_tokens)
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, shifted, captures, positions, draft_kv,
                                         block_table, last_idx)
        # One token generated so far (`first`): the same key schedule as every later iteration.
        carry = start_chain(cfg, h_last, first, length - 1, row, _keys(row.key, 1, _STREAM_DRAFT),
                            draft_probs.shape[-1])
        carry, draft_kv = propose(dparams, cfg, params.embed, carry, draft_kv, block_table)
        drafts, draft_probs = carry.drafts, carry.q
    new = Slots(last_token=first, length=length, drafts=drafts, draft_probs=draft_probs, sampling=row,
                num_generated=jnp.ones_like(length), num_accepted=jnp.zeros_like(length),
                emitted=jnp.zeros((p, state.slots.emitted.shape[1]), jnp.int32))
    slots = _write_slots(state.slots, slot, new)
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg)


# One executable per input shape (batch bucket, chunk bucket) and StepConfig; state donated.
prefill_step = jax.jit(prefill, static_argnames="cfg", donate_argnames="state")
iterate_in_place_step = jax.jit(iterate_in_place, static_argnames="cfg", donate_argnames="state")
read_verdicts_step = jax.jit(read_verdicts, donate_argnames="buffer", keep_unused=True)
read_first_token_step = jax.jit(read_first_token, donate_argnames="buffer", keep_unused=True)
# The per-step path: the same iteration as K + 1 programs, the driver threading the carry.
iterate_head_step = jax.jit(iterate_head, static_argnames="cfg", donate_argnames="state")
chain_step_jit = jax.jit(chain_step, static_argnames=("j", "cfg"), donate_argnames=("state", "carry"))
commit_step = jax.jit(commit_proposals, static_argnames="cfg", donate_argnames="state")
