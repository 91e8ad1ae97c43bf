"""The real Llama-3 configurations this project runs with random weights (shapes, sharding and
speed), and the public EAGLE-3 drafter layouts that go with them, as Hugging Face config.json
dicts. One place, so the benchmark, the memory plan and the tests agree on them."""

from __future__ import annotations

from eagle3_jax.config import DraftConfig, ModelConfig

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
}
LLAMA33_70B = {**LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64}

# SmolLM2-135M-Instruct as converted from its GGUF (`eagle3-jax prepare`): the embedded default's
# shapes, for measurements that need no weights.
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}

# "EAGLE3-LLaMA3.1-Instruct-8B" (../shared/EAGLE3.md, section 1): no rope_theta (10000 applies).
EAGLE3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 2048, "vocab_size": 128256, "draft_vocab_size": 32000,
             "tie_word_embeddings": False, "torch_dtype": "float16"}
# The 70B layout: narrower than its 8192-wide target, with target_hidden_size and its own embedding.
EAGLE3_70B = {**EAGLE3_8B, "hidden_size": 6144, "intermediate_size": 16384, "num_attention_heads": 48,
              "head_dim": 128, "target_hidden_size": 8192, "rope_theta": 500000.0}


def llama31_8b() -> tuple[ModelConfig, DraftConfig]:
    return ModelConfig.from_hf(LLAMA31_8B), DraftConfig.from_hf(EAGLE3_8B)


def llama33_70b() -> tuple[ModelConfig, DraftConfig]:
    return ModelConfig.from_hf(LLAMA33_70B), DraftConfig.from_hf(EAGLE3_70B)
