"""The functions the steps call on a target model (`StepConfig.model`). A new family implements them over its
own params and is picked in `target_model_for`; ModelConfig parses only Llama-3 layouts, hence LLAMA3 alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from eagle3_jax.config import ConfigError, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.parallel import sharding


@dataclasses.dataclass(frozen=True)
class TargetModel:
    name: str
    # (params, cfg, tokens [B, T], positions [B, T], kv, block_tables [B, nb], attention, pin_kv, gemv)
    #   -> (hidden [B, T, D] before the final norm's gain, captures [B, T, 3D], kv)
    forward: Callable
    logits: Callable  # (params, hidden [..., D], gemv) -> logits [..., V] f32
    param_specs: Callable  # (cfg, tp) -> a PartitionSpec pytree shaped like the params
    for_serving: Callable  # params -> params as served: equal outputs, fewer buffers per dispatch


LLAMA3 = TargetModel("llama3", llama.forward, llama.logits, sharding.llama_param_specs, llama.fold_norm_gains)


def target_model_for(cfg: ModelConfig) -> TargetModel:
    if not isinstance(cfg, ModelConfig):
        raise ConfigError(f"target config: expected a ModelConfig, got {type(cfg).__name__}")
    return LLAMA3
