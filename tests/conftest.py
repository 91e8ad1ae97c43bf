"""Shared fixtures: the real SmolLM2 target (prepared once per machine), MT-bench prompts, and
engines shared across tests so each compiled bucket is built once per test run (and loaded from
JAX's persistent cache in each later module: see _drop_compiled_programs)."""

from __future__ import annotations

import gc
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from eagle3_jax import assets
from eagle3_jax.config import DraftConfig, ModelConfig

# The CPU is the test platform; f32 everywhere so parity is meaningful.
jax.config.update("jax_platforms", "cpu")


# Linux caps a process's memory mappings (vm.max_map_count, 65,530 by default) and each XLA CPU
# executable holds its own. Keeping every program of the suite, the full run aborted inside an XLA
# compile in tests/test_train.py, twice at the same test, while that file alone passed; in a later
# run one module added about 35,000 mappings on its own. Dropping the compiled programs once a
# module leaves more than this many keeps the run under the cap and rebuilds little (from JAX's
# persistent cache, where a program was saved).
_DROP_PROGRAMS_AT_MAPPINGS = 20_000
_MAPPINGS = Path("/proc/self/maps")


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    yield
    if _MAPPINGS.exists() and _MAPPINGS.read_bytes().count(b"\n") > _DROP_PROGRAMS_AT_MAPPINGS:
        gc.collect()
        jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2_dir():
    return assets.prepare_default_target(progress=False)


@pytest.fixture(scope="session")
def smollm2_cfg(smollm2_dir):
    return ModelConfig.from_json(smollm2_dir / "config.json")


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def mtbench():
    return [q["turns"][0] for q in assets.mtbench_questions()]


@pytest.fixture(scope="session")
def chat_ids(tokenizer, mtbench):
    """Chat-templated MT-bench first turns as token ids."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for q in mtbench]


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own GGUF loader: an independent reference for our conversion and forward."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = assets.fetch(assets.SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def random_drafter_dir(tmp_path_factory, smollm2_cfg):
    """A random SmolLM2-shaped drafter in the public layout (nearly every proposal rejected)."""
    from eagle3_jax.model.eagle3 import init_draft_params
    from eagle3_jax.weights.eagle3 import save_drafter

    # max_position_embeddings 32: every prompt runs past the drafter's nominal RoPE range.
    cfg = DraftConfig.like_target(smollm2_cfg, draft_vocab_size=2048, max_position_embeddings=32)
    params = init_draft_params(cfg, jax.random.PRNGKey(7), jnp.float32)
    return save_drafter(params, cfg, tmp_path_factory.mktemp("random_drafter"))


# Small shapes keep CPU compilation cheap: prompts over 64 tokens are prefilled in chunks, one
# prompt per prefill call (each prefill shape is two more programs of ~20 s each to compile on the
# CPU: tests/test_engine.py's spec_llm batches its prefills, against the target alone's single ones).
# "always": one iteration program per bucket, and every test speculates whatever the CPU's timing;
# tests/test_engine.py runs "auto" end to end.
TEST_ENGINE = {"batch_buckets": (1, 8), "prefill_buckets": (64,), "prefill_batch_buckets": (1,),
               "max_model_len": 384, "num_pages": 256, "speculation": "always"}


def make_llm(target, draft=None, num_draft=3, warmup=True, **engine):
    """An LLM on the test engine config, warmed up (every program built) unless told otherwise."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    return LLM(target=target, draft=draft, num_speculative_tokens=num_draft,
               engine_config=EngineConfig(**{**TEST_ENGINE, **engine}), warmup=warmup, progress=False)


@pytest.fixture(scope="session")
def target_llm(smollm2_dir):
    return make_llm(smollm2_dir)
