"""The KV pool sized from the device's free memory (EngineConfig.kv_memory_fraction)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from eagle3_jax.config import ConfigError, DraftConfig, EngineConfig, ModelConfig
from eagle3_jax.parallel import plan


def page_bytes(target: ModelConfig, draft: DraftConfig | None, page_size: int, dtype, tp: int = 1) -> int:
    """Bytes one page of the pool takes on each device, the target's KV and the drafter's
    (`plan.kv_bytes_per_token`)."""
    return page_size * sum(plan.kv_bytes_per_token(target, draft, tp, np.dtype(dtype).itemsize))


def free_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The least free memory over `devices`, None where one reports none (the CPU)."""
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_limit" in s and "bytes_in_use" in s for s in stats):
        return None
    return min(s["bytes_limit"] - s["bytes_in_use"] for s in stats)


def held_elsewhere(devices: Sequence[jax.Device], own: Sequence[jax.Array]) -> int | None:
    """Bytes in use on the busiest of `devices` beyond the arrays `own` (an engine's weights): what
    another engine, or anything else in the process, holds there. None where nothing is reported."""
    stats = [d.memory_stats() or {} for d in devices]
    if not all("bytes_in_use" in s for s in stats):
        return None
    mine = dict.fromkeys(devices, 0)
    for array in jax.tree.leaves(own):
        for shard in array.addressable_shards:
            if shard.device in mine:
                mine[shard.device] += shard.data.nbytes
    return max(s["bytes_in_use"] - mine[d] for d, s in zip(devices, stats))


def pages_in(free: int, fraction: float, one_page: int) -> int:
    """The pages (scratch page included) that `fraction` of `free` bytes holds."""
    return int(free * fraction) // one_page


def sized_pool(cfg: EngineConfig, target: ModelConfig, draft: DraftConfig | None, dtype,
               devices: Sequence[jax.Device], tp: int = 1) -> tuple[EngineConfig, int | None]:
    """`cfg` with num_pages taken from kv_memory_fraction of the free memory of `devices` (each
    holds its share of every page): -> (that config, the free bytes), or (cfg, None) unchanged
    where the devices report no memory. ConfigError when it holds no request at max_model_len."""
    free = free_bytes(devices)
    if free is None:
        return cfg, None
    num_pages = pages_in(free, cfg.kv_memory_fraction, page_bytes(target, draft, cfg.page_size, dtype, tp))
    if num_pages - 1 < cfg.max_blocks_per_seq:
        raise ConfigError(f"engine config: {cfg.kv_memory_fraction} of the {free / 2**30:.2f} GiB free holds "
                          f"{max(num_pages - 1, 0) * cfg.page_size} tokens of KV; one request at max_model_len "
                          f"{cfg.max_model_len} needs {cfg.max_blocks_per_seq * cfg.page_size}: lower max_model_len, "
                          "raise kv_memory_fraction or free memory")
    return dataclasses.replace(cfg, num_pages=num_pages), free
