#!/usr/bin/env python3
"""The paged attention of one layer, XLA form against the Pallas kernel, on real step shapes:
agreement (bf16 inputs, against an f32 evaluation of the XLA form) and time per call.

    python3 scripts/attention_check.py

Each case is one layer's attention of a decode or verify step over a paged pool whose rows hold
`context` cached tokens. The floor is the bytes a step must read (the valid K and V of every row,
once) over the device's copy bandwidth measured here; the XLA form reads the whole block table.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eagle3_jax.model import layers, pallas_attention  # noqa: E402

# name, batch, new tokens, kv heads, q heads per kv head, head dim, cached tokens, table width (pages)
CASES = [
    ("SmolLM2 verify K=4, 2 rows", 2, 5, 3, 3, 64, 300, 68),
    ("SmolLM2 verify K=4, 16 rows", 16, 5, 3, 3, 64, 300, 68),
    ("8B decode, 1 row", 1, 1, 8, 4, 128, 512, 68),
    ("8B verify 8 x 4 (1000 of 2048 cached)", 8, 4, 8, 4, 128, 1000, 128),
]
CPU_CASES = [
    ("SmolLM2 verify K=4, 2 rows", 2, 5, 3, 3, 64, 60, 8),
]
PAGE = 16


def timed(fn, *args, calls: int = 50, rounds: int = 5) -> float:
    """Median ms per call, calls back to back."""
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return 1e3 * statistics.median(samples)


def copy_bandwidth() -> float:
    """Bytes per second of a device copy of 1 GiB (read + written)."""
    x = jnp.ones((1 << 28,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / (timed(copy, x, calls=10, rounds=3) / 1e3)


def main() -> int:
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    bandwidth = copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| case | max abs err XLA | max abs err Pallas | XLA us | Pallas us | floor us | Pallas % of floor |")
    print("|---|---|---|---|---|---|---|")
    xla = jax.jit(layers.paged_attention)
    kernel = jax.jit(pallas_attention.paged_attention)
    for name, b, t, g, r, hd, context, nb in (CASES if jax.default_backend() == "gpu" else CPU_CASES):
        rng = np.random.default_rng(0)
        num_pages = b * nb + 1
        q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), dtype)
        k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, PAGE, g, hd)), dtype) for _ in range(2))
        table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, nb), jnp.int32)
        positions = jnp.asarray(np.broadcast_to(context + np.arange(t), (b, t)), jnp.int32)
        f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
        want = np.asarray(xla(*f32, positions, table))
        err_xla = float(np.abs(np.asarray(xla(q, k_pages, v_pages, positions, table), np.float32) - want).max())
        err_kernel = float(np.abs(np.asarray(kernel(q, k_pages, v_pages, positions, table), np.float32) - want).max())
        t_xla = timed(xla, q, k_pages, v_pages, positions, table)
        t_kernel = timed(kernel, q, k_pages, v_pages, positions, table)
        floor_us = 1e6 * 2 * b * (context + t) * g * hd * jnp.dtype(dtype).itemsize / bandwidth
        print(f"| {name} | {err_xla:.4f} | {err_kernel:.4f} | {1e3 * t_xla:.1f} | {1e3 * t_kernel:.1f} | "
              f"{floor_us:.1f} | {floor_us / (1e3 * t_kernel):.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
