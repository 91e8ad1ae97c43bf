"""Tensor parallelism: the all-reduce implementation of the run and its measured cost, sharded
random weights, collectives in compiled HLO."""

from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax.bench.common import Result, log
from eagle3_jax.bench.costs import LinkCeilings, seconds_per_call
from eagle3_jax.bench.options import ALLREDUCE_FLAGS, Options
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.parallel import sharding
from eagle3_jax.runner.runner import precompile

# A child process's check that XLA accepts XLA_FLAGS: one psum over the first `tp` devices (argv[1]),
# so the chosen all-reduce is compiled and run once, on the run's platform.
_PROBE = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
n = min(int(sys.argv[1]), jax.device_count())
mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
assert float(f(jnp.ones((n, 8), jnp.float32)).sum()) == n * n * 8
"""


def with_flags(xla_flags: str, flags: Sequence[str]) -> str:
    """XLA_FLAGS text with `flags` appended (XLA takes the last value of a flag given twice)."""
    return " ".join([*xla_flags.split(), *flags])


def check_xla_flags(xla_flags: str, tp: int, timeout: float = 300.0) -> str | None:
    """None when XLA accepts `xla_flags` and runs a psum over `tp` devices under them, else the
    reason in one line. Tried in a child process: XLA aborts the process that parses an unknown
    flag ("Unknown flag in XLA_FLAGS"), and reads XLA_FLAGS once, when jax starts its backend."""
    env = dict(os.environ, XLA_FLAGS=xla_flags, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(tp)], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"a psum under XLA_FLAGS={xla_flags!r} did not finish in {timeout:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    unknown = [line[line.index("Unknown flag"):] for line in lines if "Unknown flag" in line]
    return (unknown or lines[-1:] or [f"exit status {done.returncode}"])[0]


def use_allreduce(implementation: str, tp: int) -> str:
    """Choose XLA's all-reduce implementation (options.ALLREDUCE_FLAGS) for this process: its flags
    appended to XLA_FLAGS, after a child process checked that this jax's XLA knows them and runs
    a psum under them. -> the flags added ("" for the default). Call before jax starts its backend;
    a flag XLA rejects is a SystemExit with XLA's one-line reason, before anything is run."""
    from jax._src import xla_bridge

    flags = ALLREDUCE_FLAGS[implementation]
    if not flags:
        return ""
    if xla_bridge.backends_are_initialized():
        raise SystemExit(f"--allreduce {implementation}: jax has already started its backend, so XLA_FLAGS "
                         "can no longer change; choose it before the first use of a device")
    xla_flags = with_flags(os.environ.get("XLA_FLAGS", ""), flags)
    if reason := check_xla_flags(xla_flags, tp):
        raise SystemExit(f"--allreduce {implementation}: jax {jax.__version__}'s XLA does not run with "
                         f"{' '.join(flags)}: {reason}")
    os.environ["XLA_FLAGS"] = xla_flags
    return " ".join(flags)


def allreduce_chain(mesh: Mesh, chain: int) -> Callable:
    """jit(shard_map) of `chain` dependent psums: x [tp, *shape] split on its first axis, so each
    device all-reduces its own [1, *shape] slice, `chain` times in a row inside one program (as a
    step's all-reduces run: no dispatch between them, each waiting for the previous)."""

    def body(x):
        for _ in range(chain):
            x = jax.lax.psum(x, sharding.TP)
        return x

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(sharding.TP), out_specs=P(sharding.TP),
                                 check_vma=False))


def time_allreduce(mesh: Mesh, shape: tuple[int, ...], dtype, chain: int, calls: int,
                   rounds: int) -> tuple[float, int]:
    """(seconds of one all-reduce of a [*shape] array per device, all-reduces in the compiled
    program). The time is per call over the all-reduces XLA actually kept (normally `chain`)."""
    tp = mesh.shape[sharding.TP]
    x = jax.jit(lambda key: jax.random.normal(key, (tp, *shape), dtype),
                out_shardings=NamedSharding(mesh, P(sharding.TP)))(jax.random.PRNGKey(3))
    compiled = allreduce_chain(mesh, chain).lower(x).compile()
    count = len(hlo_collectives(compiled.as_text()).get("all-reduce", []))
    return seconds_per_call(lambda: compiled(x), calls, rounds) / max(count, 1), count


def allreduce_shapes(target: ModelConfig, batches: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """The activations a step all-reduces: the target's [B, T, D], for decode (T=1) and verify
    (T=K+1). The drafter, replicated, all-reduces nothing."""
    return [(b, t, target.hidden_size) for b in batches for t in (1, k + 1)]


def measure_links(
    opts: Options, mesh: Mesh, dtype, shapes: Sequence[tuple[int, ...]]
) -> tuple[LinkCeilings, list[Result], dict]:
    """All-reduce ceilings over the mesh, under the run's implementation (--allreduce): a large
    array (the bandwidth) and each decode-sized shape (latency-bound; what a step's all-reduces
    really cost). -> (ceilings, table rows, info)."""
    tp, itemsize = mesh.shape[sharding.TP], jnp.dtype(dtype).itemsize
    implementation = opts.allreduce
    large = (max(1, int(opts.allreduce_mb * 1e6) // (4096 * itemsize)), 4096)
    rows, seconds = [], {}
    for shape in [large, *shapes]:
        s, count = time_allreduce(mesh, shape, dtype, opts.allreduce_chain, opts.calls, opts.rounds)
        seconds[shape] = s
        size = math.prod(shape) * itemsize
        rows.append(
            Result(
                "allreduce",
                f"{list(shape)} {jnp.dtype(dtype).name}" + (" (bandwidth)" if shape == large else ""),
                shape[0] if shape != large else 0,
                {
                    "mb": size / 1e6,
                    "us": 1e6 * s,
                    "algbw_gbs": size / s / 1e9,
                    "busbw_gbs": size / s * 2 * (tp - 1) / tp / 1e9,
                    "hlo_allreduces": count,
                    "chain": opts.allreduce_chain,
                    "implementation": implementation,
                },
            )
        )
        log(f"all-reduce ({implementation}) {list(shape)}: {1e6 * s:.1f} us, {size / s / 1e9:.1f} GB/s (algbw), "
            f"HLO {count}")
    link = LinkCeilings(tp, math.prod(large) * itemsize / seconds[large], seconds)
    info = {
        "mesh": f"{tp} devices: " + ", ".join(str(d) for d in mesh.devices.flat),
        "implementation": f"{implementation} (--allreduce; XLA_FLAGS: "
        f"{' '.join(ALLREDUCE_FLAGS[implementation]) or 'none added'})",
        "method": f"jit(shard_map) of {opts.allreduce_chain} dependent psums of the array each device holds, "
        f"time per call (median of {opts.rounds} rounds of {opts.calls}) / the all-reduces in the "
        "compiled HLO",
        "formula": "algbw = S / t (S = bytes each device contributes); busbw = algbw x 2(N-1)/N (NCCL's "
        "ring convention: the bytes each link carries); the floor adds sum(S) / algbw of the "
        "large array",
        "algbw GB/s (floor)": round(link.algbw / 1e9, 1),
        "busbw GB/s": round(link.busbw / 1e9, 1),
    }
    return link, rows, info


@functools.cache
def _random_creator(shape: tuple[int, ...], dtype, out: NamedSharding, kind: str, scale: float) -> Callable:
    """One jitted creator per (shape, dtype, sharding, kind): an 80-layer model needs a dozen small
    programs, not one huge one. With out_shardings each device generates only its own slice
    (threefry is partitionable), so no tensor is ever whole on one device."""

    def make(key):
        if kind == "normal":
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
        return jnp.full(shape, 1 if kind == "ones" else 0, dtype)

    return jax.jit(make, out_shardings=out)


def random_sharded(shapes: Any, shardings: Any, key: jax.Array, scale: float = 0.02) -> Any:
    """Random arrays shaped like `shapes` (ShapeDtypeStructs), each created on its `shardings`:
    float matrices and KV pages scale * N(0, 1) (init_params' 0.02 for weights), 1-D float leaves
    ones (norms), integer leaves zeros (d2t)."""

    def kind(x) -> str:
        return "zeros" if not jnp.issubdtype(x.dtype, jnp.floating) else "ones" if x.ndim == 1 else "normal"

    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    makers = [
        _random_creator(tuple(x.shape), jnp.dtype(x.dtype), where, kind(x), scale)
        for x, where in zip(leaves, treedef.flatten_up_to(shardings))
    ]
    precompile([(m, (keys[0],), {}) for m in dict.fromkeys(makers)])  # the distinct creators, at once
    return treedef.unflatten([m(k) for m, k in zip(makers, keys)])


def sharded_random_params(target: ModelConfig, draft: DraftConfig, own_embedding: bool, mesh: Mesh, dtype):
    """(target params, draft params) with random weights, every tensor created on its shards
    (llama_param_specs), the drafter as the engine holds it (sharding.place_draft: replicated,
    with its own embedding or a copy of the target's)."""
    tp = mesh.shape[sharding.TP]
    t_shapes = jax.eval_shape(lambda: llama.init_params(target, jax.random.PRNGKey(0), dtype))
    d_shapes = jax.eval_shape(lambda: init_draft_params(draft, jax.random.PRNGKey(1), dtype, own_embedding))
    params = random_sharded(t_shapes, sharding.named(mesh, sharding.llama_param_specs(target, tp)),
                            jax.random.PRNGKey(0))
    replicated = sharding.named(mesh, sharding.replicated_like(d_shapes))  # draft_param_specs' layout
    dparams = random_sharded(d_shapes, replicated, jax.random.PRNGKey(1))
    return params, sharding.place_draft(dparams, params.embed, mesh)


def weight_bytes(params: Any, dparams: Any) -> dict[str, int]:
    """Bytes of the target's and the drafter's weights on the first device (what each device
    holds: the layout is symmetric), and whole."""

    def on_first(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    return {
        "target": on_first(params),
        "draft": on_first(dparams),
        "target_whole": sum(x.nbytes for x in jax.tree.leaves(params)),
        "draft_whole": sum(x.nbytes for x in jax.tree.leaves(dparams)),
    }


_COLLECTIVE = re.compile(
    r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}


def hlo_collectives(hlo: str) -> dict[str, list[tuple[tuple[int, ...], int]]]:
    """op -> [(dims, bytes)] per result of each collective instruction in compiled HLO text (an
    async collective at its -start; a combined one, tuple-shaped, once per operand). Exact for
    all-reduce; an async all-gather's tuple also lists its operand."""
    found: dict[str, list] = {}
    for line in hlo.splitlines():
        if m := _COLLECTIVE.search(line):
            for dtype, dims in _ARRAY.findall(m.group(1)):
                shape = tuple(int(d) for d in dims.split(",") if d)
                found.setdefault(m.group(2), []).append((shape, math.prod(shape) * _ITEMSIZE.get(dtype, 0)))
    return found


def device_memory_gb(devices: Sequence[jax.Device]) -> list[float] | None:
    """Peak bytes in use per device (GB), where the backend reports it (GPUs do, the CPU does not)."""
    stats = [d.memory_stats() for d in devices]
    if not all(stats) or not all("peak_bytes_in_use" in s for s in stats):
        return None
    return [round(s["peak_bytes_in_use"] / 1e9, 2) for s in stats]
