"""Hugging Face LlamaForCausalLM checkpoints <-> LlamaParams.

PyTorch Linear weights are stored [out, in]; our parameters are [in, out] so a forward is `x @ w`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import ModelConfig
from eagle3_jax.model.llama import LayerParams, LlamaParams
from eagle3_jax.weights.tensors import TensorFiles, check_names, take, write

# (our field, HF suffix, transposed, shape [out, in] as stored) per layer.
_LAYER_TENSORS: tuple[tuple[str, str, bool, Callable[[ModelConfig], tuple[int, ...]]], ...] = (
    ("attn_norm", "input_layernorm.weight", False, lambda c: (c.hidden_size,)),
    ("wq", "self_attn.q_proj.weight", True, lambda c: (c.q_size, c.hidden_size)),
    ("wk", "self_attn.k_proj.weight", True, lambda c: (c.kv_size, c.hidden_size)),
    ("wv", "self_attn.v_proj.weight", True, lambda c: (c.kv_size, c.hidden_size)),
    ("wo", "self_attn.o_proj.weight", True, lambda c: (c.hidden_size, c.q_size)),
    ("mlp_norm", "post_attention_layernorm.weight", False, lambda c: (c.hidden_size,)),
    ("w_gate", "mlp.gate_proj.weight", True, lambda c: (c.intermediate_size, c.hidden_size)),
    ("w_up", "mlp.up_proj.weight", True, lambda c: (c.intermediate_size, c.hidden_size)),
    ("w_down", "mlp.down_proj.weight", True, lambda c: (c.hidden_size, c.intermediate_size)),
)


def hf_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names |= {f"model.layers.{i}.{suffix}" for _, suffix, _, _ in _LAYER_TENSORS}
    return names


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype=jnp.bfloat16,
                   where: str = "checkpoint", place: Callable = None) -> LlamaParams:
    """Build LlamaParams from HF-named tensors, checking names and shapes.

    `place(array, path)` puts one converted host array on its devices (a sharding-aware loader
    passes its own); `path` is the field path, e.g. ('layers', 3, 'wq').
    """
    place = place or (lambda x, path: jnp.asarray(x))
    found = set(tensors)
    # A tied checkpoint may still carry lm_head.weight (a copy of the embedding): ignore it.
    if cfg.tie_word_embeddings:
        found.discard("lm_head.weight")
    check_names(found, hf_names(cfg), where)

    def get(name, shape, transpose, path):
        x = np.asarray(take(tensors, name, shape, where))
        x = x.T if transpose else x
        return place(x.astype(dtype), path)

    layers = tuple(
        LayerParams(**{field: get(f"model.layers.{i}.{suffix}", shape(cfg), tr, ("layers", i, field))
                       for field, suffix, tr, shape in _LAYER_TENSORS})
        for i in range(cfg.num_layers))
    d, v = cfg.hidden_size, cfg.vocab_size
    return LlamaParams(
        embed=get("model.embed_tokens.weight", (v, d), False, ("embed",)),
        layers=layers,
        norm=get("model.norm.weight", (d,), False, ("norm",)),
        lm_head=None if cfg.tie_word_embeddings else get("lm_head.weight", (v, d), True, ("lm_head",)),
    )


def params_to_hf(params: LlamaParams) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": np.asarray(params.embed), "model.norm.weight": np.asarray(params.norm)}
    if params.lm_head is not None:
        out["lm_head.weight"] = np.asarray(params.lm_head).T
    for i, layer in enumerate(params.layers):
        for field, suffix, transpose, _ in _LAYER_TENSORS:
            x = np.asarray(getattr(layer, field))
            out[f"model.layers.{i}.{suffix}"] = x.T if transpose else x
    return out


def load_llama(directory: str | Path, dtype=jnp.bfloat16, place: Callable | None = None) -> tuple[ModelConfig, LlamaParams]:
    """(config, params) from a Hugging Face Llama directory (config.json + safetensors).
    `place(array, path)` puts each tensor on its devices as it is read (see params_from_hf)."""
    directory = Path(directory)
    cfg = ModelConfig.from_json(directory / "config.json")
    return cfg, params_from_hf(TensorFiles(directory), cfg, dtype, where=str(directory), place=place)


def save_llama(params: LlamaParams, directory: str | Path) -> None:
    write(params_to_hf(params), Path(directory) / "model.safetensors")
