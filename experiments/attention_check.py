#!/usr/bin/env python3
"""The paged attention of one layer, XLA form against the Pallas kernel, on real step shapes:
agreement (bf16 inputs, against an f32 evaluation of the XLA form) and time per call.

    python3 experiments/attention_check.py
    python3 experiments/attention_check.py --only "8B verify"     # the cases whose name has this

Each case is one layer's attention of a decode or verify step over a paged pool whose rows hold
`context` cached tokens. The floor is the bytes a step must read (the valid K and V of every row,
once) over the device's copy bandwidth measured here; the XLA form reads the whole block table.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax.bench import costs
from eagle3_jax.model import layers, pallas_attention

# name, batch, new tokens, kv heads, q heads per kv head, head dim, cached tokens, table width (pages)
CASES = [
    ("SmolLM2 verify K=4, 2 rows", 2, 5, 3, 3, 64, 300, 68),
    ("SmolLM2 verify K=4, 16 rows", 16, 5, 3, 3, 64, 300, 68),
    ("SmolLM2 decode, 2 rows", 2, 1, 3, 3, 64, 300, 68),
    ("8B decode, 1 row", 1, 1, 8, 4, 128, 512, 68),
    ("8B decode, 1 row, 4000 cached", 1, 1, 8, 4, 128, 4000, 260),
    ("8B verify 8 x 4 (1000 of 2048 cached)", 8, 4, 8, 4, 128, 1000, 128),
    ("8B verify 8 x 16 (1000 of 2048 cached)", 8, 16, 8, 4, 128, 1000, 128),
]
CPU_CASES = [
    ("SmolLM2 verify K=4, 2 rows", 2, 5, 3, 3, 64, 60, 8),
]
PAGE = 16


def timed(fn, *args, calls: int = 50, rounds: int = 5) -> float:
    """Median ms per call, calls back to back."""
    return 1e3 * costs.seconds_per_call(lambda: fn(*args), calls, rounds)


LAYERS = 32  # attentions per timed program, each reading the last one's output (a model's layers)


def stacked(attend):
    """One program of LAYERS dependent attentions: per-call dispatch (~34 us on the H200) would
    otherwise hide a kernel of a few us."""
    def layers_of(q, k_pages, v_pages, positions, table):
        for _ in range(LAYERS):
            q = attend(q, k_pages, v_pages, positions, table).astype(q.dtype)
        return q
    return jax.jit(layers_of)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this text")
    only = ap.parse_args().only
    gpu_cases = [case for case in CASES if only in case[0]]
    if not gpu_cases:
        ap.error(f"--only {only!r}: no case has it in its name; the cases: {[case[0] for case in CASES]}")
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    bandwidth = costs.copy_bandwidth()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("us per layer: one program of 32 dependent attentions, divided by 32. Pallas columns: splits of each "
          "(row, kv head)'s keys, from pallas_attention.num_splits for about N programs in all (default N = "
          f"{pallas_attention.TARGET_PROGRAMS}); 'N=0' is one split")
    programs = (0, 64, pallas_attention.TARGET_PROGRAMS, 1024)
    print("| case | max abs err XLA | max abs err Pallas | XLA us | "
          + " | ".join(f"Pallas N={n} us (splits)" for n in programs) + " | Pallas 128-key blocks us | floor us | "
          "Pallas % of floor |")
    print("|---|---|---|---|" + "---|" * len(programs) + "---|---|---|")
    xla = jax.jit(layers.paged_attention)
    kernel = jax.jit(pallas_attention.paged_attention)
    for name, b, t, g, r, hd, context, nb in (gpu_cases if jax.default_backend() == "gpu" else CPU_CASES):
        rng = np.random.default_rng(0)
        num_pages = b * nb + 1
        q = jnp.asarray(rng.standard_normal((b, t, g * r, hd)), dtype)
        k_pages, v_pages = (jnp.asarray(rng.standard_normal((num_pages, PAGE, g, hd)), dtype) for _ in range(2))
        table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, nb), jnp.int32)
        positions = jnp.asarray(np.broadcast_to(context + np.arange(t), (b, t)), jnp.int32)
        args = (q, k_pages, v_pages, positions, table)
        f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
        want = np.asarray(xla(*f32, positions, table))
        err_xla = float(np.abs(np.asarray(xla(*args), np.float32) - want).max())
        err_kernel = float(np.abs(np.asarray(kernel(*args), np.float32) - want).max())
        key_blocks = nb // pallas_attention.pages_per_block(nb, PAGE)
        splits = [pallas_attention.num_splits(b, g, key_blocks, n) if n else 1 for n in programs]
        us_xla = 1e3 * timed(stacked(layers.paged_attention), *args, calls=10) / LAYERS
        variants = [functools.partial(pallas_attention.paged_attention, splits=n) for n in splits]
        variants.append(functools.partial(pallas_attention.paged_attention, block_keys=128))
        us = [1e3 * timed(stacked(attend), *args, calls=10) / LAYERS for attend in variants]
        floor_us = 1e6 * 2 * b * (context + t) * g * hd * jnp.dtype(dtype).itemsize / bandwidth
        best = us[programs.index(pallas_attention.TARGET_PROGRAMS)]
        print(f"| {name} | {err_xla:.4f} | {err_kernel:.4f} | {us_xla:.1f} | "
              + " | ".join(f"{u:.1f} ({n})" for u, n in zip(us, splits)) + f" | {us[-1]:.1f} | {floor_us:.2f} | "
              f"{floor_us / best:.0%} |",
              flush=True)
    block_errors(dtype, gpu_cases)
    return 0


def block_errors(dtype, gpu_cases) -> None:
    """layers.attention_block, kernels (RoPE + KV write + q tiles, then attention) against the XLA
    form, both in `dtype`, each against the XLA form in f32: the block's output and written pages."""
    print("\n| attention block | max abs err XLA | max abs err Pallas | max abs err of written K, Pallas |\n"
          "|---|---|---|---|")
    for name, b, t, g, r, hd, context, nb in (gpu_cases if jax.default_backend() == "gpu" else CPU_CASES):
        rng = np.random.default_rng(1)
        d, num_pages = g * r * hd, b * nb + 1
        x = rng.standard_normal((b, t, d))
        wqkv = rng.standard_normal((d, g, r + 2, hd)) / np.sqrt(d)
        wo = rng.standard_normal((d, d)) / np.sqrt(d)
        pages = [rng.standard_normal((1, num_pages, PAGE, g, hd)) for _ in range(2)]  # one layer
        table = jnp.asarray(1 + rng.permutation(num_pages - 1).reshape(b, nb), jnp.int32)
        positions = jnp.asarray(np.broadcast_to(context + np.arange(t), (b, t)), jnp.int32)
        kw = {"inv_freq": layers.rope_inv_freq(hd, 500000.0, None)}
        case = (x, wqkv, wo, pages, positions, table, kw)
        want, want_k = block_outputs("xla", jnp.float32, *case)
        (xla, _), (kernel, kernel_k) = block_outputs("xla", dtype, *case), block_outputs("pallas", dtype, *case)
        print(f"| {name} | {np.abs(xla - want).max():.4f} | {np.abs(kernel - want).max():.4f} | "
              f"{np.abs(kernel_k - want_k).max():.4f} |", flush=True)


def block_outputs(kind, dtype, x, wqkv, wo, pages, positions, table, kw) -> tuple[np.ndarray, np.ndarray]:
    """(attention_block's output, the K pages it wrote, scratch page left out) as f32 arrays."""
    args = [jnp.asarray(a, dtype) for a in (x, wqkv, wo)]  # x stands for the normed input
    k_pages, v_pages = (jnp.asarray(a, dtype) for a in pages)
    fn = jax.jit(functools.partial(layers.attention_block, layer=0, attention=kind, **kw))
    out, k_pages, _ = fn(*args, positions, k_pages, v_pages, block_table=table)
    return np.asarray(out, np.float32), np.asarray(k_pages[0, 1:], np.float32)


if __name__ == "__main__":
    sys.exit(main())
