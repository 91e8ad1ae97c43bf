#!/usr/bin/env python3
"""Does a one-row projection at SmolLM2's shapes run faster as a two-row one?

    python3 experiments/rows_probe.py          # GPU: a table, us per projection

Why: in the SmolLM2 step functions at one row (the profile of the tree iteration), XLA runs a
one-row dot as an element-wise multiply and a reduction (two kernels), and the draft's lm_head
[576, 16,384] as a reduction of 9-15 us where the same weight read by a Triton GEMM over four rows
takes about 4.7. A chain of K drafts K one-row lm_heads an iteration; a tree one (its first
level). Padding the row to two (a zero row, sliced off after) would hand XLA a GEMM.

Method as experiments/gemv_probe.py's: each timed program runs LAYERS dependent projections, each
on its own copy of the weight, divided by LAYERS; rows 1 as the engine runs it, "1 padded to 2",
and 2 and 4 real rows for reference.

Measured on the H200 (jax 0.11.2), us per projection, one row against one row padded
to two: the drafter's lm_head 14.09 / 10.72, its qkv 11.39 / 8.25, the target's down 7.48 / 5.69,
its lm_head in this layout 75.48 / 18.97 (the engine's is the embedding, [V, H], and runs as a
GEMM at one row: 16.9 us in the decode's profile); but the target's qkv 9.36 / 12.34, o 9.54 /
10.65 and gate_up 11.78 / 14.96, slower. Mixed, by shape; at most about 8 us a one-row draft step
(lm_head, qkv, down), where a chain runs on two rows by default and a tree has one such step (its
first level's lm_head, 3 us): not built (BENCHMARKS.md, "Tried and rejected").
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp

from eagle3_jax.bench import costs

LAYERS = 16
# name, K, N, output dtype: SmolLM2-135M's projections as the engine runs them, and its drafter's
SHAPES = [("target qkv", 576, 960, None), ("target o", 576, 576, None), ("target gate_up", 576, 3072, None),
          ("target down", 1536, 576, None), ("target lm_head", 576, 49152, jnp.float32),
          ("draft fc", 1728, 576, None), ("draft qkv", 1152, 960, None),
          ("draft lm_head", 576, 16384, jnp.float32)]


def one_row(x, w, out):
    return jnp.dot(x[:1], w, preferred_element_type=out)


def one_row_padded(x, w, out):
    return jnp.dot(jnp.pad(x[:1], ((0, 1), (0, 0))), w, preferred_element_type=out)[:1]


def rows(m):
    return lambda x, w, out: jnp.dot(x[:m], w, preferred_element_type=out)


def chained(project, out):
    def run(x, ws):
        for i in range(LAYERS):
            y = project(x, ws[i], out)
            # The next input depends on this output, so the projections cannot overlap.
            x = x.at[:y.shape[0]].add((1e-6 * y[:, :1]).astype(x.dtype))
        return x
    return jax.jit(run)


def main() -> int:
    if jax.default_backend() != "gpu":
        print("times XLA's GPU kernels: GPU only")
        return 1
    variants = [("1 row", one_row), ("1 row padded to 2", one_row_padded), ("2 rows", rows(2)), ("4 rows", rows(4))]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; us per projection (a chain of {LAYERS}, each "
          "on its own weight copy, each followed by one small kernel)\n")
    print("| projection | K x N | " + " | ".join(v for v, _ in variants) + " |\n|---|---|" + "---|" * len(variants))
    for name, k, n, out in SHAPES:
        ws = (0.02 * jax.random.normal(jax.random.PRNGKey(0), (LAYERS, k, n), jnp.float32)).astype(jnp.bfloat16)
        x = jax.random.normal(jax.random.PRNGKey(1), (4, k), jnp.float32).astype(jnp.bfloat16)
        us = []
        for _, project in variants:
            chain = chained(project, out)
            us.append(costs.seconds_per_call(lambda chain=chain, x=x, ws=ws: chain(x, ws)) / LAYERS * 1e6)
        print(f"| {name} | {k} x {n} | " + " | ".join(f"{u:.2f}" for u in us) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
