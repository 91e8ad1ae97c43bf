"""The device runner: `ModelRunner` owns the served weights, the donated `DeviceState`, the buffers
pinned per batch bucket and the compiled steps. It dispatches prefills and iterations without
waiting, and compiles and times them on padding rows; what to run, and when, is the engine's.

Every buffer an iteration touches keeps its device address from call to call: XLA rewrites its CUDA
graph for any moved buffer, at a host cost as large as an iteration (BENCHMARKS.md, "Host overhead").
So the state is donated, per-call arguments live in `PinnedBatch`, results land in buffers held here.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm.auto import tqdm

from eagle3_jax.config import DUMMY_SLOT, DraftConfig, ModelConfig, ServedConfig, check_draft_fits
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.parallel import sharding
from eagle3_jax.runner import executables, logprobs, sampling
from eagle3_jax.runner.speculators import Speculator
from eagle3_jax.runner.state import (
    DeviceState,
    SlotLayout,
    init_state,
    state_shardings,
    with_drafts,
    with_history,
    with_lengths,
)
from eagle3_jax.runner.steps import (
    TARGET_ALONE,
    StepConfig,
    accept_head_step,
    accept_step,
    chain_step_jit,
    commit_step,
    iterate_head_step,
    iterate_in_place_step,
    prefill_step,
    read_first_token_step,
    read_verdicts_step,
    state_jit,
    verified_shapes,
    verify_step,
)
from eagle3_jax.runner.target import target_model_for
from eagle3_jax.sampling_params import SamplingParams

Job = tuple[Callable, tuple, dict]  # (jitted function, args, keyword args): one program to compile
# A masked iteration's token masks [B, W, words], computed by the host once its verify is dispatched.
MaskFill = Callable[[], np.ndarray]


def compile_on_pool(compiles: Sequence[Callable[[], Any]], progress: bool = False) -> tuple[float, list]:
    """Run the compiles (thunks) on a thread pool, as XLA compiles without the GIL -> (seconds, executables)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(compiles), os.cpu_count() or 1))) as pool:
        futures = [pool.submit(compile_) for compile_ in compiles]
        done = concurrent.futures.as_completed(futures)
        for future in tqdm(done, total=len(futures), desc="compiling", unit="program", disable=not progress):
            future.result()
    return time.perf_counter() - start, [future.result() for future in futures]


def precompile(jobs: Sequence[Job], progress: bool = False) -> float:
    """Lower and compile the jobs on a thread pool -> seconds. A jitted call with the same shapes then
    loads them from JAX's persistent compilation cache (where one is set, and they were kept)."""
    return compile_on_pool([lambda j=j: j[0].lower(*j[1], **j[2]).compile() for j in jobs], progress)[0]


@dataclasses.dataclass(frozen=True)
class AheadProgram:
    """A fused program `ModelRunner.compile_ahead` builds: `key`, how the runner finds it when it runs
    (("iterate", bucket, cfg), a masked iteration's ("verify", ...) and ("accept", ...), or ("prefill",
    rows, chunk, cfg)); `jitted` lowered on `args` and
    `kwargs` (padding rows) with `cfg` static."""

    key: tuple
    jitted: Callable
    args: tuple
    kwargs: dict
    cfg: StepConfig

    def store_key(self, devices: Sequence[jax.Device]) -> str:
        return executables.program_key(self.key[0], self.key[1:], self.args, self.kwargs, devices)

    def compile(self) -> jax.stages.Compiled:
        return self.jitted.lower(*self.args, cfg=self.cfg, **self.kwargs).compile()


class CompileCounter:
    """Counts executables JAX builds (backend compiles and persistent-cache loads), process-wide."""

    count = 0
    _registered = False

    @classmethod
    def install(cls) -> None:
        if cls._registered:
            return
        cls._registered = True

        def on_duration(event: str, _duration: float, **_kw) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                cls.count += 1

        def on_event(event: str, **_kw) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                cls.count += 1

        jax.monitoring.register_event_duration_secs_listener(on_duration)
        jax.monitoring.register_event_listener(on_event)


def freeze_heap() -> None:
    """Collect, then move every tracked object out of the cyclic collector's reach (`gc.freeze`),
    as vLLM and SGLang do after start-up: a compiled engine leaves hundreds of thousands of objects
    (JAX's caches, traced programs) that every full collection would walk while requests wait.
    Frozen objects are still freed by reference counting; the next warm-up unfreezes first."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@dataclasses.dataclass
class PrefillInputs:
    """The host arrays of one prefill call (`steps.prefill`'s): tokens, next_tokens [P, T]; block_table
    [P, nb]; the rest [P]."""

    tokens: np.ndarray
    next_tokens: np.ndarray
    num_valid: np.ndarray
    start: np.ndarray
    slot: np.ndarray
    block_table: np.ndarray
    num_generated: np.ndarray

    @classmethod
    def padding(cls, rows: int, size: int, num_blocks: int) -> PrefillInputs:
        """Padding rows: each a last chunk of one token into the dummy slot, its block table scratch."""
        next_tokens = np.zeros((rows, size), np.int32)
        next_tokens[:, 0] = -1
        return cls(np.zeros((rows, size), np.int32), next_tokens, np.ones(rows, np.int32), np.zeros(rows, np.int32),
                   np.full(rows, DUMMY_SLOT, np.int32), np.zeros((rows, num_blocks), np.int32), np.ones(rows, np.int32))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.tokens, self.next_tokens, self.num_valid, self.start, self.slot, self.block_table,
                self.num_generated)


# The rows' cached lengths, a slot's token history, some slots' pending proposals, set in place
# (donated: the state keeps its addresses).
_set_lengths = state_jit(with_lengths, donate_argnums=0)
_set_history = state_jit(with_history, donate_argnums=0)
_set_drafts = state_jit(with_drafts, donate_argnums=0)

# The pending proposals of some slots (and a tree's parents), for the host to read.
_read_drafts = jax.jit(lambda drafts, rows, width: drafts[rows, :width], static_argnums=2)
_read_tree = jax.jit(lambda drafts, parents, rows, width: (drafts[rows, :width], parents[rows, :width]),
                     static_argnums=3)

# A padding row never makes a call sample: greedy.
PADDING_PARAMS = SamplingParams(max_tokens=1)

# Overwrite device arrays with new values at their own addresses: the donated `old` is the output
# buffer (keep_unused: jit would otherwise drop the unread `old`, and with it the aliasing).
_overwrite = jax.jit(lambda old, new: new, donate_argnums=0, keep_unused=True)


class PinnedBatch:
    """The iteration's slots [B] and block tables [B, nb] at one device address per bucket,
    overwritten in place only when they change (a host array passed in would be a new buffer every
    call); two verdict buffers per bucket (and per bucket of logprobs programs), used in turn; one
    buffer per bucket for a logprobs program's scored tokens; the latest masked iteration's verify
    logits and captures (`steps.verify_in_place`); one first-token buffer per slot."""

    def __init__(self, mesh: Mesh | None):
        self._placement = sharding.replicated_placement(mesh)
        self._by_bucket: dict[int, tuple[np.ndarray, np.ndarray, tuple[jax.Array, jax.Array]]] = {}
        # (bucket, whether scored) -> (oldest, newest)
        self._verdicts: dict[tuple[int, bool], tuple[jax.Array, jax.Array]] = {}
        self._scored: dict[int, jax.Array] = {}  # bucket -> the last logprobs program's scored [B, E, F]
        self._masks: dict[tuple[int, ...], jax.Array] = {}  # token masks by shape: [B, W, words], [P, words]
        # The latest masked verify's (logits, captures) with their shapes' key: one pair only, which keeps
        # its address while a grammar batch keeps its bucket and proposal (a pair per bucket would hold
        # B x W x V f32 for each bucket, outside the pool's sizing).
        self._verified: tuple[tuple, tuple[jax.Array, jax.Array | None]] | None = None
        self._verified_shapes: dict[tuple[int, StepConfig], tuple] = {}
        self._first_tokens: list[list[jax.Array]] = []  # slot -> [slot index [1], first token [1]]

    def buffers(self) -> list[jax.Array]:
        """Every device buffer held here."""
        return jax.tree.leaves(([held[2] for held in self._by_bucket.values()], list(self._verdicts.values()),
                                list(self._scored.values()), self._first_tokens, list(self._masks.values()),
                                None if self._verified is None else self._verified[1]))

    def get(self, slots: np.ndarray, tables: np.ndarray) -> tuple[jax.Array, jax.Array]:
        held = self._by_bucket.get(len(slots))
        if held is not None and np.array_equal(held[0], slots) and np.array_equal(held[1], tables):
            return held[2]
        if held is None:
            # Buffers of their own (the CPU backend may alias host memory, which a donation cannot
            # reuse); overwritten once already, so the bucket's first call (warm-up) compiles that.
            held = (None, None, jax.device_put((slots, tables), self._placement, may_alias=False))
        device = _overwrite(held[2], (slots, tables))
        self._by_bucket[len(slots)] = (slots.copy(), tables.copy(), device)
        return device

    def token_mask(self, mask: np.ndarray | None) -> jax.Array | None:
        """`mask` on the device in the buffer held for its shape, overwritten in place (None: a
        program that takes none)."""
        if mask is None:
            return None
        held = self._masks.get(mask.shape)
        if held is None:
            held = jax.device_put(mask, self._placement, may_alias=False)
        self._masks[mask.shape] = held = _overwrite(held, mask)
        return held

    def read_verdicts(self, state: DeviceState, rows: jax.Array, scored: jax.Array | None = None) -> jax.Array:
        """The verdicts [B, 2 + E] of the iteration just dispatched over `rows` [B] (a logprobs
        program's: [B, 2 + E + E F] with its `scored` [B, E, F]), without waiting, in the bucket's
        older buffer: read them before the bucket's next iteration but one."""
        key = (rows.shape[0], scored is not None)
        pair = self._verdicts.get(key)
        if pair is None:
            width = state.slots.emitted.shape[1] * (1 + (0 if scored is None else scored.shape[2]))
            empty = np.zeros((rows.shape[0], 2 + width), np.int32)
            pair = tuple(jax.device_put(empty, self._placement, may_alias=False) for _ in range(2))
        verdicts = read_verdicts_step(pair[0], state.slots.accepted, state.slots.emitted, rows, scored)
        self._verdicts[key] = (pair[1], verdicts)
        return verdicts

    def scored(self, bucket: int, shape: tuple[int, int]) -> jax.Array:
        """The buffer [bucket, *shape] a logprobs iteration writes over (donated); `keep_scored` takes it back."""
        held = self._scored.pop(bucket, None)
        return held if held is not None else jax.device_put(np.zeros((bucket, *shape), np.int32), self._placement,
                                                            may_alias=False)

    def keep_scored(self, scored: jax.Array) -> None:
        self._scored[scored.shape[0]] = scored

    def verified(self, params, state: DeviceState, slots: jax.Array, tables: jax.Array,
                 cfg: StepConfig) -> tuple[jax.Array, jax.Array | None]:
        """The buffers (logits, captures or None) a masked iteration's verify of `cfg` over `slots`
        writes over (donated; `steps.verify_in_place`); `keep_verified` takes them back."""
        shapes = self._verified_shapes.get((len(slots), cfg))
        if shapes is None:  # traced once a bucket and config
            shapes = self._verified_shapes[len(slots), cfg] = verified_shapes(params, state, slots, tables, cfg)
        held, self._verified = self._verified, None
        if held is not None and held[0] == _shapes_key(shapes):
            return held[1]
        # Made on the device: B x W x V f32 from the host would cross PCIe at each new shape.
        return tuple(None if x is None else jnp.zeros(x.shape, x.dtype, device=self._placement) for x in shapes)

    def keep_verified(self, verified: tuple[jax.Array, jax.Array | None]) -> None:
        self._verified = (_shapes_key(verified), verified)

    def read_first_token(self, state: DeviceState, slot: int) -> jax.Array:
        """The first token [1] the prefill just dispatched sampled into `slot`, without waiting. One buffer
        a slot suffices: a slot is reused only after its request, which read it, finished."""
        if not self._first_tokens:  # every slot's at once: none is allocated while serving
            held = [(np.array([s], np.int32), np.zeros(1, np.int32)) for s in range(state.slots.last_token.shape[0])]
            self._first_tokens = [list(pair) for pair in jax.device_put(held, self._placement, may_alias=False)]
        index, buffer = self._first_tokens[slot]
        first = read_first_token_step(buffer, state.slots.last_token, index)
        self._first_tokens[slot][1] = first
        return first


def verify_pinned(params, state: DeviceState, pinned: PinnedBatch, slots: jax.Array, tables: jax.Array,
                  cfg: StepConfig, verify: Callable) -> tuple[DeviceState, tuple[jax.Array, jax.Array | None]]:
    """A masked iteration's verify (`steps.verify_in_place`; `verify`, its program called without `cfg`)
    over the pinned `slots`, `tables`, written over the buffers held for it, which keep its outputs
    -> (state, (logits, captures or None))."""
    state, *verified = verify(params, state, slots, tables, *pinned.verified(params, state, slots, tables, cfg))
    pinned.keep_verified(verified := tuple(verified))
    return state, verified


def _shapes_key(arrays) -> tuple:
    return tuple(None if x is None else (x.shape, str(x.dtype)) for x in arrays)


def iterate_pinned(params, draft_params, state: DeviceState, pinned: PinnedBatch, slots: np.ndarray,
                   tables: np.ndarray, cfg: StepConfig, token_mask: MaskFill | None = None,
                   built: Callable | None = None) -> tuple[DeviceState, jax.Array]:
    """One fused iteration, every buffer at a stable address, state donated -> (state, verdicts [B, 2 + E],
    a logprobs program's with its scored tokens); `built`: the program compiled ahead for `cfg` at this
    bucket (None: the jitted step). A masked program (`cfg.masked`) is two: its verify's forward
    dispatched first, then `token_mask()` [B, W, words] computed on the host while it runs, then the
    acceptance under them (`built`: that pair)."""
    slots, tables = pinned.get(slots, tables)
    verified = ()
    if cfg.masked:
        verify, step = built or (functools.partial(verify_step(cfg, len(slots)), cfg=cfg),
                                 functools.partial(accept_step(cfg, len(slots)), cfg=cfg))
        state, verified = verify_pinned(params, state, pinned, slots, tables, cfg, verify)
    else:
        step = built or functools.partial(iterate_in_place_step(cfg, len(slots)), cfg=cfg)
    mask = None if token_mask is None else pinned.token_mask(token_mask())
    if not cfg.logprobs:
        state = step(params, draft_params, state, slots, tables, *verified, token_mask=mask)
        return state, pinned.read_verdicts(state, slots)
    scored = pinned.scored(len(slots), (state.slots.emitted.shape[1], logprobs.fields(cfg.target.vocab_size)))
    state, scored = step(params, draft_params, state, slots, tables, *verified, scored, token_mask=mask)
    pinned.keep_scored(scored)
    return state, pinned.read_verdicts(state, slots, scored)


def time_calls(call: Callable[[DeviceState], tuple[DeviceState, Any]], state: DeviceState,
               reset: Callable[[DeviceState], DeviceState], calls: int, rounds: int) -> tuple[DeviceState, list[float]]:
    """Seconds per call of `call` (state -> (state, out), donated), `calls` back to back as serving issues
    them: one sample a round, after two warm-up calls, `reset` before each round. -> (state, samples)."""
    for _ in range(2):
        state, out = call(state)
    jax.block_until_ready((state, out))
    samples = []
    for _ in range(rounds):
        state = jax.block_until_ready(reset(state))
        start = time.perf_counter()
        for _ in range(calls):
            state, out = call(state)
        jax.block_until_ready((state, out))
        samples.append((time.perf_counter() - start) / calls)
    return state, samples


@dataclasses.dataclass(frozen=True)
class PlacedWeights:
    """The weights an engine serves, on its devices: the target's folded for serving (fewer argument
    buffers per dispatch), the drafter's beside them. `placed`: the target's as placed, before
    folding, which the caller still holds while the engine is built (in use when the pool is sized)."""

    params: Any
    draft_params: DraftParams | None
    placed: Any

    def arrays(self) -> tuple:
        return self.placed, self.params, self.draft_params


def place_weights(target: ModelConfig, params, draft: DraftConfig | None, draft_params: DraftParams | None,
                  mesh: Mesh | None = None) -> PlacedWeights:
    """The weights as `weights/` loads them, checked against each other and placed on the devices:
    under a mesh the target sharded (weights its loader placed stay where they are) and the drafter
    replicated, with an embedding of its own (no collective in the draft). The caller's are untouched."""
    if draft is not None:
        check_draft_fits(target, draft, has_own_embedding=draft_params.embed is not None)
    model = target_model_for(target)
    if mesh is not None:
        params = sharding.shard_params(params, mesh, model.param_specs(target, mesh.shape[sharding.TP]))
        if draft_params is not None:
            draft_params = sharding.place_draft(draft_params, params.embed, mesh)
    return PlacedWeights(model.for_serving(params), draft_params, params)


class ModelRunner:
    """The target and drafter on the device, their state, and the programs that step it."""

    def __init__(self, cfg: ServedConfig, target: ModelConfig, draft: DraftConfig | None, weights: PlacedWeights,
                 mesh: Mesh | None = None):
        """`cfg`: the engine's served configuration (runner/served.py); `weights`: `place_weights`'."""
        self.cfg = cfg
        self.proposals: tuple[Speculator, ...] = cfg.speculation.proposals
        main = self.proposals[0] if self.proposals else TARGET_ALONE
        drafting = any(p.facts.uses_drafter for p in self.proposals)
        kernels = cfg.kernels
        self.step_cfg = StepConfig(target=target, draft=draft if drafting else None, speculator=main, mesh=mesh,
                                   attention=kernels.attention, gemv=kernels.gemv, gemm=kernels.gemm,
                                   model=target_model_for(target), batch_invariant=kernels.batch_invariant)
        self._params, self._draft_params = weights.params, weights.draft_params
        layout = SlotLayout.union(p.facts.slot_layout for p in self.proposals or (main,))
        make_state = functools.partial(init_state, target, self.step_cfg.draft, cfg, weights.placed.embed.dtype,
                                       layout)
        if mesh is None:
            self._state = make_state()
        else:  # each device builds its own share: the whole pool never sits on one
            shapes = jax.eval_shape(make_state)
            self._state = jax.jit(make_state, out_shardings=state_shardings(shapes, target, self.step_cfg.draft,
                                                                             mesh))()
        self._pinned = PinnedBatch(mesh)
        # The programs `compile_ahead` has built (AheadProgram.key -> executable), run in place of the jitted steps.
        self._built: dict[tuple, jax.stages.Compiled] = {}
        CompileCounter.install()

    def close(self) -> None:
        """Free every device buffer this runner holds (weights, KV pool, slots, pinned batches) now,
        whoever else still refers to them; the runner is unusable after."""
        held = (self._params, self._draft_params, self._state, self._pinned.buffers())
        self._params = self._draft_params = self._state = None
        self._pinned = PinnedBatch(self.step_cfg.mesh)
        self._built = {}
        for array in jax.tree.leaves(held):
            if isinstance(array, jax.Array) and not array.is_deleted():
                array.delete()

    @property
    def closed(self) -> bool:
        return self._state is None

    @property
    def speculator(self) -> Speculator:
        """The engine's proposal (TARGET_ALONE where it serves none). Prefills draft it."""
        return self.step_cfg.speculator

    def config(self, proposal: Speculator, greedy: bool, logprobs: bool = False, masked: bool = False) -> StepConfig:
        """The step config of one program: `proposal` (one of `proposals`, or TARGET_ALONE), greedy or
        not, scoring the tokens it emits or not, taking token masks or not."""
        return dataclasses.replace(self.step_cfg, speculator=proposal, greedy=greedy, logprobs=logprobs, masked=masked)

    def allow_all(self, cfg: StepConfig, rows: int, iteration: bool = True) -> np.ndarray | None:
        """Token masks allowing everything for an iteration ([rows, W, words]) or a prefill ([rows,
        words]) of `cfg` (None: it takes none)."""
        if not cfg.masked:
            return None
        shape = (rows, cfg.speculator.facts.verify_width) if iteration else (rows,)
        return sampling.allow_all(shape, self.step_cfg.target.vocab_size)

    @property
    def num_compilations(self) -> int:
        return CompileCounter.count

    def prefill(self, inputs: PrefillInputs, params: Sequence[SamplingParams], seeds: Sequence[int | None],
                token_mask: np.ndarray | None = None, logprobs: bool = False,
                prompt_logprobs: bool = False) -> jax.Array | None:
        """One prefill call over `inputs`' P rows, row p sampled by `params[p]` with `seeds[p]`
        (None: its params carry a seed); the greedy program when every row is greedy; with
        `token_mask` [P, words] the program that samples the first tokens under it. With `logprobs`
        or `prompt_logprobs`, the program that scores (`steps.prefill`) -> its packed logprobs, not
        waited for; else None."""
        row = sampling.row_sampling_from_params(params, seeds, point_mass=self.speculator.facts.point_mass)
        cfg = dataclasses.replace(self.config(self.speculator, all(p.greedy for p in params), logprobs,
                                              masked=token_mask is not None), prompt_logprobs=prompt_logprobs)
        out = self._prefill_step(cfg, (*inputs.arrays(), row), self._pinned.token_mask(token_mask))
        self._state, scored = out if logprobs or prompt_logprobs else (out, None)
        return scored

    def _prefill_step(self, cfg: StepConfig, inputs: tuple, mask: jax.Array | None):
        """`prefill_step` of `cfg` on `inputs` (its arguments after the state), by the program compiled
        ahead where there is one. -> its outputs (the state donated)."""
        rows, size = inputs[0].shape
        built = self._built.get(("prefill", rows, size, cfg))
        step = built or functools.partial(prefill_step, cfg=cfg)
        return step(self._params, self._draft_params, self._state, *inputs, token_mask=mask)

    def write_history(self, slot: int, tokens: Sequence[int]) -> None:
        """Set `slot`'s token history to `tokens` from position 0, where the slots keep one (a prefill
        past a cached prefix writes only what it computes)."""
        history = self._state.slots.history
        if history is not None:
            row = np.zeros(history.shape[1], np.int32)
            row[:len(tokens)] = tokens
            self._state = _set_history(self._state, np.int32(slot), row)

    def first_token(self, slot: int) -> jax.Array:
        """The first token [1] the last prefill into `slot` sampled; read it before the slot's next prefill."""
        return self._pinned.read_first_token(self._state, slot)

    def iterate(self, slots: np.ndarray, tables: np.ndarray, cfg: StepConfig,
                token_mask: MaskFill | None = None) -> jax.Array:
        """One iteration over `slots` [B], `tables` [B, nb], fused or a program per draft step -> verdicts
        [B, 2 + E] (a `cfg.logprobs` program's with its scored tokens: `steps.split_verdicts`), to read
        before the bucket's next iteration but one. A masked program's (cfg.masked): its verify's forward
        dispatched, then `token_mask()` [B, W, words] called while it runs, then the acceptance under them."""
        if self.cfg.speculation.fused_iteration or not cfg.speculative:
            built = self._built.get(("iterate", len(slots), cfg))
            if cfg.masked:  # its verify and acceptance (`ahead_programs`)
                pair = tuple(self._built.get((kind, len(slots), cfg)) for kind in ("verify", "accept"))
                built = pair if all(pair) else None
            self._state, verdicts = iterate_pinned(self._params, self._draft_params, self._state, self._pinned, slots,
                                                   tables, cfg, token_mask, built)
            return verdicts
        slots, tables = self._pinned.get(slots, tables)
        if cfg.masked:
            state, verified = verify_pinned(self._params, self._state, self._pinned, slots, tables, cfg,
                                            functools.partial(verify_step(cfg, len(slots)), cfg=cfg))
            state, _, _, carry, scored = accept_head_step(self._params, self._draft_params, state, slots, tables,
                                                          *verified, cfg=cfg,
                                                          token_mask=self._pinned.token_mask(token_mask()))
        else:
            state, _, _, carry, scored = iterate_head_step(self._params, self._draft_params, self._state, slots,
                                                           tables, cfg=cfg)
        for j in range(1, cfg.speculator.facts.num_draft_steps):
            state, carry = chain_step_jit(self._draft_params, self._params.embed, state, carry, tables, j, cfg=cfg)
        self._state = commit_step(state, slots, carry, cfg=cfg)
        return self._pinned.read_verdicts(self._state, slots, scored)

    def read_drafts(self, slots: np.ndarray, width: int) -> np.ndarray:
        """The pending proposals [B, width] of `slots` [B] (target ids), read now: the host follows a
        grammar along them before a masked verify (waits for what was dispatched before)."""
        return np.asarray(_read_drafts(self._state.slots.drafts, slots, width))

    def read_tree(self, slots: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The pending trees of `slots` [B], read now: (node tokens, their parents) [B, width] each,
        node i + 1's at i (runner/tree.py's verify layout; parent 0: the root). For a grammar's
        masks along every path of the tree before a masked verify, as `read_drafts`."""
        drafts, parents = _read_tree(self._state.slots.drafts, self._state.slots.parents, slots, width)
        return np.asarray(drafts), np.asarray(parents)

    def write_drafts(self, slots: np.ndarray, drafts: np.ndarray, parents: np.ndarray | None = None) -> None:
        """Overwrite the first w pending proposals of `slots` [B] with `drafts` [B, w] (target ids), and
        a tree's parents with `parents` [B, w] where given, in place: the host puts a grammar's forced
        tokens there before a masked verify. Their q rows stay the drafter's (engine/engine.py,
        `_force_drafts` and `_force_tree`, say why that keeps every rule exact)."""
        self._state = _set_drafts(self._state, np.asarray(slots, np.int32), np.asarray(drafts, np.int32),
                                  None if parents is None else np.asarray(parents, np.int32))

    def padding_rows(self, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """A bucket of padded rows: (slots [B] all the dummy slot, block tables [B, nb] all scratch)."""
        return np.full(bucket, DUMMY_SLOT, np.int32), np.zeros((bucket, self.cfg.pool.max_blocks_per_seq), np.int32)

    def _padding_prefill(self, rows: int, size: int) -> tuple:
        """`prefill_step`'s arguments after the state for `rows` padding rows of `size` tokens."""
        inputs = PrefillInputs.padding(rows, size, self.cfg.pool.max_blocks_per_seq)
        return (*inputs.arrays(), sampling.row_sampling_from_params([PADDING_PARAMS] * rows, [0] * rows))

    def compile_iteration(self, bucket: int, cfg: StepConfig) -> None:
        """Build (or load) the iteration program of `cfg` at `bucket` by running it on padding rows (a
        masked one with the read of the drafts its masks follow, and their write with forced tokens)."""
        slots, tables = self.padding_rows(bucket)
        if cfg.masked and cfg.speculative:
            width = cfg.speculator.facts.verify_width - 1
            if cfg.speculator.facts.verifies_chain:
                self.write_drafts(slots, self.read_drafts(slots, width))
            else:
                self.write_drafts(slots, *self.read_tree(slots, width))
        mask = self.allow_all(cfg, bucket)
        self.iterate(slots, tables, cfg, None if mask is None else lambda: mask).block_until_ready()

    def compile_prefill(self, rows: int, size: int, greedy: bool, masked: bool = False) -> None:
        """Build the prefill program of `rows` x `size` tokens by running it on padding rows."""
        cfg = self.config(self.speculator, greedy, masked=masked)
        mask = self.allow_all(cfg, rows, iteration=False)
        self._state = self._prefill_step(cfg, self._padding_prefill(rows, size), self._pinned.token_mask(mask))
        self.first_token(DUMMY_SLOT).block_until_ready()  # as serving reads it

    def ahead_programs(self, iterations: Sequence[tuple[int, StepConfig]],
                       prefills: Sequence[tuple[int, int, bool, bool]]) -> list[AheadProgram]:
        """The fused iteration and prefill programs to build ahead (`compile_ahead`): iterations (bucket,
        config; a masked one's verify and acceptance, `iterate_pinned`), prefills (rows, chunk, greedy,
        masked); programs that score logprobs are built on first use."""
        p, dp, st = self._params, self._draft_params, self._state
        programs = []
        for b, c in iterations:
            rows = self.padding_rows(b)
            if not c.masked:
                programs.append(AheadProgram(("iterate", b, c), iterate_in_place_step(c, b), (p, dp, st, *rows),
                                             {"token_mask": None}, c))
                continue
            verified = tuple(None if x is None else np.zeros(x.shape, x.dtype)
                             for x in verified_shapes(p, st, *rows, c))  # (the pinned buffers' shapes)
            programs += [AheadProgram(("verify", b, c), verify_step(c, b), (p, st, *rows, *verified), {}, c),
                         AheadProgram(("accept", b, c), accept_step(c, b), (p, dp, st, *rows, *verified),
                                      {"token_mask": self.allow_all(c, b)}, c)]
        for rows, size, greedy, masked in prefills:
            cfg = self.config(self.speculator, greedy, masked=masked)
            programs.append(AheadProgram(("prefill", rows, size, cfg), prefill_step,
                                         (p, dp, st, *self._padding_prefill(rows, size)),
                                         {"token_mask": self.allow_all(cfg, rows, iteration=False)}, cfg))
        return programs

    @property
    def devices(self) -> list[jax.Device]:
        """The devices the programs run on."""
        mesh = self.step_cfg.mesh
        return list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]

    def compile_ahead(self, iterations: Sequence[tuple[int, StepConfig]],
                      prefills: Sequence[tuple[int, int, bool, bool]],
                      progress: bool = False) -> float:
        """Build the fused programs at once on a thread pool, for every later call of their shapes to
        run (never traced again) -> seconds. Each is loaded from the executable store beside JAX's
        persistent cache where an earlier start kept it (runner/executables.py: no tracing), else
        lowered, compiled and kept there. What it has built it skips."""
        start = time.perf_counter()
        store = executables.ExecutableStore.beside_compilation_cache(self.devices)
        programs = [p for p in self.ahead_programs(iterations, prefills) if p.key not in self._built]
        keys = [p.store_key(store.devices) for p in programs]

        built = compile_on_pool([functools.partial(store.build, k, p.compile) for p, k in zip(programs, keys)],
                                progress)[1]
        self._built.update((p.key, compiled) for p, compiled in zip(programs, built))
        return time.perf_counter() - start

    def time_iteration(self, slots: np.ndarray, tables: np.ndarray, cfg: StepConfig, context: int | None = None,
                       calls: int = 3, rounds: int = 3) -> list[float]:
        """Seconds per iteration over `slots` [B], `tables` [B, nb], dispatched as serving does (`time_calls`).
        With `context`, the rows start every round at that many cached tokens and end at 0 (a prefill
        rewrites a slot's state anyway)."""
        rows = np.unique(slots)

        def call(state):
            self._state = state
            verdicts = self.iterate(slots, tables, cfg)  # donates `state`: read self._state after
            return self._state, verdicts

        def reset(state):
            return state if context is None else _set_lengths(state, rows, context)

        state, samples = time_calls(call, self._state, reset, calls, rounds)
        self._state = state if context is None else _set_lengths(state, rows, 0)
        return samples
