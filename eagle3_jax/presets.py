"""The real Llama-3 configurations this project runs with random weights, and their public EAGLE-3
drafter layouts, as Hugging Face config.json dicts (shipped in `eagle3_jax/configs/`): one place
for the benchmark, the memory plan and the tests. `bench --step-model` and `plan --target` take
the names of `PRESETS`.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_jax.config import DraftConfig, ModelConfig

CONFIGS = Path(__file__).resolve().parent / "configs"


def _shipped(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


LLAMA31_8B = _shipped("Llama-3.1-8B-Instruct")
LLAMA33_70B = _shipped("Llama-3.3-70B-Instruct")

# SmolLM2-135M-Instruct as converted from its GGUF (`eagle3-jax prepare`): the embedded default's
# shapes, for measurements that need no weights.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}

# The drafter "EAGLE3-LLaMA3.1-Instruct-8B": no rope_theta (10000 applies).
EAGLE3_8B = _shipped("EAGLE3-LLaMA3.1-Instruct-8B")
# The 70B layout: narrower than its 8192-wide target, with target_hidden_size and its own embedding.
EAGLE3_70B = _shipped("EAGLE3-LLaMA3.3-Instruct-70B")


def llama31_8b() -> tuple[ModelConfig, DraftConfig]:
    return ModelConfig.from_hf(LLAMA31_8B), DraftConfig.from_hf(EAGLE3_8B)


def llama33_70b() -> tuple[ModelConfig, DraftConfig]:
    return ModelConfig.from_hf(LLAMA33_70B), DraftConfig.from_hf(EAGLE3_70B)


def smollm2_135m() -> tuple[ModelConfig, DraftConfig]:
    """SmolLM2-135M-Instruct and a drafter of the shipped one's shapes (the target's layer, a draft
    vocabulary of 16,384)."""
    target = ModelConfig.from_hf(SMOLLM2_135M)
    return target, DraftConfig.like_target(target, 16384)


# Preset name (spelled either way) -> (target directory, drafter directory) under CONFIGS.
PRESETS: dict[str, tuple[str, str]] = {
    "llama3.1-8b": ("Llama-3.1-8B-Instruct", "EAGLE3-LLaMA3.1-Instruct-8B"),
    "llama-3.1-8b": ("Llama-3.1-8B-Instruct", "EAGLE3-LLaMA3.1-Instruct-8B"),
    "llama3.3-70b": ("Llama-3.3-70B-Instruct", "EAGLE3-LLaMA3.3-Instruct-70B"),
    "llama-3.3-70b": ("Llama-3.3-70B-Instruct", "EAGLE3-LLaMA3.3-Instruct-70B"),
}


def preset_dirs(name: str) -> tuple[Path, Path]:
    """(target, drafter) directories of a preset, each holding a config.json; KeyError naming the
    presets when `name` is not one."""
    key = name.lower()
    if key not in PRESETS:
        raise KeyError(f"{name!r} is not a preset ({', '.join(PRESETS)})")
    target, draft = PRESETS[key]
    return CONFIGS / target, CONFIGS / draft
