"""Weight projections of few rows (decode, verify and draft steps) as one Pallas Mosaic GPU kernel
each, for Hopper GPUs.

Why: at a few rows a projection is a matrix-vector product that only has to stream its weight
from HBM once, and a kernel of our own can take in the small kernels around it (the RMSNorm's
scale, the SwiGLU, the residual add), which cost a Llama-3.1-8B decode about 0.5 ms on the H200.
This is the first step: the product alone. Where it stands (H200; BENCHMARKS.md, "Tried and
rejected"): in a chain of lone GEMVs it beat `jnp.dot` (o 13.8 against 16.1 us, gate_up 60.8
against 62.0; `experiments/gemv_probe.py --kernel mosaic`), but in the 8B forward its 129 kernels
took 3,749 us where XLA's GEMMs take about 3,655, and every step was 4-5% slower. Most of that
gap (0.13 of 0.22 ms a decode) is programmatic dependent launch: XLA launches its own kernels
with it and this one without, as jax 0.11.2's runtime does not act on the mark
`griddepcontrol_wait` leaves. Once it does, the weight copies (which depend on no earlier kernel)
can also start before the wait for x. On SmolLM2 with the drafter, EAGLE-3
at batch 1 gave 1,642 tok/s against 2,142 with XLA's dots, the host's time per step up from 0.98
to 1.30 ms. Hence opt-in (EngineConfig.gemv).

The kernel: a grid of (N / tile_n column tiles, S splits of K). Program (j, s) pipelines its K range
through shared memory in tile_k steps with TMA copies, `stages` in flight, and multiplies on the
tensor cores with wgmma. The weight tile is wgmma's 64-row operand (read transposed from shared
memory) and x the narrow one, so the product comes out transposed:
    out^T [tile_n, Mp] += W^T [tile_n, tile_k] @ x^T [tile_k, Mp]
and a batch of one pads to 8 columns (zeros the TMA copies fill in), where x on the left would
pad to 64 rows. Each program writes its f32 partial [tile_n, Mp]; XLA sums the S partials and
transposes back, one small kernel, as XLA's own split-K does.

Numerics: f32 accumulation of bf16 products, rounded once to the output dtype. The tiling depends
only on the weight's shape (`tiling`), never on the number of rows, and the partials are summed
split by split in order (XLA's reduce over them was not batch-invariant), so a row comes out bit
for bit the same whatever rows share its call: on six shapes on the H200, rows 1, 3, 8 and 32
alone against a 64-row call (`experiments/gemv_probe.py --kernel mosaic --check`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_ROWS = 64  # wgmma's narrow side; more rows are no longer a matrix-vector product (XLA's GEMMs)
_SMEM_BUDGET = 192 * 1024  # bytes of pipeline stages per program: with the output tile (<= 32 KB), under 227 KB
_PROGRAMS = 264  # split K until the grid has about two programs per multiprocessor (132), no more


@dataclasses.dataclass(frozen=True)
class Tiling:
    tile_n: int  # output columns per program: wgmma's M, a multiple of 64
    tile_k: int  # K per pipeline step: 64 or 128 (one or two 128-byte swizzle spans of bf16)
    splits: int  # programs sharing one column tile's K range
    stages: int  # pipeline steps in flight


def supports(rows: int, k: int, n: int, dtype) -> bool:
    """Whether x [rows, k] @ w [k, n] fits the kernel."""
    return 0 < rows <= MAX_ROWS and k % 64 == 0 and n % 64 == 0 and jnp.dtype(dtype) == jnp.bfloat16


def tiling(k: int, n: int) -> Tiling:
    """The kernel's tiles for a [k, n] weight (a function of the weight's shape only; the module
    docstring says why). Tuned on the H200's 8B projections (experiments/gemv_probe.py): 128-wide
    column tiles only where there are at least 200 of them (gate_up), 64 elsewhere; K split in
    up to four while the grid stays within two programs per multiprocessor."""
    tile_k = 128 if k % 128 == 0 else 64
    tile_n = 128 if n % 128 == 0 and n // 128 >= 200 else 64
    tiles = n // tile_n
    splits = max(s for s in (1, 2, 3, 4) if k % (s * tile_k) == 0 and (s == 1 or tiles * s <= _PROGRAMS))
    stage_bytes = (tile_k * tile_n + MAX_ROWS * tile_k) * 2
    stages = max(2, min(4, k // splits // tile_k, _SMEM_BUDGET // stage_bytes))
    return Tiling(tile_n, tile_k, splits, stages)


def partials(x: jax.Array, w: jax.Array, t: Tiling) -> jax.Array:
    """x [M, K], w [K, N] -> transposed partial products [S, N, Mp] f32, Mp = M rounded up to 8.
    Up to 8 rows, the TMA copies read x's rows past M as zeros: no padded copy of x is made (it
    would cost a kernel of its own per projection). Past 8, Mosaic tiles x's rows by 8 and takes
    only whole tiles, so an M that is not a multiple of 8 (a verify of 2 x 5 tokens) is padded."""
    # The GPU-only backend, imported on use.
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    mp = -(-m // 8) * 8
    if m > 8 and m != mp:
        x = jnp.pad(x, ((0, mp - m), (0, 0)))  # zero rows: their own output columns, dropped by `project`
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
    """x [..., K] @ w [K, *out] -> [..., *out] in out_dtype (default x's), f32 accumulation.
    The caller checks `supports` (rows = the product of x's leading dimensions)."""
    lead, k = x.shape[:-1], x.shape[-1]
    out_shape = w.shape[1:]
    rows, n = math.prod(lead), math.prod(out_shape)
    parts = partials(x.reshape(rows, k), w.reshape(k, n), tiling(k, n))  # [S, N, Mp] f32
    # Split by split, in order (a reduce's order changed with Mp): one XLA kernel with the
    # transpose and the cast.
    y = functools.reduce(jnp.add, list(parts)).T[:rows]  # [rows, N]
    return y.astype(out_dtype or x.dtype).reshape(*lead, *out_shape)
