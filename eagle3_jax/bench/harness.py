"""Model configurations, engine sizing, synthetic rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eagle3_jax.bench.common import STEP_PRESETS
from eagle3_jax.bench.options import Options
from eagle3_jax.config import (
    DraftConfig,
    EngineConfig,
    ModelConfig,
    ServedConfig,
    TreeSpec,
    default_batch_buckets,
    smallest_bucket,
)


def draft_config_like(target: ModelConfig, draft_vocab_size: int = 32000) -> DraftConfig:
    """A drafter whose midlayer has the target's layer shapes (as the public 8B drafter has)."""
    return DraftConfig.like_target(target, draft_vocab_size)


def step_models(opts: Options) -> tuple[ModelConfig, DraftConfig]:
    """The step phase's (target, drafter) shapes: a preset's pair, or a checkpoint's config with
    --step-draft's drafter (default: one with the target's layer shapes)."""
    if opts.step_model in STEP_PRESETS:
        target, draft = STEP_PRESETS[opts.step_model]()
    else:
        target = ModelConfig.from_json(Path(opts.step_model) / "config.json")
        draft = draft_config_like(target)
    if opts.step_draft:
        path = Path(opts.step_draft)
        draft = DraftConfig.from_json(path / "config.json" if path.is_dir() else path)
    return target, draft


def own_embedding(target: ModelConfig, draft: DraftConfig) -> bool:
    """The 70B layout: a drafter narrower than its target ships its own embedding."""
    return draft.hidden_size != target.hidden_size


def hf_config_dict(cfg: ModelConfig) -> dict:
    """transformers LlamaConfig arguments for a ModelConfig."""
    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu"}
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return d


def sized_engine_config(batches: Sequence[int], k: int, max_model_len: int,
                        prefill_buckets: Sequence[int] = (128, 512), min_bucket: int | None = None,
                        speculation: str = "always", attention: str = "auto",
                        prefill_batch_buckets: Sequence[int] | None = None, gemv: str = "xla",
                        tree: TreeSpec | None = None, gemm: str = "auto") -> EngineConfig:
    """Buckets = the batch sizes, none below `min_bucket` (a smaller batch runs padded to it;
    None: the smallest of the engine's default buckets for this mode, `default_batch_buckets`);
    a KV pool of exactly one full-length row per slot. "always": an EAGLE-3 row measures
    speculation at every batch size. `prefill_batch_buckets` None keeps the engine's default;
    `tree`: EngineConfig.tree; k = 0 without a tree: the target alone; `gemm`: EngineConfig.gemm."""
    cfg = EngineConfig(prefill_buckets=tuple(prefill_buckets), num_speculative_tokens=k,
                       max_model_len=max_model_len, speculation=speculation, attention=attention, gemv=gemv,
                       prefill_batch_buckets=tuple(prefill_batch_buckets or EngineConfig.prefill_batch_buckets),
                       tree=tree, gemm=gemm)
    if min_bucket is None:
        min_bucket = default_batch_buckets(cfg.speculative_proposals)[0]
    buckets = tuple(sorted({max(b, min_bucket) for b in batches}))
    return dataclasses.replace(cfg, batch_buckets=buckets, num_pages=1 + buckets[-1] * cfg.max_blocks_per_seq)


def bucket_for(cfg: ServedConfig, batch: int) -> int:
    return smallest_bucket(cfg.batch_buckets, batch)


# ==== synthetic rows =========================================================================
def synthetic_rows(cfg: ServedConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots 1..batch, each with pages of its own: (rows [B], block tables [B, nb])."""
    nb, num_pages = cfg.pool.max_blocks_per_seq, cfg.pool.num_pages
    if 1 + batch * nb > num_pages:
        raise ValueError(f"{batch} rows of {nb} pages need {1 + batch * nb} pages; the pool has {num_pages}")
    return np.arange(1, batch + 1, dtype=np.int32), (1 + np.arange(batch * nb, dtype=np.int32)).reshape(batch, nb)
