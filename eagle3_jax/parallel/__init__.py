"""Tensor parallelism over a 1-D "tp" mesh (jax.sharding + XLA's SPMD partitioner) and memory
planning. See sharding.py for the layout and plan.py for `eagle3-jax plan`."""

from eagle3_jax.parallel.sharding import (
    LOGITS,
    REPLICATED,
    TP,
    ShardingError,
    draft_cache_specs,
    draft_param_specs,
    forward_shardings,
    jit_forward,
    kv_cache_specs,
    kv_heads_split,
    kv_page_spec,
    llama_cache_specs,
    llama_param_specs,
    logits_spec,
    make_mesh,
    make_place,
    named,
    per_device_bytes,
    replicate,
    replicated_like,
    shard_params,
    shard_shape,
    spec_at,
    vocab_logits,
)

__all__ = [
    "LOGITS", "REPLICATED", "TP", "ShardingError", "draft_cache_specs", "draft_param_specs",
    "forward_shardings", "jit_forward", "kv_cache_specs", "kv_heads_split", "kv_page_spec",
    "llama_cache_specs", "llama_param_specs", "logits_spec", "make_mesh", "make_place", "named",
    "per_device_bytes", "replicate", "replicated_like", "shard_params", "shard_shape", "spec_at",
    "vocab_logits",
]
