"""Hugging Face LlamaForCausalLM checkpoints <-> LlamaParams (conversions: layout.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import ModelConfig
from eagle3_jax.model.llama import LayerParams, LlamaParams
from eagle3_jax.weights import layout
from eagle3_jax.weights.tensors import TensorFiles, check_names, write

_GLOBAL_FIELDS: tuple[layout.Field, ...] = (
    layout.stored("embed", "model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    layout.stored("norm", "model.norm.weight", lambda c: (c.hidden_size,)),
)
_LM_HEAD = layout.linear("lm_head", "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size))
# Per layer, under `model.layers.{i}.`.
_LAYER_FIELDS: tuple[layout.Field, ...] = (
    layout.stored("attn_norm", "input_layernorm.weight", lambda c: (c.hidden_size,)),
    layout.qkv("wqkv", "self_attn.", lambda c: c.hidden_size),
    layout.linear("wo", "self_attn.o_proj.weight", lambda c: (c.hidden_size, c.q_size)),
    layout.stored("mlp_norm", "post_attention_layernorm.weight", lambda c: (c.hidden_size,)),
    layout.gate_up("w_gate_up", "mlp."),
    layout.linear("w_down", "mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size)),
)


def _global_fields(tied: bool) -> tuple[layout.Field, ...]:
    return _GLOBAL_FIELDS if tied else (*_GLOBAL_FIELDS, _LM_HEAD)


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def hf_names(cfg: ModelConfig) -> set[str]:
    names = set(layout.public_shapes(_global_fields(cfg.tie_word_embeddings), cfg))
    for i in range(cfg.num_layers):
        names |= set(layout.public_shapes(_LAYER_FIELDS, cfg, _layer_prefix(i)))
    return names


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype=jnp.bfloat16,
                   where: str = "checkpoint", place: Callable | None = None) -> LlamaParams:
    """LlamaParams from HF-named tensors, names and shapes checked; `place(array, path)` puts each
    converted array on its devices, path as ('layers', 3, 'wqkv')."""
    place = place or (lambda x, path: jnp.asarray(x))
    found = set(tensors)
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): ignore it.
    if cfg.tie_word_embeddings:
        found.discard("lm_head.weight")
    check_names(found, hf_names(cfg), where)

    def read(fields, prefix="", path=()):
        return {name: place(x.astype(dtype), (*path, name))
                for name, x in layout.read_fields(fields, tensors, cfg, where, prefix)}

    top = read(_global_fields(cfg.tie_word_embeddings))
    layers = tuple(LayerParams(**read(_LAYER_FIELDS, _layer_prefix(i), ("layers", i)))
                   for i in range(cfg.num_layers))
    return LlamaParams(embed=top["embed"], layers=layers, norm=top["norm"], lm_head=top.get("lm_head"))


def params_to_hf(params: LlamaParams) -> dict[str, np.ndarray]:
    """HF-named tensors ([out, in]; q/k/v and gate/up separate) of `params`, in their dtype."""
    out = layout.public_tensors(_global_fields(params.lm_head is None), params)
    for i, layer in enumerate(params.layers):
        out.update(layout.public_tensors(_LAYER_FIELDS, layer, _layer_prefix(i)))
    return out


def load_llama(
    directory: str | Path, dtype=jnp.bfloat16, place: Callable | None = None
) -> tuple[ModelConfig, LlamaParams]:
    """(config, params) from a Hugging Face Llama directory; `place` as `params_from_hf`'s."""
    directory = Path(directory)
    cfg = ModelConfig.from_json(directory / "config.json")
    return cfg, params_from_hf(TensorFiles(directory), cfg, dtype, where=str(directory), place=place)


def save_llama(params: LlamaParams, directory: str | Path) -> None:
    write(params_to_hf(params), Path(directory) / "model.safetensors")
