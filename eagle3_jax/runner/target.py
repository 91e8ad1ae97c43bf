"""What the step functions need of a target model, and Llama-3 as its implementation.

The steps never call a model by name: they call `StepConfig.model`, a `TargetModel`. A new
target family implements these four functions over its own parameter pytree and is picked by
`target_model_for` from its config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from eagle3_jax.config import ConfigError, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class TargetModel:
    """A target family's pure functions (frozen and hashable: part of every StepConfig)."""

    name: str
    # (params, cfg, tokens [B, T], positions [B, T], kv, block_tables [B, nb], attention, pin_kv, gemv)
    #   -> (hidden [B, T, D] before the final norm's gain, captures [B, T, 3D], kv)
    forward: Callable
    # (params, hidden [..., D], gemv) -> logits [..., V] f32
    logits: Callable
    # (cfg, tp) -> a PartitionSpec pytree shaped like the params (tensor parallelism)
    param_specs: Callable
    # params -> params as served: equal outputs, fewer buffers per dispatch
    for_serving: Callable


LLAMA3 = TargetModel("llama3", llama.forward, llama.logits, sharding.llama_param_specs, llama.fold_norm_gains)


def target_model_for(cfg: ModelConfig) -> TargetModel:
    """The implementation serving a target config: every Llama-3 layout (ModelConfig parses
    only those) is LLAMA3."""
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"target config: expected a ModelConfig, got {type(cfg).__name__}")
    return LLAMA3
