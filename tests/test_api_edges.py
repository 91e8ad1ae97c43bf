"""`LLM`'s answers to bad input: an error output (finish_reason "error", the message in `.error`)
for a bad prompt, from `generate` and `stream` alike; a clear exception for a call that cannot
mean anything (no prompts, an invalid K), raised before anything loads.

A tiny random target without a tokenizer and without warm-up: nothing here compiles a step.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_cli import write_tiny_target

from eagle3_jax.api import LLM
from eagle3_jax.config import ConfigError, EngineConfig

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    target = write_tiny_target(tmp_path_factory.mktemp("tiny_target"))
    cfg = EngineConfig(batch_buckets=(2,), prefill_buckets=(32,), prefill_batch_buckets=(1,),
                       max_model_len=MAX_MODEL_LEN, num_pages=32)
    return LLM(target=target, draft=None, num_speculative_tokens=0, engine_config=cfg, warmup=False, progress=False)


def test_stream_of_an_empty_prompt_yields_an_error_output(llm):
    deltas = list(llm.stream(""))
    assert len(deltas) == 1
    delta = deltas[0]
    assert delta.finished and delta.token_ids == [] and delta.text == ""
    assert delta.output.finish_reason == "error" and delta.output.error == "prompt is empty"
    # The same request through generate: the same output.
    (out,) = llm.generate([""])
    assert (out.finish_reason, out.error) == ("error", "prompt is empty")


def test_a_list_of_floats_is_one_bad_prompt(llm):
    outs = llm.generate([0.5, 1.5])
    assert len(outs) == 1  # not read as two prompts
    assert outs[0].finish_reason == "error"
    assert outs[0].error.startswith("a prompt is a string, chat messages")
    assert "float" in outs[0].error
    (delta,) = llm.stream([0.5, 1.5])
    assert delta.output.error == outs[0].error


def test_bad_prompt_shapes_are_reported_not_raised(llm):
    outs = llm.generate([[{"role": "user"}], [1, "two"], ""])
    assert [o.finish_reason for o in outs] == ["error"] * 3
    assert outs[0].error == "chat message 0 needs a 'role' and a 'content', both strings"
    assert outs[1].error.startswith("a prompt is a string") and "str" in outs[1].error
    assert outs[2].error == "prompt is empty"
    (one,) = llm.generate(None)
    assert one.finish_reason == "error" and "NoneType" in one.error


def test_numpy_token_ids_are_prompts(llm):
    ids = llm.encode(np.array([3, 4], dtype=np.int64))
    assert ids == [3, 4] and all(type(t) is int for t in ids)
    assert llm.encode([np.int32(3), 4]) == [3, 4]
    # A list of 1-d arrays is a batch (each request refused here for its own reason, so nothing
    # compiles); a prompt holding an array is one bad prompt, reported, not raised.
    outs = llm.generate([np.array([1, 10**6]), np.array([], dtype=np.int32)])
    assert [o.error for o in outs] == ["prompt token id 1000000 at index 1 is outside the vocabulary 0..255",
                                       "prompt is empty"]
    (out,) = llm.generate([[np.array([1, 2])]])
    assert out.finish_reason == "error" and out.error.endswith("got a list holding ndarray")


def test_no_prompts_raises(llm):
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([])


def test_overlong_prompt_names_max_model_len(llm):
    (out,) = llm.generate([list(range(3, 3 + MAX_MODEL_LEN))])
    assert out.finish_reason == "error"
    assert out.error.startswith(f"prompt has {MAX_MODEL_LEN} tokens; the context holds {MAX_MODEL_LEN}")
    assert "EngineConfig.max_model_len" in out.error
    assert out.prompt_token_ids == list(range(3, 3 + MAX_MODEL_LEN))


@pytest.mark.parametrize("k", [-1, 17])
def test_invalid_num_speculative_tokens_fails_before_loading(tmp_path, k):
    # The target does not exist: reaching the loader would raise FileNotFoundError instead.
    with pytest.raises(ConfigError, match=f"num_speculative_tokens must be in 0..16, got {k}"):
        LLM(target=tmp_path / "nowhere", num_speculative_tokens=k)


def test_gemm_setting_is_checked_and_auto_takes_cublas_only_for_wide_verifies_of_a_narrow_target():
    """EngineConfig.gemm: a bad value fails by name; "auto" compiles an iteration with cuBLAS's GEMMs
    at 64 to 512 verify rows (bucket x tokens verified a row) of a target at most 2048 wide, where
    XLA's Triton GEMMs split K into an extra reduction kernel per projection (BENCHMARKS.md, "GEMMs:
    Triton or cuBLAS"); "triton" and "cublas" hold at every bucket."""
    from eagle3_jax.config import TreeSpec
    from eagle3_jax.presets import llama31_8b, smollm2_135m
    from eagle3_jax.runner.speculators import Chain, Tree
    from eagle3_jax.runner.steps import StepConfig, iterate_in_place_step, iteration_gemm

    with pytest.raises(ConfigError, match="gemm must be one of auto, triton, cublas, got 'cutlass'"):
        EngineConfig(gemm="cutlass")
    assert EngineConfig().gemm == "auto"
    (small, small_draft), (wide, wide_draft) = smollm2_135m(), llama31_8b()

    def gemm(target, draft, rows, k=4, tree=None, setting="auto"):
        cfg = StepConfig(target=target, draft=draft, speculator=Tree(tree) if tree else Chain(k), gemm=setting)
        return iteration_gemm(cfg, rows)

    tree = TreeSpec(6, 8, 31)  # 32 tokens verified a row
    assert [gemm(small, small_draft, b, tree=tree) for b in (1, 2, 16, 32)] == ["triton", "cublas", "cublas", "triton"]
    assert [gemm(small, small_draft, b) for b in (8, 16, 64)] == ["triton", "cublas", "cublas"]  # 5 a row
    assert [gemm(small, None, b, k=0) for b in (32, 64)] == ["triton", "cublas"]  # the target alone: 1 a row
    assert {gemm(wide, wide_draft, b, tree=tree) for b in (1, 8, 64)} == {"triton"}  # 4096 wide
    assert {gemm(wide, wide_draft, b, setting="cublas") for b in (1, 64)} == {"cublas"}  # 2,048 rows too
    assert {gemm(small, small_draft, b, tree=tree, setting="triton") for b in (1, 64)} == {"triton"}
    cfg = StepConfig(target=small, draft=small_draft, speculator=Tree(tree), gemm="auto")
    assert iterate_in_place_step(cfg, 1) is not iterate_in_place_step(cfg, 2)  # two compilations of one function
    assert iterate_in_place_step(cfg, 2) is iterate_in_place_step(cfg, 8)
