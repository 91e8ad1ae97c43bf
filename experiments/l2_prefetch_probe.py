#!/usr/bin/env python3
"""Can a layer's o_proj weight be read into L2 while its attention runs, so that the GEMV after
it reads from L2 instead of HBM?

    python3 experiments/l2_prefetch_probe.py            # GPU: both scheduling modes, one table
    python3 experiments/l2_prefetch_probe.py --check    # any backend: the Pallas touch sums its input

Why: an 8B decode at batch 1 spends ~20 us a layer in latency-bound kernels (RoPE + KV write,
attention and its combine, norms, split-K reductions; BENCHMARKS.md), during
which HBM sits nearly idle, and then the GEMVs are bound by HBM. The o_proj weight (34 MB) fits
the H200's 50 MB L2. If a "touch" kernel reads it while the attention runs, the o_proj GEMV
could read it from L2. Two conditions, each measured here:
- L2 keeps the weight until the GEMV: touch -> GEMV in series against GEMV alone.
- The touch runs beside the attention. XLA's default command-buffer scheduling (LHS) runs
  fusions one after another; `--xla_gpu_command_buffer_scheduling_mode=CONCURRENT` builds the
  CUDA graph from data dependencies, so independent kernels may overlap. XLA reads XLA_FLAGS
  once per process, so each mode runs in a child process of its own.

Each timed program is LAYERS layers, each on its own weight and KV copy (nothing stays in L2
from one layer to the next except what the layer itself touched), each fed by the previous
layer's output. us per layer. Shapes: Llama-3.1-8B decode at one row, 512 cached tokens.

Measured on the H200 (jax 0.11.2; BENCHMARKS.md), LHS / CONCURRENT:
- L2 does keep the weight. After a touch the GEMV took about 7 us (touch -> GEMV 20.2, touch
  alone 13.1), against 13.0 alone.
- But the touches are slow: XLA's sum read the 34 MB in 13.1 us (2.6 TB/s), the Pallas kernel in
  18.9 (1.8 TB/s).
- Nothing overlaps under LHS. Under CONCURRENT the Pallas touch did overlap the attention (26.9 us
  for attention, touch and GEMV), yet that is still slower than attention -> GEMV without a touch
  (24.6 / 25.4).
- The most this could save is the GEMV's ~6 us a layer, about 4% of an 8B decode: not enough for
  the 90% bar, so the engine does not use it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from eagle3_jax.bench import costs
from eagle3_jax.model import pallas_attention

LAYERS = 8
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128  # Llama-3.1-8B
CONTEXT, PAGE = 512, 16
MODES = ("LHS", "CONCURRENT")  # XLA's default command-buffer scheduling, and a DAG of data dependencies
TOUCH_PROGRAMS = 256  # about two per SM
VARIANTS = ("attention", "gemv", "touch xla", "touch pallas", "attention -> gemv", "touch xla -> gemv",
            "touch pallas -> gemv", "(attention | touch xla) -> gemv", "(attention | touch pallas) -> gemv")


def _touch_kernel(w_ref, out_ref):
    # w_ref [steps, width]: this program's share of the weight; out_ref [1] f32, its sum. The loads
    # ask L2 to keep the lines (evict_last): the GEMV after is meant to find them there.
    from jax.experimental.pallas import triton as plgpu

    def body(i, acc):
        return acc + plgpu.load(w_ref.at[i], eviction_policy="evict_last").astype(jnp.float32).sum()

    out_ref[0] = jax.lax.fori_loop(0, w_ref.shape[0], body, jnp.float32(0))


def touch_pallas(w: jax.Array) -> jax.Array:
    """Read every element of w [K, N] once (the sum, so no load is dead) -> [] f32."""
    rows = w.reshape(TOUCH_PROGRAMS, -1, w.shape[-1])  # [programs, steps, N]: contiguous, a bitcast
    sums = pl.pallas_call(
        _touch_kernel,
        grid=(TOUCH_PROGRAMS,),
        in_specs=[pl.BlockSpec((None,) + rows.shape[1:], lambda i: (i, 0, 0))],
        out_specs=pl.BlockSpec((1,), lambda i: (i,)),
        out_shape=jax.ShapeDtypeStruct((TOUCH_PROGRAMS,), jnp.float32),
        interpret=jax.default_backend() != "gpu",
        name="eagle3_l2_touch",
    )(rows)
    return sums.sum()


def touch_xla(w: jax.Array) -> jax.Array:
    return jnp.sum(w, dtype=jnp.float32)


def layer_fn(variant: str):
    """One layer of `variant`: (x [1, HIDDEN], w [HIDDEN, HIDDEN], k/v pages, positions, table) -> x."""
    touch = touch_pallas if "pallas" in variant else touch_xla

    def attend(x, kp, vp, positions, table):
        q = x.reshape(1, 1, HEADS, HEAD_DIM)
        return pallas_attention.paged_attention(q, kp, vp, positions, table).reshape(1, HIDDEN)

    def layer(x, w, kp, vp, positions, table):
        if variant == "attention":
            return attend(x, kp, vp, positions, table).astype(x.dtype)
        if variant == "gemv":
            return x + jnp.dot(x, w)
        if variant.startswith("touch") and "->" not in variant:
            return x.at[0, 0].add((1e-30 * touch(w)).astype(x.dtype))
        # Both touch variants start once the layer's input exists (the barrier), and the GEMV waits for
        # the touch; in CONCURRENT mode nothing orders the touch against the attention.
        w, x = jax.lax.optimization_barrier((w, x))
        t = touch(w) if "touch" in variant else jnp.float32(0)
        a = attend(x, kp, vp, positions, table) if "attention" in variant else x
        a, t = jax.lax.optimization_barrier((a, t))
        return (x + jnp.dot(a.astype(x.dtype), w)).at[0, 0].add((1e-30 * t).astype(x.dtype))

    return layer


def chain(variant: str):
    layer = layer_fn(variant)

    def run(x, ws, kps, vps, positions, table):
        for i in range(LAYERS):
            x = layer(x, ws[i], kps[i], vps[i], positions, table)
        return x
    return jax.jit(run)


def inputs():
    key = jax.random.PRNGKey(0)
    keys = jax.random.split(key, 3 * LAYERS + 1)
    ws = [(0.02 * jax.random.normal(keys[i], (HIDDEN, HIDDEN), jnp.float32)).astype(jnp.bfloat16)
          for i in range(LAYERS)]
    pages = CONTEXT // PAGE + 2
    kps = [jax.random.normal(keys[LAYERS + i], (pages + 1, PAGE, KV_HEADS, HEAD_DIM), jnp.bfloat16)
           for i in range(LAYERS)]
    vps = [jax.random.normal(keys[2 * LAYERS + i], (pages + 1, PAGE, KV_HEADS, HEAD_DIM), jnp.bfloat16)
           for i in range(LAYERS)]
    table = jnp.arange(1, pages + 1, dtype=jnp.int32)[None]
    positions = jnp.full((1, 1), CONTEXT, jnp.int32)
    x = jax.random.normal(keys[-1], (1, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    return x, ws, kps, vps, positions, table


def measure_mode() -> dict[str, float]:
    """us per layer of every variant, in this process's scheduling mode."""
    args = inputs()
    us = {}
    for variant in VARIANTS:
        us[variant] = 1e6 * costs.seconds_per_call(functools.partial(chain(variant), *args), calls=20) / LAYERS
    return us


def check() -> int:
    w = jax.random.normal(jax.random.PRNGKey(0), (512, 64), jnp.float32).astype(jnp.bfloat16)
    got, want = float(touch_pallas(w)), float(jnp.sum(w, dtype=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-2)
    print(f"touch_pallas sums its input: {got:.4f} against {want:.4f}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="the touch kernel's sum, any backend")
    ap.add_argument("--mode-child", choices=MODES, help=argparse.SUPPRESS)  # set by the parent with XLA_FLAGS
    a = ap.parse_args()
    if a.check:
        return check()
    if a.mode_child:
        print(json.dumps(measure_mode()))
        return 0
    results = {}
    for mode in MODES:
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_command_buffer_scheduling_mode={mode}".strip()
        child = subprocess.run([sys.executable, __file__, "--mode-child", mode], capture_output=True, text=True,
                               env=dict(os.environ, XLA_FLAGS=flags), check=False)
        if child.returncode:
            print(f"{mode} failed:\n{child.stderr[-2000:]}", file=sys.stderr)
            return 1
        results[mode] = json.loads(child.stdout.strip().splitlines()[-1])
    weight_mb = HIDDEN * HIDDEN * 2 / 1e6
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; o_proj {weight_mb:.0f} MB, floor "
          f"{1e6 * weight_mb * 1e6 / costs.copy_bandwidth():.1f} us at the copy bandwidth; us per layer\n")
    print("| variant | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES))
    for v in VARIANTS:
        print(f"| {v} | " + " | ".join(f"{results[m][v]:.1f}" for m in MODES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
