#!/usr/bin/env python3
"""What a buffer costs at dispatch, and whether stacked layer weights cost anything on the device.

    python3 experiments/stacked_weights_probe.py [HLO_OUT]

Times one jitted program of unrolled layers, x = x + silu(norm(x) @ w1[l]) @ w2[l], with the
weights as one array per layer (2 L buffers) or stacked [L, ...] (2 buffers, layer l a static
slice), at SmolLM2's and the 8B's MLP shapes, one row, bf16. Enqueue is the host's time per call
until the dispatch returns; wall, until the device finishes 50 back-to-back calls; floor, the
weights' bytes over 4.5 TB/s (the H200's measured read bandwidth). The last column counts
slice/copy instructions in the compiled HLO: stacked weights show their slices there, and the
wall time says whether the device pays for them (BENCHMARKS.md).

Measured on the H200: stacking halves the enqueue time at SmolLM2's shapes and costs the device
nothing. The engine still keeps one array per layer: with the SmolLM2 target's weights stacked
this way, XLA had not finished compiling the engine's first program after 3 minutes (20 s
before): the compiled HLO shows each GEMM as a fusion that slices its layer inside, one
computation per layer, where per-layer weights let the layers share a kernel. The KV cache is
stacked (`llama.KVCache`): its kernels take the layer as a block index, which shares them.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def make(layers: int, d: int, n: int, stacked: bool, dtype=jnp.bfloat16):
    key = jax.random.PRNGKey(0)
    if stacked:
        return (jax.random.normal(key, (layers, d, n), dtype) * 0.02,
                jax.random.normal(key, (layers, n, d), dtype) * 0.02)
    return (tuple(jax.random.normal(jax.random.fold_in(key, i), (d, n), dtype) * 0.02 for i in range(layers)),
            tuple(jax.random.normal(jax.random.fold_in(key, 100 + i), (n, d), dtype) * 0.02 for i in range(layers)))


def forward(weights, x):
    w1, w2 = weights
    for i in range(len(w1) if isinstance(w1, tuple) else w1.shape[0]):
        h = x * jax.lax.rsqrt(jnp.mean(x.astype(jnp.float32) ** 2, -1, keepdims=True) + 1e-5).astype(x.dtype)
        x = x + jax.nn.silu(h @ w1[i]) @ w2[i]
    return x


def main(hlo_out: str | None = None) -> int:
    step = jax.jit(forward)
    print(jax.devices()[0].device_kind, jax.__version__)
    print("| weights | layers | D x N | buffers | enqueue us/call | wall us/call | floor us | slice/copy in HLO |")
    print("|---|---|---|---|---|---|---|---|")
    for layers, d, n in ((30, 576, 1536), (16, 4096, 14336)):
        for stacked in (False, True):
            weights = make(layers, d, n, stacked)
            x = jnp.ones((1, d), jnp.bfloat16)
            text = step.lower(weights, x).compile().as_text()
            copies = (len(re.findall(r"^\s*\S+ = \S+ (copy|slice)\(", text, re.MULTILINE))
                      + len(re.findall(r"fusion.*kind=kLoop.*slice", text)))
            for _ in range(3):
                y = step(weights, x)
            y.block_until_ready()
            calls = 50
            start = time.perf_counter()
            for _ in range(calls):
                y = step(weights, x)
            enqueued = time.perf_counter()
            y.block_until_ready()
            done = time.perf_counter()
            floor_us = 1e6 * 2 * layers * 2 * d * n / 4.5e12
            kind = "stacked" if stacked else "per layer"
            print(f"| {kind} | {layers} | {d} x {n} | {len(jax.tree.leaves(weights))} | "
                  f"{1e6 * (enqueued - start) / calls:.0f} | {1e6 * (done - start) / calls:.0f} | {floor_us:.0f} | "
                  f"{copies} |", flush=True)
            if stacked and layers == 16 and hlo_out:
                Path(hlo_out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
