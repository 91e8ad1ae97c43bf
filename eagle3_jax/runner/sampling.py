r"""Lossless speculative sampling math (device side, pure jittable JAX).

Everything here is a pure function of arrays.  Per-row sampling parameters
(temperature, top-k, top-p, min-p, PRNG key, acceptance mode) are *arrays*, so
one compiled function serves a batch that mixes greedy and sampled rows.

Target distribution
-------------------
For a sampled row the distribution we must reproduce is the *filtered* target
distribution ``p = filtered_probs(target_logits, ...)`` -- exactly what
target-only decoding with the same `SamplingParams` would sample from
(temperature, then top-k, then top-p, then min-p, renormalised).

Why chain speculative sampling is lossless (Leviathan et al. 2023, "Fast
Inference from Transformers via Speculative Decoding", Thm. 1 / App. A.1;
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", Thm. 1)
-------------------------------------------------------------------------
One position, target ``p``, draft ``q``, drafted token ``d ~ q``.  Accept ``d``
with probability ``min(1, p(d)/q(d))``; otherwise emit a token from the residual
``r = (p - q)^+ / Z`` with ``Z = sum_x (p(x) - q(x))^+ = 1 - sum_x min(p, q)``::

    P(out = x) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
               = min(p(x), q(x))        + Z * (p(x) - q(x))^+ / Z
               = p(x).

For a chain of K drafted tokens the argument is applied position by position:
given that d_0..d_{i-1} were accepted, the emitted prefix equals the drafted
prefix, so target and draft distributions at position i are the correct
conditionals p_i(. | prefix), q_i(. | prefix) and position i is again an exact
one-step draw from p_i.  If all K drafts are accepted the bonus token is drawn
directly from p_K.  Hence every emitted sequence has exactly the target-only
distribution.  The only requirements are: d_i is really drawn from q_i, and the
uniforms used here are independent of the draft's sampling randomness (use
different key streams, see `fold_in_rows`).

One-hot acceptance (vLLM / SGLang shortcut) and why it accepts less
-------------------------------------------------------------------
Replacing q by the point mass on d (accept with probability p(d); on rejection
sample from p with d zeroed, = norm((p - onehot(d))^+)) is lossless for *any*
way of choosing d, because for every fixed d::

    P(out = x | d) = 1{x=d} p(d) + (1 - p(d)) * p(x) 1{x!=d} / (1 - p(d)) = p(x).

Its acceptance probability is E_{d~q}[p(d)] = sum_x q(x) p(x), whereas the
real-q rule accepts with probability sum_x min(p(x), q(x)).  Since
ab <= min(a, b) for a, b in [0, 1], one-hot never accepts more (e.g. p = q =
uniform over V: real q accepts always, one-hot with probability 1/V).  If the
draft picks tokens greedily (q is one-hot) the two rules coincide.

Coupled acceptance: a seed fixes the output, whatever speculation does
---------------------------------------------------------------------
Drafter-invariant coupling (Daliri et al. 2024, "Coupling without communication
and drafter-invariant speculative decoding"): the token at absolute position n
of a row is ``argmax_x log p(x) + G_n(x)``, with G_n i.i.d. Gumbel noise over
the target vocabulary, a function of the row's key and n alone
(`coupling_noise`).  By the Gumbel-max trick that token is an exact draw from
p, so target-only decoding under this rule samples the target's distribution.
The draft proposes with the same noise (``argmax log q + G_n``; a tree's
children are the Gumbel-top-k), and the target accepts a proposal iff it
equals its own perturbed argmax after the proposal's parent, emitting that
argmax at the first mismatch: exactly greedy verification of the perturbed
logits.  Every emitted token is then the target's own coupled draw at its
position: the output is a function of (prompt, seed) alone, the same alone or
in a batch, speculating or not, with a chain or a tree.  It accepts less than
the draft-q rule (P(accept) >= (1 - TV) / (1 + TV) against 1 - TV, TV the
total variation between p and q), so unseeded requests keep the draft-q rule on
a chain (`SamplingParams.draft_acceptance`); on a tree, whose children are not
draws from q, the coupled rule accepts more than the point-mass rule.

Greedy rows (temperature == 0)
------------------------------
Never go through probabilities: accept while d_i == argmax(target_logits[i])
(first index on ties, same as `jnp.argmax`), then emit the argmax at the first
mismatch (or the bonus argmax).  Token-identical to target-only greedy decoding.

Conventions
-----------
* `filtered_probs`: logits ``[..., V]``; every parameter array must be
  broadcastable to the logits' *leading* shape ``logits.shape[:-1]``
  (e.g. logits ``[B, T, V]`` with params ``[B, 1]``; logits ``[B, V]`` with
  params ``[B]``; scalars are fine).
* `RowSampling` fields are per row ``[B]`` (key ``[B, 2]`` uint32 raw
  threefry2x32 key data); `verify_chain` broadcasts them over the chain itself.
* `verify_chain` pads ``emitted`` after the correction/bonus token with
  ``PAD_TOKEN = -1``.
* Randomness is derived per row from that row's own key, so a row's result
  never depends on the other rows of the batch.
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

PAD_TOKEN = -1
"""Filler for `emitted` entries after the correction / bonus token."""

KEY_IMPL = "threefry2x32"
"""PRNG implementation of the raw per-row keys (key data shape [2] uint32)."""

COUPLING_TAG = 0x636F7570
"""Folded into a row's key before the position for the coupling noise: its stream
is apart from every (tokens generated, stream) pair the other keys fold in."""

RESIDUAL_EPS = 1e-6
"""If the residual mass sum((p - q)^+) is below this, p == q up to float error
and the (then ~impossible) rejection falls back to sampling from p."""


# --------------------------------------------------------------------------
# Per-row parameters
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RowSampling:
    """Per-row sampling parameters (a pytree; all fields are arrays, no statics).

    Shapes (B = batch rows):
      temperature [B] f32   0 => greedy row
      top_k       [B] i32   0 => off
      top_p       [B] f32   1 => off
      min_p       [B] f32   0 => off
      key         [B, 2] u32 raw threefry2x32 key data (the row's base key)
      one_hot     [B] bool  True => one-hot ("vLLM") acceptance
      coupled     [B] bool  True => coupled acceptance (a seed fixes the output)
    """

    temperature: Array
    top_k: Array
    top_p: Array
    min_p: Array
    key: Array
    one_hot: Array
    coupled: Array

    @property
    def greedy(self) -> Array:  # [B] bool
        return self.temperature == 0

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]


jax.tree_util.register_dataclass(
    RowSampling,
    data_fields=["temperature", "top_k", "top_p", "min_p", "key", "one_hot", "coupled"],
    meta_fields=[],
)

SamplingState = RowSampling  # alias


def seed_to_key_data(seed: int) -> np.ndarray:
    """Raw threefry2x32 key data [2] u32 for a non-negative integer seed.

    Equals ``jax.random.key_data(jax.random.key(seed))`` for seed < 2**32 (and
    uses the high 32 bits too for larger seeds, without needing jax_enable_x64).
    """
    seed = int(seed)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


def row_sampling_from_params(
    params: Sequence[SamplingParams],
    seeds: Sequence[int | None] | None = None,
    *,
    rng: np.random.Generator | None = None,
    tree: bool = False,
) -> RowSampling:
    """Host helper: a list of `SamplingParams` -> `RowSampling` of numpy arrays.

    The row seed is ``params[i].seed`` if set, else ``seeds[i]`` if given and not
    None, else a fresh random seed from ``rng`` (default: OS entropy).
    Returns numpy arrays (``jax.device_put`` it / pass it to a jitted function).
    ``tree``: the engine drafts a tree (`SamplingParams.acceptance_rule`).
    """
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
    rules = [sp.acceptance_rule(tree) for sp in params]
    return RowSampling(
        temperature=np.array([sp.temperature for sp in params], np.float32).reshape(n),
        top_k=np.array([sp.top_k for sp in params], np.int32).reshape(n),
        top_p=np.array([sp.top_p for sp in params], np.float32).reshape(n),
        min_p=np.array([sp.min_p for sp in params], np.float32).reshape(n),
        key=keys,
        one_hot=np.array([rule == "one_hot" for rule in rules], bool).reshape(n),
        coupled=np.array([rule == "coupled" and not sp.greedy for rule, sp in zip(rules, params)], bool).reshape(n),
    )


# --------------------------------------------------------------------------
# PRNG helpers
# --------------------------------------------------------------------------
def _as_key(key) -> Array:
    """Typed PRNG key from a typed key or raw threefry key data [..., 2] u32."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key.astype(jnp.uint32), impl=KEY_IMPL)


def fold_in_rows(keys: Array, data) -> Array:
    """Per-row ``fold_in``: keys [B, 2] u32, data [B] or scalar int -> [B, 2] u32.

    Use it to derive fresh, batch-independent keys for every decode step and
    to separate streams, e.g.::

        step_key   = fold_in_rows(row.key, num_generated)   # [B, 2]
        draft_key  = fold_in_rows(step_key, 0)              # draft sampling
        verify_key = fold_in_rows(step_key, 1)              # verify_chain
    """
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
    """A bijective mixer of uint32 words (the "lowbias32" hash finalizer): every output bit
    depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def coupling_noise(keys: Array, index: Array, vocab_size: int) -> Array:
    """The Gumbel noise of the coupled rule: keys [B, 2] u32 (the rows' base keys), index [B, ...]
    i32 absolute token positions -> [B, ..., V] f32, noise of the token at index[b, ...] of row b:
    a function of the row's key and the position alone, so a draft step and the verify that
    checks its proposal (and a target-only step at the same position) draw the same noise.

    One threefry fold per (row, position) gives the position's two key words; each token's
    uniform is then a counter-based hash of them and the token id (two rounds of `_mix32`, 24
    bits). Why not threefry per token: the noise spans the whole vocabulary at every verified
    position, and threefry's rounds made it cost 14.6 ms of a SmolLM2 iteration of 8 rows x 4
    positions on a 2-core CPU, against about a tenth of that hashed."""
    keys = fold_in_rows(keys, COUPLING_TAG)
    index = jnp.asarray(index, jnp.int32)
    flat = index.reshape(index.shape[0], -1)  # [B, N]

    def position_key(key, i):  # [2] u32
        return jax.random.key_data(jax.random.fold_in(_as_key(key), i))

    words = jax.vmap(lambda k, row: jax.vmap(lambda i: position_key(k, i))(row))(keys, flat)  # [B, N, 2]
    token = jnp.arange(vocab_size, dtype=jnp.uint32)
    bits = _mix32(_mix32(words[..., :1] ^ (token * jnp.uint32(0x9E3779B9))) + words[..., 1:])  # [B, N, V]
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1)
    return (-jnp.log(-jnp.log(u))).reshape(*index.shape, vocab_size)


def perturbed_log_probs(probs: Array, noise: Array) -> Array:
    """log probs + noise [..., V], -inf where probs is 0: its argmax is the coupled draw from probs
    (Gumbel-max), and its top-k are k draws without replacement (Gumbel-top-k)."""
    return jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) + noise, -jnp.inf)


def coupled_ids(probs: Array, noise: Array) -> Array:
    """The coupled draw: probs, noise [..., V] -> argmax of `perturbed_log_probs` [...] i32."""
    return jnp.argmax(perturbed_log_probs(probs, noise), axis=-1).astype(jnp.int32)


# --------------------------------------------------------------------------
# Filtering
# --------------------------------------------------------------------------
def _topk_topp_threshold(x: Array, top_k: Array, top_p: Array) -> Array:
    """Logit threshold implementing top-k then top-p.

    x [..., V] f32 (temperature-scaled logits), top_k [..., 1] i32,
    top_p [..., 1] f32  ->  thr [..., 1] f32; keep tokens with x >= thr.
    One descending sort of the values per row (no argsort needed).
    """
    V = x.shape[-1]
    s = jnp.sort(x, axis=-1, descending=True)  # [..., V]
    k_eff = jnp.where((top_k > 0) & (top_k < V), top_k, V)  # [..., 1]
    thr_k = jnp.take_along_axis(s, k_eff - 1, axis=-1)  # [..., 1]
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
    """Filtered, renormalised sampling distribution.

    Args:
      logits:      [..., V] (any float dtype; computed in f32)
      temperature: broadcastable to [...] f32; 0 => greedy row
      top_k:       broadcastable to [...] i32; 0 (or >= V) => off
      top_p:       broadcastable to [...] f32; >= 1 => off
      min_p:       broadcastable to [...] f32; 0 => off
    Returns:
      probs [..., V] f32.  Greedy rows: one-hot of ``argmax(logits)`` (first
      index on ties).  Other rows: softmax(logits / T) restricted to the tokens
      surviving, in this order, top-k (the k largest; all tokens tied with the
      k-th largest value are kept), top-p (the smallest prefix of the sorted
      distribution -- renormalised after top-k -- whose mass is >= top_p; the
      top token is always kept; tokens tied with the last kept one are kept
      too) and min-p (p >= min_p * p_max, which is invariant to the
      renormalisations), renormalised.

    Cost: one descending value sort per row, and only if some non-greedy row
    uses top-k or top-p (``lax.cond``); otherwise just a masked softmax.
    """
    logits = jnp.asarray(logits, jnp.float32)
    V = logits.shape[-1]
    lead = logits.shape[:-1]

    def bc(a, dtype):  # -> [..., 1]
        return jnp.broadcast_to(jnp.asarray(a, dtype), lead)[..., None]

    t = bc(temperature, jnp.float32)
    k = bc(top_k, jnp.int32)
    tp = bc(top_p, jnp.float32)
    mp = bc(min_p, jnp.float32)

    greedy = t == 0  # [..., 1]
    x = logits / jnp.where(greedy, 1.0, t)  # [..., V]
    x_max = jnp.max(x, axis=-1, keepdims=True)  # [..., 1]

    need_sort = jnp.any(~greedy & (((k > 0) & (k < V)) | (tp < 1.0)))
    neg_inf = jnp.full(lead + (1,), -jnp.inf, jnp.float32)
    thr_kp = lax.cond(need_sort, _topk_topp_threshold, lambda *_: neg_inf, x, k, tp)
    thr_m = jnp.where(mp > 0, x_max + jnp.log(jnp.where(mp > 0, mp, 1.0)), -jnp.inf)
    thr = jnp.maximum(thr_kp, thr_m)  # [..., 1]; <= x_max, so the max is kept

    e = jnp.where(x >= thr, jnp.exp(x - x_max), 0.0)
    probs = e / jnp.sum(e, axis=-1, keepdims=True)

    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    return jnp.where(greedy, onehot, probs)


# --------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------
def sample_from_uniform(probs: Array, u: Array) -> Array:
    """Inverse-CDF draw.  probs [..., V] >= 0 (need not be normalised),
    u [...] uniform in [0, 1)  ->  token [...] i32.

    Tokens with probability exactly 0 are never returned (the index is chosen
    among ``probs > 0`` only, robust to cumsum rounding).
    """
    probs = jnp.asarray(probs, jnp.float32)
    V = probs.shape[-1]
    cdf = jnp.cumsum(probs, axis=-1)  # [..., V]
    r = u[..., None] * cdf[..., -1:]  # [..., 1]
    pos = probs > 0
    cand = (cdf > r) & pos
    first = jnp.argmax(cand, axis=-1)
    last_pos = V - 1 - jnp.argmax(jnp.flip(pos, axis=-1), axis=-1)  # rounding fallback
    return jnp.where(jnp.any(cand, axis=-1), first, last_pos).astype(jnp.int32)


def sample(probs: Array, key) -> Array:
    """Categorical draw(s).  probs [..., V]; key: ONE PRNG key (typed, or raw
    [2] u32)  ->  token [...] i32.  Zero-probability tokens are never drawn.

    All rows share ``key``; for batch-independent per-row randomness use
    `sample_rows`.
    """
    u = jax.random.uniform(_as_key(key), probs.shape[:-1], jnp.float32)
    return sample_from_uniform(probs, u)


def sample_rows(probs: Array, keys: Array) -> Array:
    """Per-row categorical.  probs [B, V], keys [B, 2] u32 -> token [B] i32."""
    u = jax.vmap(lambda k: jax.random.uniform(_as_key(k), (), jnp.float32))(
        jnp.asarray(keys, jnp.uint32)
    )
    return sample_from_uniform(probs, u)


def sample_logits(logits: Array, params: RowSampling, keys: Array | None = None,
                  noise: Array | None = None) -> Array:
    """Target-only token choice (e.g. the first token after prefill).

    logits [B, V], params fields [B], keys [B, 2] u32 (default params.key), noise [B, V]: the
    coupling noise at the token's position (`coupling_noise`; None: no row is coupled)
    -> token [B] i32.  Greedy rows: exactly ``argmax(logits)``; coupled rows: the coupled draw.
    """
    keys = params.key if keys is None else keys
    probs = filtered_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    tok = sample_rows(probs, keys)
    if noise is not None:
        tok = jnp.where(params.coupled, coupled_ids(probs, noise), tok)
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jnp.where(params.greedy, greedy_tok, tok)


# --------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------
def _leading_accepts(accept: Array) -> Array:
    """accept [B, K] bool -> number of leading Trues [B] i32 (0..K)."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def assemble_emitted(draft_tokens: Array, num_accepted: Array, last_token: Array) -> Array:
    """draft [B, K], n [B], last [B] -> emitted [B, K+1] (drafts, last, PAD)."""
    B, K = draft_tokens.shape
    pos = lax.broadcasted_iota(jnp.int32, (B, K + 1), 1)
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
    n = num_accepted[:, None]
    return jnp.where(pos < n, drafts, jnp.where(pos == n, last_token[:, None], PAD_TOKEN))


def greedy_verify(target_logits: Array, draft_tokens: Array, valid: Array | None = None) -> tuple[Array, Array]:
    """Exact greedy chain verification.

    target_logits [B, K+1, V], draft_tokens [B, K] i32, valid [B] bool (None: all): rows whose
    proposals are not to be verified accept none
    -> (num_accepted [B] i32 in 0..K, emitted [B, K+1] i32, PAD_TOKEN-padded).
    """
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    K = draft_tokens.shape[1]
    g = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
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
    """Lossless chain speculative sampling step (vectorised over the chain).

    Args:
      target_logits: [B, K+1, V] target logits at the K drafted positions plus
        the bonus position (position i scores the token following prefix +
        d_0..d_{i-1}).  Raw logits: filtering happens here.
      draft_tokens:  [B, K] i32, d_i ~ q_i (exactly).
      draft_probs:   [B, K, V] q_i in the *target* vocabulary (the exact
        distribution d_i was drawn from; need not be normalised perfectly), or
        None => every sampled row uses one-hot acceptance.  Ignored for greedy
        and one-hot rows.
      params:        RowSampling with [B] fields.
      keys:          [B, 2] u32 per-row keys for THIS step (default
        params.key -- the caller must pass fresh keys each step, e.g.
        ``fold_in_rows(params.key, step)``, independent of the draft's keys).
      noise:         [B, K+1, V] the coupling noise at the positions the K+1
        logits choose tokens for (`coupling_noise`), or None: no row is coupled.
      valid:         [B] bool, or None (all): a row whose proposals are not to be
        verified (drafted by another speculator) accepts none and draws its
        token from p itself, as the target alone does.
    Returns:
      num_accepted [B] i32 in 0..K,
      emitted [B, K+1] i32: emitted[:, :n] = accepted drafts, emitted[:, n] =
        correction / bonus token, emitted[:, n+1:] = PAD_TOKEN (-1).
    Rows: greedy (temperature 0) -> exact argmax matching; one_hot -> accept
    with prob p_i(d_i), reject -> norm(p_i with d_i zeroed); otherwise accept
    with prob min(1, p_i(d_i)/q_i(d_i)), reject -> norm((p_i - q_i)^+)
    (falls back to p_i if that mass < RESIDUAL_EPS).  Bonus ~ p_K.  Coupled
    rows -> greedy verification of the perturbed logits (module docstring).
    """
    target_logits = jnp.asarray(target_logits, jnp.float32)
    draft_tokens = jnp.asarray(draft_tokens, jnp.int32)
    B, K1, V = target_logits.shape
    K = K1 - 1
    assert draft_tokens.shape == (B, K), (draft_tokens.shape, (B, K))
    keys = params.key if keys is None else keys

    greedy = params.greedy  # [B]
    one_hot = jnp.asarray(params.one_hot, bool)
    if draft_probs is None:
        one_hot = jnp.ones_like(one_hot)
    else:
        draft_probs = jnp.asarray(draft_probs, jnp.float32)
        assert draft_probs.shape == (B, K, V), (draft_probs.shape, (B, K, V))

    col = lambda a: jnp.asarray(a)[:, None]  # [B] -> [B, 1] broadcast over chain
    p = filtered_probs(
        target_logits, col(params.temperature), col(params.top_k), col(params.top_p), col(params.min_p)
    )  # [B, K+1, V]

    u_acc, u_samp = row_uniforms(keys, K)  # [B, K], [B]

    # --- acceptance decisions for all K positions at once
    if K > 0:
        p_d = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]  # [B, K]
        if draft_probs is None:
            q_d = jnp.ones_like(p_d)
        else:
            q_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
            q_d = jnp.where(col(one_hot), 1.0, q_d)
        # u < p/q  <=>  u*q < p  (q == 0: accept iff p > 0; p == 0: never)
        accept = u_acc * q_d < p_d  # [B, K]
        if valid is not None:
            accept = accept & jnp.asarray(valid)[:, None]
        n = _leading_accepts(accept)  # [B]
    else:
        n = jnp.zeros((B,), jnp.int32)

    # --- residual distribution at the stopping position n
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    if K > 0:
        n_c = jnp.minimum(n, K - 1)
        d_n = jnp.take_along_axis(draft_tokens, n_c[:, None], axis=1)  # [B, 1]
        q_onehot = (lax.broadcasted_iota(jnp.int32, (B, V), 1) == d_n).astype(jnp.float32)
        if draft_probs is None:
            q_n = q_onehot
        else:
            q_n = jnp.take_along_axis(draft_probs, n_c[:, None, None], axis=1)[:, 0]  # [B, V]
            q_n = jnp.where(col(one_hot), q_onehot, q_n)
        q_n = jnp.where(col(n == K), 0.0, q_n)  # bonus: sample from p_K
        if valid is not None:  # nothing was tried: sample from p itself
            q_n = jnp.where(col(jnp.asarray(valid)), q_n, 0.0)
        resid = jnp.maximum(p_n - q_n, 0.0)
        resid = jnp.where(jnp.sum(resid, -1, keepdims=True) >= RESIDUAL_EPS, resid, p_n)
    else:
        resid = p_n
    tok = sample_from_uniform(resid, u_samp)  # [B]

    emitted = assemble_emitted(draft_tokens, n, tok)
    if noise is not None:  # coupled rows: accept what equals the target's own coupled draw
        c_n, c_emitted = greedy_verify(perturbed_log_probs(p, noise), draft_tokens, valid)
        coupled = jnp.asarray(params.coupled, bool)
        n, emitted = jnp.where(coupled, c_n, n), jnp.where(col(coupled), c_emitted, emitted)

    # --- greedy rows: exact argmax path
    g_n, g_emitted = greedy_verify(target_logits, draft_tokens, valid)
    return jnp.where(greedy, g_n, n), jnp.where(col(greedy), g_emitted, emitted)
