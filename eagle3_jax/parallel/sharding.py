"""Tensor parallelism (Megatron layout) through jax.sharding: we only say where each array lives,
XLA's SPMD partitioner (Shardy) derives the per-device program and inserts the collectives.

One mesh axis, "tp". The layout per weight ([in, out], so `x @ w`; fused as in model/layers.py):

  wqkv       [D, G, R+2, hd]  P(None, "tp", None, None)  by kv group: local q, k, v heads
  w_gate_up  [D, 2, I]        P(None, None, "tp")        column-parallel
  wo, w_down [in, D]          P("tp", None)              row-parallel: one all-reduce of [B, T, D]
  norms, d2t                  P()                        replicated
  embed      [V, D]           P("tp", None)              vocab-parallel: masked lookup + all-reduce
  lm_head    [D, V]           P(None, "tp")              vocab-parallel: logits [.., V/tp] a device

A layer costs two all-reduces of [B, T, D]; the residual stream stays replicated. Vocab-parallel
because Llama-3's embedding and lm_head are 2.1 GB each at 70B, and lm_head is a large share of
a decode's weight reads. Splitting wqkv's G gives each device whole groups (q heads and the kv
head they attend to), and merging (G, R) keeps device r's q heads contiguous, the rows of wo it
contracts. Where tp does not divide kvh, wqkv and the KV cache are replicated (correct, more
memory); likewise a vocabulary tp does not divide. Head counts or intermediate sizes it does not
divide raise `ShardingError`.

The drafter is replicated, weights and KV cache: split, each draft step would add latency-bound
all-reduces, K of them in a row; replicated, the draft adds no collective to an iteration. Its
embedding is its own (70B layout) or a replicated copy of the target's (`place_draft`), since a
lookup in a vocab-parallel table is an all-reduce. plan.py counts the memory this costs.

Sharding propagation is not cost-based, so fused step functions pin the target's activations:
`replicate` its hidden and captures, and `vocab_logits` for its logits (tests/test_parallel.py
checks an iteration's collectives).
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
COLUMN = P(None, TP)  # the weights' specs: the module docstring's table
QKV_GROUPS = P(None, TP, None, None)
GATE_UP = P(None, None, TP)
ROW = P(TP, None)
VOCAB_ROWS = P(TP, None)
LOGITS = P(None, None, TP)  # logits [B, T, V] as the vocab-parallel lm_head leaves them


class ShardingError(ValueError):
    """A model that cannot be split `tp` ways; the message names the numbers."""


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with axis "tp" over the first `tp` devices (or the given ones); the axis is
    Auto, so propagation decides intermediate layouts (`jax.make_mesh` defaults to Explicit)."""
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
        embed=VOCAB_ROWS if vocab else REPLICATED,
        layers=tuple(layer for _ in range(cfg.num_layers)),
        norm=REPLICATED,
        # Tied: logits use `embed` [V, D] itself, whose V split already makes them vocab-parallel.
        lm_head=None if cfg.tie_word_embeddings else (COLUMN if vocab else REPLICATED),
    )


def draft_holds_embedding(own_embedding: bool, tp: int) -> bool:
    """Whether the drafter holds an embedding: its own, or at tp > 1 a copy of the target's."""
    return own_embedding or tp > 1


def draft_param_specs(cfg: DraftConfig | None, tp: int, own_embedding: bool) -> DraftParams:
    """PartitionSpecs shaped like DraftParams as `place_draft` leaves them: all replicated; embed
    None only at tp 1 for a drafter that reads the target's."""
    del cfg  # the same for every drafter
    r = REPLICATED
    return DraftParams(fc=r, hidden_norm=r, input_norm=r, wqkv=r, wo=r, mlp_norm=r, w_gate_up=r, w_down=r, norm=r,
                       lm_head=r, d2t=r, embed=r if draft_holds_embedding(own_embedding, tp) else None)


def place_draft(dparams: DraftParams, target_embed: jax.Array, mesh: Mesh) -> DraftParams:
    """The drafter on every device of `mesh`, with its own embedding or a replicated copy of the
    target's `target_embed` [V, D]."""
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
    """The drafter's KV pages [1, P, page, kvh, hd]: replicated."""
    del cfg, tp
    return KVCache(k=REPLICATED, v=REPLICATED)


def logits_spec(vocab_size: int, tp: int) -> P:
    """Where [B, T, V] logits of a vocab-parallel lm_head live (replicated if V % tp)."""
    return LOGITS if _vocab_ok(vocab_size, tp) else REPLICATED


def named(mesh: Mesh, specs: Any) -> Any:
    """Pytree of PartitionSpecs -> same pytree of NamedShardings on `mesh` (None stays None)."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_params(params: Any, mesh: Mesh, specs: Any) -> Any:
    """Place a pytree (LlamaParams, DraftParams, KVCache) per `specs`; each device gets its slice."""
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
    """A `place(host_array, path)` for `weights.llama.params_from_hf`: each device gets its slice."""

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
    """Bytes one device holds of a pytree of arrays / ShapeDtypeStructs under `specs`;
    `dtype_bytes` overrides floating-point leaves' itemsize."""
    def leaf_bytes(spec: P, x) -> int:
        itemsize = np.dtype(x.dtype).itemsize
        if dtype_bytes is not None and jax.dtypes.issubdtype(x.dtype, np.floating):  # bfloat16 too
            itemsize = dtype_bytes
        return math.prod(shard_shape(x.shape, spec, tp)) * itemsize

    return int(sum(jax.tree.leaves(jax.tree.map(leaf_bytes, specs, shapes, is_leaf=_is_spec))))


def replicated_placement(mesh: Mesh | None) -> NamedSharding | None:
    """Where a host array goes for a step under `mesh`: replicated (None without a mesh)."""
    return None if mesh is None else NamedSharding(mesh, REPLICATED)


def replicated_like(tree: Any) -> Any:
    """P() for every leaf of `tree` (slot state, sampling parameters, token buffers)."""
    return jax.tree.map(lambda _: REPLICATED, tree)


# ------------------------------------------------------------------------------------------------
# Activation constraints for fused step functions: left alone, Shardy can push a split into the
# residual stream, or all-gather the lm_head weights rather than the logits. No-ops without a mesh.


def replicate(tree: Any, mesh: Mesh | None) -> Any:
    """Constrain every array of `tree` to be replicated (the target's hidden and captures)."""
    if mesh is None:
        return tree
    return jax.lax.with_sharding_constraint(tree, jax.tree.map(lambda _: NamedSharding(mesh, REPLICATED), tree))


def vocab_logits(logits: jax.Array, mesh: Mesh | None, *, gather: bool = True) -> jax.Array:
    """Logits [..., V] pinned vocab-sharded where the lm_head makes them, then with `gather` one
    all-gather, so that top-p runs locally; an argmax needs no gather."""
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
    """The model's `pin_kv` under tp: the KV cache pinned to `kv_cache_specs` after each write, so
    that only the new k, v [B, T, kvh, hd] move, never the whole cache (None without a mesh)."""
    if mesh is None:
        return None
    shardings = named(mesh, kv_cache_specs(num_kv_heads, mesh.shape[TP]))
    return lambda cache: jax.lax.with_sharding_constraint(cache, shardings)


def draft_cache_pin(mesh: Mesh | None):
    """The draft forward's `pin_kv` under tp: its KV cache stays replicated (None without a mesh)."""
    if mesh is None:
        return None
    shardings = named(mesh, draft_cache_specs(None, mesh.shape[TP]))
    return lambda cache: jax.lax.with_sharding_constraint(cache, shardings)


# ------------------------------------------------------------------------------------------------
# A sharded forward: the pattern the engine's step functions follow.


def forward_shardings(mesh: Mesh, param_specs: LlamaParams, cache_specs: KVCache):
    """(in_shardings, out_shardings) for `llama.forward` with cfg bound: all but params and cache
    replicated; the cache leaves in its layout, so donation aliases it."""
    rep = NamedSharding(mesh, REPLICATED)
    params_s, cache_s = named(mesh, param_specs), named(mesh, cache_specs)
    return (params_s, rep, rep, cache_s, rep), (rep, rep, cache_s)


def jit_forward(cfg: ModelConfig, mesh: Mesh, *, with_logits: bool = False, donate_cache: bool = True):
    """jit(llama.forward) on a tp mesh: (params, tokens, positions, cache, block_table) -> (hidden
    [B, T, D], captures [B, T, n*D], both replicated, cache), with_logits first f32 logits
    [B, T, V] left vocab-sharded."""
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
