"""The compiled, fixed-shape step functions: our CUDA graphs.

Two executables per shape bucket, both pure `DeviceState -> DeviceState` functions that donate the
state (the KV pool is updated in place):

  prefill(chunks [P, T])    target prefill of one chunk of each of P prompts + the draft prefill
                            over the same chunks (ids shifted left by one, the target's captures);
                            on a prompt's last chunk it also samples the first token (left in the
                            slot's last_token, `read_first_token` copies it out) and drafts the
                            first proposal (K tokens, or a tree).
  iterate(rows [B])         one whole speculative iteration: target verify of K+1 tokens (a tree's
                            T+1), lossless acceptance, draft extend over the accepted positions
                            (overwriting the draft KV its own proposal wrote, with the target's
                            captures), the draft steps of the next proposal. No host round trip inside.

What is verified, how it is accepted and drafted, is the speculator's (`StepConfig.speculator`,
runner/speculator.py); the target is called through `StepConfig.model` (runner/target.py).

The same iteration also exists as K + 1 programs (`iterate_head`, `chain_step` per proposal,
`commit_proposals`), dispatched back to back by the runner with the `DraftCarry` pytree threaded
between them, for `EngineConfig(fused_iteration=False)`: both paths run the same functions. A
chain only: a tree's levels change the carry's shape, so a tree runs fused (EngineConfig says so).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig, TreeSpec
from eagle3_jax.model import eagle3
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache
from eagle3_jax.parallel.sharding import cache_pin, draft_cache_pin, replicate, vocab_logits
from eagle3_jax.runner import sampling
from eagle3_jax.runner.speculator import Chain, DraftCarry, DraftContext, Tree
from eagle3_jax.runner.state import DUMMY_SLOT, DeviceState, Slots, state_shardings
from eagle3_jax.runner.target import LLAMA3, TargetModel

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
    # The fused iteration's GEMMs: "triton", "cublas" or "auto", per bucket (EngineConfig.gemm,
    # `iteration_gemm`).
    gemm: str = "triton"
    model: TargetModel = LLAMA3  # the target's functions
    # A dynamic tree drafted instead of the chain (never a chain TreeSpec: the runner serves those
    # as Chain); num_draft is then its steps, or 0 in the target-only program.
    tree: TreeSpec | None = None
    # A tree's verify also says what the draft's top-1 chain would have accepted (`Tree.accept`),
    # for an engine serving a chain beside its tree; without one it leaves -1 and computes nothing.
    measure_chain: bool = False
    # The target's forward and logits in the batch-invariant kernels (EngineConfig.batch_invariant);
    # the drafter keeps `attention` and `gemv`: its numerics change proposals, never the output.
    batch_invariant: bool = False

    def __post_init__(self):
        if self.tree is not None and (self.tree.is_chain or self.num_draft not in (0, self.tree.steps)):
            raise ConfigError(f"step config: tree {self.tree} needs num_draft {self.tree.steps} (or 0) and a "
                              f"non-chain tree, got num_draft {self.num_draft}")

    @property
    def target_attention(self) -> str:
        return "invariant" if self.batch_invariant else self.attention

    @property
    def target_gemv(self) -> str:
        return "invariant" if self.batch_invariant else self.gemv

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.num_draft > 0

    @property
    def speculator(self) -> Chain | Tree:
        """The proposal's shape: the tree when this program speculates with one, else a chain of K
        (of 0 when this program runs the target alone)."""
        if self.speculative and self.tree is not None:
            return Tree(self.tree)
        return Chain(self.num_draft if self.speculative else 0)

    @property
    def draft_context(self) -> DraftContext:
        # The drafter is replicated under tp (sharding.py, "Draft head"): its logits are computed
        # whole on every device, and nothing of the draft is pinned but its KV.
        return DraftContext(self.draft, self.attention, self.gemv, self.greedy, self.pin_draft_kv())

    def pin_target_kv(self):
        """The target forward's `pin_kv` (None on one device)."""
        return cache_pin(self.mesh, self.target.num_kv_heads)

    def pin_draft_kv(self):
        """The draft forward's `pin_kv`: its replicated KV cache (None on one device)."""
        return draft_cache_pin(self.mesh)


def _target(params, cfg: StepConfig, tokens, positions, kv, block_tables, tree=None):
    """Target forward with the residual stream replicated across tensor-parallel devices; `tree`
    (a layers.TreeAttention, or None for the causal mask) as the speculator's layout gives it."""
    extra = {} if tree is None else {"tree": tree}
    hidden, captures, kv = cfg.model.forward(params, cfg.target, tokens, positions, kv, block_tables,
                                             cfg.target_attention, cfg.pin_target_kv(), cfg.target_gemv, **extra)
    return (*replicate((hidden, captures), cfg.mesh), kv)


def _logits(params, cfg: StepConfig, hidden):
    """Target logits [..., V], vocab-sharded under tensor parallelism where a greedy program needs
    only an argmax (per-shard (max, index) pairs move, not the logits)."""
    return vocab_logits(cfg.model.logits(params, hidden, cfg.target_gemv), cfg.mesh, gather=not cfg.greedy)


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
                  captures: jax.Array, positions: jax.Array, draft_kv: KVCache, block_tables: jax.Array,
                  index: jax.Array) -> tuple[jax.Array, KVCache]:
    """The draft over target-verified positions: capture t paired with the token at t+1
    (next_tokens [B, T]), RoPE position t. -> (pre-norm h [B, H] at `index` [B], draft_kv)."""
    h, draft_kv = eagle3.draft_forward(dparams, cfg.draft, target_embed, next_tokens,
                                       eagle3.fuse_captures(dparams, captures, cfg.gemv), positions, draft_kv,
                                       block_tables, cfg.attention, cfg.pin_draft_kv(), cfg.gemv)
    return jnp.take_along_axis(h, index[:, None, None], axis=1)[:, 0], draft_kv


def _gather(tree, rows: jax.Array):
    return jax.tree_util.tree_map(lambda x: x[rows], tree)


def _write_slots(slots: Slots, rows: jax.Array, **values: jax.Array) -> Slots:
    """The named fields' rows set (each field's values [B, ...]); the other fields untouched.
    Only what changed is written: each field is a scatter kernel of its own."""
    slots = slots.replace(**{name: jax.tree.map(lambda x, v: x.at[rows].set(v), getattr(slots, name), v)
                             for name, v in values.items()})
    # Padded rows all wrote the dummy slot: reset it so its positions never grow.
    return slots.replace(length=slots.length.at[DUMMY_SLOT].set(0))


def iterate_head(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
                 cfg: StepConfig):
    """Verify, accept, extend the draft, and run the first draft step.

    rows [B], block_tables [B, nb] -> (state, num_accepted [B] i32, emitted [B, W] i32, carry):
    row b emitted emitted[b, :num_accepted[b] + 1]; entries after are padding. The slots also keep
    each row's top1_accepted (`Tree.accept`) beside num_accepted, for the host. `carry` is None
    when this program runs the target alone; else the draft continues from it (`chain_step`)
    and `commit_proposals` stores its proposals.
    """
    spec = cfg.speculator
    s = _gather(state.slots, rows)
    # [B, W] each; the mask: None (a chain's causal one) or a tree's TreeAttention
    tokens, positions, mask = spec.verify_layout(s)
    hidden, captures, target_kv = _target(params, cfg, tokens, positions, state.target_kv, block_tables, mask)
    logits = _logits(params, cfg, hidden)  # [B, W, V]
    # emitted, path [B, E] (E = spec.emitted_width); path None where the accepted tokens were
    # verified where they stay (a chain)
    n, emitted, path, top1 = spec.accept(cfg.greedy, dparams, logits, s,
                                         _keys(s.sampling.key, s.num_generated, _STREAM_VERIFY), cfg.target.vocab_size,
                                         cfg.measure_chain)
    target_kv = spec.commit_kv(target_kv, path, s.length, block_tables)  # the accepted KV at length..length+n
    last = jnp.take_along_axis(emitted, n[:, None], axis=1)[:, 0]  # correction or bonus token
    num_generated = s.num_generated + n + 1
    draft_kv, carry = state.draft_kv, None
    if cfg.draft is not None:
        # Draft extend: position t pairs capture t with the token at t+1, for t = length..length+n.
        # It runs in target-only programs too (one position), so the draft's KV has no holes when
        # speculation resumes.
        ext_captures, ext_positions = spec.extend_inputs(captures, positions, path, s.length)  # [B, E, C], [B, E]
        ext_tokens = jnp.where(jnp.arange(spec.emitted_width) <= n[:, None], emitted, 0)
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, ext_tokens, ext_captures, ext_positions,
                                         draft_kv, block_tables, n)  # h at length + n
    if cfg.speculative:
        carry = spec.start(h_last, last, s.length + n, s.sampling, _keys(s.sampling.key, num_generated, _STREAM_DRAFT),
                           s.draft_probs.shape[-1])
        carry, draft_kv = spec.draft_step(cfg.draft_context, dparams, params.embed, carry, draft_kv, block_tables, 0)
    width = state.slots.emitted.shape[1]  # the engine's widest verify; a target-only iteration emits 1
    slots = _write_slots(state.slots, rows, last_token=last, length=s.length + n + 1, num_generated=num_generated,
                         accepted=jnp.stack([n, top1], axis=1),
                         emitted=jnp.pad(emitted, ((0, 0), (0, width - emitted.shape[1]))))
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg), n, emitted, carry


def chain_step(dparams: DraftParams, target_embed: jax.Array, state: DeviceState, carry: DraftCarry,
               block_tables: jax.Array, j: int, cfg: StepConfig) -> tuple[DeviceState, DraftCarry]:
    """Draft step j >= 1 as its own program (the per-step path), threading the carry."""
    carry, draft_kv = cfg.speculator.draft_step(cfg.draft_context, dparams, target_embed, carry, state.draft_kv,
                                                block_tables, j)
    return _finish(state.replace(draft_kv=draft_kv), cfg), carry


def commit_proposals(state: DeviceState, rows: jax.Array, carry: DraftCarry, cfg: StepConfig) -> DeviceState:
    """Store the proposals (a chain's with, in a sampling program, their q; a tree's nodes and
    parents) for the next iteration to verify."""
    slots = cfg.speculator.commit(state.slots, rows, carry, cfg.greedy)
    return _finish(state.replace(slots=slots), cfg)


def iterate(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array, block_tables: jax.Array,
            cfg: StepConfig) -> tuple[DeviceState, jax.Array, jax.Array]:
    """One whole speculative iteration in one program (the fused path); see `iterate_head`."""
    state, n, emitted, carry = iterate_head(params, dparams, state, rows, block_tables, cfg)
    if carry is not None:
        carry, draft_kv = cfg.speculator.propose(cfg.draft_context, dparams, params.embed, carry, state.draft_kv,
                                                 block_tables, start=1)
        state = commit_proposals(state.replace(draft_kv=draft_kv), rows, carry, cfg)
    return state, n, emitted


def iterate_in_place(params, dparams: DraftParams | None, state: DeviceState, rows: jax.Array,
                     block_tables: jax.Array, cfg: StepConfig) -> DeviceState:
    """`iterate` as the engine runs it: the verdicts stay in the slots (`Slots.accepted`,
    `Slots.emitted`), so the program's only output is the donated state, which XLA aliases to its
    input. Why: XLA runs the program as a CUDA graph (a command buffer) that records the address of
    every buffer it touches, and rewrites the nodes that touch a buffer whose address changed before
    the next launch. A returned array is a new buffer on every call; so is a host array passed in.
    That rewrite costs about as much host time as a SmolLM2 iteration takes on the device
    (BENCHMARKS.md, "Host overhead"). `read_verdicts` copies the verdicts out, into buffers of
    their own for the same reason."""
    return iterate(params, dparams, state, rows, block_tables, cfg)[0]


def read_verdicts(buffer: jax.Array, accepted: jax.Array, emitted: jax.Array, rows: jax.Array) -> jax.Array:
    """The rows' verdicts, copied out of the slots in one array, so the host reads them with one
    device-to-host copy: accepted [S, 2] (`Slots.accepted`), emitted [S, K+1], rows [B] -> verdicts
    [B, 2 + K+1]: the proposals accepted, top1_accepted, then the tokens emitted (`split_verdicts`).

    Written over `buffer` [B, 2 + K+1] (donated; only its address is used), so the program
    allocates nothing. Why: a device buffer allocated between two iterations, even one this small,
    can move the next iteration's temporary buffer, and XLA then updates every node of its CUDA
    graph before the launch (BENCHMARKS.md, "Host overhead")."""
    del buffer
    return jnp.concatenate([accepted[rows], emitted[rows]], axis=1)


def read_first_token(buffer: jax.Array, last_token: jax.Array, slot: jax.Array) -> jax.Array:
    """The first token a prefill sampled into `slot` [1], copied out of the slots: last_token [S]
    -> [1]. Written over `buffer` [1] (donated; only its address is used), so the program
    allocates nothing, for the reason `read_verdicts` gives: a prefill admitted between two
    iterations would otherwise leave a new buffer on the device, kept until the host reads it."""
    del buffer
    return last_token[slot]


def split_verdicts(verdicts):
    """verdicts [B, 2 + K+1] (`read_verdicts`; a device or host array) -> (num_accepted [B],
    top1_accepted [B] (`Tree.accept`), emitted [B, K+1]): row b emitted emitted[b, :num_accepted[b] + 1]."""
    return verdicts[:, 0], verdicts[:, 1], verdicts[:, 2:]


def prefill(params, dparams: DraftParams | None, state: DeviceState, tokens: jax.Array,
            next_tokens: jax.Array, num_valid: jax.Array, start: jax.Array, slot: jax.Array,
            block_table: jax.Array, num_generated: jax.Array, row: sampling.RowSampling,
            cfg: StepConfig) -> DeviceState:
    """Prefill one chunk of each of P prompts, row p into `slot[p]`.

    tokens [P, T] (row p padded after num_valid[p]), next_tokens [P, T]: the same ids shifted left
    by one; entry num_valid-1 of a row is the next token, or -1 on a new request's last chunk,
    where the sampled first token goes; start [P]: position of each row's tokens[0]; block_table
    [P, nb]; num_generated [P]: the tokens generated once the chunk is in, 1 for a new request
    (the token sampled here), g for one resumed after preemption with g generated (the last of
    them given in next_tokens, which its next iteration verifies from: the keys continue where
    they were); row: each request's sampling parameters [P]. Padding rows (a bucket larger than the
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
    logits = _logits(params, cfg, last_hidden)  # [P, V]
    length = start + num_valid  # the first generated token's position
    sampled = (jnp.argmax(logits, axis=-1).astype(jnp.int32) if cfg.greedy
               else sampling.sample_logits(logits, row, _keys(row.key, 0, _STREAM_FIRST),
                                           sampling.coupling_noise(row.key, length, cfg.target.vocab_size)))  # [P]
    given = jnp.take_along_axis(next_tokens, last_idx[:, None], axis=1)[:, 0]
    first = jnp.where(given < 0, sampled, given)
    spec = cfg.speculator
    draft_kv = state.draft_kv
    if cfg.speculative:
        # next_tokens holds -1 where the token the target just produced belongs (last chunk).
        shifted = jnp.where(next_tokens < 0, first[:, None], next_tokens)
        h_last, draft_kv = _draft_extend(dparams, cfg, params.embed, shifted, captures, positions, draft_kv,
                                         block_table, last_idx)
        # The same key schedule as every later iteration.
        carry = spec.start(h_last, first, length - 1, row, _keys(row.key, num_generated, _STREAM_DRAFT),
                           state.slots.draft_probs.shape[-1])
        carry, draft_kv = spec.propose(cfg.draft_context, dparams, params.embed, carry, draft_kv, block_table)

    def zeros(x):  # the rows' share of a per-slot buffer, zeroed
        return None if x is None else jnp.zeros((p, *x.shape[1:]), x.dtype)

    slots = _write_slots(state.slots, slot, last_token=first, length=length, drafts=zeros(state.slots.drafts),
                         draft_probs=zeros(state.slots.draft_probs), sampling=row, num_generated=num_generated,
                         accepted=zeros(state.slots.accepted), emitted=zeros(state.slots.emitted),
                         parents=zeros(state.slots.parents), drafted_by=jnp.zeros_like(length))
    if cfg.speculative:
        slots = spec.commit(slots, slot, carry, cfg.greedy)  # the first proposal, as an iteration leaves it
    return _finish(DeviceState(target_kv=target_kv, draft_kv=draft_kv, slots=slots), cfg)


# The fused iteration's GEMMs (EngineConfig.gemm). "auto" takes cuBLAS from this many verify rows
# (bucket x tokens verified a row) for a target at most this wide; XLA's Triton GEMMs elsewhere.
CUBLAS_MIN_ROWS, CUBLAS_MAX_ROWS = 64, 512
CUBLAS_MAX_HIDDEN = 2048
_GEMM_OPTIONS = {"triton": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}  # compiler options


def gemm_for(setting: str, target: ModelConfig, verify_rows: int) -> str:
    """EngineConfig.gemm for one program of `verify_rows` rows verified: "triton" or "cublas"."""
    if setting != "auto":
        return setting
    wide = CUBLAS_MIN_ROWS <= verify_rows <= CUBLAS_MAX_ROWS
    return "cublas" if wide and target.hidden_size <= CUBLAS_MAX_HIDDEN else "triton"


def iteration_gemm(cfg: StepConfig, rows: int) -> str:
    """The GEMMs of `cfg`'s fused iteration over `rows` rows (a bucket)."""
    return gemm_for(cfg.gemm, cfg.target, rows * cfg.speculator.verify_width)


def jit_per_gemm(fun, **jit_kwargs) -> dict:
    """`fun` jitted once per GEMM backend, {"triton": ..., "cublas": ...}: XLA takes the choice as a
    compiler option, fixed per jitted function."""
    return {gemm: jax.jit(fun, compiler_options=options, **jit_kwargs) for gemm, options in _GEMM_OPTIONS.items()}


# One executable per input shape (batch bucket, chunk bucket) and StepConfig; state donated.
prefill_step = jax.jit(prefill, static_argnames="cfg", donate_argnames="state")
_iterate_in_place = jit_per_gemm(iterate_in_place, static_argnames="cfg", donate_argnames="state")
read_verdicts_step = jax.jit(read_verdicts, donate_argnames="buffer", keep_unused=True)
read_first_token_step = jax.jit(read_first_token, donate_argnames="buffer", keep_unused=True)
# The per-step path: the same iteration as K + 1 programs, the runner threading the carry.
iterate_head_step = jax.jit(iterate_head, static_argnames="cfg", donate_argnames="state")
chain_step_jit = jax.jit(chain_step, static_argnames=("j", "cfg"), donate_argnames=("state", "carry"))
commit_step = jax.jit(commit_proposals, static_argnames="cfg", donate_argnames="state")


def iterate_in_place_step(cfg: StepConfig, rows: int):
    """The jitted fused iteration of `cfg` over `rows` rows, compiled with its GEMMs (`iteration_gemm`):
    call it as iterate_in_place(params, draft_params, state, slots, tables, cfg=cfg)."""
    return _iterate_in_place[iteration_gemm(cfg, rows)]
