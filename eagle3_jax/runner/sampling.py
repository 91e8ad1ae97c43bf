"""Lossless speculative sampling on the device: pure, jittable functions of arrays.

Parameters are per-row arrays (`RowSampling`), so one compile serves greedy and sampled rows
together, and each row draws from its own key, so its tokens never depend on the batch. A sampled
row reproduces `filtered_probs`. Rules (docs/EAGLE3.md, "The speculative loop"): draft-q (Leviathan
et al. 2023, Thm. 1: accept d ~ q with probability min(1, p(d)/q(d)), else draw from
norm((p - q)^+); lossless only if d was really drawn from q, with uniforms apart from the draft's);
one-hot (q the point mass on d, as vLLM: lossless for any d, accepts less); coupled (Daliri et al.
2024: the token at position n is argmax log p + G_n, Gumbel noise of the row's key and n alone,
verified greedily, so a seed fixes the output); greedy (argmax matching, first index on ties).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from eagle3_jax.sampling_params import SamplingParams

Array = jax.Array

PAD_TOKEN = -1  # fills `emitted` after the correction / bonus token
KEY_IMPL = "threefry2x32"
COUPLING_TAG = 0x636F7570  # keeps the coupling noise's stream apart from every (step, stream) fold
RESIDUAL_EPS = 1e-6  # a residual mass below this means p == q up to rounding: draw from p instead


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters, arrays only (one compile for any mix): [B] each, key [B, 2] u32
    (raw threefry2x32 data, the row's base key). Temperature 0: greedy; top_k 0, top_p 1, min_p 0: off."""

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array
    key: Array
    one_hot: Array
    coupled: Array

    @property
    def greedy(self) -> Array:
        return self.temperature == 0

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


jax.tree_util.register_dataclass(
    RowSampling,
    data_fields=["temperature", "top_k", "top_p", "min_p", "key", "one_hot", "coupled"],
    meta_fields=[],
)

SamplingState = RowSampling


def seed_to_key_data(seed: int) -> np.ndarray:
    """Raw threefry2x32 key data [2] u32 of a seed >= 0: jax.random.key(seed)'s, all 64 bits without x64."""
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


def row_sampling_from_params(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None] | None = None,
    *,
    rng: np.random.Generator | None = None,
    point_mass: bool = False,
) -> RowSampling:
    """Host side: `SamplingParams` -> `RowSampling` of numpy arrays. A row's seed is params[i].seed,
    else seeds[i], else drawn from rng (OS entropy); point_mass: the
    speculator's proposals are point masses (`SamplingParams.acceptance_rule`)."""
    n = len(params)
    if seeds is not None and len(seeds) != n:
        raise ValueError(f"seeds has length {len(seeds)}, expected {n}")
    if rng is None:
        rng = np.random.default_rng()
    keys = np.zeros((n, 2), np.uint32)
    for i, sp in enumerate(params):
        s = sp.seed
        if s is None and seeds is not None:
            s = seeds[i]
        if s is None:
            s = int(rng.integers(0, 2**63 - 1))
        keys[i] = seed_to_key_data(s)
    rules = [sp.acceptance_rule(point_mass) for sp in params]
    return RowSampling(
        temperature=np.array([sp.temperature for sp in params], np.float32).reshape(n),
        top_k=np.array([sp.top_k for sp in params], np.int32).reshape(n),
        top_p=np.array([sp.top_p for sp in params], np.float32).reshape(n),
        min_p=np.array([sp.min_p for sp in params], np.float32).reshape(n),
        key=keys,
        one_hot=np.array([rule == "one_hot" for rule in rules], bool).reshape(n),
        coupled=np.array([rule == "coupled" and not sp.greedy for rule, sp in zip(rules, params)], bool).reshape(n),
    )


def _as_key(key) -> Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key.astype(jnp.uint32), impl=KEY_IMPL)


def fold_in_rows(keys: Array, data) -> Array:
    """Per-row fold_in (a step's keys, streams kept apart): keys [B, 2] u32, data [B] or scalar."""
    keys = jnp.asarray(keys, jnp.uint32)
    data = jnp.broadcast_to(jnp.asarray(data, jnp.uint32), keys.shape[:1])
    return jax.vmap(lambda k, d: jax.random.key_data(jax.random.fold_in(_as_key(k), d)))(
        keys, data
    )


def row_uniforms(keys: Array, num: int) -> tuple[Array, Array]:
    """keys [B, 2] u32 -> (u_accept [B, num] f32, u_sample [B] f32), per row."""

    def one(k):
        ka, ks = jax.random.split(_as_key(k))
        return jax.random.uniform(ka, (num,), jnp.float32), jax.random.uniform(ks, (), jnp.float32)

    return jax.vmap(one)(jnp.asarray(keys, jnp.uint32))


def _mix32(x: Array) -> Array:
    """The "lowbias32" hash finalizer: a bijection of u32 words, each output bit on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def coupling_noise(keys: Array, index: Array, vocab_size: int) -> Array:
    """The coupled rule's Gumbel noise: keys [B, 2] u32 (base keys), index [B, ...] i32 absolute
    positions -> [B, ..., V] f32. A function of key and position alone, so the draft, the verify
    and a target-only step at one position draw the same noise. One threefry fold per position,
    then a hash of it and the token id (24 bits): threefry per token over the whole vocabulary
    dominated a CPU iteration."""
    keys = fold_in_rows(keys, COUPLING_TAG)
    index = jnp.asarray(index, jnp.int32)
    flat = index.reshape(index.shape[0], -1)

    def position_key(key, i):
        return jax.random.key_data(jax.random.fold_in(_as_key(key), i))

    words = jax.vmap(lambda k, row: jax.vmap(lambda i: position_key(k, i))(row))(keys, flat)  # [B, N, 2]
    token = jnp.arange(vocab_size, dtype=jnp.uint32)
    bits = _mix32(_mix32(words[..., :1] ^ (token * jnp.uint32(0x9E3779B9))) + words[..., 1:])  # [B, N, V]
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return (-jnp.log(-jnp.log(u))).reshape(*index.shape, vocab_size)


def perturbed_log_probs(probs: Array, noise: Array) -> Array:
    """log probs + noise [..., V], -inf where probs is 0: argmax a draw (Gumbel-max), top-k k draws
    without replacement."""
    return jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) + noise, -jnp.inf)


def coupled_ids(probs: Array, noise: Array) -> Array:
    """The coupled draw: probs, noise [..., V] -> [...] i32."""
    return jnp.argmax(perturbed_log_probs(probs, noise), axis=-1).astype(jnp.int32)


def _topk_topp_threshold(x: Array, top_k: Array, top_p: Array) -> Array:
    """Top-k then top-p as a threshold: x [..., V] f32 scaled logits, top_k, top_p [..., 1] -> thr
    [..., 1], keep x >= thr. A threshold needs a value sort only, no argsort."""
    V = x.shape[-1]
    s = jnp.sort(x, axis=-1, descending=True)
    k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)
    thr_k = jnp.take_along_axis(s, k_eff - 1, axis=-1)
    keep_k = s >= thr_k  # [..., V] (ties at the k-th value kept)
    e = jnp.where(keep_k, jnp.exp(s - s[..., :1]), 0.0)
    ps = e / jnp.sum(e, axis=-1, keepdims=True)  # probs after top-k, sorted
    cs = jnp.cumsum(ps, axis=-1)
    mass_before = jnp.concatenate([jnp.zeros_like(cs[..., :1]), cs[..., :-1]], axis=-1)
    keep_p = (mass_before < top_p) | (top_p >= 1.0)
    first = lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == 0
    keep = (keep_k & keep_p) | first  # the top token is always kept
    return jnp.min(jnp.where(keep, s, jnp.inf), axis=-1, keepdims=True)


def filtered_probs(logits: Array, temperature, top_k, top_p, min_p) -> Array:
    """The distribution a row samples: logits [..., V], parameters broadcastable to [...] -> probs
    [..., V] f32. Greedy rows: one-hot of the argmax. Others: softmax(logits / T) over the tokens
    kept by top-k, then top-p (over the top-k renormalised), then min-p (p >= min_p p_max); ties
    with the last kept value are kept, the top token always. Sorts only if a sampled row needs it."""
    logits = jnp.asarray(logits, jnp.float32)
    V = logits.shape[-1]
    lead = logits.shape[:-1]

    def bc(a, dtype):  # -> [..., 1]
        return jnp.broadcast_to(jnp.asarray(a, dtype), lead)[..., None]

    t = bc(temperature, jnp.float32)
    k = bc(top_k, jnp.int32)
    tp = bc(top_p, jnp.float32)
    mp = bc(min_p, jnp.float32)

    greedy = t == 0
    x = logits / jnp.where(greedy, 1.0, t)
    x_max = jnp.max(x, axis=-1, keepdims=True)

    need_sort = jnp.any(~greedy & (((k > 0) & (k < V)) | (tp < 1.0)))
    neg_inf = jnp.full(lead + (1,), -jnp.inf, jnp.float32)
    thr_kp = lax.cond(need_sort, _topk_topp_threshold, lambda *_: neg_inf, x, k, tp)
    thr_m = jnp.where(mp > 0, x_max + jnp.log(jnp.where(mp > 0, mp, 1.0)), -jnp.inf)
    thr = jnp.maximum(thr_kp, thr_m)  # [..., 1]; <= x_max, so the max is kept

    e = jnp.where(x >= thr, jnp.exp(x - x_max), 0.0)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)

    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


def sample_from_uniform(probs: Array, u: Array) -> Array:
    """Inverse-CDF draw: probs [..., V] >= 0, unnormalised, u [...] in [0, 1) -> [...] i32. Never a
    zero-probability token, whatever the cumsum's rounding."""
    probs = jnp.asarray(probs, jnp.float32)
    V = probs.shape[-1]
    cdf = jnp.cumsum(probs, axis=-1)
    r = u[..., None] * cdf[..., -1:]
    pos = probs > 0
    cand = (cdf > r) & pos
    first = jnp.argmax(cand, axis=-1)
    last_pos = V - 1 - jnp.argmax(jnp.flip(pos, axis=-1), axis=-1)  # rounding fallback
    return jnp.where(jnp.any(cand, axis=-1), first, last_pos).astype(jnp.int32)


def sample(probs: Array, key) -> Array:
    """probs [..., V], one key for all rows (typed or raw [2] u32) -> [...] i32; per row: `sample_rows`."""
    u = jax.random.uniform(_as_key(key), probs.shape[:-1], jnp.float32)
    return sample_from_uniform(probs, u)


def sample_rows(probs: Array, keys: Array) -> Array:
    """Per-row categorical: probs [B, V], keys [B, 2] u32 -> [B] i32."""
    u = jax.vmap(lambda k: jax.random.uniform(_as_key(k), (), jnp.float32))(
        jnp.asarray(keys, jnp.uint32)
    )
    return sample_from_uniform(probs, u)


def sample_logits(logits: Array, params: RowSampling, keys: Array | None = None,
                  noise: Array | None = None) -> Array:
    """Target-only choice: logits [B, V], keys [B, 2] u32 (default params.key), noise [B, V] at the
    token's position (None: no row coupled) -> [B] i32."""
    keys = params.key if keys is None else keys
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    tok = sample_rows(probs, keys)
    if noise is not None:
        tok = jnp.where(params.coupled, coupled_ids(probs, noise), tok)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(params.greedy, greedy_tok, tok)


def mask_words(vocab_size: int) -> int:
    """int32 words of one packed token mask: bit t % 32 of word t // 32 allows token t."""
    return (vocab_size + 31) // 32


def allow_all(shape: tuple[int, ...], vocab_size: int) -> np.ndarray:
    """Packed token masks [*shape, mask_words] allowing every token (rows no grammar constrains)."""
    return np.full((*shape, mask_words(vocab_size)), -1, np.int32)


def mask_logits(logits: Array, token_mask: Array) -> Array:
    """A grammar's token mask applied: logits [..., V], token_mask [..., ceil(V / 32)] i32 (bit t % 32
    of word t // 32 allows token t) -> logits with every refused token -inf. Every rule then
    accepts only allowed tokens (greedy: an argmax; sampled: p = 0 there) and draws its correction
    or bonus token among them, so speculation keeps the constrained output exactly."""
    V = logits.shape[-1]
    bits = jnp.right_shift(token_mask[..., None], jnp.arange(32, dtype=jnp.int32)) & 1  # [..., W, 32]
    allowed = bits.reshape(*token_mask.shape[:-1], -1)[..., :V].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def _leading_accepts(accept: Array) -> Array:
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def assemble_emitted(draft_tokens: Array, num_accepted: Array, last_token: Array) -> Array:
    """draft [B, K], n [B], last [B] -> emitted [B, K+1] (drafts, last, PAD)."""
    B, K = draft_tokens.shape
    pos = lax.broadcasted_iota(jnp.int32, (B, K + 1), 1)
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    n = num_accepted[:, None]
    return jnp.where(pos < n, drafts, jnp.where(pos == n, last_token[:, None], PAD_TOKEN))


def greedy_verify(target_logits: Array, draft_tokens: Array, valid: Array | None = None) -> tuple[Array, Array]:
    """target_logits [B, K+1, V], draft_tokens [B, K] i32, valid [B] bool (None: all; invalid rows
    accept none) -> (num_accepted [B] i32 in 0..K, emitted [B, K+1] i32)."""
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    K = draft_tokens.shape[1]
    g = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    match = draft_tokens == g[:, :K]
    n = _leading_accepts(match if valid is None else match & jnp.asarray(valid)[:, None])
    last = jnp.take_along_axis(g, n[:, None], axis=1)[:, 0]
    return n, assemble_emitted(draft_tokens, n, last)


def verify_chain(
    target_logits: Array,
    draft_tokens: Array,
    draft_probs: Array | None,
    params: RowSampling,
    keys: Array | None = None,
    noise: Array | None = None,
    valid: Array | None = None,
) -> tuple[Array, Array]:
    """A chain's verify, each row by its rule: target_logits [B, K+1, V] raw; draft_probs [B, K, V]
    the q each proposal was drawn from, target vocabulary (None: one-hot); keys [B, 2] u32 fresh each
    step, apart from the draft's; noise [B, K+1, V] (None: no row coupled); valid [B] (None: all):
    an invalid row, another speculator's, accepts none and draws from p -> (num_accepted [B] in
    0..K, emitted [B, K+1]: the accepted drafts, the correction or bonus token, then PAD_TOKEN)."""
    target_logits = jnp.asarray(target_logits, jnp.float32)
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    B, K1, V = target_logits.shape
    K = K1 - 1
    assert draft_tokens.shape == (B, K), (draft_tokens.shape, (B, K))
    keys = params.key if keys is None else keys

    greedy = params.greedy
    one_hot = jnp.asarray(params.one_hot, bool)
    if draft_probs is None:
        one_hot = jnp.ones_like(one_hot)
    else:
        draft_probs = jnp.asarray(draft_probs, jnp.float32)
        assert draft_probs.shape == (B, K, V), (draft_probs.shape, (B, K, V))

    col = lambda a: jnp.asarray(a)[:, None]  # [B] -> [B, 1] broadcast over chain
    p = filtered_probs(
        target_logits, col(params.temperature), col(params.top_k), col(params.top_p), col(params.min_p)
    )

    u_acc, u_samp = row_uniforms(keys, K)  # [B, K], [B]

    if K > 0:
        p_d = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
        if draft_probs is None:
            q_d = jnp.ones_like(p_d)
        else:
            q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
            q_d = jnp.where(col(one_hot), 1.0, q_d)
        # u < p/q  <=>  u*q < p  (q == 0: accept iff p > 0; p == 0: never)
        accept = u_acc * q_d < p_d
        if valid is not None:
            accept = accept & jnp.asarray(valid)[:, None]
        n = _leading_accepts(accept)
    else:
        n = jnp.zeros((B,), jnp.int32)

    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    if K > 0:
        n_c = jnp.minimum(n, K - 1)
        d_n = jnp.take_along_axis(draft_tokens, n_c[:, None], axis=1)
        q_onehot = (lax.broadcasted_iota(jnp.int32, (B, V), 1) == d_n).astype(jnp.float32)
        if draft_probs is None:
            q_n = q_onehot
        else:
            q_n = jnp.take_along_axis(draft_probs, n_c[:, None, None], axis=1)[:, 0]
            q_n = jnp.where(col(one_hot), q_onehot, q_n)
        q_n = jnp.where(col(n == K), 0.0, q_n)  # bonus: sample from p_K
        if valid is not None:  # nothing was tried: sample from p itself
            q_n = jnp.where(col(jnp.asarray(valid)), q_n, 0.0)
        resid = jnp.maximum(p_n - q_n, 0.0)
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) >= RESIDUAL_EPS, resid, p_n)
    else:
        resid = p_n
    tok = sample_from_uniform(resid, u_samp)

    emitted = assemble_emitted(draft_tokens, n, tok)
    if noise is not None:  # coupled rows: accept what equals the target's own coupled draw
        c_n, c_emitted = greedy_verify(perturbed_log_probs(p, noise), draft_tokens, valid)
        coupled = jnp.asarray(params.coupled, bool)
        n, emitted = jnp.where(coupled, c_n, n), jnp.where(col(coupled), c_emitted, emitted)

    g_n, g_emitted = greedy_verify(target_logits, draft_tokens, valid)
    return jnp.where(greedy, g_n, n), jnp.where(col(greedy), g_emitted, emitted)
