#!/usr/bin/env python3
"""Why the host's dispatch of an engine step takes about as long as the step runs on the device.

    python3 experiments/graph_launch_probe.py

The profiler puts the engine's host time per step in `cuGraphLaunch` (BENCHMARKS.md),
0.7-1.5 ms per SmolLM2 iteration, close to the iteration's device time. Two readings fit:
the launch costs the host per node of the graph, or it waits while the previous launch of the same
graph is still running. This program tells them apart with chains of n small kernels (each
reduction feeds the next element-wise step, so XLA cannot fuse them), one row of 4096 f32:

  idle        the device drained before each call: the launch alone
  same        the same program dispatched back to back, as the engine does
  alternating two programs of the same size taking turns (a graph never follows itself)
  + side      as `same`, with a small program after each call that reads the output (which the
              next call donates) into a new buffer, kept one call and copied to the host, as the
              engine's verdicts are
  + side, drop the same small program, its output dropped at once (no copy)
  + other     the same small program on another array (never donated), kept and copied
  + side, pair as `+ side`, but the small program writes over one of two donated buffers in turn,
              so nothing is allocated between the calls (how the engine writes its verdicts,
              `PinnedBatch.read_verdicts`)

Columns: kernels per program (from the compiled HLO), device us per call (back-to-back wall time),
and the host's median us per dispatch in each mode. If `same` tracks the device time while `idle`
and `alternating` stay small, the launch waits for its own graph's previous run; if all three
grow with n alike, it is the per-node cost.

Measured on the H200 (jax 0.11.2, BENCHMARKS.md), host us per dispatch
at 800 kernels and 842-897 us of device time: idle 165-245, same 123-157, alternating 163-226,
+ side 1,134-1,252, + side, drop 594-631, + other 1,160-1,683, + side, pair 176-188. A graph launch
by itself costs the host about 0.15-0.3 us a kernel and does not wait for its previous run. What
costs 1-2 us a kernel is a small device buffer allocated between the calls. The likely mechanism:
it moves the next call's temporary buffer, so XLA updates every node of the graph before the
launch. Written into buffers that already exist ("pair"), it costs nothing. The engine's verdicts
(`steps.read_verdicts`) were such an output: with them, XLA's log (TF_CPP_VMODULE=
command_buffer_thunk=3) counted 1,225 graph updates in 2,800 engine iterations, 1,200 of them at
batch buckets 16-64; with the pair, 50, about one per round.

The first table, the launch alone per kernel kind (device drained before each call), tells the
kernels apart: the GEMM chain's extra cost is its one weight argument per step (argument handling
is 1-2 us a buffer), not its kernels.
"""

from __future__ import annotations

import re
import statistics
import time

import jax
import jax.numpy as jnp


def chain(n: int, offset: float):
    def f(x):  # [1, 4096] -> [1, 4096]: n reduce + broadcast steps, one kernel or two each
        for i in range(n):
            x = x * 0.999 + jnp.tanh(jnp.sum(x, axis=-1, keepdims=True) * 1e-3 + offset + i)
        return x
    return jax.jit(f, donate_argnums=0)


def dot_chain(n: int):
    """n GEMV steps, [1, 576] @ [576, 576] in bf16, each a Triton GEMM fusion of XLA's:
    -> (program of (x, weights), (weights,))."""
    def f(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x
    return jax.jit(f, donate_argnums=0), ([jnp.full((576, 576), 1e-3, jnp.bfloat16) for _ in range(n)],)


def pallas_chain(n: int):
    """n Pallas (Triton) kernels, each y = x * 0.999 + 0.001 over [4096]: -> (program of x, ())."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 0.999 + 0.001

    step = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4096,), jnp.float32),
                          interpret=jax.default_backend() == "cpu")

    def f(x):
        for _ in range(n):
            x = step(x)
        return x
    return jax.jit(f, donate_argnums=0), ()


def kernels(compiled) -> int:
    """Kernel launches in the compiled HLO: fusions and custom calls of the entry computation."""
    entry = compiled.as_text().split("ENTRY", 1)[1]
    return len(re.findall(r"= [^ ]+ (fusion|custom-call)\(", entry))


_side = jax.jit(lambda x: x[:, :8] * 2)  # a fresh small output per call, like `read_verdicts` was
# The same, written over a donated buffer (unused but for its address).
_side_into = jax.jit(lambda buffer, x: x[:, :8] * 2, donate_argnums=0, keep_unused=True)


def host_us(fns, x, calls: int, drain: bool, side: str = "") -> tuple[float, jax.Array]:
    """Median us the host spends in one dispatch of `fns` (cycled), with the side program after
    it: "keep" (reads x, output kept one call and copied out), "drop", "other" (reads another array),
    "pair" (as "keep", into two donated buffers taking turns)."""
    samples, held, other = [], None, jnp.ones((1, 4096), jnp.float32)
    pair = [jnp.zeros((1, 8), jnp.float32) for _ in range(2)]
    for i in range(calls):
        if drain:
            x.block_until_ready()
        t = time.perf_counter()
        x = fns[i % len(fns)](x)
        samples.append(time.perf_counter() - t)
        if side == "drop":
            _side(x)  # the result dropped at once
        elif side:
            if side == "pair":
                out = _side_into(pair[0], x)
                pair = [pair[1], out]
            else:
                out = _side(other if side == "other" else x)
            out.copy_to_host_async()
            if held is not None:
                jax.device_get(held)
            held = out
    x.block_until_ready()
    return 1e6 * statistics.median(samples), x


def main() -> None:
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    launch_by_kind()
    print()
    print("| steps | kernels | device us/call | host us: idle | same | alternating | + side | + side, drop | + other "
          "| + side, pair |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in (25, 100, 400):
        a, b = chain(n, 0.0), chain(n, 0.5)
        x = jnp.ones((1, 4096), jnp.float32)
        count = kernels(a.lower(x).compile())
        for f in (a, b):  # compile and build the graphs
            for _ in range(3):
                x = f(x)
        x.block_until_ready()
        calls = 60
        start = time.perf_counter()
        for _ in range(calls):
            x = a(x)
        x.block_until_ready()
        device = 1e6 * (time.perf_counter() - start) / calls
        idle, x = host_us([a], x, calls, drain=True)
        same, x = host_us([a], x, calls, drain=False)
        alternating, x = host_us([a, b], x, calls, drain=False)
        sides = []
        for mode in ("keep", "drop", "other", "pair"):
            us, x = host_us([a], x, calls, drain=False, side=mode)
            sides.append(f"{us:.0f}")
        print(f"| {n} | {count} | {device:.0f} | {idle:.0f} | {same:.0f} | {alternating:.0f} | {' | '.join(sides)} |",
              flush=True)


def launch_by_kind() -> None:
    """The launch alone (device drained before each call), per kernel kind: host us per call."""
    print("\n| kernel kind | steps | kernels | host us per launch, drained | us per kernel |\n|---|---|---|---|---|")
    kinds = (("XLA reduce + elementwise", lambda n: (chain(n, 0.0), ()), (1, 4096), jnp.float32),
             ("XLA Triton GEMM", dot_chain, (1, 576), jnp.bfloat16),
             ("Pallas Triton", pallas_chain, (4096,), jnp.float32))
    for name, build, shape, dtype in kinds:
        for n in (50, 200):
            fn, rest = build(n)  # called as fn(x, *rest), x donated
            x = jnp.ones(shape, dtype)
            count = kernels(fn.lower(x, *rest).compile())
            samples = []
            for i in range(40):
                x = jax.block_until_ready(x)
                t = time.perf_counter()
                x = fn(x, *rest)
                if i >= 5:  # the first calls compile and build the graph
                    samples.append(time.perf_counter() - t)
            us = 1e6 * statistics.median(samples)
            print(f"| {name} | {n} | {count} | {us:.0f} | {us / max(count, 1):.2f} |", flush=True)


if __name__ == "__main__":
    main()
