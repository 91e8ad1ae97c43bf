"""Weight projections of few rows (decode, verify, draft steps) as one Pallas Mosaic GPU kernel each,
for Hopper. Opt-in (EngineConfig.gemv): slower than XLA's dots in whole steps, mostly for lack of
programmatic dependent launch in jax's runtime (BENCHMARKS.md, "Tried and rejected").

A grid of (N / tile_n column tiles, S splits of K), each pipelining its K range through shared memory
by TMA into wgmma. W is wgmma's 64-row operand and x the narrow one (out^T += W^T x^T), so one row pads
to 8 columns, not 64. Batch-invariant: the tiling depends on the weight's shape only, and the S f32
partials are summed in order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_ROWS = 64  # wgmma's narrow side
_SMEM_BUDGET = 192 * 1024  # pipeline stages per program: with the output tile, under 227 KB
_PROGRAMS = 264  # split K up to about two programs per multiprocessor (132)


@dataclasses.dataclass(frozen=True)
class Tiling:
    tile_n: int  # output columns per program: wgmma's M, a multiple of 64
    tile_k: int  # K per pipeline step: 64 or 128 (one or two 128-byte swizzle spans of bf16)
    splits: int
    stages: int


def supports(rows: int, k: int, n: int, dtype) -> bool:
    return 0 < rows <= MAX_ROWS and k % 64 == 0 and n % 64 == 0 and jnp.dtype(dtype) == jnp.bfloat16


def tiling(k: int, n: int) -> Tiling:
    """The tiles of a [k, n] weight, from its shape only; tuned on Llama-3.1-8B's projections."""
    tile_k = 128 if k % 128 == 0 else 64
    tile_n = 128 if n % 128 == 0 and n // 128 >= 200 else 64
    tiles = n // tile_n
    splits = max(s for s in (1, 2, 3, 4) if k % (s * tile_k) == 0 and (s == 1 or tiles * s <= _PROGRAMS))
    stage_bytes = (tile_k * tile_n + MAX_ROWS * tile_k) * 2
    stages = max(2, min(4, k // splits // tile_k, _SMEM_BUDGET // stage_bytes))
    return Tiling(tile_n, tile_k, splits, stages)


def partials(x: jax.Array, w: jax.Array, t: Tiling) -> jax.Array:
    """x [M, K], w [K, N] -> transposed partials [S, N, Mp] f32, Mp = M rounded up to 8. Up to 8 rows
    the TMA copies fill zeros; past 8 Mosaic takes only whole 8-row tiles, so x is padded."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    mp = -(-m // 8) * 8
    if m > 8 and m != mp:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))
    n = w.shape[1]
    steps = k // t.splits // t.tile_k
    # Both operands' minor dimension is cut into 64-element (128-byte) swizzled tiles, as wgmma reads them.
    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def body(x_gmem, w_gmem, out_gmem, out_smem, acc):
        j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")

        def step(_, x_smem, w_smem):  # x_smem [Mp, tile_k], w_smem [tile_k, tile_n]
            plgpu.wgmma(acc, w_smem.transpose((1, 0)), x_smem.transpose((1, 0)))
            plgpu.wgmma_wait(1)  # one wgmma stays in flight; delay_release keeps its tiles alive

        plgpu.emit_pipeline(
            step, grid=(steps,),
            in_specs=[plgpu.BlockSpec((mp, t.tile_k), lambda i: (0, s * steps + i), transforms=tiles,
                                      delay_release=1),
                      plgpu.BlockSpec((t.tile_k, t.tile_n), lambda i: (s * steps + i, j), transforms=tiles,
                                      delay_release=1)],
            max_concurrent_steps=t.stages)(x_gmem, w_gmem)
        plgpu.wgmma_wait(0)
        out_smem[...] = acc[...]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[s, pl.ds(j * t.tile_n, t.tile_n)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((t.splits, n, mp), jnp.float32),
        scratch_types={"out_smem": plgpu.SMEM((t.tile_n, mp), jnp.float32),
                       "acc": plgpu.ACC((t.tile_n, mp), jnp.float32)},
        grid=(n // t.tile_n, t.splits), grid_names=("n", "s"), kernel_name="eagle3_gemv")(x, w)


@functools.partial(jax.jit, static_argnames="out_dtype")
def project(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x [..., K] @ w [K, *out] -> [..., *out], f32 accumulation; the caller checks `supports`."""
    lead, k = x.shape[:-1], x.shape[-1]
    out_shape = w.shape[1:]
    rows, n = math.prod(lead), math.prod(out_shape)
    parts = partials(x.reshape(rows, k), w.reshape(k, n), tiling(k, n))
    # Split by split, in order: a reduce's order changed with Mp.
    y = functools.reduce(jnp.add, list(parts)).T[:rows]
    return y.astype(out_dtype or x.dtype).reshape(*lead, *out_shape)
