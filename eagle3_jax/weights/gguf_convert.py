"""Convert a llama.cpp GGUF Llama model into a Hugging Face directory (config.json,
model.safetensors, tokenizer files with the chat template).

Quantized tensors are dequantized with the `gguf` package; q_proj and k_proj rows, permuted by
llama.cpp for its interleaved RoPE, are put back in rotate-half order (`layers.apply_rope`). The
files load in transformers 4.x and 5.x: config.json in the 4.x layout, and a tokenizer_config.json
naming `PreTrainedTokenizerFast` without 5.x-only keys.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from eagle3_jax.weights.tensors import CheckpointError, write

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Bumped whenever the files written change, so that an older conversion is redone.
FORMAT_VERSION = 2
TOKENIZER_CLASS = "PreTrainedTokenizerFast"  # in transformers 4.x and 5.x
# Keys only 5.x writes; 4.x would pass them to the tokenizer's constructor.
_TOKENIZER_KEYS_5X = ("backend",)


def hf_name(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        if m.group(2) not in _LAYER_NAMES:
            raise CheckpointError(f"GGUF tensor '{gguf_name}' has no Llama counterpart")
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise CheckpointError(f"GGUF tensor '{gguf_name}' has no Llama counterpart")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of q/k: [heads*hd, D] -> same shape, HF order."""
    hd = w.shape[0] // heads
    return w.reshape(heads, hd // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise CheckpointError(f"GGUF metadata lacks '{key}'")
        return default
    return field.contents()


def hf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture is {arch!r}; only 'llama' converts")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = int(_field(reader, "llama.vocab_size", len(_field(reader, "tokenizer.ggml.tokens"))))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "torch_dtype": "float32",
    }


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: bool = True) -> Path:
    """Write config.json, model.safetensors (f32, the exact dequantized values) and tokenizer."""
    import gguf  # heavy-ish and only needed here

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # noqa: BLE001 (the gguf package raises assorted errors on a damaged file)
        raise CheckpointError(f"{gguf_path}: unreadable GGUF ({e})") from None
    config = hf_config(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        name = hf_name(t.name)
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(reversed([int(n) for n in t.shape])))  # ggml dims are reversed
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, config["num_key_value_heads"])
        tensors[name] = w
    weights = out_dir / "model.safetensors"
    write(tensors, weights)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gguf_tokenizer(reader).save_pretrained(str(out_dir))
    tokenizer_config = out_dir / "tokenizer_config.json"
    portable = portable_tokenizer_config(json.loads(tokenizer_config.read_text()),
                                         _field(reader, "tokenizer.chat_template"))
    tokenizer_config.write_text(json.dumps(portable, indent=2, ensure_ascii=False) + "\n")
    return out_dir


def portable_tokenizer_config(d: dict[str, Any], chat_template: str | None = None) -> dict[str, Any]:
    """A tokenizer_config.json as transformers 4.x reads it, from either's, the chat template inline."""
    d = {k: v for k, v in d.items() if k not in _TOKENIZER_KEYS_5X}
    d["tokenizer_class"] = TOKENIZER_CLASS
    if chat_template is not None:
        d["chat_template"] = chat_template
    extra = d.get("extra_special_tokens")
    if isinstance(extra, list):  # 5.x writes a list; 4.x expects a dict of named tokens
        if extra:
            d["additional_special_tokens"] = list(dict.fromkeys(d.get("additional_special_tokens", []) + extra))
        del d["extra_special_tokens"]
    return d


def gguf_tokenizer(reader):
    """The GGUF's byte-level BPE tokenizer, special tokens and chat template, built as transformers'
    GGUFGPTConverter does but with `tokenizers` alone (transformers' path imports torch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"GGUF tokenizer model is {model!r}; only 'gpt2' (byte-level BPE) converts")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                               byte_fallback=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # llama.cpp's token type for control tokens
    bpe.add_special_tokens([t for t, kind in zip(tokens, types) if kind == control])

    def special(key):
        i = reader.fields.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i.contents())] if i is not None else None

    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=special("bos"), eos_token=special("eos"),
                                   unk_token=special("unknown"), pad_token=special("padding"),
                                   chat_template=_field(reader, "tokenizer.chat_template"))
