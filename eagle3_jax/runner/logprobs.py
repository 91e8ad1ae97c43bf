"""The target's log-probabilities of the tokens a step scores, and the most likely tokens beside each,
packed into int32 rows the host reads with the step's verdicts (vLLM's "raw" logprobs: the
log-softmax of the logits, before temperature, top-k, top-p or min-p).

A row of `fields(V)` int32 per token: [its logprob (f32 bits), its rank (1: the likeliest; ties
count as ahead), the `top_n(V)` likeliest ids, their logprobs (f32 bits)]. N is MAX_LOGPROBS (the
most a request may ask for) or the whole vocabulary if smaller; the host keeps what was asked.
Batch-invariant programs rank and normalize each row in model/pallas_top_k.py's kernel, a program
per row, so a token's values do not depend on the rows beside it or the program that scored it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.model import pallas_top_k
from eagle3_jax.runner.tree import vocab_top_k
from eagle3_jax.sampling_params import MAX_LOGPROBS


def top_n(vocab_size: int) -> int:
    """The likeliest tokens listed beside each scored one."""
    return min(MAX_LOGPROBS, vocab_size)


def fields(vocab_size: int) -> int:
    """int32 per scored token in a packed row."""
    return 2 + 2 * top_n(vocab_size)


def token_logprobs(logits: jax.Array, tokens: jax.Array, invariant: bool = False) -> jax.Array:
    """logits [..., V] f32, tokens [...] -> packed rows [..., fields(V)] int32 (the module docstring)."""
    n = top_n(logits.shape[-1])
    token_logit = jnp.take_along_axis(logits, tokens[..., None], axis=-1)  # [..., 1]
    rank = jnp.sum(logits >= token_logit, axis=-1, dtype=jnp.int32)
    if invariant:
        values, ids, lse = pallas_top_k.top_k(logits, n)
        top, token = values - lse[..., None], token_logit[..., 0] - lse
    else:
        logp = jax.nn.log_softmax(logits, axis=-1)
        top, ids = vocab_top_k(logp, n)
        token = jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]
    bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([bits(token)[..., None], rank[..., None], ids.astype(jnp.int32), bits(top)], axis=-1)


def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Packed rows [..., F] (host) -> (logprob [...] f32, rank [...] i32, top ids [..., N] i32,
    top logprobs [..., N] f32), the top best first."""
    packed = np.asarray(packed, np.int32)
    n = (packed.shape[-1] - 2) // 2
    return (packed[..., 0].view(np.float32), packed[..., 1], packed[..., 2:2 + n],
            packed[..., 2 + n:].view(np.float32))
