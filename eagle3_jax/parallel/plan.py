"""Per-device memory plan for a tensor-parallel deployment (`eagle3-jax plan`), in bytes per device.

Weights are `jax.eval_shape(init_params)` under sharding.py's specs, so the figures follow the
layout. The KV cache is the paged pool for `max_batch` rows of `max_len` tokens plus scratch.
Activations estimate the largest transient buffers of the XLA attention; XLA may fuse some away.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from eagle3_jax.config import DraftConfig, ModelConfig, check_draft_fits
from eagle3_jax.parallel.sharding import (
    draft_holds_embedding,
    draft_param_specs,
    kv_heads_split,
    llama_param_specs,
    per_device_bytes,
)

GB = 1e9


def target_weight_bytes(cfg: ModelConfig, tp: int, dtype_bytes: int = 2) -> int:
    """Per-device bytes of the target's weights under llama_param_specs."""
    shapes = jax.eval_shape(lambda: _init_target(cfg))
    return per_device_bytes(shapes, llama_param_specs(cfg, tp), tp, dtype_bytes)


def draft_weight_bytes(cfg: DraftConfig, tp: int, own_embedding: bool, dtype_bytes: int = 2) -> int:
    """Per-device bytes of the drafter's weights (all replicated; at tp > 1 with an embedding)."""
    shapes = jax.eval_shape(lambda: _init_draft(cfg, draft_holds_embedding(own_embedding, tp)))
    return per_device_bytes(shapes, draft_param_specs(cfg, tp, own_embedding), tp, dtype_bytes)


def _init_target(cfg: ModelConfig):
    from eagle3_jax.model.llama import init_params

    return init_params(cfg, jax.random.key(0), jnp.bfloat16)


def _init_draft(cfg: DraftConfig, own_embedding: bool):
    from eagle3_jax.model.eagle3 import init_draft_params

    return init_draft_params(cfg, jax.random.key(0), jnp.bfloat16, own_embedding)


def _local_kv_heads(kv_heads: int, tp: int) -> int:
    return kv_heads // tp if kv_heads_split(kv_heads, tp) else kv_heads


def kv_bytes_per_token(target: ModelConfig, draft: DraftConfig | None, tp: int, dtype_bytes: int) -> tuple[int, int]:
    """Per device, one token's keys and values: (the target's over its layers, split by kv heads
    where tp divides them; the drafter's, replicated)."""
    target_bytes = target.num_layers * 2 * _local_kv_heads(target.num_kv_heads, tp) * target.head_dim * dtype_bytes
    return target_bytes, 0 if draft is None else 2 * draft.num_kv_heads * draft.head_dim * dtype_bytes


def plan_memory(target_cfg: ModelConfig, draft_cfg: DraftConfig | None, tp: int, *,
                dtype_bytes: int = 2, max_batch: int, max_len: int, page_size: int,
                gpu_bytes: float = 141e9, mem_fraction: float = 0.9,
                draft_own_embedding: bool | None = None, num_draft_tokens: int = 4,
                prefill_tokens: int = 512) -> dict:
    """Per-device bytes of a tp-way deployment and how many KV tokens fit. mem_fraction: the share
    of `gpu_bytes` jax may take (XLA_PYTHON_CLIENT_MEM_FRACTION). draft_own_embedding None: the
    70B layout where the widths differ. prefill_tokens: the largest prefill chunk (the XLA
    attention's f32 scores are [heads/tp, T, max_len]). Raises ShardingError or ConfigError."""
    t, d = target_cfg, draft_cfg
    own_embed = (d is not None and d.hidden_size != t.hidden_size) if draft_own_embedding is None \
        else draft_own_embedding

    if d is not None:
        check_draft_fits(t, d, own_embed)
    w_target = target_weight_bytes(t, tp, dtype_bytes)
    w_draft = draft_weight_bytes(d, tp, own_embed, dtype_bytes) if d is not None else 0

    # Every row owns ceil(max_len / page) pages, plus the scratch page.
    blocks = math.ceil(max_len / page_size)
    num_pages = max_batch * blocks + 1
    kvh_t = _local_kv_heads(t.num_kv_heads, tp)
    kv_tok_target, kv_tok_draft = kv_bytes_per_token(t, d, tp, dtype_bytes)
    pool_tokens = num_pages * page_size
    kv_target, kv_draft = pool_tokens * kv_tok_target, pool_tokens * kv_tok_draft

    # Replicated: verify's captures, the drafter's hidden state, a prefill chunk's captures, and
    # the draft distributions [max_batch + 1, K, V_draft] f32 kept between iterations.
    cap_width = (d.num_captures * d.target_hidden_size) if d is not None else 0
    d_hidden = d.hidden_size if d is not None else 0
    hidden = dtype_bytes * (max_batch * (num_draft_tokens + 1) * cap_width
                            + max_batch * d_hidden + prefill_tokens * cap_width)
    if d is not None:
        hidden += (max_batch + 1) * num_draft_tokens * d.draft_vocab_size * 4

    # The largest step, a layer at a time: gathered K and V, f32 scores and probabilities, the
    # MLP's gate/up, f32 logits.
    q_local = t.num_heads // tp

    def step_ws(rows: int, tokens: int, logit_rows: int) -> int:
        ctx = rows * blocks * page_size
        gathered = 2 * ctx * kvh_t * t.head_dim * dtype_bytes
        scores = 2 * rows * q_local * tokens * blocks * page_size * 4
        mlp = 2 * rows * tokens * (t.intermediate_size // tp) * dtype_bytes
        logits = logit_rows * (t.vocab_size // tp if t.vocab_size % tp == 0 else t.vocab_size) * 4
        return gathered + scores + mlp + logits

    workspace = max(step_ws(max_batch, num_draft_tokens + 1, max_batch * (num_draft_tokens + 1)),
                    step_ws(1, prefill_tokens, 1))

    usable = int(gpu_bytes * mem_fraction)
    fixed = w_target + w_draft + hidden + workspace
    kv_budget = usable - fixed
    per_token = kv_tok_target + kv_tok_draft
    max_kv_tokens = max(kv_budget, 0) // per_token
    max_rows = max((max_kv_tokens // page_size - 1) // blocks, 0)
    return dict(
        tp=tp, dtype_bytes=dtype_bytes, max_batch=max_batch, max_len=max_len, page_size=page_size,
        gpu_bytes=int(gpu_bytes), usable_bytes=usable,
        weights_target=w_target, weights_draft=w_draft, draft_own_embedding=own_embed,
        kv_pages=num_pages, kv_target=kv_target, kv_draft=kv_draft,
        kv_bytes_per_token=per_token, kv_heads_per_device=kvh_t,
        hidden_buffers=hidden, workspace=workspace,
        total=fixed + kv_target + kv_draft, free=usable - fixed - kv_target - kv_draft,
        fits=usable - fixed - kv_target - kv_draft >= 0,
        kv_budget=kv_budget, max_kv_tokens=max_kv_tokens, max_batch_at_max_len=max_rows,
    )


_ROWS = (
    ("weights: target", "weights_target", "b"),
    ("weights: draft", "weights_draft", "b"),
    ("KV cache: target", "kv_target", "b"),
    ("KV cache: draft", "kv_draft", "b"),
    ("hidden-state buffers", "hidden_buffers", "b"),
    ("step workspace (est.)", "workspace", "b"),
    ("total", "total", "b"),
    ("usable (gpu x fraction)", "usable_bytes", "b"),
    ("free", "free", "b"),
    ("fits", "fits", "s"),
    ("KV heads per device", "kv_heads_per_device", "n"),
    ("KV bytes per token", "kv_bytes_per_token", "n"),
    ("KV budget after fixed", "kv_budget", "b"),
    ("max KV tokens", "max_kv_tokens", "n"),
    ("max rows at max_len", "max_batch_at_max_len", "n"),
)


def format_plan(plans: dict | list[dict]) -> str:
    """A text table, one column per plan (e.g. per tp); byte figures in GB (1e9) per device."""
    plans = [plans] if isinstance(plans, dict) else list(plans)
    head = ["per device"] + [f"tp={p['tp']}" for p in plans]

    def cell(p: dict, key: str, kind: str) -> str:
        v = p[key]
        if kind == "b":
            return f"{v / GB:,.2f} GB"
        if kind == "s":
            return "yes" if v else "NO"
        return f"{v:,}"

    rows = [head] + [[label] + [cell(p, key, kind) for p in plans] for label, key, kind in _ROWS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    p = plans[0]
    lines.append(f"(max_batch {p['max_batch']}, max_len {p['max_len']}, page {p['page_size']}, "
                 f"{p['dtype_bytes']} bytes/elem, {p['gpu_bytes'] / GB:.0f} GB per GPU)")
    return "\n".join(lines)
