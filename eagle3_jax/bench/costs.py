"""Ceilings measured on the device, and the fewest bytes and FLOPs of each call: the floors."""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from eagle3_jax.config import DraftConfig, ModelConfig, TreeSpec


@dataclasses.dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s: the best of the memory-bound kernels below
    flops: float  # FLOP/s of a bf16 matmul on random data
    bandwidths: dict[str, float] = dataclasses.field(default_factory=dict)  # each kernel's bytes/s


def seconds_per_call(fn: Callable[[], Any], calls: int = 10, rounds: int = 5) -> float:
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


def copy_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second (read + written) of one device copy of `gib` GiB of f32: the probe
    scripts' floor (the bench's own is `measure_ceilings`, the best of several kernels)."""
    x = jnp.ones((int(gib * (1 << 28)),), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * x.nbytes / seconds_per_call(lambda: copy(x), calls=10, rounds=3)


def _bandwidths(copy_gb: float) -> dict[str, float]:
    """Bytes per second of each way of streaming copy_gb of random data."""
    x32 = jax.random.uniform(jax.random.PRNGKey(0), (max(1, int(copy_gb * 1e9) // 16384), 4096), jnp.float32)
    x16 = jax.random.uniform(jax.random.PRNGKey(1), (2 * x32.shape[0], 4096), jnp.bfloat16)
    double, row_sum = jax.jit(lambda v: v * 2), jax.jit(lambda v: v.sum(axis=1))
    return {"copy bf16": 2 * x16.nbytes / seconds_per_call(lambda: double(x16)),
            "copy f32": 2 * x32.nbytes / seconds_per_call(lambda: double(x32)),
            "read f32 (row sums)": x32.nbytes / seconds_per_call(lambda: row_sum(x32))}


def measure_ceilings(copy_gb: float, matmul_n: int) -> Ceilings:
    """Memory bandwidth: copies (x * 2, bytes read + written) of copy_gb of random bf16 and f32, and
    a read-only row sum of the f32; the best is the ceiling. Compute: an n^3 bf16 matmul."""
    bandwidths = _bandwidths(copy_gb)  # its arrays are freed before the matmul's
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (matmul_n, matmul_n), jnp.bfloat16) for i in (2, 3))
    matmul = jax.jit(jnp.dot)
    flops = 2 * matmul_n ** 3 / seconds_per_call(lambda: matmul(a, b))
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


def _layers_cost(num_layers: int, split_params: int, qkv_params: int, batch: int, new_tokens: int, context: int,
                 heads: int, kv_heads: int, head_dim: int, itemsize: int, tp: int = 1) -> Cost:
    """Decoder layers run on `new_tokens` tokens per row, per device: its share of the weights read
    once (`split_params` divided over tp; `qkv_params`, the fused wqkv, and the KV cache only when
    tp divides the kv heads), its share of each row's cached KV (`context` tokens) read once, matmul
    and attention FLOPs.

    When tp does not divide the kv heads, sharding.py replicates the whole wqkv (q's columns too)
    and this counts all of it on every device: what the layout holds. The partitioner may read
    less (on jax 0.10 Shardy splits the projection's output and each device slices the weight),
    so in that case the figure is an upper estimate, not a floor."""
    kv_ways = _ways(kv_heads, tp)
    weights = split_params / tp + qkv_params / kv_ways
    kv_bytes = 2 * kv_heads * head_dim * itemsize * context * batch / kv_ways
    flops = batch * new_tokens * (2 * weights + 4 * heads * head_dim * context / tp)
    return Cost(num_layers * (weights * itemsize + kv_bytes), num_layers * flops)


def target_cost(cfg: ModelConfig, batch: int, new_tokens: int, context: int, itemsize: int, tp: int = 1) -> Cost:
    """A target forward of batch x new_tokens tokens, logits at every one of them (per device at tp)."""
    d = cfg.hidden_size
    split = d * cfg.q_size + 3 * d * cfg.intermediate_size  # wo, MLP
    qkv = d * (cfg.q_size + 2 * cfg.kv_size)  # wqkv
    head = cfg.vocab_size * d  # lm_head, or the tied embedding
    vocab_ways = _ways(cfg.vocab_size, tp)
    cost = _layers_cost(cfg.num_layers, split, qkv, batch, new_tokens, context, cfg.num_heads,
                        cfg.num_kv_heads, cfg.head_dim, itemsize, tp)
    cost += Cost(head * itemsize / vocab_ways, 2 * head * batch * new_tokens / vocab_ways)
    if tp > 1:
        # The Megatron layout (parallel/sharding.py): [B, T, D] is all-reduced after wo and after
        # w_down in every layer, and once after the vocab-parallel embedding lookup.
        cost += _allreduced((batch, new_tokens, d), 2 * cfg.num_layers + (vocab_ways > 1), itemsize)
    return cost


def draft_cost(cfg: DraftConfig, batch: int, new_tokens: int, context: int, itemsize: int, first: bool) -> Cost:
    """One draft pass: the midlayer (fc too on the first), draft lm_head at one token per row. The
    same per device at every tp: the drafter is replicated (parallel/sharding.py, "Draft head"),
    so each device reads all of it and all-reduces nothing."""
    h = cfg.hidden_size
    split = cfg.q_size * h + 3 * h * cfg.intermediate_size  # wo, MLP
    split += cfg.num_captures * cfg.target_hidden_size * h if first else 0
    qkv = 2 * h * (cfg.q_size + 2 * cfg.kv_size)  # wqkv (2H in)
    head = h * cfg.draft_vocab_size
    cost = _layers_cost(1, split, qkv, batch, new_tokens, context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        itemsize)
    return cost + Cost(head * itemsize, 2 * head * batch)


def iteration_cost(target: ModelConfig, draft: DraftConfig | None, k: int, batch: int, context: int,
                   itemsize: int, tp: int = 1) -> Cost:
    """One iterate step: verify K+1 tokens; with K > 0, draft extend over them + K-1 chain steps.
    Its all-reduces (tp > 1) are the target's alone."""
    cost = target_cost(target, batch, k + 1, context, itemsize, tp)
    if k:
        cost += draft_cost(draft, batch, k + 1, context, itemsize, first=True)
        for _ in range(k - 1):
            cost += draft_cost(draft, batch, 1, context, itemsize, first=False)
    return cost




def tree_iteration_cost(target: ModelConfig, draft: DraftConfig, spec: TreeSpec, batch: int, context: int,
                        itemsize: int, tp: int = 1) -> Cost:
    """One tree iteration: verify the root and spec.tokens nodes; the draft extend over the
    accepted path (up to spec.steps + 1 positions), then spec.steps - 1 levels of top_k beams."""
    cost = target_cost(target, batch, spec.tokens + 1, context, itemsize, tp)
    cost += draft_cost(draft, batch, spec.steps + 1, context, itemsize, first=True)
    for _ in range(spec.steps - 1):
        cost += draft_cost(draft, batch, spec.top_k, context, itemsize, first=False)
    return cost
