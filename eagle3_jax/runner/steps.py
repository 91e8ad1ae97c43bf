"""The compiled, fixed-shape step functions (our CUDA graphs): pure functions of the donated
`DeviceState`, the KV pool updated in place, one executable per shape bucket. `prefill` runs one
chunk of each of P prompts (a last chunk also yields the first token and proposal); `iterate`
verifies, accepts, extends the drafter and drafts the next proposal, with no host round trip.
`fused_iteration=False` runs it as K + 1 programs (`iterate_head`, `chain_step`, `commit_proposals`).
A masked iteration (a row under a grammar) is split after the verify's forward (`verify_in_place`),
so that the host computes the token masks while it runs; the rest (`accept_in_place`, or per step
`accept_head`) applies them. The unmasked iteration stays one program.
Programs of a batch with a row asking for logprobs also score the tokens they emit (runner/logprobs.py);
the others are unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig
from eagle3_jax.model import eagle3
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.parallel.sharding import (
    REPLICATED,
    TP,
    cache_pin,
    draft_cache_pin,
    llama_cache_specs,
    replicate,
    specs_like,
    vocab_logits,
    vocab_split,
)
from eagle3_jax.runner import logprobs, sampling
from eagle3_jax.runner.speculators import Chain, DraftCarry, DraftContext, DraftStart, Speculator
from eagle3_jax.runner.state import DUMMY_SLOT, DeviceState, Slots, state_shardings
from eagle3_jax.runner.target import LLAMA3, TargetModel

TARGET_ALONE = Chain(0)  # the iteration that verifies the last token alone

# Independent PRNG streams under each (row key, tokens generated) pair.
_STREAM_DRAFT, _STREAM_VERIFY, _STREAM_FIRST = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static part of every step function (hashable: one executable per distinct value)."""

    target: ModelConfig
    draft: DraftConfig | None
    speculator: Speculator = TARGET_ALONE
    mesh: Mesh | None = None
    # Every row greedy: argmax only. The host picks the program (as vLLM's `all_greedy`): a
    # `lax.cond` on the device would copy its predicate to the host and block the stream.
    greedy: bool = False
    # A row is under a grammar: the program takes each row's packed token masks and applies them to
    # the target's logits (`sampling.mask_logits`). Picked on the host, so other batches pay nothing.
    masked: bool = False
    attention: str = "xla"
    gemv: str = "xla"
    gemm: str = "triton"
    model: TargetModel = LLAMA3
    # Batch-invariant kernels for the target only: the drafter's numerics change proposals, never the output.
    batch_invariant: bool = False
    # A row asks for logprobs: score each emitted token (a prefill: its first), `logprobs.token_logprobs`.
    logprobs: bool = False
    # A prefill row asks for prompt_logprobs: score every position of the chunk.
    prompt_logprobs: bool = False

    def __post_init__(self):
        if self.speculative and self.speculator.facts.uses_drafter and self.draft is None:
            raise ConfigError(f"step config: {self.speculator.facts.label} drafts with the EAGLE-3 head; draft is None")

    @property
    def target_attention(self) -> str:
        return "invariant" if self.batch_invariant else self.attention

    @property
    def target_gemv(self) -> str:
        return "invariant" if self.batch_invariant else self.gemv

    @property
    def per_device(self) -> bool:
        return self.batch_invariant and self.mesh is not None

    @property
    def speculative(self) -> bool:
        """This program drafts a proposal (whether or not a drafter is loaded)."""
        return self.speculator.facts.num_draft_steps > 0

    @property
    def draft_context(self) -> DraftContext:
        # The drafter is replicated under tp (sharding.py, "Draft head"): only its KV is pinned.
        return DraftContext(self.draft, self.attention, self.gemv, self.greedy, self.pin_draft_kv())

    def pin_target_kv(self):
        return cache_pin(self.mesh, self.target.num_kv_heads)

    def pin_draft_kv(self):
        return draft_cache_pin(self.mesh)


def _target(params, cfg: StepConfig, tokens, positions, kv, block_tables, tree=None):
    """Target forward, its residual stream replicated under tensor parallelism; `tree` None: causal."""
    extra = {} if tree is None else {"tree": tree}
    if cfg.per_device:
        return _per_device_target(params, cfg, tokens, positions, kv, block_tables, extra)
    hidden, captures, kv = cfg.model.forward(params, cfg.target, tokens, positions, kv, block_tables,
                                             cfg.target_attention, cfg.pin_target_kv(), cfg.target_gemv, **extra)
    return (*replicate((hidden, captures), cfg.mesh), kv)


def _per_device_target(params, cfg: StepConfig, tokens, positions, kv, block_tables, extra: dict):
    """The batch-invariant forward per device (shard_map), row-parallel partials summed in rank
    order (`llama.sum_shards`): XLA's partitioner does not split a pallas_call."""
    tp = cfg.mesh.shape[TP]
    cache = llama_cache_specs(cfg.target, tp)

    def body(params, tokens, positions, kv, block_tables, extra):
        return cfg.model.forward(params, cfg.target, tokens, positions, kv, block_tables, "invariant", None,
                                 "invariant", tp_axis=TP, **extra)

    specs = (_local_specs(params, cfg), REPLICATED, REPLICATED, cache, REPLICATED,
             jax.tree.map(lambda _: REPLICATED, extra))
    return jax.shard_map(body, mesh=cfg.mesh, in_specs=specs, out_specs=(REPLICATED, REPLICATED, cache),
                         check_vma=False)(params, tokens, positions, kv, block_tables, extra)


def _local_specs(params, cfg: StepConfig):
    """The served weights' partition specs on `cfg.mesh` (shard_map's in_specs for them)."""
    return specs_like(params, cfg.model.param_specs(cfg.target, cfg.mesh.shape[TP]))


def _logits(params, cfg: StepConfig, hidden):
    """Target logits [..., V], vocab-sharded under tensor parallelism where a greedy program needs
    only an argmax (per-shard (max, index) pairs move, not the logits)."""
    if cfg.per_device:
        specs = _local_specs(params, cfg)
        split = P(*[None] * (hidden.ndim - 1), TP) if vocab_split(cfg.target.vocab_size, cfg.mesh) else REPLICATED
        logits = jax.shard_map(lambda p, h: cfg.model.logits(p, h, "invariant"), mesh=cfg.mesh,
                               in_specs=(specs, REPLICATED), out_specs=split, check_vma=False)(params, hidden)
    else:
        logits = cfg.model.logits(params, hidden, cfg.target_gemv)
    return vocab_logits(logits, cfg.mesh, gather=not cfg.greedy or cfg.logprobs or cfg.prompt_logprobs)


def _finish(state: DeviceState, cfg: StepConfig) -> DeviceState:
    """The state leaves in its input layout, so donation lines up and nothing recompiles."""
    if cfg.mesh is None:
        return state
    return jax.lax.with_sharding_constraint(state, state_shardings(state, cfg.target, cfg.draft, cfg.mesh))


def _keys(row_key: jax.Array, num_generated, stream: int) -> jax.Array:
    """Per-row keys [B, 2] of (tokens generated so far, stream): independent of the batch."""
    return sampling.fold_in_rows(sampling.fold_in_rows(row_key, num_generated), stream)


def _draft_extend(dparams: DraftParams, cfg: StepConfig, target_embed: jax.Array, next_tokens: jax.Array,
                  captures: jax.Array, positions: jax.Array, draft_kv: KVCache, block_tables: jax.Array,
                  index: jax.Array) -> tuple[jax.Array, KVCache]:
    """The draft over target-verified positions: capture t paired with the token at t+1
    (next_tokens [B, T]), RoPE position t. -> (pre-norm h [B, H] at `index` [B], draft_kv)."""
    h, draft_kv = eagle3.draft_forward(dparams, cfg.draft, target_embed, next_tokens,
                                       eagle3.fuse_captures(dparams, captures, cfg.gemv), positions, draft_kv,
                                       block_tables, cfg.attention, cfg.pin_draft_kv(), cfg.gemv)
    return jnp.take_along_axis(h, index[:, None, None], axis=1)[:, 0], draft_kv


def _record(history: jax.Array, positions: jax.Array, tokens: jax.Array, valid: jax.Array) -> jax.Array:
    """history [B, M] with tokens [B, T] written at positions [B, T] where valid [B, T]."""
    columns = jnp.where(valid, positions, history.shape[1])
    return history.at[jnp.arange(history.shape[0])[:, None], columns].set(tokens, mode="drop")


def _gather(tree, rows: jax.Array):
    return jax.tree_util.tree_map(lambda x: x[rows], tree)


def _write_slots(slots: Slots, rows: jax.Array, **values: jax.Array) -> Slots:
    slots = slots.replace(**{name: jax.tree.map(lambda x, v: x.at[rows].set(v), getattr(slots, name), v)
                             for name, v in values.items()})
    # Padded rows all wrote the dummy slot: reset it so its positions never grow.
    return slots.replace(length=slots.length.at[DUMMY_SLOT].set(0))


def _verify(params, cfg: StepConfig, state: DeviceState, rows: jax.Array, block_tables: jax.Array):
    """The verify's target forward over the rows' pending proposals -> (the rows' slots, the verified
    positions [B, W], the target's logits [B, W, V], captures [B, W, C], target_kv with their KV written)."""
    s = _gather(state.slots, rows)
    tokens, positions, mask = cfg.speculator.verify_layout(s)
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_tables, mask)
    return s, positions, _logits(params, cfg, hidden), captures, target_kv


def iterate_head(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
                 cfg: StepConfig, token_mask: jax.Array | None = None):
    """Verify, accept, extend the draft, run the first draft step. rows [B], block_tables [B, nb],
    token_mask [B, W, ceil(V / 32)] (cfg.masked) -> (state, n [B], emitted [B, E]: row b emitted
    emitted[b, :n[b] + 1], carry: None if nothing drafts, scored: `cfg.logprobs`' packed rows [B, W, F]
    of the emitted tokens, W the slots' emitted width, scored by the target's logits before any token
    mask; else None)."""
    s, positions, logits, captures, target_kv = _verify(params, cfg, state, rows, block_tables)
    return _accept(params, dparams, state, rows, block_tables, cfg, token_mask, s, positions, logits, captures,
                   target_kv)


def verify_in_place(params, state: DeviceState, rows: jax.Array, block_tables: jax.Array, logits: jax.Array,
                    captures: jax.Array | None, cfg: StepConfig
                    ) -> tuple[DeviceState, jax.Array, jax.Array | None]:
    """A masked iteration's first program: the verify's target forward alone, which needs no mask, so
    the host computes the masks while it runs (`accept_head` then applies them). -> (the state, the
    verified tokens' target KV written; the target's logits [B, W, V] and, where a drafter extends,
    captures [B, W, C], else None), written over the donated `logits` and `captures` so that they
    keep one address from call to call. They are no part of the state: their shapes are the
    bucket's and the proposal's, and the state is one for every program. Under a mesh both leave
    replicated, one placement the buffers held for them share whatever the program."""
    del logits, captures
    _, _, logits, captures, target_kv = _verify(params, cfg, state, rows, block_tables)
    verified = replicate((logits, captures if cfg.draft is not None else None), cfg.mesh)
    return _finish(state.replace(target_kv=target_kv), cfg), *verified


def verified_shapes(params, state: DeviceState, rows: jax.Array, block_tables: jax.Array, cfg: StepConfig
                    ) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct | None]:
    """The shapes of `verify_in_place`'s logits and captures (None where no drafter extends), traced."""
    _, _, logits, captures, _ = jax.eval_shape(lambda *a: _verify(params, cfg, *a), state, rows, block_tables)
    return logits, captures if cfg.draft is not None else None


def accept_head(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
                logits: jax.Array, captures: jax.Array | None, cfg: StepConfig, token_mask: jax.Array | None = None):
    """`iterate_head` after `verify_in_place` ran its forward on `state` (its slots as the verify read
    them: that program writes only the target's KV): the same outputs, from the verify's `logits`
    and `captures` (read, not donated)."""
    s = _gather(state.slots, rows)
    positions = cfg.speculator.verify_layout(s)[1]
    return _accept(params, dparams, state, rows, block_tables, cfg, token_mask, s, positions, logits, captures,
                   state.target_kv)


def _accept(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
            cfg: StepConfig, token_mask: jax.Array | None, s, positions: jax.Array, logits: jax.Array,
            captures: jax.Array | None, target_kv: KVCache):
    """`iterate_head` after its verify (`_verify`'s outputs)."""
    spec = cfg.speculator
    target_logits = logits
    if cfg.masked:  # a mask per verified position: a chain's along its drafts, a tree's per node
        logits = sampling.mask_logits(logits, token_mask)
    n, emitted, path, top1 = spec.accept(cfg.greedy, dparams, logits, s,
                                         _keys(s.sampling.key, s.num_generated, _STREAM_VERIFY), cfg.target.vocab_size)
    target_kv = spec.commit_kv(target_kv, path, s.length, block_tables)
    width = state.slots.emitted.shape[1]  # the engine's widest verify; a target-only iteration emits 1
    scored = _score_emitted(target_logits, emitted, path, width, cfg) if cfg.logprobs else None
    last = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]  # correction or bonus token
    num_generated = s.num_generated + n + 1
    kept = ({} if s.history is None else
            {"history": _record(s.history, s.length[:, None] + 1 + jnp.arange(emitted.shape[1]), emitted,
                                jnp.arange(emitted.shape[1]) <= n[:, None])})
    draft_kv, carry, h_last = state.draft_kv, None, None
    if cfg.draft is not None:
        # Over t = length..length+n, in target-only programs too: no holes when speculation resumes.
        ext_captures, ext_positions = spec.extend_inputs(captures, positions, path, s.length)
        ext_tokens = jnp.where(jnp.arange(emitted.shape[1]) <= n[:, None], emitted, 0)
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, ext_tokens, ext_captures, ext_positions,
                                         draft_kv, block_tables, n)
    if cfg.speculative:
        at = DraftStart(token=last, position=s.length + n, h=h_last, history=kept.get("history"), row=s.sampling,
                        keys=_keys(s.sampling.key, num_generated, _STREAM_DRAFT))
        carry, draft_kv = spec.draft_step(cfg.draft_context, dparams, params.embed, spec.start(cfg.draft_context, at),
                                          draft_kv, block_tables, 0)
    slots = _write_slots(state.slots, rows, last_token=last, length=s.length + n + 1, num_generated=num_generated,
                         accepted=jnp.stack([n, top1], axis=1),
                         emitted=jnp.pad(emitted, ((0, 0), (0, width - emitted.shape[1]))), **kept)
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg), n, emitted, carry, scored


def _score_emitted(logits: jax.Array, emitted: jax.Array, path: jax.Array | None, width: int,
                   cfg: StepConfig) -> jax.Array:
    """Emitted token d [B, E] was chosen by the verify's logits [B, W', V] at path[d] (a chain's: d)
    -> its packed logprobs [B, width, F] (past n: unread)."""
    at = jnp.arange(emitted.shape[1])[None] if path is None else jnp.maximum(path, 0)
    chosen = jnp.take_along_axis(logits, at[:, :, None], axis=1)  # [B, E, V]: only the emitted positions
    scored = logprobs.token_logprobs(chosen, jnp.maximum(emitted, 0), cfg.batch_invariant)
    return jnp.pad(scored, ((0, 0), (0, width - scored.shape[1]), (0, 0)))


def chain_step(dparams: DraftParams, target_embed: jax.Array, state: DeviceState, carry: DraftCarry,
               block_tables: jax.Array, j: int, cfg: StepConfig) -> tuple[DeviceState, DraftCarry]:
    """Draft step j >= 1 as its own program (the per-step path), threading the carry."""
    carry, draft_kv = cfg.speculator.draft_step(cfg.draft_context, dparams, target_embed, carry, state.draft_kv,
                                                block_tables, j)
    return _finish(state.replace(draft_kv=draft_kv), cfg), carry


def commit_proposals(state: DeviceState, rows: jax.Array, carry: DraftCarry, cfg: StepConfig) -> DeviceState:
    slots = cfg.speculator.commit(state.slots, rows, carry, cfg.greedy)
    return _finish(state.replace(slots=slots), cfg)


def iterate(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
            cfg: StepConfig, token_mask: jax.Array | None = None
            ) -> tuple[DeviceState, jax.Array, jax.Array, jax.Array | None]:
    """One whole speculative iteration in one program (the fused path); see `iterate_head`."""
    return _propose(params, dparams, rows, block_tables, cfg,
                    *iterate_head(params, dparams, state, rows, block_tables, cfg, token_mask))


def _propose(params, dparams: DraftParams | None, rows: jax.Array, block_tables: jax.Array, cfg: StepConfig,
             state: DeviceState, n: jax.Array, emitted: jax.Array, carry: DraftCarry | None,
             scored: jax.Array | None) -> tuple[DeviceState, jax.Array, jax.Array, jax.Array | None]:
    """The draft steps after a head's first and the proposal committed (the fused path)."""
    if carry is not None:
        carry, draft_kv = cfg.speculator.propose(cfg.draft_context, dparams, params.embed, carry, state.draft_kv,
                                                 block_tables, start=1)
        state = commit_proposals(state.replace(draft_kv=draft_kv), rows, carry, cfg)
    return state, n, emitted, scored


def iterate_in_place(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                     block_tables: jax.Array, cfg: StepConfig, token_mask: jax.Array | None = None) -> DeviceState:
    """`iterate` with the verdicts left in the slots: the only output is the donated state, aliased
    to its input, since XLA's CUDA graph is rewritten whenever a buffer moves and a returned array
    is a new buffer each call (BENCHMARKS.md, "Host overhead")."""
    return iterate(params, dparams, state, rows, block_tables, cfg, token_mask)[0]


def iterate_scored_in_place(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                            block_tables: jax.Array, scored: jax.Array, cfg: StepConfig,
                            token_mask: jax.Array | None = None) -> tuple[DeviceState, jax.Array]:
    """`iterate_in_place` of a `cfg.logprobs` program: the emitted tokens' packed logprobs [B, W, F]
    written over the donated `scored`, so that they too keep one address from call to call."""
    del scored
    state, _, _, scored = iterate(params, dparams, state, rows, block_tables, cfg, token_mask)
    return state, scored


def accept(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
           logits: jax.Array, captures: jax.Array | None, cfg: StepConfig, token_mask: jax.Array | None = None
           ) -> tuple[DeviceState, jax.Array, jax.Array, jax.Array | None]:
    """A masked iteration's second program (fused): `iterate` after `verify_in_place`, under the masks."""
    return _propose(params, dparams, rows, block_tables, cfg,
                    *accept_head(params, dparams, state, rows, block_tables, logits, captures, cfg, token_mask))


def accept_in_place(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
                    logits: jax.Array, captures: jax.Array | None, cfg: StepConfig,
                    token_mask: jax.Array | None = None) -> DeviceState:
    """`accept` with the verdicts left in the slots, as `iterate_in_place`."""
    return accept(params, dparams, state, rows, block_tables, logits, captures, cfg, token_mask)[0]


def accept_scored_in_place(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                           block_tables: jax.Array, logits: jax.Array, captures: jax.Array | None, scored: jax.Array,
                           cfg: StepConfig, token_mask: jax.Array | None = None) -> tuple[DeviceState, jax.Array]:
    """`accept_in_place` of a `cfg.logprobs` program, as `iterate_scored_in_place`."""
    del scored
    state, _, _, scored = accept(params, dparams, state, rows, block_tables, logits, captures, cfg, token_mask)
    return state, scored


def read_verdicts(buffer: jax.Array, accepted: jax.Array, emitted: jax.Array, rows: jax.Array,
                  scored: jax.Array | None = None) -> jax.Array:
    """accepted [S, 2], emitted [S, E], rows [B] (and a logprobs program's scored [B, E, F]) ->
    verdicts [B, 2 + E (+ E F)] (`split_verdicts`), one array for one device-to-host copy. Written
    over the donated `buffer`, so nothing is allocated between iterations (a new buffer can move
    the next iteration's temporaries)."""
    del buffer
    parts = [accepted[rows], emitted[rows]] + ([] if scored is None else [scored.reshape(scored.shape[0], -1)])
    return jnp.concatenate(parts, axis=1)


def read_first_token(buffer: jax.Array, last_token: jax.Array, slot: jax.Array) -> jax.Array:
    """last_token [S], slot [1] -> the first token a prefill sampled there [1] (as `read_verdicts`)."""
    del buffer
    return last_token[slot]


def split_verdicts(verdicts, fields: int = 0):
    """verdicts [B, 2 + E (+ E F)] -> (num_accepted [B], top1 [B] (`Speculator.accept`), emitted [B, E],
    scored [B, E, F] or None); `fields`: F, `logprobs.fields` where the program scored, else 0."""
    e = (verdicts.shape[1] - 2) // (1 + fields)
    scored = verdicts[:, 2 + e:].reshape(verdicts.shape[0], e, fields) if fields else None
    return verdicts[:, 0], verdicts[:, 1], verdicts[:, 2:2 + e], scored


def prefill(params, dparams: DraftParams | None, state: DeviceState, tokens: jax.Array,
            next_tokens: jax.Array, num_valid: jax.Array, start: jax.Array, slot: jax.Array,
            block_table: jax.Array, num_generated: jax.Array, row: sampling.RowSampling,
            cfg: StepConfig, token_mask: jax.Array | None = None) -> DeviceState | tuple[DeviceState, jax.Array]:
    """One chunk of each of P prompts, row p into `slot[p]` (padding rows: the dummy slot).
    tokens [P, T] (padded after num_valid [P]); next_tokens [P, T] the ids shifted left, -1 where
    the sampled first token goes; start [P] the position of tokens[:, 0]; block_table [P, nb];
    num_generated [P] once the chunk is in (1; g after preemption: keys continue); row [P];
    token_mask [P, ceil(V / 32)] (cfg.masked) the tokens the first generated one may be.
    -> the state; a program that scores, (state, packed logprobs): `cfg.prompt_logprobs` [P, T, F],
    position t's of the token after it (the last's: the first generated), else [P, 1, F] that last one's,
    by the target's logits before any token mask."""
    # XLA's dots whatever the rows: a prompt's KV must not depend on how many shared its call.
    cfg = dataclasses.replace(cfg, gemv="xla")
    p, t = tokens.shape
    positions = start[:, None] + jnp.arange(t)
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_table)
    last_idx = num_valid - 1
    last_hidden = jnp.take_along_axis(hidden, last_idx[:, None, None], axis=1)[:, 0]
    logits = target_logits = _logits(params, cfg, last_hidden)
    if cfg.masked:
        logits = sampling.mask_logits(logits, token_mask)
    length = start + num_valid  # the first generated token's position
    sampled = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if cfg.greedy
               else sampling.sample_logits(logits, row, _keys(row.key, 0, _STREAM_FIRST),
                                           sampling.coupling_noise(row.key, length, cfg.target.vocab_size)))
    given = jnp.take_along_axis(next_tokens, last_idx[:, None], axis=1)[:, 0]
    first = jnp.where(given < 0, sampled, given)
    following = jnp.where(next_tokens < 0, first[:, None], next_tokens)  # [P, T] the token after each
    scored = None
    if cfg.prompt_logprobs:
        scored = _score_chunk(params, cfg, hidden, following)
    elif cfg.logprobs:
        scored = logprobs.token_logprobs(target_logits[:, None], first[:, None], cfg.batch_invariant)
    spec = cfg.speculator
    kept = {}
    if state.slots.history is not None:  # the chunk's tokens, and the first generated one after them
        valid = jnp.arange(t) < num_valid[:, None]
        history = _record(state.slots.history[slot], positions, tokens, valid)
        kept["history"] = _record(history, length[:, None], first[:, None], jnp.ones_like(valid[:, :1]))
    draft_kv, h_last = state.draft_kv, None
    if cfg.draft is not None:
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, following, captures, positions, draft_kv,
                                         block_table, last_idx)
    if cfg.speculative:  # the same key schedule as every later iteration
        at = DraftStart(token=first, position=length - 1, h=h_last, history=kept.get("history"), row=row,
                        keys=_keys(row.key, num_generated, _STREAM_DRAFT))
        carry, draft_kv = spec.propose(cfg.draft_context, dparams, params.embed, spec.start(cfg.draft_context, at),
                                       draft_kv, block_table)

    def zeros(x):
        return None if x is None else jnp.zeros((p, *x.shape[1:]), x.dtype)

    slots = _write_slots(state.slots, slot, last_token=first, length=length, drafts=zeros(state.slots.drafts),
                         draft_probs=zeros(state.slots.draft_probs), sampling=row, num_generated=num_generated,
                         accepted=zeros(state.slots.accepted), emitted=zeros(state.slots.emitted),
                         parents=zeros(state.slots.parents), drafted_by=jnp.zeros_like(length), **kept)
    if cfg.speculative:
        slots = spec.commit(slots, slot, carry, cfg.greedy)  # the first proposal, as an iteration leaves it
    state = _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg)
    return state if scored is None else (state, scored)


SCORE_BLOCK = 32  # positions a prompt-scoring prefill makes logits for at a time


def _score_chunk(params, cfg: StepConfig, hidden: jax.Array, following: jax.Array) -> jax.Array:
    """hidden [P, T, D], following [P, T] the token after each position -> packed logprobs [P, T, F],
    the logits made a block of positions at a time (a chunk's whole would be P x T x V f32)."""
    p, t, d = hidden.shape
    block = math.gcd(t, SCORE_BLOCK)
    blocks = (hidden.reshape(p, t // block, block, d).swapaxes(0, 1),
              following.reshape(p, t // block, block).swapaxes(0, 1))
    scored = jax.lax.map(lambda x: logprobs.token_logprobs(_logits(params, cfg, x[0]), x[1], cfg.batch_invariant),
                         blocks)  # [T / block, P, block, F]
    return scored.swapaxes(0, 1).reshape(p, t, -1)


# The fused iteration's GEMMs (EngineConfig.gemm). "auto" takes cuBLAS from this many verify rows
# (bucket x tokens verified a row) for a target at most this wide; XLA's Triton GEMMs elsewhere.
CUBLAS_MIN_ROWS, CUBLAS_MAX_ROWS = 64, 512
CUBLAS_MAX_HIDDEN = 2048
# XLA:GPU rematerializes a program whose estimated memory passes the device's, and its estimate counts
# the donated KV pool more than once (82 GiB for a 30 GiB pool): on the default pool the rewritten greedy
# target-alone iteration gave other tokens (BENCHMARKS.md, "Batch invariance end to end"). A program
# here updates the pool in place and allocates little else, so the limit is lifted past any device.
NO_REMAT = {"xla_gpu_memory_limit_slop_factor": 1000}
_GEMM_OPTIONS = {"triton": {}, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def state_jit(fun, compiler_options: dict | None = None, **jit_kwargs):
    """`jax.jit` for a program that donates the device state (the KV pool in place): never rematerialized."""
    return jax.jit(fun, compiler_options={**NO_REMAT, **(compiler_options or {})}, **jit_kwargs)


def gemm_for(setting: str, target: ModelConfig, verify_rows: int) -> str:
    """EngineConfig.gemm for one program of `verify_rows` rows verified: "triton" or "cublas"."""
    if setting != "auto":
        return setting
    wide = CUBLAS_MIN_ROWS <= verify_rows <= CUBLAS_MAX_ROWS
    return "cublas" if wide and target.hidden_size <= CUBLAS_MAX_HIDDEN else "triton"


def iteration_gemm(cfg: StepConfig, rows: int) -> str:
    return gemm_for(cfg.gemm, cfg.target, rows * cfg.speculator.facts.verify_width)


def jit_per_gemm(fun, **jit_kwargs) -> dict:
    """`fun` jitted once per GEMM backend, {"triton": ..., "cublas": ...}: XLA takes the choice as a
    compiler option, fixed per jitted function."""
    return {gemm: state_jit(fun, compiler_options=options, **jit_kwargs) for gemm, options in _GEMM_OPTIONS.items()}


# One executable per input shape (batch bucket, chunk bucket) and StepConfig; state donated.
prefill_step = state_jit(prefill, static_argnames="cfg", donate_argnames="state")
_iterate_in_place = jit_per_gemm(iterate_in_place, static_argnames="cfg", donate_argnames="state")
_iterate_scored_in_place = jit_per_gemm(iterate_scored_in_place, static_argnames="cfg",
                                        donate_argnames=("state", "scored"))
# A masked iteration: the verify's forward, then the acceptance under the masks (`verify_in_place`).
_verify_in_place = jit_per_gemm(verify_in_place, static_argnames="cfg", donate_argnames=("state", "logits", "captures"))
_accept_in_place = jit_per_gemm(accept_in_place, static_argnames="cfg", donate_argnames="state")
_accept_scored_in_place = jit_per_gemm(accept_scored_in_place, static_argnames="cfg",
                                       donate_argnames=("state", "scored"))
read_verdicts_step = jax.jit(read_verdicts, donate_argnames="buffer", keep_unused=True)
read_first_token_step = jax.jit(read_first_token, donate_argnames="buffer", keep_unused=True)
# The per-step path: the same iteration as K + 1 programs, the runner threading the carry.
iterate_head_step = state_jit(iterate_head, static_argnames="cfg", donate_argnames="state")
chain_step_jit = state_jit(chain_step, static_argnames=("j", "cfg"), donate_argnames=("state", "carry"))
commit_step = state_jit(commit_proposals, static_argnames="cfg", donate_argnames="state")
accept_head_step = state_jit(accept_head, static_argnames="cfg", donate_argnames="state")


def iterate_in_place_step(cfg: StepConfig, rows: int):
    """The jitted fused iteration of `cfg` over `rows` rows, compiled with its GEMMs (`iteration_gemm`):
    call it as iterate_in_place(params, draft_params, state, slots, tables, cfg=cfg); a `cfg.logprobs`
    program as iterate_scored_in_place(params, draft_params, state, slots, tables, scored, cfg=cfg); a
    `cfg.masked` one with token_mask= too."""
    return (_iterate_scored_in_place if cfg.logprobs else _iterate_in_place)[iteration_gemm(cfg, rows)]


def verify_step(cfg: StepConfig, rows: int):
    """A masked iteration's jitted forward of `cfg` over `rows` rows (`verify_in_place`), its GEMMs as
    the iteration's: call it as verify_in_place(params, state, slots, tables, logits, captures, cfg=cfg)."""
    return _verify_in_place[iteration_gemm(cfg, rows)]


def accept_step(cfg: StepConfig, rows: int):
    """A masked iteration's jitted acceptance of `cfg` over `rows` rows (`accept_in_place`; a
    `cfg.logprobs` program's `accept_scored_in_place`), called as `iterate_in_place_step`'s program
    with the verify's logits and captures after the tables, and token_mask=."""
    return (_accept_scored_in_place if cfg.logprobs else _accept_in_place)[iteration_gemm(cfg, rows)]
