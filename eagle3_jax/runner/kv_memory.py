"""The KV pool sized from the device's free memory (EngineConfig.kv_memory_fraction)."""

from __future__ import annotations

import dataclasses
import os
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


# On a device that reports no memory (the CPU) the pool is host memory: at most this share of what
# is available once the weights are loaded, the rest left to the programs, their compilation and
# the machine's other processes.
HOST_KV_SHARE = 0.25


def host_available_bytes() -> int | None:
    """Host memory available for new allocations (Linux's MemAvailable, else the free pages), None
    where the system does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def host_pool(cfg: EngineConfig, one_page: int) -> EngineConfig:
    """`cfg` with the pool `resolved()` gives a device that reports no memory (every slot at
    min(max_model_len, 1024) tokens, plus one request at max_model_len), cut to HOST_KV_SHARE of the
    host's available memory, yet holding one request at max_model_len. `one_page`: its host bytes."""
    wanted = cfg.resolved().num_pages
    available = host_available_bytes()
    if available is None:
        return dataclasses.replace(cfg, num_pages=wanted)
    least = cfg.max_blocks_per_seq + 1  # one request at max_model_len, and the scratch page
    return dataclasses.replace(cfg, num_pages=max(min(wanted, pages_in(available, HOST_KV_SHARE, one_page)), least))


def pages_in(free: int, fraction: float, one_page: int) -> int:
    """The pages (scratch page included) that `fraction` of `free` bytes holds."""
    return int(free * fraction) // one_page


def sized_pool(cfg: EngineConfig, target: ModelConfig, draft: DraftConfig | None, dtype,
               devices: Sequence[jax.Device], tp: int = 1) -> tuple[EngineConfig, int | None]:
    """`cfg` with num_pages taken from kv_memory_fraction of the free memory of `devices` (each
    holds its share of every page): -> (that config, the free bytes); where the devices report no
    memory, `host_pool`'s (all their shares in the host's memory) and None. ConfigError when it
    holds no request at max_model_len."""
    free = free_bytes(devices)
    if free is None:
        return host_pool(cfg, len(devices) * page_bytes(target, draft, cfg.page_size, dtype, tp)), None
    num_pages = pages_in(free, cfg.kv_memory_fraction, page_bytes(target, draft, cfg.page_size, dtype, tp))
    if num_pages - 1 < cfg.max_blocks_per_seq:
        raise ConfigError(f"engine config: {cfg.kv_memory_fraction} of the {free / 2**30:.2f} GiB free holds "
                          f"{max(num_pages - 1, 0) * cfg.page_size} tokens of KV; one request at max_model_len "
                          f"{cfg.max_model_len} needs {cfg.max_blocks_per_seq * cfg.page_size}: lower max_model_len, "
                          "raise kv_memory_fraction or free memory")
    return dataclasses.replace(cfg, num_pages=num_pages), free
