"""The residual add and the RMSNorm after it as one Pallas (Triton) kernel, a program per row, where
XLA compiles three or four small kernels (BENCHMARKS.md, "Llama-3.1-8B step functions"). Numerics
are `layers.add_rms_norm`'s: the sum rounded to the stream's dtype, f32 statistics, the normed value
rounded, then the gain.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(*refs, has_delta: bool, has_weight: bool, eps: float, lanes: int):
    # refs: x [D], (delta [D]), (weight [D]), then outputs sum [D], normed [D]: one row each.
    it = iter(refs)
    x_ref = next(it)
    delta_ref = next(it) if has_delta else None
    weight_ref = next(it) if has_weight else None
    sum_ref, out_ref = next(it), next(it)
    d = x_ref.shape[0]
    cols = jnp.arange(lanes)  # D padded to a power of two, the rest masked
    mask = cols < d
    s = plgpu.load(x_ref.at[cols], mask=mask, other=0.0)
    if has_delta:
        delta = plgpu.load(delta_ref.at[cols], mask=mask, other=0.0)
        s = (s.astype(jnp.float32) + delta.astype(jnp.float32)).astype(sum_ref.dtype)
    plgpu.store(sum_ref.at[cols], s, mask=mask)
    s32 = jnp.where(mask, s.astype(jnp.float32), 0.0)
    y = (s32 * jax.lax.rsqrt(jnp.sum(s32 * s32) / d + eps)).astype(out_ref.dtype)
    if has_weight:
        y = plgpu.load(weight_ref.at[cols], mask=mask, other=0.0) * y
    plgpu.store(out_ref.at[cols], y.astype(out_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames="eps")
def add_rms_norm(x: jax.Array, delta: jax.Array | None, weight: jax.Array | None,
                 eps: float) -> tuple[jax.Array, jax.Array]:
    """x [..., D], delta [..., D] or None, weight [D] or None -> (x + delta, rms_norm of it)."""
    shape, d = x.shape, x.shape[-1]
    rows = x.reshape(-1, d)
    lanes = pl.next_power_of_2(d)
    row_spec = pl.BlockSpec((None, d), lambda i: (i, 0))
    args = [rows] + ([] if delta is None else [delta.reshape(-1, d)]) + ([] if weight is None else [weight])
    in_specs = [row_spec] * (1 + (delta is not None)) + ([] if weight is None else [pl.BlockSpec((d,), lambda i: (0,))])
    out = jax.ShapeDtypeStruct(rows.shape, x.dtype)
    s, y = pl.pallas_call(
        functools.partial(_kernel, has_delta=delta is not None, has_weight=weight is not None, eps=eps, lanes=lanes),
        grid=(rows.shape[0],),
        in_specs=in_specs,
        out_specs=[row_spec, row_spec],
        out_shape=[out, out],
        interpret=jax.default_backend() != "gpu",
        compiler_params=plgpu.CompilerParams(num_warps=min(max(lanes // 512, 1), 8), num_stages=1),
        name="eagle3_add_rms_norm",
    )(*args)
    return s.reshape(shape), y.reshape(shape)
