"""The EAGLE-3 training objective with the training-time test (TTT), in pure JAX.

Source: the EAGLE reference trainer, SafeAILab/EAGLE `eagle/traineagle3/cnets.py` (Model.forward,
LlamaAttention.forward) and `eagle/traineagle3/main.py`; arXiv 2503.01840 (EAGLE-3).

Per row of T tokens x_0..x_{T-1}, the frozen target gives captures g_t and logits l_t (of x_{t+1}).
Step j = 0..S-1 of the TTT runs the draft at every base index t at once:
  input token  x_{t+1+j}          (`shift_left(tokens, 1 + j)`)
  input hidden j = 0: fc(g_t); j > 0: the draft's pre-norm output of step j-1 at the same base
  RoPE position t + j             (cnets.py: `position_ids + lck`)
  target       softmax(l_{t+1+j}) over the draft vocabulary (cnets.py: target_head[..., t2d])
  mask         x_{t+2+j} is an assistant token and argmax l_{t+1+j} is in the draft vocabulary
               (the reference indexes the loss mask at t+j; we index the predicted token's)
Attention (cnets.py's extended TTT mask): step j at base t sees the step-0 keys of bases 0..t and
the step-i key at base t for i = 1..j, as a chain step at position t+j does at inference.
Loss: sum_j 0.8**j * CE_j (main.py's ploss_weight), CE_j a masked mean of -sum_v p_v log q_v
(the reference averages over all positions). S = 6, the deepest proposal the engine serves (the
reference's 7th step trains a depth nothing drafts). Accuracy_j: draft argmax == target argmax
over step j's assistant positions.

Reachable bases (`reach_top_k` = k > 0; ours): step j's loss also requires that every earlier
step's data token was in the draft's top k, the only contexts where inference runs step j
(GRIFFIN, arXiv 2502.11018, masks misaligned tokens for the same reason).

Acceptance proxy (`chain_acceptance`): teacher-forced, a greedy chain from base t accepts its
first j + 1 proposals when steps 0..j all hit; it counts every base alike, where the engine resumes
only where it stopped, so `chain_walk` walks the engine's iterations over the same hits
(BENCHMARKS.md, "Where acceptance is lost").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import DraftParams, draft_forward, draft_layer, draft_logits, fuse_captures
from eagle3_jax.model.layers import project_qkv, rope_inv_freq

STEP_WEIGHT = 0.8  # main.py: ploss_weight = [0.8 ** i for i in range(len(plosses))]
TTT_STEPS = 6  # the deepest proposal served (a chain of 6, TreeSpec(6, 8, 31)); cnets.py unrolls 7


def shift_left(x: jax.Array, n: int, fill=0) -> jax.Array:
    """x [B, T, ...] -> y[:, t] = x[:, t + n], `fill` past the end (cnets.py `padding`, n times)."""
    if n == 0:
        return x
    b, t = x.shape[:2]
    n = min(n, t)
    pad = jnp.full((b, n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def ttt_visibility(seq_len: int, step: int) -> np.ndarray:
    """The TTT mask of `step` as a dense bool [T, (step + 1) * T], keys step-major (for tests)."""
    t = np.arange(seq_len)
    blocks = [t[None, :] <= t[:, None]]
    blocks += [t[None, :] == t[:, None]] * step
    return np.concatenate(blocks, axis=1)


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, k_diag: tuple[jax.Array, ...],
                  v_diag: tuple[jax.Array, ...]) -> jax.Array:
    """GQA under the TTT mask, never materialized: q [B, T, H, hd]; k0, v0 [B, T, kvh, hd] (step 0,
    causal); k_diag, v_diag one [B, T, kvh, hd] per step 1..j, seen at the own base -> [B, T, H, hd]."""
    b, t, h, hd = q.shape
    kvh = k0.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scale = 1.0 / math.sqrt(hd)
    causal = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    causal = jnp.where(visible, causal, -jnp.inf)
    diag = [jnp.einsum("btkgd,btkd->bkgt", qg, k, preferred_element_type=jnp.float32)[..., None] * scale
            for k in k_diag]
    probs = jax.nn.softmax(jnp.concatenate([causal, *diag], axis=-1), axis=-1)  # [B, kvh, g, T, T + j]
    probs = probs.astype(v0.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs[..., :t], v0)
    for i, v in enumerate(v_diag):
        out = out + jnp.einsum("bkgt,btkd->btkgd", probs[..., t + i], v)
    return out.reshape(b, t, h, hd)


def row_pages(batch: int, seq_len: int, num_layers: int, kv_heads: int, head_dim: int,
              dtype) -> tuple[llama.KVCache, jax.Array]:
    """A paged cache, each row in one page of size T (page 0 scratch): (cache, block_table [B, 1])."""
    cache = llama.KVCache.zeros(num_layers, batch + 1, seq_len, kv_heads, head_dim, dtype)
    return cache, jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None]


def target_pass(params: llama.LlamaParams, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Frozen target: tokens [B, T] -> (captures [B, T, n_capture * H_t], logits [B, T, V] f32)."""
    b, t = tokens.shape
    cache, table = row_pages(b, t, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, captures, _ = llama.forward(params, cfg, tokens, positions, cache, table)
    return jax.lax.stop_gradient(captures), jax.lax.stop_gradient(llama.logits(params, hidden))


def target_distribution(logits: jax.Array, used: jax.Array, t2d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V]; used [N] the draft vocabulary's target ids; t2d [V] bool -> (p [B, T, N]
    f32 over the draft vocabulary, in_vocab [B, T]: the target's argmax is a draft token)."""
    p = jax.nn.softmax(jnp.take(logits, used, axis=-1).astype(jnp.float32), axis=-1)
    return p, t2d[jnp.argmax(logits, axis=-1)]


def chain_step(params: DraftParams, cfg: DraftConfig, embed: jax.Array, tokens: jax.Array, h: jax.Array,
               positions: jax.Array, k0: jax.Array, v0: jax.Array, k_prev: tuple[jax.Array, ...],
               v_prev: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """TTT step j >= 1, the draft layer under `ttt_attention`: h [B, T, H]; k_prev, v_prev steps
    1..j-1's -> (pre-norm h [B, T, H], k, v [B, T, kvh, hd])."""
    b, t, _ = h.shape
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def ttt(x):
        q, k, v = project_qkv(x, params.wqkv, positions, inv_freq=inv_freq)
        out = ttt_attention(q, k0, v0, (*k_prev, k), (*v_prev, v))
        return out.reshape(b, t, cfg.q_size) @ params.wo, (k, v)

    h, (k, v) = draft_layer(params, cfg, embed, tokens, h, ttt)
    return h, k, v


def _head_stats(params: DraftParams, cfg: DraftConfig, h: jax.Array, p: jax.Array, next_ids: jax.Array | None,
                reach_top_k: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """h [B, T, H], p [B, T, N], next_ids [B, T] (-1 outside the draft vocabulary) -> (CE, argmax
    hit, next token in the top `reach_top_k` or None), each [B, T]. Rematerialized in the backward
    pass, so no step's [B, T, N] logits are kept."""
    logits = draft_logits(params, cfg, h)
    ce = -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hit = jnp.argmax(logits, -1) == jnp.argmax(p, -1)
    reach = None
    if reach_top_k > 0:
        chosen = jnp.take_along_axis(logits, jnp.maximum(next_ids, 0)[..., None], axis=-1)
        reach = jax.lax.stop_gradient((next_ids >= 0) & (jnp.sum(logits > chosen, axis=-1) < reach_top_k))
    return ce, jax.lax.stop_gradient(hit), reach


_head_stats_remat = jax.checkpoint(_head_stats, static_argnums=(1, 5))


def step_targets(tokens: jax.Array, loss_mask: jax.Array, p: jax.Array, in_vocab: jax.Array,
                 j: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """TTT step j's -> (input tokens [B, T], target p [B, T, N], loss mask, accuracy denominator)."""
    assistant = shift_left(loss_mask, 2 + j, False)
    return (shift_left(tokens, 1 + j), shift_left(p, 1 + j, 0.0),
            assistant & shift_left(in_vocab, 1 + j, False), assistant)


def ttt_hiddens(params: DraftParams, cfg: DraftConfig, embed: jax.Array, captures: jax.Array,
                tokens: jax.Array, num_steps: int) -> list[jax.Array]:
    """The draft's pre-norm outputs [B, T, H] of TTT steps 0..num_steps-1; embed [V, H] the frozen
    target embedding; captures [B, T, n_capture * H_t]; tokens [B, T]."""
    b, t = tokens.shape
    base = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = fuse_captures(params, captures.astype(params.fc.dtype))
    # Step 0 is plain causal: the inference draft forward.
    cache, table = row_pages(b, t, 1, cfg.num_kv_heads, cfg.head_dim, h.dtype)
    h, cache = draft_forward(params, cfg, embed, shift_left(tokens, 1), h, base, cache, table)
    k0, v0 = cache.k[0][1:], cache.v[0][1:]  # [B, T, kvh, hd], rotated at positions t
    out, ks, vs = [h], (), ()
    for j in range(1, num_steps):
        h, k, v = chain_step(params, cfg, embed, shift_left(tokens, 1 + j), h, base + j, k0, v0, ks, vs)
        out.append(h)
        ks, vs = (*ks, k), (*vs, v)
    return out


def ttt_loss(params: DraftParams, cfg: DraftConfig, embed: jax.Array, captures: jax.Array,
             tokens: jax.Array, loss_mask: jax.Array, p: jax.Array, in_vocab: jax.Array,
             num_steps: int = TTT_STEPS, step_weight: float = STEP_WEIGHT, draft_ids: jax.Array | None = None,
             reach_top_k: int = 0, per_position: bool = False) -> tuple[jax.Array, dict]:
    """The weighted TTT loss of one batch: loss_mask [B, T] (assistant tokens), p and in_vocab from
    `target_distribution`, draft_ids [B, T] (`draft_ids_of`) with reach_top_k > 0 -> (loss,
    {"loss_steps", "acc_steps", "accept_steps": [S]}), with `per_position` also "hits" [S, B, T]
    and "valid" [B, T] for `chain_walk`."""
    if reach_top_k > 0 and draft_ids is None:
        raise ValueError("reach_top_k needs draft_ids")
    losses, accs, hits, denoms = [], [], [], []
    reach = None  # [B, T]: inference reaches step j at this base
    for j, h in enumerate(ttt_hiddens(params, cfg, embed, captures, tokens, num_steps)):
        _, step_p, mask, denom = step_targets(tokens, loss_mask, p, in_vocab, j)
        next_ids = shift_left(draft_ids, 2 + j, -1) if reach_top_k > 0 else None
        ce, hit, step_reach = _head_stats_remat(params, cfg, h, step_p, next_ids, reach_top_k)
        counted = mask if reach is None else mask & reach
        losses.append(jnp.sum(jnp.where(counted, ce, 0.0)) / jnp.maximum(jnp.sum(counted), 1))
        hit = hit & mask
        accs.append(jnp.sum(hit) / jnp.maximum(jnp.sum(denom), 1))
        hits.append(hit)
        denoms.append(denom)
        if step_reach is not None:
            reach = step_reach if reach is None else reach & step_reach
    losses, accs = jnp.stack(losses), jnp.stack(accs)
    accept = chain_acceptance(jnp.stack(hits), jnp.all(jnp.stack(denoms), axis=0))
    weights = jnp.asarray([step_weight ** j for j in range(num_steps)], jnp.float32)
    aux = {"loss_steps": losses, "acc_steps": accs, "accept_steps": accept}
    if per_position:
        aux.update(hits=jnp.stack(hits), valid=denoms[0])
    return jnp.sum(weights * losses), aux


def draft_ids_of(tokens: jax.Array, used: jax.Array, vocab_size: int) -> jax.Array:
    """tokens [B, T]; used [N] -> [B, T] int32 draft ids, -1 outside the draft vocabulary."""
    index = jnp.full((vocab_size,), -1, jnp.int32).at[used].set(jnp.arange(used.shape[0], dtype=jnp.int32))
    return index[tokens]


def chain_acceptance(hits: jax.Array, valid: jax.Array) -> jax.Array:
    """hits [S, B, T], valid [B, T] -> [S] f32: the share of valid bases whose steps 0..j all hit
    (acceptance length at K proposals: 1 + the sum of the first K)."""
    run = jnp.cumprod(hits.astype(jnp.float32), axis=0)
    return jnp.sum(run * valid, axis=(1, 2)) / jnp.maximum(jnp.sum(valid), 1)


def chain_walk(hits: np.ndarray, valid: np.ndarray, k: int) -> tuple[int, int, np.ndarray]:
    """The engine's greedy chain of k proposals walked over teacher-forced hits [S >= k, B, T]
    (`ttt_loss`), valid [B, T]: a row starts after its first valid base (the prefill's token), an
    iteration at base t accepts the leading hits there and resumes at t + accepted + 1, and the row
    ends at an invalid base. On a greedy reply this is the engine's own count. -> (iterations,
    emitted, accepted_at [k]), `RequestMetrics`' sums."""
    hits, valid = np.asarray(hits, bool), np.asarray(valid, bool)
    b, t = valid.shape
    accepted = np.cumprod(hits[:k], axis=0).sum(axis=0)  # [B, T]
    rows = np.arange(b)
    base = np.argmax(valid, axis=1) + 1
    alive = valid.any(axis=1)
    iterations, emitted, accepted_at = 0, 0, np.zeros(k, np.int64)
    while True:
        at = np.minimum(base, t - 1)
        alive &= (base < t) & valid[rows, at]
        if not alive.any():
            return iterations, emitted, accepted_at
        a = accepted[rows, at][alive]
        iterations += int(alive.sum())
        emitted += int(a.sum()) + len(a)
        accepted_at += (a[:, None] > np.arange(k)).sum(axis=0)
        base = base + accepted[rows, at] + 1
