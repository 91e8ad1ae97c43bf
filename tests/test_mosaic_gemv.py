"""model/mosaic_gemv.py, the Mosaic GPU kernel for few-row weight projections.

The suite runs on the CPU, where the kernel cannot (its TMA copies have no interpreter in jax
0.10), so it checks what needs none: the tiles it picks; that a decode forward lowers for the GPU
with the kernel in each projection, and a prefill-sized one without it; that the engine's
iteration runs it in every projection and its prefill in none. On a Hopper GPU,
`experiments/gemv_probe.py --kernel mosaic --check` runs it: against jnp.dot, and a row's result bit
for bit the same whatever rows share its call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from runner_probe import trace_iteration, trace_prefill

from eagle3_jax.config import ConfigError, EngineConfig, ModelConfig
from eagle3_jax.model import llama, mosaic_gemv
from eagle3_jax.model.mosaic_gemv import Tiling
from eagle3_jax.runner.served import DeviceFacts, gemv_kind


def test_tiles_of_the_8b_and_smollm2_projections():
    want = {  # (K, N): the 8B's o, qkv, down, gate_up, lm_head; SmolLM2's qkv and down
        (4096, 4096): Tiling(64, 128, 4, 4),
        (4096, 6144): Tiling(64, 128, 2, 4),
        (14336, 4096): Tiling(64, 128, 4, 4),
        (4096, 28672): Tiling(128, 128, 1, 4),
        (4096, 128256): Tiling(128, 128, 1, 4),
        (576, 960): Tiling(64, 64, 3, 3),  # K = 9 x 64: three splits of three steps
        (1536, 576): Tiling(64, 128, 4, 3),
    }
    for (k, n), tiling in want.items():
        got = mosaic_gemv.tiling(k, n)
        assert got == tiling, (k, n)
        assert n % got.tile_n == 0 and k % (got.splits * got.tile_k) == 0
        assert got.stages <= k // got.splits // got.tile_k  # never deeper than a program's steps
        # pipeline stages at the most rows, plus the f32 output tile: within a program's 227 KB
        smem = got.stages * (got.tile_k * got.tile_n + mosaic_gemv.MAX_ROWS * got.tile_k) * 2
        assert smem + got.tile_n * mosaic_gemv.MAX_ROWS * 4 <= 227 * 1024
    assert mosaic_gemv.supports(64, 4096, 4096, jnp.bfloat16)
    assert not mosaic_gemv.supports(65, 4096, 4096, jnp.bfloat16)  # a GEMM: XLA's
    assert not mosaic_gemv.supports(1, 4096, 4096, jnp.float32)
    assert not mosaic_gemv.supports(1, 4000, 4096, jnp.bfloat16)


def test_every_row_count_it_takes_lowers_for_the_gpu():
    """supports() promises 1..64 rows. Mosaic tiles x's rows by 8 and, past 8, takes only whole
    tiles: unpadded, 49 of these counts failed to lower (SmolLM2's verify of 2 x 5 tokens, 10
    rows, on the H200), while the 8B bench's 1, 4, 8 and 32 rows passed."""
    w = jax.ShapeDtypeStruct((128, 192), jnp.bfloat16)
    for rows in range(1, mosaic_gemv.MAX_ROWS + 1):
        x = jax.ShapeDtypeStruct((rows, 128), jnp.bfloat16)
        assert mosaic_gemv.supports(rows, 128, 192, x.dtype)
        text = jax.jit(mosaic_gemv.project).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and f"tensor<{rows}x192xbf16>" in text, rows


def test_decode_lowers_for_the_gpu_with_the_kernel_in_every_projection(monkeypatch):
    """A two-layer model with an untied lm_head: a decode forward (2 rows) puts the kernel in each
    layer's four projections and the lm_head, and lowers for CUDA with them (the kernels are built
    then: a shape the kernel rejects fails here); a prefill forward (2 x 64 rows) has none."""
    cfg = ModelConfig.from_hf({"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 512,
                               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
                               "max_position_embeddings": 256})
    params = jax.eval_shape(lambda: llama.fold_norm_gains(llama.init_params(cfg, jax.random.PRNGKey(0))))
    cache = jax.eval_shape(lambda: llama.KVCache.zeros(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim,
                                                         jnp.bfloat16))
    calls = []
    project = mosaic_gemv.project
    monkeypatch.setattr(mosaic_gemv, "project", lambda x, w, out_dtype=None: calls.append(w.shape) or
                        project(x, w, out_dtype))

    def step(params, cache, tokens, positions, table):
        hidden, _, cache = llama.forward(params, cfg, tokens, positions, cache, table, gemv="mosaic")
        return llama.logits(params, hidden, gemv="mosaic"), cache

    for t, want in ((1, 4 * cfg.num_layers + 1), (64, 0)):
        calls.clear()
        args = (jax.ShapeDtypeStruct((2, t), jnp.int32), jax.ShapeDtypeStruct((2, t), jnp.int32),
                jax.ShapeDtypeStruct((2, 4), jnp.int32))
        lowered = jax.jit(step).trace(params, cache, *args).lower(lowering_platforms=("cuda",))
        assert len(calls) == want, (t, calls)
        assert ("mosaic_gpu" in lowered.as_text()) == (want > 0)


def test_the_gemv_setting_names_what_is_wrong():
    with pytest.raises(ConfigError, match="gemv must be one of xla, mosaic, got 'fast'"):
        EngineConfig(gemv="fast")
    with pytest.raises(ConfigError, match="gemv 'mosaic' runs on one Hopper GPU only, not on cpu"):
        gemv_kind(EngineConfig(gemv="mosaic"), DeviceFacts.of(None))  # the suite runs on the CPU
    assert gemv_kind(EngineConfig(), DeviceFacts.of(None)) == "xla"


def test_the_engine_runs_the_kernel_in_iterations_and_never_in_prefills(monkeypatch):
    """StepConfig.gemv reaches every projection of an iteration (target verify, draft extend and
    chain), while a prefill keeps XLA's dots even where its rows would fit the kernel (a lone
    32-token chunk): lowered for CUDA from the CPU suite's engine."""
    import dataclasses

    from eagle3_jax.config import DraftConfig
    from eagle3_jax.engine.engine import Engine
    from eagle3_jax.model.eagle3 import init_draft_params

    target = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                         max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,))
    draft = DraftConfig.like_target(target, 256)
    params = llama.fold_norm_gains(llama.init_params(target, jax.random.PRNGKey(0), jnp.bfloat16))
    engine = Engine(target, params, draft, init_draft_params(draft, jax.random.PRNGKey(1), jnp.bfloat16, False),
                    EngineConfig(batch_buckets=(2,), prefill_buckets=(32,), max_model_len=128))
    cfg = dataclasses.replace(engine.step_cfg, gemv="mosaic")
    calls = []
    project = mosaic_gemv.project
    monkeypatch.setattr(mosaic_gemv, "project", lambda x, w, out_dtype=None: calls.append(w.shape) or
                        project(x, w, out_dtype))

    prefill = trace_prefill(engine.runner, 1, 32, cfg).lower(lowering_platforms=("cuda",))
    assert calls == [] and "mosaic_gpu" not in prefill.as_text()

    iteration = trace_iteration(engine.runner, 2, cfg).lower(lowering_platforms=("cuda",))
    # target: 4 projections a layer + lm_head; draft extend: fc + its 4; each of K - 1 chain steps:
    # its 4; K draft lm_heads
    k = cfg.speculator.facts.max_accepted
    assert len(calls) == 4 * target.num_layers + 1 + 5 + 4 * (k - 1) + k, calls
    assert "mosaic_gpu" in iteration.as_text()
