"""The EAGLE-3 training objective with the training-time test (TTT), in pure JAX.

Source: the EAGLE reference trainer, SafeAILab/EAGLE `eagle/traineagle3/cnets.py` (Model.forward,
LlamaAttention.forward) and `eagle/traineagle3/main.py`; arXiv 2503.01840 (EAGLE-3).

Notation, per row of T tokens x_0..x_{T-1}; the frozen target gives captures g_t and logits
l_t (its distribution of x_{t+1}). Step j = 0..S-1 of the TTT runs the draft at every base index t
at once:
  input token  x_{t+1+j}          (`shift_left(tokens, 1 + j)`)
  input hidden j = 0: fc(g_t); j > 0: the draft's own pre-norm output of step j-1 at the same
               base t (which sat at position t+j-1: the chain step's "previous hidden")
  RoPE position t + j             (cnets.py: `position_ids + lck`, lck = steps done so far)
  target       softmax(l_{t+1+j}) restricted to the draft vocabulary (cnets.py: target_head[..., t2d])
  mask         x_{t+2+j} is an assistant token and argmax l_{t+1+j} is in the draft vocabulary
               (cnets.py: position_mask = t2d[target argmax] * loss_mask; the reference indexes the
               loss mask at t+j, we index it at the predicted token t+2+j)
Attention (the "extended" TTT mask, cnets.py LlamaAttention.forward): the query of step j at base
t sees the step-0 keys of bases 0..t (causal) and the step-i key at base t for each i = 1..j (one
diagonal per step). This is exactly what inference sees: a chain step at position t+j attends to
the draft prefill's keys 0..t and to the chain steps' own keys at t+1..t+j.
Loss: sum_j 0.8**j * CE_j (main.py: `ploss_weight = [0.8 ** i ...]`), CE_j = masked mean over
positions of -sum_v p_v log q_v (forward KL up to the target's entropy; same gradient). The
reference averages over all B*T positions; we average over the masked ones. S = 6 steps by
default, the depth of the deepest proposal the engine serves (a chain of 6 or the tree
TreeSpec(6, 8, 31)): step j trains proposal j + 1, and the reference's 7th step (cnets.py
`self.length = 7`) trains a depth nothing drafts; `num_steps` sets it. Accuracy_j: draft argmax ==
target argmax, over the assistant positions of step j (a target argmax outside the draft
vocabulary counts as a miss, as in the reference's `acces`).

Reachable bases only (`reach_top_k` = k > 0; ours, not the reference's): step j's loss also
requires that at every earlier step i < j the data's next token x_{t+2+i} was among the draft's
top k. Only there does inference ever run step j on this context (a chain follows the draft's
top 1, a tree's beams its top k); elsewhere step j learns to continue from a proposal nobody
made, and the one layer's capacity goes to contexts that cannot raise acceptance (GRIFFIN, arXiv
2502.11018, masks misaligned tokens out of its loss for the same reason). Accuracy and the
acceptance proxy stay over every base.

Acceptance proxy (`chain_acceptance`): with every input teacher-forced, a greedy chain of K
proposals from base t would accept its first j + 1 when steps 0..j all hit; accept_j is the
share of bases (whose S predicted tokens are all assistant tokens) where they do, and
1 + sum_{j<K} accept_j the chain's acceptance length. It ignores that a sampled row's tokens are
not the target's argmax, so it tracks MT-bench's greedy acceptance rather than equals it. It also
counts every base alike, where the engine starts an iteration only where the last one stopped:
after a miss, the token the draft missed. `chain_walk` walks the engine's iterations over the
same hits; on a greedy reply it is the engine's own count (BENCHMARKS.md, "Where acceptance is
lost": the uniform proxy reads 0.3-0.4 above it at K = 4).
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
    """x [B, T, ...] -> y with y[:, t] = x[:, t + n] where t + n < T, else `fill`
    (cnets.py `padding(x, left=False)` applied n times)."""
    if n == 0:
        return x
    b, t = x.shape[:2]
    n = min(n, t)
    pad = jnp.full((b, n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def ttt_visibility(seq_len: int, step: int) -> np.ndarray:
    """The TTT mask of step `step` as a dense boolean [T, (step + 1) * T]: query base t vs the
    keys of steps 0..step laid out step-major (key i*T + s is step i's key at base s).
    For documentation and tests; `ttt_attention` never builds it."""
    t = np.arange(seq_len)
    blocks = [t[None, :] <= t[:, None]]  # step 0: causal
    blocks += [t[None, :] == t[:, None]] * step  # steps 1..step: the diagonal
    return np.concatenate(blocks, axis=1)


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, k_diag: tuple[jax.Array, ...],
                  v_diag: tuple[jax.Array, ...]) -> jax.Array:
    """GQA under the TTT mask without materializing it.

    q [B, T, H, hd] (rotated); k0, v0 [B, T, kvh, hd]: step-0 keys/values (causal part);
    k_diag, v_diag: one [B, T, kvh, hd] per later step 1..j (the current one last), each seen only
    at the query's own base index. -> [B, T, H, hd].
    """
    b, t, h, hd = q.shape
    kvh = k0.shape[2]
    qg = q.reshape(b, t, kvh, h // kvh, hd)
    scale = 1.0 / math.sqrt(hd)
    causal = jnp.einsum("btkgd,bskd->bkgts", qg, k0, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]  # [T(query), T(key)]
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
    """A paged cache holding each row whole in one page of size T: (cache, block_table [B, 1]).
    Page 0 stays the scratch page."""
    cache = llama.KVCache.zeros(num_layers, batch + 1, seq_len, kv_heads, head_dim, dtype)
    return cache, jnp.arange(1, batch + 1, dtype=jnp.int32)[:, None]


def target_pass(params: llama.LlamaParams, cfg: ModelConfig, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Frozen full-sequence causal target pass. tokens [B, T] ->
    (captures [B, T, n_capture * H_t], logits [B, T, V] f32)."""
    b, t = tokens.shape
    cache, table = row_pages(b, t, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    hidden, captures, _ = llama.forward(params, cfg, tokens, positions, cache, table)
    return jax.lax.stop_gradient(captures), jax.lax.stop_gradient(llama.logits(params, hidden))


def target_distribution(logits: jax.Array, used: jax.Array, t2d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V]; used [N] target ids of the draft vocabulary; t2d [V] bool ->
    (p [B, T, N] f32: softmax over the draft vocabulary only, in_vocab [B, T] bool: the target's
    argmax is a draft token)."""
    p = jax.nn.softmax(jnp.take(logits, used, axis=-1).astype(jnp.float32), axis=-1)
    return p, t2d[jnp.argmax(logits, axis=-1)]


def chain_step(params: DraftParams, cfg: DraftConfig, embed: jax.Array, tokens: jax.Array, h: jax.Array,
               positions: jax.Array, k0: jax.Array, v0: jax.Array, k_prev: tuple[jax.Array, ...],
               v_prev: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A TTT step j >= 1: the draft layer with the TTT attention in place of the paged one.

    tokens, positions [B, T]; h [B, T, H] (previous step's pre-norm output); k0, v0 step 0's
    keys/values; k_prev, v_prev those of steps 1..j-1. -> (pre-norm h [B, T, H], k, v [B, T, kvh, hd]).
    """
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
    """h [B, T, H], p [B, T, N], next_ids [B, T] (the draft id of the data's next token, -1 outside
    the draft vocabulary; None with reach_top_k 0) -> (CE [B, T], argmax hit [B, T] bool, the next
    token among the draft's top `reach_top_k` [B, T] bool, None with 0). Rematerialized in the
    backward pass: the [B, T, N] logits of every step are never kept."""
    logits = draft_logits(params, cfg, h)  # [B, T, N] f32
    ce = -jnp.sum(p * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    hit = jnp.argmax(logits, -1) == jnp.argmax(p, -1)
    reach = None
    if reach_top_k > 0:
        chosen = jnp.take_along_axis(logits, jnp.maximum(next_ids, 0)[..., None], axis=-1)  # [B, T, 1]
        reach = jax.lax.stop_gradient((next_ids >= 0) & (jnp.sum(logits > chosen, axis=-1) < reach_top_k))
    return ce, jax.lax.stop_gradient(hit), reach


_head_stats_remat = jax.checkpoint(_head_stats, static_argnums=(1, 5))


def step_targets(tokens: jax.Array, loss_mask: jax.Array, p: jax.Array, in_vocab: jax.Array,
                 j: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The shifted inputs and targets of TTT step j (see the module docstring).
    -> (input tokens [B, T], target p [B, T, N], loss mask [B, T], accuracy denominator [B, T])."""
    assistant = shift_left(loss_mask, 2 + j, False)  # the predicted token x_{t+2+j} is assistant
    return (shift_left(tokens, 1 + j), shift_left(p, 1 + j, 0.0),
            assistant & shift_left(in_vocab, 1 + j, False), assistant)


def ttt_hiddens(params: DraftParams, cfg: DraftConfig, embed: jax.Array, captures: jax.Array,
                tokens: jax.Array, num_steps: int) -> list[jax.Array]:
    """The draft's pre-norm outputs [B, T, H] of TTT steps 0..num_steps-1 (base index t in step j
    is the chain step at position t + j after a prefill of x_0..x_t).

    params in the compute dtype; embed [V, H] the (frozen) target embedding; captures
    [B, T, n_capture * H_t]; tokens [B, T].
    """
    b, t = tokens.shape
    base = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    h = fuse_captures(params, captures.astype(params.fc.dtype))
    # Step 0 is plain causal: the inference draft forward over a row-per-page cache.
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
    """The weighted TTT loss of one batch.

    Arguments as `ttt_hiddens`, plus loss_mask [B, T] (assistant tokens) and p [B, T, N],
    in_vocab [B, T] from `target_distribution`; with `reach_top_k` > 0, draft_ids [B, T] (each
    token's draft id, -1 outside the draft vocabulary; `draft_ids_of`): step j's loss counts only
    bases whose data tokens steps 0..j-1 proposed within their top `reach_top_k` (module docstring).
    -> (scalar loss, {"loss_steps": [S], "acc_steps": [S], "accept_steps": [S] (`chain_acceptance`)}),
    with `per_position` also "hits" [S, B, T] and "valid" [B, T] (step 0's denominator) for `chain_walk`.
    """
    if reach_top_k > 0 and draft_ids is None:
        raise ValueError("reach_top_k needs draft_ids")
    losses, accs, hits, denoms = [], [], [], []
    reach = None  # [B, T] with reach_top_k > 0: inference reaches step j at this base
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
    """tokens [B, T] target ids; used [N] the draft vocabulary's target ids -> [B, T] int32 draft
    ids, -1 for a token outside the draft vocabulary."""
    index = jnp.full((vocab_size,), -1, jnp.int32).at[used].set(jnp.arange(used.shape[0], dtype=jnp.int32))
    return index[tokens]


def chain_acceptance(hits: jax.Array, valid: jax.Array) -> jax.Array:
    """hits [S, B, T] bool (step j's draft argmax is the target's at base t), valid [B, T] bool ->
    [S] f32: the share of valid bases whose steps 0..j all hit, the teacher-forced acceptance rate
    of a chain's proposal j + 1 (its acceptance length at K proposals: 1 + the sum of the first K)."""
    run = jnp.cumprod(hits.astype(jnp.float32), axis=0)  # [S, B, T]: steps 0..j all hit
    return jnp.sum(run * valid, axis=(1, 2)) / jnp.maximum(jnp.sum(valid), 1)


def chain_walk(hits: np.ndarray, valid: np.ndarray, k: int) -> tuple[int, int, np.ndarray]:
    """The engine's greedy chain of k proposals, walked over teacher-forced hits (host numpy).

    hits [S >= k, B, T] bool (`ttt_loss`: step j's argmax is the target's at base t, a reply
    token there), valid [B, T] bool (base t's step 0 predicts a reply token: step 0's accuracy
    denominator). Each row's first iteration is at the base after its first valid one (the
    prefill gives the first reply token); an iteration at base t accepts the leading hits of
    steps 0..k-1 there and emits them and the target's own token, so the next is at base
    t + accepted + 1; the row ends at a base that is not valid (its last token was emitted). On a
    greedy reply every draft's inputs are then the data's, as in the TTT, so this is what the
    engine would count on it, short of an iteration running past a reply cut at max_tokens.
    -> (iterations, emitted, accepted_at [k]): `RequestMetrics`' sums over the rows.
    """
    hits, valid = np.asarray(hits, bool), np.asarray(valid, bool)
    b, t = valid.shape
    accepted = np.cumprod(hits[:k], axis=0).sum(axis=0)  # [B, T] leading hits at each base
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
