#!/usr/bin/env python3
"""Does XLA read 8-bit weights at half the bytes when the dequantizing convert sits on the dot's
operand, for the few-row GEMMs of a draft step?

    python3 experiments/quant_gemm_probe.py            # GPU: the 8B drafter's projections, a table
    python3 experiments/quant_gemm_probe.py --check    # any backend: the quantized products' error

Why: at Llama-3.1-8B's shapes a draft forward reads its drafter's 748 MB of weights (a tree
(5, 4, 15) runs five such forwards an iteration; BENCHMARKS.md, "Llama-3.1-8B step functions"),
and the draft's weights only decide what is proposed, never what is emitted: the target verifies
every token. Weights stored as int8 (or float8_e4m3fn) with a scale per output column would halve
those reads, if XLA fuses the convert to bf16 into its GEMM (its Triton GEMM fusions accept
converts on an operand) instead of writing a bf16 copy of the weight first.

Method: as gemv_probe.py, LAYERS dependent projections each on its own weight copy (nothing
served from L2), us per projection. "int8" and "fp8" store the weight with a scale per output
column and multiply `dot(x, q.astype(bf16))` by it; "fp8 GEMM" also rounds x to float8 (one
scale for the call) and multiplies on the tensor cores in fp8, the weight stored [N, K].

Measured on the H200 (jax 0.11.2, BENCHMARKS.md "Tried and rejected"): int8 with the convert on
the operand is 1.3-4.6x slower than bf16 at every shape and row count (o 1.3-3.2x, the others
2.1-4.6x; 0.4-0.8 TB/s of 8-bit weight: XLA writes a bf16 copy of the weight and reads it again),
and fp8 the same 2.1-4.6x on qkv, gate_up, down and lm_head (o's fp8 figures of that run were the
fp8 GEMM's: the probe then told the two forms apart by the weight's shape, which a square weight
defeats; it now passes the form). The fp8 GEMM is faster only from 16 rows, on the widest weights
(gate_up 40.2 against 59.6 us, lm_head 42.5 against 66.6), and 1.7-2.7x slower at 1 and 4 rows (o
at 4 rows 1.00x), a tree level's 4 beams at batch 1 among them. Verdict: no 8-bit drafter through
XLA's dots; it would take a GEMV kernel of our own that dequantizes as it reads.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.bench import costs

LAYERS = 8
# name, K, N: Llama-3.1-8B's EAGLE-3 drafter (its midlayer reads [embedding, hidden], 2 x 4096)
SHAPES = [("qkv", 8192, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
          ("lm_head", 4096, 32000)]
ROWS = (1, 4, 16, 32)
FORMATS = ("bf16", "int8", "fp8", "fp8 GEMM")


def quantize(w: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array | None]:
    """w [..., K, N] -> (stored weight, scale [..., N] f32 or None for bf16)."""
    if fmt == "bf16":
        return w.astype(jnp.bfloat16), None
    w32 = w.astype(jnp.float32)
    top = 127.0 if fmt == "int8" else 448.0
    scale = jnp.maximum(jnp.abs(w32).max(axis=-2), 1e-12) / top
    q = w32 / scale[..., None, :]
    q = jnp.round(q).astype(jnp.int8) if fmt == "int8" else q.astype(jnp.float8_e4m3fn)
    if fmt == "fp8 GEMM":  # stored [..., N, K]: both operands K-major, as cuBLASLt's fp8 GEMM takes them
        q = jnp.swapaxes(q, -1, -2)
    return q, scale


def product(x: jax.Array, q: jax.Array, scale: jax.Array | None, fmt: str) -> jax.Array:
    """x [M, K] bf16, q and scale as `quantize(w, fmt)` stored them -> [M, N] bf16."""
    if fmt == "bf16":
        return jnp.dot(x, q)
    if fmt == "fp8 GEMM":  # fp8 x fp8 on the tensor cores
        x_scale = jnp.maximum(jnp.abs(x).max().astype(jnp.float32), 1e-12) / 448.0
        x8 = (x.astype(jnp.float32) / x_scale).astype(jnp.float8_e4m3fn)
        y = jax.lax.dot_general(x8, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
        return (y.astype(jnp.float32) * (x_scale * scale)).astype(jnp.bfloat16)
    y = jnp.dot(x, q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (y * scale).astype(jnp.bfloat16)


def chained(x, qs, scales, fmt):
    for i in range(LAYERS):
        y = product(x, qs[i], None if scales is None else scales[i], fmt)
        x = x.at[:, :1].add((1e-6 * y[:, :1]).astype(x.dtype))
    return x


def check() -> int:
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((512, 256)) * 0.02, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    want = np.asarray(jnp.dot(x.astype(jnp.float32), w))
    for fmt in FORMATS:
        got = np.asarray(product(x, *quantize(w, fmt), fmt), np.float32)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        print(f"{fmt}: max rel err {err:.2e}")
        if err > {"bf16": 0.02, "int8": 0.05}.get(fmt, 0.12):
            return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    if args.check:
        return check()
    bandwidth = costs.copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"us per projection, a chain of {LAYERS} on their own weight copies\n")
    print("| projection | rows | " + " | ".join(f"{f} us (TB/s)" for f in FORMATS) + " | "
          + " | ".join(f"{f} / bf16" for f in FORMATS[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(FORMATS) - 1))
    run = jax.jit(chained, static_argnames="fmt")
    for name, k, n in SHAPES:
        w = 0.02 * jax.random.normal(jax.random.PRNGKey(0), (LAYERS, k, n), jnp.float32)
        stored = {fmt: quantize(w, fmt) for fmt in FORMATS}
        del w
        for rows in ROWS:
            x = jax.random.normal(jax.random.PRNGKey(1), (rows, k), jnp.bfloat16)
            us, cells = {}, []
            for fmt in FORMATS:
                q, scale = stored[fmt]
                call = functools.partial(run, x, q, scale, fmt=fmt)
                us[fmt] = 1e6 * costs.seconds_per_call(call) / LAYERS
                tbs = q[0].nbytes / (us[fmt] * 1e-6) / 1e12
                cells.append(f"{us[fmt]:.1f} ({tbs:.2f})")
            ratios = " | ".join(f"{us[f] / us['bf16']:.2f}" for f in FORMATS[1:])
            print(f"| {name} | {rows} | {' | '.join(cells)} | {ratios} |", flush=True)
        del stored
    return 0


if __name__ == "__main__":
    sys.exit(main())
