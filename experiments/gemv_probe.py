#!/usr/bin/env python3
"""Can a GEMV of our own read the 8B weights as fast as XLA's Triton GEMMs, while leaving its
split-K partial sums to the kernel after it?

    python3 experiments/gemv_probe.py                   # GPU: every shape, the Triton sweep, a table
    python3 experiments/gemv_probe.py --kernel mosaic   # Hopper: the same for model/mosaic_gemv.py's kernel
    python3 experiments/gemv_probe.py --check           # any backend: the Triton kernel against jnp.dot
    python3 experiments/gemv_probe.py --kernel mosaic --check   # Hopper: the engine's kernel, see check_mosaic

Why: an 8B decode at batch 1 spends about 3.7 of its 4.3 ms in XLA's weight GEMMs (91% of the read
bandwidth) and ~0.7 ms in ten small kernels a layer, among them three split-K reductions, two
add + RMSNorms and the SwiGLU multiply (BENCHMARKS.md). Those three kinds could live
inside the GEMVs: RMSNorm's scale is per row, so it commutes with the matmul and can be applied
from summed sums of squares; the residual add and the SwiGLU are element-wise on the GEMV's input.
That plan only pays if the GEMV itself keeps XLA's speed when it writes its partials [S, M, N] in
f32 instead of reducing them. This probe measures that, and nothing else.

The kernel: a grid of (N / block_n column tiles, S splits of K); program (n, s) walks its K range
in block_k steps, x [M, block_k] @ W [block_k, block_n] on the tensor cores (M padded to 16 rows),
and writes its partial [M, block_n] in f32. XLA's side is `jnp.dot` (bf16 out, its autotuned tiles
and split-K reduction included). Each timed program runs LAYERS GEMVs, each on its own copy of
the weight (so nothing is served from L2) and each fed by the previous one's output (so none can
overlap), divided by LAYERS. Bandwidth = weight bytes / time; the floor is the weight bytes over
the copy bandwidth measured here.

Measured on the H200 (jax 0.11.2, BENCHMARKS.md), us per GEMV at batch 1, XLA
against the best of the sweep: o 14.0 / 28.3, qkv 19.2 / 42.0, down 37.1 / 94.3, gate_up
61.8 / 179.4; the same at 32 rows. This kernel reads 1.1-1.3 TB/s where XLA's reads 2.2-3.9: 2.0-3.0x
slower, so the fused plan does not start from it. Why it is slow was not measured; the likeliest
reason is weight loads that Triton does not pipeline here, and Pallas' Mosaic GPU backend (TMA,
explicit pipelines) is the next thing to try.

It was (`--kernel mosaic`): model/mosaic_gemv.py's kernel, its partials summed
by one XLA kernel, against jnp.dot at batch 1: o 13.8 / 16.1 us, qkv 17.8 / 21.2, down 33.7 / 35.0,
gate_up 60.8 / 62.0; 0.84-0.98x XLA's time, and the engine now runs it (EngineConfig.gemv).
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
from jax.experimental import pallas as pl

from eagle3_jax.bench import costs
from eagle3_jax.model import mosaic_gemv

LAYERS = 8  # weight copies per timed program
# name, K, N: the Llama-3.1-8B layer's projections (q/k/v and gate/up fused, as the engine runs them)
SHAPES = [("o", 4096, 4096), ("qkv", 4096, 6144), ("down", 14336, 4096), ("gate_up", 4096, 28672)]
ROWS = (1, 32)  # decode at batch 1; the verify of 8 x 4
# block_n, block_k, programs wanted, num_warps, num_stages
CONFIGS = [(n, k, p, 4, 4) for n in (64, 128) for k in (128, 256) for p in (264, 528)] + [(64, 256, 528, 4, 3)]


def _gemv_kernel(x_ref, w_ref, out_ref, *, block_k: int):
    # x_ref [M, K/S] (this split's K range), w_ref [K/S, block_n], out_ref [M, block_n] f32.
    steps = x_ref.shape[1] // block_k

    def body(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)]
        w = w_ref[pl.ds(i * block_k, block_k), :]
        return acc + jax.lax.dot(x, w, preferred_element_type=jnp.float32)

    out_ref[...] = jax.lax.fori_loop(0, steps, body, jnp.zeros(out_ref.shape, jnp.float32))


def gemv_partials(x: jax.Array, w: jax.Array, *, block_n: int, block_k: int, splits: int, num_warps: int = 4,
                  num_stages: int = 3) -> jax.Array:
    """x [M, K] (M a power of two >= 16), w [K, N] -> partial products [S, M, N] f32, summing to x @ w."""
    from jax.experimental.pallas import triton as plgpu

    m, k = x.shape
    n = w.shape[1]
    span = k // splits
    return pl.pallas_call(
        functools.partial(_gemv_kernel, block_k=block_k),
        grid=(n // block_n, splits),
        in_specs=[pl.BlockSpec((m, span), lambda j, s: (0, s)), pl.BlockSpec((span, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        interpret=jax.default_backend() != "gpu",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="eagle3_gemv_partials",
    )(x, w)


def splits_for(k: int, n: int, block_n: int, block_k: int, programs: int) -> int | None:
    """The power-of-two split count nearest `programs` programs in all whose K range is whole
    block_k steps; None when there is none."""
    tiles = n // block_n
    best = None
    s = 1
    while k % (s * block_k) == 0:
        if best is None or abs(tiles * s - programs) < abs(tiles * best - programs):
            best = s
        s *= 2
    return best


def padded_rows(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def chained(gemv):
    """LAYERS dependent GEMVs, weight i on copy i: x [M, K], ws [LAYERS, K, N] -> [M, K]-shaped."""
    def run(x, ws):
        for i in range(LAYERS):
            y = gemv(x, ws[i])
            if y.ndim == 3 and y.shape[-1] == x.shape[0]:
                y = y.sum(axis=0).T  # Mosaic's transposed partials [S, N, Mp], summed: its consumer's work
            elif y.ndim == 3:
                y = y[0]  # Triton's partials [S, M, N]: split 0's stands in for the sum
            # The next input depends on this output (a column of it), so the GEMVs cannot overlap;
            # one small kernel per GEMV on either side (the fused plan's consumer sums the partials).
            x = x.at[:y.shape[0]].add((1e-6 * y[:, :1]).astype(x.dtype))
        return x
    return jax.jit(run)


def seconds_per_gemv(gemv, x: jax.Array, ws: jax.Array) -> float:
    chain = chained(gemv)
    return costs.seconds_per_call(lambda: chain(x, ws)) / LAYERS


def xla_gemv(x: jax.Array, w: jax.Array, rows: int) -> jax.Array:
    """XLA's side: the real rows only, as the engine's M = B*T."""
    return jnp.dot(x[:rows], w)


def check() -> int:
    """The kernel against jnp.dot on small shapes (Pallas' interpreter off the GPU)."""
    rng = np.random.default_rng(0)
    for m, k, n, bn, bk, s in [(16, 256, 128, 64, 64, 2), (16, 512, 256, 128, 128, 4), (32, 256, 64, 64, 128, 1)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        got = gemv_partials(x, w, block_n=bn, block_k=bk, splits=s)
        assert got.shape == (s, m, n)
        np.testing.assert_allclose(np.asarray(got.sum(axis=0)), np.asarray(x @ w), rtol=1e-4, atol=1e-3)
    print("gemv_partials agrees with jnp.dot (M x K x N, block_n, block_k, splits): 16x256x128, 64, 64, 2; "
          "16x512x256, 128, 128, 4; 32x256x64, 64, 128, 1")
    return 0


# tile_n (the wgmma's rows), tile_k, pipeline stages, programs wanted
MOSAIC_CONFIGS = [(n, k, st, p) for n in (64, 128) for k in (128, 256) for st in (4, 6, 8) for p in (132, 264)
                  if st * (k * n + 32 * k) * 2 <= 200 * 1024]


def weight_copies():
    """Per projection: (name, K, N, its LAYERS weight copies [LAYERS, K, N] bf16, one copy's bytes)."""
    for name, k, n in SHAPES:
        ws = (0.02 * jax.random.normal(jax.random.PRNGKey(0), (LAYERS, k, n), jnp.float32)).astype(jnp.bfloat16)
        yield name, k, n, ws, k * n * 2


def table_header(kernel: str, config: str) -> float:
    """Prints the sweep's preamble and table header; -> the copy bandwidth (bytes/s), the floor's."""
    bandwidth = costs.copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
          f"us per GEMV (a chain of {LAYERS}, each on its own weight copy, each followed by one small kernel); "
          f"{kernel} config {config}\n")
    print(f"| projection | rows | weight MB | floor us | XLA jnp.dot us (TB/s) | best {kernel} us (TB/s) | config | "
          f"{kernel} / XLA | max rel err |\n|---|---|---|---|---|---|---|---|---|")
    return bandwidth


def check_mosaic() -> int:
    """The engine's `mosaic_gemv.project` against jnp.dot (f32 out, 64 rows); and whether each of a
    call's first 1, 3, 8, 10, 20 and 32 rows, alone in a call, comes out bit for bit as in the 64-row
    call, for the kernel's partials and for the summed result (10 and 20 rows are padded to whole
    8-row tiles, `mosaic_gemv.partials`)."""
    if jax.default_backend() != "gpu":
        print("the check runs Mosaic GPU kernels: Hopper GPU only")
        return 1
    rng = np.random.default_rng(0)
    ok = True
    for k, n in [(4096, 4096), (4096, 6144), (14336, 4096), (4096, 28672), (576, 960), (1536, 576)]:
        x = jnp.asarray(rng.standard_normal((64, k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        t = mosaic_gemv.tiling(k, n)
        want = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
        got = np.asarray(mosaic_gemv.project(x, w, jnp.float32))
        parts = np.asarray(mosaic_gemv.partials(x, w, t))  # [S, N, 64]
        err = float(np.abs(got - want).max() / np.abs(want).max())
        rows_alike = parts_alike = True
        for r in (1, 3, 8, 10, 20, 32):
            rows_alike &= np.array_equal(np.asarray(mosaic_gemv.project(x[:r], w, jnp.float32)), got[:r])
            parts_alike &= np.array_equal(np.asarray(mosaic_gemv.partials(x[:r], w, t))[..., :r], parts[..., :r])
        print(f"K {k} N {n} {t}: max rel err {err:.1e}; rows alike in any batch: partials {parts_alike}, "
              f"result {rows_alike}")
        ok &= err < 1e-3 and rows_alike and parts_alike
    return 0 if ok else 1


def sweep_mosaic() -> int:
    """Mosaic GPU's GEMV (its partials summed by one XLA kernel) against XLA's jnp.dot, every shape."""
    if jax.default_backend() != "gpu":
        print("the sweep compiles Mosaic GPU kernels: Hopper GPU only")
        return 1
    bandwidth = table_header("Mosaic", "(tile_n, tile_k, splits, stages)")
    for name, k, n, ws, weight_bytes in weight_copies():
        ranked = []
        for rows in ROWS:
            m = max(8, rows)
            x = jax.random.normal(jax.random.PRNGKey(rows), (m, k), jnp.float32).astype(jnp.bfloat16)
            x = x.at[rows:].set(0)
            want = np.asarray(jnp.dot(x[:rows], ws[0], preferred_element_type=jnp.float32))
            xla_s = seconds_per_gemv(functools.partial(xla_gemv, rows=rows), x, ws)
            results = []
            # Rows past the first: the first row's five best configs only.
            configs = MOSAIC_CONFIGS if not ranked else [c for _, c in sorted(ranked)[:5]]
            for tn, tk, st, programs in configs:
                sp = splits_for(k, n, tn, tk, programs)
                if sp is None:
                    continue
                gemv = functools.partial(mosaic_gemv.partials, t=mosaic_gemv.Tiling(tn, tk, sp, st))
                try:
                    got = np.asarray(jax.jit(gemv)(x, ws[0]).sum(axis=0)).T[:rows]
                    err = float(np.abs(got - want).max() / np.abs(want).max())
                    t = seconds_per_gemv(gemv, x, ws)
                except Exception as e:  # noqa: BLE001 - a config Mosaic rejects is skipped, and said
                    print(f"  skipped {name} rows {rows} {(tn, tk, sp, st)}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:300] if str(e) else ''}", file=sys.stderr, flush=True)
                    continue
                results.append((t, (tn, tk, st, programs), (tn, tk, sp, st), err))
                print(f"  {name} rows {rows} {(tn, tk, sp, st)}: {1e6 * t:.1f} us, err {err:.1e}",
                      file=sys.stderr, flush=True)
            if not results:
                print(f"| {name} | {rows} | {weight_bytes / 1e6:.0f} | | {1e6 * xla_s:.1f} | no config ran | | | |")
                continue
            if not ranked:
                ranked = [(t, c) for t, c, _, _ in results]
            t, _, config, err = min(results)
            print(f"| {name} | {rows} | {weight_bytes / 1e6:.0f} | {1e6 * weight_bytes / bandwidth:.1f} | "
                  f"{1e6 * xla_s:.1f} ({weight_bytes / xla_s / 1e12:.2f}) | {1e6 * t:.1f} "
                  f"({weight_bytes / t / 1e12:.2f}) | {config} | {t / xla_s:.2f} | {err:.1e} |", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="correctness on small shapes only (any backend)")
    ap.add_argument("--kernel", choices=("triton", "mosaic"), default="triton",
                    help="whose GEMV to sweep against XLA's: Pallas Triton (this file's) or Mosaic GPU")
    a = ap.parse_args()
    if a.kernel == "mosaic":
        return check_mosaic() if a.check else sweep_mosaic()
    if a.check:
        return check()
    if jax.default_backend() != "gpu":
        print("the sweep times Triton kernels: GPU only (use --check here)")
        return 1
    bandwidth = table_header("Pallas partials", "(block_n, block_k, splits, stages)")
    for name, k, n, ws, weight_bytes in weight_copies():
        for rows in ROWS:
            m = padded_rows(rows)
            x = jax.random.normal(jax.random.PRNGKey(rows), (m, k), jnp.float32).astype(jnp.bfloat16)
            x = x.at[rows:].set(0)  # padding rows, as the engine's
            want = np.asarray(jnp.dot(x[:rows], ws[0], preferred_element_type=jnp.float32))
            xla_s = seconds_per_gemv(functools.partial(xla_gemv, rows=rows), x, ws)
            best = None
            for bn, bk, programs, warps, stages in CONFIGS:
                s = splits_for(k, n, bn, bk, programs)
                if s is None:
                    continue
                gemv = functools.partial(gemv_partials, block_n=bn, block_k=bk, splits=s, num_warps=warps,
                                         num_stages=stages)
                try:
                    got = np.asarray(gemv(x, ws[0]).sum(axis=0))[:rows]
                    err = float(np.abs(got - want).max() / np.abs(want).max())
                    t = seconds_per_gemv(gemv, x, ws)
                except Exception as e:  # noqa: BLE001 - a config Triton rejects is skipped, and said
                    print(f"  skipped {name} rows {rows} ({bn}, {bk}, {s}, {stages}): {type(e).__name__}",
                          file=sys.stderr)
                    continue
                if best is None or t < best[0]:
                    best = (t, (bn, bk, s, stages), err)
            t, config, err = best
            print(f"| {name} | {rows} | {weight_bytes / 1e6:.0f} | {1e6 * weight_bytes / bandwidth:.1f} | "
                  f"{1e6 * xla_s:.1f} ({weight_bytes / xla_s / 1e12:.2f}) | {1e6 * t:.1f} "
                  f"({weight_bytes / t / 1e12:.2f}) | {config} | {t / xla_s:.2f} | {err:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
