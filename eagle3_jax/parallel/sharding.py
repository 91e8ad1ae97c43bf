"""Tensor parallelism (Megatron layout) through jax.sharding: we only say where each array lives,
XLA's SPMD partitioner (Shardy) derives the per-device program and inserts the collectives.

One mesh axis, "tp". The layout, per weight (ours are [in, out], so `x @ w`; q/k/v and gate/up
are fused, see model/layers.py):

  wqkv       [D, G, R+2, hd]  P(None, "tp", None, None)  column-parallel by kv group: each device
                                                          computes its own groups' q, k and v
                                                          heads, no communication (see Heads)
  w_gate_up  [D, 2, I]        P(None, None, "tp")        column-parallel: each device computes its
                                                          slice of both gate and up
  wo, w_down [in, D]          P("tp", None)              row-parallel: each device contracts its
                                                          slice, one all-reduce of [B, T, D]
                                                          restores the sum
  norms, d2t                  P()                        replicated (tiny)
  embed      [V, D]           P("tp", None)              vocab-parallel: masked local lookup + one
                                                          all-reduce of [B, T, D]
  lm_head    [D, V]           P(None, "tp")              vocab-parallel: logits come out [.., V/tp]
                                                          per device, no communication in the matmul

So one transformer layer costs exactly two all-reduces of [B, T, D] (after wo, after w_down) and
the residual stream (hidden states, captures) stays replicated between layers.

Why vocab-parallel: Llama-3's 128256 x 8192 embedding and lm_head are 2.1 GB each in bf16;
replicated they would take 4.2 GB of every device, and the lm_head matmul is a large share of a
decode step's weight reads, so splitting it speeds decode up as much as splitting the layers does.

Heads: wqkv [D, G, R+2, hd] holds, per kv group g (G = kvh groups of R = H/kvh q heads), q heads
g*R .. g*R+R-1, then k head g, then v head g. Splitting G gives each device whole groups: the q
heads and exactly the kv head they attend to, so attention is local. The projection comes out
[B, T, G, R, hd] split on G; merging (G, R) into H keeps the split on the major axis, so device r
holds q heads [r*H/tp, (r+1)*H/tp) contiguously, the rows of wo (P("tp", None)) it contracts.
  - kvh % tp == 0: as above. The KV cache pages [P, page, kvh, hd] are split on the kv-head axis
    the same way.
  - otherwise (e.g. kvh = 2 at tp = 8) the groups cannot be divided, and with them the fused q
    weights: the whole wqkv and the KV cache are replicated. Correct, but it costs memory: every
    device stores all of q/k/v's weights (separate matrices kept q split and replicated only
    k/v), and the whole KV cache. Shardy then still splits the projection's output, propagating
    wo's row split back through the attention: on jax 0.10 it cuts [B, T, G, R+2, hd] over G
    and the R+2 axis (padded), each device slicing the replicated weight, so q and attention
    stay split, but k and v land on one shard of that axis and are moved with small activation
    collectives (per layer: 4 collective-permutes, one all-reduce of [B, T, 1, 1, hd] pairs)
    before the 2 all-gathers of [B, T, kvh, hd] for the replicated cache write. Every Llama-3
    model has kvh = 8, so this only arises beyond tp 8 or with other small models.

Draft head (DraftParams): replicated, every weight and its KV cache whole on every device. Split
like the target, each draft forward would cost 3 or 4 all-reduces of [B, T, H] (fc, embedding, wo,
w_down) and each draft token an all-gather of its logits or argmax partials; at decode sizes these
are latency-bound (tens of microseconds each, whatever their size) and a chain of K steps runs them
one after another, so the chain cost milliseconds for a fraction of a millisecond of weight reads.
Replicated, the draft extend (fed the replicated captures) and every draft step, its argmax or
sampling included, run locally: the draft adds no collective to an iteration. The embedding the
draft reads is replicated too: its own (70B layout), or a replicated copy of the target's (8B
layout; `place_draft`), since a lookup in the target's vocab-parallel table is an all-reduce.
Per-device cost, bf16, the same at every tp (`draft_param_specs`, `draft_cache_specs`;
parallel/plan.py counts it):
  - 70B drafter: 1.58 GB (fc, midlayer, lm_head over 32000 ids) + 1.58 GB (its embedding
    [128256, 6144]) = 3.15 GB per device (split 4 ways it was 0.79 GB); its KV cache 4 KB per
    token on every device (the target's: 320 KB / tp).
  - 8B drafter: 0.85 GB + 1.05 GB (the copy of the target's embedding [128256, 4096]) = 1.90 GB
    per device; its KV cache 4 KB per token (the target's: 128 KB / tp).

Fused step functions (verify + draft in one executable) must pin the target's activations,
because sharding propagation is not cost-based: `replicate` its residual stream (forward's hidden
and captures) and pass its logits through `vocab_logits` (computed vocab-sharded, then one
all-gather of the [.., V] activation where a sampler needs them whole; an argmax moves only
per-shard (max, index) pairs). The draft's values need no pin: all its inputs are replicated.
Then an iteration's only collectives are the target's: 2 all-reduces per layer, the embedding's,
and the logits' gather or argmax partials (see tests/test_parallel.py).

Vocabulary sizes that tp does not divide fall back to a replicated embedding / lm_head (correct,
just more memory); head counts or intermediate sizes that tp does not divide raise
`ShardingError` naming the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import DraftParams
from eagle3_jax.model.llama import KVCache, LayerParams, LlamaParams

TP = "tp"
REPLICATED = P()  # hidden states [B, T, D], captures [B, T, n * D], tokens, positions, block tables
COLUMN = P(None, TP)  # [in, out] split on out
QKV_GROUPS = P(None, TP, None, None)  # wqkv [D, G, R + 2, hd] split on the kv groups
GATE_UP = P(None, None, TP)  # w_gate_up [D, 2, I] split on I
ROW = P(TP, None)  # [in, out] split on in
VOCAB_ROWS = P(TP, None)  # embedding [V, D] split on V
LOGITS = P(None, None, TP)  # logits [B, T, V] as the vocab-parallel lm_head leaves them


class ShardingError(ValueError):
    """A model that cannot be split `tp` ways; the message names the numbers."""


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tp` devices (or the given ones).

    The axis is `AxisType.Auto` (sharding propagation decides intermediate layouts); recent jax's
    `jax.make_mesh` defaults to Explicit axes, which would type-check every op instead.
    """
    devices = list(jax.devices() if devices is None else devices)
    if tp < 1:
        raise ShardingError(f"tp must be >= 1, got {tp}")
    if len(devices) < tp:
        raise ShardingError(f"tp={tp} needs {tp} devices, only {len(devices)} available "
                            f"({devices[0].platform if devices else 'none'})")
    return Mesh(np.array(devices[:tp]), (TP,), axis_types=(AxisType.Auto,))


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def kv_heads_split(num_kv_heads: int, tp: int) -> bool:
    """True when the kv groups (wqkv's G axis, KV cache) are divided over tp; else replicated."""
    return num_kv_heads % tp == 0


def _check(what: str, n: int, tp: int, where: str) -> None:
    if n % tp:
        raise ShardingError(f"{where}: {what} {n} is not divisible by tp={tp}; "
                            f"use a tp that divides {n}")


def _vocab_ok(v: int, tp: int) -> bool:
    return v % tp == 0


def vocab_split(vocab_size: int, mesh: Mesh) -> bool:
    """Whether the embedding and lm_head are vocab-parallel on `mesh` (else replicated)."""
    return _vocab_ok(vocab_size, mesh.shape[TP])


def _layer_specs(q_heads: int, kv_heads: int, intermediate: int, tp: int, where: str) -> dict:
    _check("num_attention_heads", q_heads, tp, where)
    _check("intermediate_size", intermediate, tp, where)
    qkv = QKV_GROUPS if kv_heads_split(kv_heads, tp) else REPLICATED
    return dict(wqkv=qkv, wo=ROW, mlp_norm=REPLICATED, w_gate_up=GATE_UP, w_down=ROW)


def llama_param_specs(cfg: ModelConfig, tp: int) -> LlamaParams:
    """PartitionSpecs shaped like LlamaParams (lm_head None when tied)."""
    layer = LayerParams(attn_norm=REPLICATED, **_layer_specs(
        cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp, "target"))
    vocab = _vocab_ok(cfg.vocab_size, tp)
    return LlamaParams(
        embed=VOCAB_ROWS if vocab else REPLICATED,  # [V, D]
        layers=tuple(layer for _ in range(cfg.num_layers)),
        norm=REPLICATED,
        # Tied: logits use `embed` [V, D] itself, whose V split already makes them vocab-parallel.
        lm_head=None if cfg.tie_word_embeddings else (COLUMN if vocab else REPLICATED),  # [D, V]
    )


def draft_holds_embedding(own_embedding: bool, tp: int) -> bool:
    """Whether the drafter holds an embedding table on each device: its own, or at tp > 1 a
    replicated copy of the target's (`place_draft`)."""
    return own_embedding or tp > 1


def draft_param_specs(cfg: DraftConfig | None, tp: int, own_embedding: bool) -> DraftParams:
    """PartitionSpecs shaped like DraftParams as `place_draft` leaves them: every leaf replicated
    at every tp (module docstring, "Draft head"); embed None only at tp 1 for a drafter without
    its own (it then reads the target's)."""
    del cfg  # the same for every drafter
    r = REPLICATED
    return DraftParams(fc=r, hidden_norm=r, input_norm=r, wqkv=r, wo=r, mlp_norm=r, w_gate_up=r, w_down=r, norm=r,
                       lm_head=r, d2t=r, embed=r if draft_holds_embedding(own_embedding, tp) else None)


def place_draft(dparams: DraftParams, target_embed: jax.Array, mesh: Mesh) -> DraftParams:
    """The drafter on every device of `mesh` (draft_param_specs), with the embedding its forward
    reads: its own, or a replicated copy of the target's `target_embed` [V, D] (the target keeps
    its vocab-parallel one). Host or device arrays in; device arrays already replicated stay."""
    if dparams.embed is None:
        dparams = dparams.replace(embed=target_embed)
    return shard_params(dparams, mesh, draft_param_specs(None, mesh.shape[TP], own_embedding=True))


def kv_page_spec(num_kv_heads: int, tp: int) -> P:
    """Spec of a page array [L, num_pages, page_size, kvh, hd]: split on kvh, or replicated."""
    return P(None, None, None, TP, None) if kv_heads_split(num_kv_heads, tp) else REPLICATED


def kv_cache_specs(num_kv_heads: int, tp: int) -> KVCache:
    spec = kv_page_spec(num_kv_heads, tp)
    return KVCache(k=spec, v=spec)


def llama_cache_specs(cfg: ModelConfig, tp: int) -> KVCache:
    return kv_cache_specs(cfg.num_kv_heads, tp)


def draft_cache_specs(cfg: DraftConfig | None, tp: int) -> KVCache:
    """The drafter's KV pages [1, P, page, kvh, hd]: replicated, as its weights (the same for
    every drafter and tp)."""
    del cfg, tp
    return KVCache(k=REPLICATED, v=REPLICATED)


def logits_spec(vocab_size: int, tp: int) -> P:
    """Where [B, T, V] logits of a vocab-parallel lm_head live (replicated if V % tp)."""
    return LOGITS if _vocab_ok(vocab_size, tp) else REPLICATED


def named(mesh: Mesh, specs: Any) -> Any:
    """Pytree of PartitionSpecs -> same pytree of NamedShardings on `mesh` (None stays None)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_params(params: Any, mesh: Mesh, specs: Any) -> Any:
    """Place an existing pytree (LlamaParams, DraftParams, KVCache) per `specs`.

    Each array is sliced per device: from host (numpy) arrays nothing is copied whole onto a
    device; from device arrays jax moves only the slices.
    """
    return jax.device_put(params, named(mesh, specs))


def spec_at(specs: Any, path: Sequence[str | int]) -> P:
    """The spec at a field path such as ('layers', 3, 'wqkv') or ('embed',)."""
    node = specs
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    if not _is_spec(node):
        raise KeyError(f"no PartitionSpec at path {tuple(path)} (found {node!r})")
    return node


def specs_like(params: Any, specs: Any) -> Any:
    """`specs` pruned to the leaves `params` holds (served weights have no norm gains: folded)."""
    def key(entry):
        return entry.idx if hasattr(entry, "idx") else entry.name

    return jax.tree_util.tree_map_with_path(lambda path, _: spec_at(specs, [key(e) for e in path]), params)


def make_place(mesh: Mesh, specs: Any) -> Callable[[np.ndarray, tuple], jax.Array]:
    """A `place(host_array, path)` for `weights.llama.params_from_hf(..., place=...)`.

    Each device receives only its slice of the host tensor (make_array_from_callback asks for
    the slices of this process's devices), so a 70B checkpoint never sits whole on one device;
    the host holds one converted tensor at a time.
    """

    def place(x: np.ndarray, path: tuple) -> jax.Array:
        sharding = NamedSharding(mesh, spec_at(specs, path))
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return place


def shard_shape(shape: Sequence[int], spec: P | None, tp: int) -> tuple[int, ...]:
    """Per-device shape of an array of `shape` under `spec` on a tp-way mesh (no devices needed)."""
    if spec is None:
        return tuple(shape)
    out = []
    for i, n in enumerate(shape):
        axis = spec[i] if i < len(spec) else None
        names = axis if isinstance(axis, tuple) else (axis,)
        ways = tp if TP in names else 1
        if n % ways:
            raise ShardingError(f"dimension {i} of shape {tuple(shape)} ({n}) is not divisible by tp={tp}")
        out.append(n // ways)
    return tuple(out)


def per_device_bytes(shapes: Any, specs: Any, tp: int, dtype_bytes: int | None = None) -> int:
    """Bytes one device holds of a pytree of arrays / ShapeDtypeStructs under `specs`.

    `dtype_bytes` overrides the itemsize of floating-point leaves (int leaves keep theirs).
    """
    def leaf_bytes(spec: P, x) -> int:
        itemsize = np.dtype(x.dtype).itemsize
        if dtype_bytes is not None and jax.dtypes.issubdtype(x.dtype, np.floating):  # bfloat16 too
            itemsize = dtype_bytes
        return math.prod(shard_shape(x.shape, spec, tp)) * itemsize

    return int(sum(jax.tree.leaves(jax.tree.map(leaf_bytes, specs, shapes, is_leaf=_is_spec))))


def replicated_placement(mesh: Mesh | None) -> NamedSharding | None:
    """Where a host array goes for a step under `mesh`: every device holds all of it (None: the
    default device, no mesh)."""
    return None if mesh is None else NamedSharding(mesh, REPLICATED)


def replicated_like(tree: Any) -> Any:
    """P() for every leaf of `tree` (slot state, sampling parameters, token buffers)."""
    return jax.tree.map(lambda _: REPLICATED, tree)


# ------------------------------------------------------------------------------------------------
# Activation constraints for fused step functions. Sharding propagation is not cost-based: left
# alone inside a whole speculative iteration, Shardy can push a split from one op into the
# residual stream around it (a split drafter's row-parallel fc did: all-gathers / all-to-alls of
# [B, T, D]) and, when logits must end replicated for sampling, prefers all-gathering the lm_head
# WEIGHTS over the logits. These pin the Megatron layout. All are no-ops when mesh is None (single
# device).


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """Constrain every array of `tree` to be replicated: use on the target forward's (hidden,
    captures), the residual stream the replicated drafter reads."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: NamedSharding(mesh, REPLICATED), tree))


def vocab_logits(logits: jax.Array, mesh: Mesh | None, *, gather: bool = True) -> jax.Array:
    """Logits [..., V] from a vocab-parallel lm_head: pinned vocab-sharded where the matmul makes
    them (so each device multiplies by its lm_head slice, no weight moves), then, with `gather`,
    one all-gather of the [..., V] activation so sort/cumsum-based sampling runs locally (left
    sharded, a top-p sampler costs dozens of small collectives). An argmax alone can take
    gather=False: it moves only per-shard (max, index) pairs."""
    if mesh is None:
        return logits
    v = logits.shape[-1]
    if v % mesh.shape[TP]:
        return logits
    logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P(*([None] * (logits.ndim - 1)), TP)))
    if gather:
        logits = jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, REPLICATED))
    return logits


def cache_pin(mesh: Mesh | None, num_kv_heads: int):
    """The model's `pin_kv` under tp: a function pinning a KV cache of `num_kv_heads` heads (the
    target's or the drafter's) to its layout, `kv_cache_specs`, after each layer's write (None
    without a mesh). Every layer writes into one stacked array, and left alone Shardy
    shards those writes like the new tokens' k and v, then all-gathers the whole cache for the
    step's output (two all-gathers of [L, P, page, kvh, hd] a step, seen with kv heads replicated
    at tp 8); pinned, only the new k and v [B, T, kvh, hd] move."""
    if mesh is None:
        return None
    shardings = named(mesh, kv_cache_specs(num_kv_heads, mesh.shape[TP]))
    return lambda cache: jax.lax.with_sharding_constraint(cache, shardings)


def draft_cache_pin(mesh: Mesh | None):
    """The draft forward's `pin_kv` under tp: its KV cache stays replicated after the write, so
    no sharding from elsewhere in a fused program reaches the draft (None without a mesh)."""
    if mesh is None:
        return None
    shardings = named(mesh, draft_cache_specs(None, mesh.shape[TP]))
    return lambda cache: jax.lax.with_sharding_constraint(cache, shardings)


# ------------------------------------------------------------------------------------------------
# A sharded forward: the pattern the engine's step functions follow.


def forward_shardings(mesh: Mesh, param_specs: LlamaParams, cache_specs: KVCache):
    """(in_shardings, out_shardings) for `llama.forward(params, tokens, positions, cache, bt)`
    with cfg bound: everything but params and cache replicated; the cache comes back in the
    layout it went in (so donation aliases it and the next step needs no resharding)."""
    rep = NamedSharding(mesh, REPLICATED)
    params_s, cache_s = named(mesh, param_specs), named(mesh, cache_specs)
    return (params_s, rep, rep, cache_s, rep), (rep, rep, cache_s)


def jit_forward(cfg: ModelConfig, mesh: Mesh, *, with_logits: bool = False, donate_cache: bool = True):
    """jit(llama.forward) on a tp mesh, the pattern for the engine's step functions:
    (params, tokens, positions, cache, block_table) ->
    (hidden [B, T, D] replicated, captures [B, T, n*D] replicated, cache sharded as on entry),
    with `with_logits` first also f32 logits [B, T, V], left vocab-sharded (LOGITS) as the
    vocab-parallel lm_head makes them (an argmax of them moves only per-shard (max, index)
    pairs; a sort-based sampler wants `vocab_logits(..., gather=True)` inside its jit)."""
    tp = mesh.shape[TP]
    ins, outs = forward_shardings(mesh, llama_param_specs(cfg, tp), llama_cache_specs(cfg, tp))
    pin_kv = cache_pin(mesh, cfg.num_kv_heads)

    def fn(params, tokens, positions, cache, block_table):
        hidden, captures, cache = llama.forward(params, cfg, tokens, positions, cache, block_table, pin_kv=pin_kv)
        if with_logits:
            return llama.logits(params, hidden), hidden, captures, cache
        return hidden, captures, cache

    if with_logits:
        outs = (NamedSharding(mesh, logits_spec(cfg.vocab_size, tp)),) + outs
    return jax.jit(fn, in_shardings=ins, out_shardings=outs,
                   donate_argnums=(3,) if donate_cache else ())
