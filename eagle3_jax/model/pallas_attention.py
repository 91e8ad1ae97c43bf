"""Paged GQA attention for decode and verify steps as one Pallas (Triton) kernel.

Why a kernel of our own: the XLA form (`layers.paged_attention`) gathers every row's whole block
table (max_model_len positions), masks it and runs softmax as separate fusions, about a dozen
kernels per layer. A SmolLM2 iteration is bound by its kernel count (~780 kernels, ~2 us each on
the H200; BENCHMARKS.md, fourth session), and an 8B verify reads the full-length cache where only
the valid part is needed. This kernel reads only the pages a row has filled and does the whole
attention in one launch per layer (online softmax over blocks of pages, as flash-decoding).

Layout (as `layers.paged_attention`): q [B, T, G*R, hd] (G kv heads, R q heads per kv head, HF
head order), pages [P, page, G, hd], positions [B, T] contiguous per row (the T new tokens),
block_table [B, nb]. One program per (row, kv head): its T*R queries form the M rows of the
tile (padded to a power of two, at least 16 for the tensor cores); query row m = t*R + r is
query head g*R + r of token t and sees cached positions <= positions[b, t].

Only for steps with few new tokens per row (T*R <= MAX_QUERY_ROWS): decode, verify, draft steps
and the smallest prefill chunks; larger chunks keep the XLA form. Off the GPU the kernel runs in
Pallas' interpreter (tests).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_QUERY_ROWS = 64  # T*R per (row, kv head) tile; larger steps use the XLA form
_MASKED = -1e30  # finite: a padded query row sees nothing and must not produce NaN


def supports(num_tokens: int, heads: int, kv_heads: int, page_size: int) -> bool:
    """Whether a step of `num_tokens` new tokens per row fits the kernel."""
    rows = num_tokens * (heads // kv_heads)
    return rows <= MAX_QUERY_ROWS and page_size >= 16 and page_size & (page_size - 1) == 0


def _kernel(q_ref, qpos_ref, table_ref, k_ref, v_ref, o_ref, *, pages_per_block: int, scale: float):
    # q_ref [M, hd]; qpos_ref [M] i32 (-1: padding row); table_ref [nb] i32;
    # k_ref, v_ref [P, page, hd] (this program's kv head); o_ref [M, hd].
    m, hd = q_ref.shape
    block_k = pages_per_block * k_ref.shape[1]
    q = q_ref[...]
    qpos = qpos_ref[...]
    num_blocks = jnp.max(qpos) // block_k + 1  # blocks holding positions 0..max(qpos)

    def body(i, carry):
        o, row_max, row_sum = carry
        pages = table_ref[pl.ds(i * pages_per_block, pages_per_block)]  # [ppb]
        k = k_ref[pages].reshape(block_k, hd)
        v = v_ref[pages].reshape(block_k, hd)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        key_pos = i * block_k + jax.lax.broadcasted_iota(jnp.int32, (m, block_k), 1)
        s = jnp.where(key_pos <= qpos[:, None], s, _MASKED)  # [M, block_k]
        new_max = jnp.maximum(row_max, s.max(axis=1))
        correction = jnp.exp(row_max - new_max)
        p = jnp.exp(s - new_max[:, None])
        row_sum = row_sum * correction + p.sum(axis=1)
        o = o * correction[:, None] + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return o, new_max, row_sum

    init = (jnp.zeros((m, hd), jnp.float32), jnp.full((m,), _MASKED, jnp.float32), jnp.zeros((m,), jnp.float32))
    o, _, row_sum = jax.lax.fori_loop(0, num_blocks, body, init)
    o_ref[...] = (o / jnp.maximum(row_sum, 1e-30)[:, None]).astype(o_ref.dtype)


def _pages_per_block(num_blocks: int, page_size: int) -> int:
    """Pages per loop step: up to 64 keys, and a divisor of the table width (no read past it)."""
    ppb = max(1, 64 // page_size)
    while num_blocks % ppb:
        ppb //= 2
    return ppb


@functools.partial(jax.jit, static_argnames=("num_warps",))
def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, positions: jax.Array,
                    block_table: jax.Array, num_warps: int = 4) -> jax.Array:
    """Same contract as `layers.paged_attention`: q [B, T, H, hd], k/v_pages [P, page, G, hd]
    (already holding this step's keys), positions [B, T], block_table [B, nb] -> [B, T, H, hd]."""
    b, t, h, hd = q.shape
    num_pages, page_size, g, _ = k_pages.shape
    r = h // g
    rows = t * r
    m = max(16, 1 << (rows - 1).bit_length())  # tile rows: a power of two >= 16
    # [B, T, G, R, hd] -> [B, G, T*R, hd], padded to M rows; each query row's position.
    qg = q.reshape(b, t, g, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, g, rows, hd)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, m - rows), (0, 0)))
    qpos = jnp.pad(jnp.repeat(positions.astype(jnp.int32), r, axis=1), ((0, 0), (0, m - rows)), constant_values=-1)
    nb = block_table.shape[1]
    kernel = functools.partial(_kernel, pages_per_block=_pages_per_block(nb, page_size), scale=1.0 / math.sqrt(hd))
    pages_spec = pl.BlockSpec((num_pages, page_size, None, hd), lambda i, j: (0, 0, j, 0))
    out = pl.pallas_call(
        kernel,
        grid=(b, g),
        in_specs=[
            pl.BlockSpec((None, None, m, hd), lambda i, j: (i, j, 0, 0)),  # q
            pl.BlockSpec((None, m), lambda i, j: (i, 0)),  # query positions
            pl.BlockSpec((None, nb), lambda i, j: (i, 0)),  # block table row
            pages_spec,  # k pages of kv head j
            pages_spec,  # v pages of kv head j
        ],
        out_specs=pl.BlockSpec((None, None, m, hd), lambda i, j: (i, j, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, g, m, hd), q.dtype),
        interpret=jax.default_backend() != "gpu",
        compiler_params=_compiler_params(num_warps),
        name="eagle3_paged_attention",
    )(qg, qpos, block_table.astype(jnp.int32), k_pages, v_pages)
    # [B, G, M, hd] -> [B, T, G*R, hd]
    return out[:, :, :rows].reshape(b, g, t, r, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd)


def _compiler_params(num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=2)
