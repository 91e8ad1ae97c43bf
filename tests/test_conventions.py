"""Files this project writes follow the conventions of the tools that read them, whatever
transformers version is installed here:

- the converted default target loads in transformers 4.x as well as 5.x: config.json in the 4.x
  layout, a tokenizer class 4.x has, no 5.x-only tokenizer keys; its weights readable by all (0644);
- drafter config.json files load in the EAGLE reference implementation, which reads the presence
  of `target_hidden_size` as "this drafter brings its own embedding";
- the shipped Llama-3 configs are the real ones, and parse.
"""

from __future__ import annotations

import json
import stat

import jax
import jax.numpy as jnp
import pytest
from safetensors import safe_open

from eagle3_jax import assets, presets
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.weights import gguf_convert
from eagle3_jax.weights.eagle3 import EMBED, load_drafter, save_drafter

# Tokenizer classes of transformers 4.x that read a tokenizer.json (5.x has them too).
TOKENIZER_CLASSES_4X = {"PreTrainedTokenizerFast", "GPT2TokenizerFast", "LlamaTokenizerFast"}
# Written by transformers 5.x only: 4.x passes unknown keys to the tokenizer's constructor, and
# a list-valued extra_special_tokens (5.x) fails there (4.x expects a dict).
KEYS_5X_ONLY = {"backend"}
TORCH_DTYPES = {"float32", "float16", "bfloat16"}


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_config_4x(config: dict) -> None:
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "rope_parameters" not in config  # 5.x's layout; 4.x reads rope_theta and rope_scaling
    assert isinstance(config["rope_theta"], float) and config["rope_theta"] > 0
    assert "rope_scaling" in config
    assert config["rope_scaling"] is None or config["rope_scaling"]["rope_type"] in ("default", "llama3")
    assert config["torch_dtype"] in TORCH_DTYPES  # 4.x's key; 5.x reads it as well
    assert config["hidden_act"] == "silu" and config["attention_bias"] is False and config["mlp_bias"] is False


def assert_tokenizer_config_4x(d: dict) -> None:
    assert d["tokenizer_class"] in TOKENIZER_CLASSES_4X
    assert not KEYS_5X_ONLY & set(d), sorted(KEYS_5X_ONLY & set(d))
    assert isinstance(d.get("extra_special_tokens", {}), dict)


# ---- the converted default target ----------------------------------------------------------
@pytest.mark.slow
def test_converted_target_follows_transformers_4x_conventions(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert_config_4x(config)
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    assert config["torch_dtype"] == "float32"  # the dequantized weights are stored as f32
    tok = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert_tokenizer_config_4x(tok)
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tok["bos_token"], tok["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok["chat_template"].startswith("{% for message in messages %}")  # inline, for any 4.x
    assert (smollm2_dir / "tokenizer.json").is_file()
    # safetensors writes through a private (0600) temporary file; the weights are for everyone to read.
    assert mode(smollm2_dir / "model.safetensors") == 0o644
    # Written by this code, so a later `prepare` leaves it as it is.
    assert (smollm2_dir / "PREPARED").read_text() == assets.prepared_stamp()
    assert assets.is_prepared(smollm2_dir)


@pytest.mark.slow
def test_converted_tokenizer_loads_as_written(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_config_from_transformers_5_becomes_portable():
    written_by_5 = {"backend": "tokenizers", "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 8192,
                    "tokenizer_class": "TokenizersBackend", "extra_special_tokens": ["<tool>"]}
    d = gguf_convert.portable_tokenizer_config(written_by_5, chat_template="{{ messages }}")
    assert_tokenizer_config_4x(d)
    assert d == {"bos_token": "<s>", "eos_token": "</s>", "model_max_length": 8192,
                 "tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": ["<tool>"],
                 "chat_template": "{{ messages }}"}
    written_by_4 = {"bos_token": "<s>", "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": {},
                    "extra_special_tokens": {}}
    assert gguf_convert.portable_tokenizer_config(written_by_4) == written_by_4  # already portable


def test_a_stale_conversion_is_redone(tmp_path, monkeypatch):
    """A directory converted by older code (a stamp without this format version) is converted again
    by `prepare`; a current one is left alone."""
    converted = []

    def convert(gguf, out, progress=True):
        converted.append(out)
        return out

    monkeypatch.setattr(assets, "fetch", lambda asset, quiet=False: tmp_path / "model.gguf")
    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    out = tmp_path / "target"
    out.mkdir()
    (out / "PREPARED").write_text(assets.SMOLLM2_GGUF.sha256 + "\n")  # the stamp older code wrote
    assert not assets.is_prepared(out)
    assert assets.prepare_default_target(out, progress=False) == out
    assert converted == [out]
    assert (out / "PREPARED").read_text() == f"{assets.SMOLLM2_GGUF.sha256} format {gguf_convert.FORMAT_VERSION}\n"
    assets.prepare_default_target(out, progress=False)
    assert converted == [out]  # current: not converted again


# ---- drafters ----------------------------------------------------------------------------------
SMOLLM2 = ModelConfig.from_hf(presets.SMOLLM2_135M)


@pytest.mark.parametrize("cfg, own_embedding, key", [
    (DraftConfig.like_target(SMOLLM2, 1024), False, False),  # the shipped drafter's layout
    (DraftConfig.like_target(SMOLLM2, 1024), True, True),  # same width, its own embedding
    (DraftConfig.from_hf(presets.EAGLE3_70B), True, True),  # narrower than its target
])
def test_to_hf_writes_target_hidden_size_only_where_the_reference_expects_it(cfg, own_embedding, key):
    d = cfg.to_hf(has_own_embedding=own_embedding)
    assert ("target_hidden_size" in d) == key
    if key:
        assert d["target_hidden_size"] == cfg.target_hidden_size
    assert DraftConfig.from_hf(d) == cfg  # read back, the key's absence means hidden_size


@pytest.mark.parametrize("own_embedding", [False, True])
def test_saved_drafter_config_matches_its_tensors(tmp_path, own_embedding):
    cfg = DraftConfig.like_target(ModelConfig.from_hf({**presets.SMOLLM2_135M, "num_hidden_layers": 4,
                                                       "vocab_size": 512}), 128, intermediate_size=64)
    params = init_draft_params(cfg, jax.random.PRNGKey(0), jnp.float32, own_embedding=own_embedding)
    save_drafter(params, cfg, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    with safe_open(tmp_path / "model.safetensors", "numpy") as f:
        stores_embedding = EMBED in set(f.keys())
    assert stores_embedding == own_embedding
    assert ("target_hidden_size" in config) == stores_embedding
    assert mode(tmp_path / "model.safetensors") == 0o644
    loaded, loaded_params = load_drafter(tmp_path, dtype=jnp.float32)
    assert loaded == cfg and (loaded_params.embed is not None) == own_embedding


def test_shipped_drafter_loads_in_the_reference_as_it_does_here():
    directory = assets.DEFAULT_DRAFT
    config = json.loads((directory / "config.json").read_text())
    with safe_open(directory / "model.safetensors", "numpy") as f:
        names = set(f.keys())
    assert EMBED not in names and "model.embed_tokens.weight" not in names  # the target's embedding is used
    assert "target_hidden_size" not in config  # so the reference loads the target's embedding too
    cfg = DraftConfig.from_json(directory / "config.json")
    assert cfg.target_hidden_size == cfg.hidden_size == 576
    assert cfg.to_hf(has_own_embedding=False) == config  # the file is what the writer writes today


# ---- shipped Llama-3 configs -------------------------------------------------------------------
@pytest.mark.parametrize("name, layers, hidden, params", [
    ("llama3.1-8b", 32, 4096, 8_030_261_248),
    ("llama-3.3-70b", 80, 8192, 70_553_706_496),
])
def test_shipped_llama_configs(name, layers, hidden, params):
    from transformers import AutoConfig

    target_dir, draft_dir = presets.preset_dirs(name)
    d = json.loads((target_dir / "config.json").read_text())
    assert d["torch_dtype"] == "bfloat16" and d["vocab_size"] == 128256
    assert d["rope_scaling"] == {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    cfg = ModelConfig.from_json(target_dir / "config.json")
    assert (cfg.num_layers, cfg.hidden_size, cfg.eos_token_ids) == (layers, hidden, (128001, 128008, 128009))
    v = cfg.vocab_size
    per_layer = (cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
                 + 3 * cfg.hidden_size * cfg.intermediate_size + 2 * cfg.hidden_size)
    assert 2 * v * cfg.hidden_size + cfg.num_layers * per_layer + cfg.hidden_size == params
    hf = AutoConfig.from_pretrained(str(target_dir))  # the installed transformers reads it
    assert (hf.model_type, hf.num_hidden_layers, hf.hidden_size) == ("llama", layers, hidden)
    draft = DraftConfig.from_json(draft_dir / "config.json")
    assert draft.vocab_size == v and draft.draft_vocab_size == 32000
    assert draft.target_hidden_size == hidden
    with pytest.raises(KeyError, match="not a preset"):
        presets.preset_dirs("llama-2-7b")
