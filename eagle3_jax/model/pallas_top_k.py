"""The k largest entries of each row of a vocabulary-sized array, and the row's logsumexp, as two
Pallas (Triton) kernels: what a draft tree level needs of the draft's logits, where XLA compiles
about fourteen small kernels (BENCHMARKS.md, "Llama-3.1-8B step functions"). Stage 1, a program per
(row, CHUNK entries): the chunk's top k by k passes of max, its max and sum of exp(x - max); stage 2,
a program per row, merges the chunks' candidates and (max, sum) pairs. Ties and -inf as lax.top_k's;
`values - lse` equals jax.nn.log_softmax's entries up to f32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

CHUNK = 2048  # 8 programs a row of SmolLM2's 16,384-token draft vocabulary
_NO_INDEX = jnp.iinfo(jnp.int32).max  # a slot with no candidate left


def _top_k_passes(x, index, alive, k: int, lanes: int):
    """x, index, alive [N] -> (values, indices) [lanes]: the top k first, then -inf and _NO_INDEX."""
    slot = jnp.arange(lanes)
    values = jnp.full((lanes,), -jnp.inf, jnp.float32)
    indices = jnp.full((lanes,), _NO_INDEX, jnp.int32)
    for r in range(k):
        best = jnp.max(jnp.where(alive, x, -jnp.inf))
        at = jnp.min(jnp.where(alive & (x == best), index, _NO_INDEX))
        values = jnp.where(slot == r, best, values)
        indices = jnp.where(slot == r, at, indices)
        alive = alive & (index != at)
    return values, indices


def _chunk_kernel(x_ref, values_ref, indices_ref, max_ref, sum_ref, *, k: int, chunk: int, vocab: int):
    # x_ref [V] one row; out: values/indices [K] (k padded to a power of two), max/sum [1].
    cols = pl.program_id(1) * chunk + jnp.arange(chunk)
    valid = cols < vocab
    x = plgpu.load(x_ref.at[cols], mask=valid, other=-jnp.inf)
    values_ref[...], indices_ref[...] = _top_k_passes(x, cols, valid, k, values_ref.shape[0])
    row_max = jnp.max(x)
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)  # a chunk of -inf only: its sum is 0
    max_ref[...] = jnp.full((1,), row_max, jnp.float32)
    sum_ref[...] = jnp.full((1,), jnp.sum(jnp.exp(x - shift)), jnp.float32)


def _merge_kernel(values_ref, indices_ref, max_ref, sum_ref, out_values_ref, out_indices_ref, lse_ref, *,
                  k: int, candidates: int, splits: int):
    # values/indices_ref [S*K] the chunks' candidates, max/sum_ref [S]; out: [K], [K], lse [1].
    cols = jnp.arange(pl.next_power_of_2(candidates))
    valid = cols < candidates
    x = plgpu.load(values_ref.at[cols], mask=valid, other=-jnp.inf)
    index = plgpu.load(indices_ref.at[cols], mask=valid, other=_NO_INDEX)
    out_values_ref[...], out_indices_ref[...] = _top_k_passes(x, index, valid, k, out_values_ref.shape[0])
    parts = jnp.arange(pl.next_power_of_2(splits))
    part_max = plgpu.load(max_ref.at[parts], mask=parts < splits, other=-jnp.inf)
    part_sum = plgpu.load(sum_ref.at[parts], mask=parts < splits, other=0.0)
    row_max = jnp.max(part_max)
    shift = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    lse_ref[...] = jnp.full((1,), shift + jnp.log(jnp.sum(part_sum * jnp.exp(part_max - shift))), jnp.float32)


@functools.partial(jax.jit, static_argnames="k")
def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [..., V] -> (values [..., k] f32, indices [..., k] i32, logsumexp(x) [...] f32). Its own
    jit, so that a tree's levels of one shape lower the kernels once."""
    lead, vocab = x.shape[:-1], x.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"top_k: k = {k} outside 1..{vocab}, the row's length")
    rows = x.reshape(-1, vocab).astype(jnp.float32)
    n = rows.shape[0]
    chunk = min(CHUNK, pl.next_power_of_2(vocab))
    splits, lanes = pl.cdiv(vocab, chunk), pl.next_power_of_2(k)
    interpret = _interpret()
    f32, i32 = jnp.float32, jnp.int32
    part = pl.BlockSpec((None, None, lanes), lambda i, j: (i, j, 0))
    scalar = pl.BlockSpec((None, None, 1), lambda i, j: (i, j, 0))
    values, indices, part_max, part_sum = pl.pallas_call(
        functools.partial(_chunk_kernel, k=k, chunk=chunk, vocab=vocab),
        grid=(n, splits),
        in_specs=[pl.BlockSpec((None, vocab), lambda i, j: (i, 0))],
        out_specs=[part, part, scalar, scalar],
        out_shape=[jax.ShapeDtypeStruct((n, splits, lanes), f32), jax.ShapeDtypeStruct((n, splits, lanes), i32),
                   jax.ShapeDtypeStruct((n, splits, 1), f32), jax.ShapeDtypeStruct((n, splits, 1), f32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="eagle3_top_k_chunks",
    )(rows)
    if splits == 1:  # a short row (a level's k^2 scores): its chunk's top k are the row's
        lse = part_max[:, 0, 0] + jnp.log(part_sum[:, 0, 0])
        return values[:, 0, :k].reshape(*lead, k), indices[:, 0, :k].reshape(*lead, k), lse.reshape(lead)
    candidates = splits * lanes
    row = lambda width: pl.BlockSpec((None, width), lambda i: (i, 0))
    top_values, top_indices, lse = pl.pallas_call(
        functools.partial(_merge_kernel, k=k, candidates=candidates, splits=splits),
        grid=(n,),
        in_specs=[row(candidates), row(candidates), row(splits), row(splits)],
        out_specs=[row(lanes), row(lanes), row(1)],
        out_shape=[jax.ShapeDtypeStruct((n, lanes), f32), jax.ShapeDtypeStruct((n, lanes), i32),
                   jax.ShapeDtypeStruct((n, 1), f32)],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="eagle3_top_k_merge",
    )(values.reshape(n, candidates), indices.reshape(n, candidates), part_max.reshape(n, splits),
      part_sum.reshape(n, splits))
    return (top_values[:, :k].reshape(*lead, k), top_indices[:, :k].reshape(*lead, k), lse.reshape(lead))


def _interpret() -> bool:
    return jax.default_backend() != "gpu"
