"""The KV pool sized from the device's free memory (EngineConfig.kv_memory_fraction), and its start-up line."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import jax
import numpy as np

from eagle3_jax.config import (
    ConfigError,
    DraftConfig,
    EngineConfig,
    ModelConfig,
    PoolConfig,
    ServedConfig,
    TreeSpec,
    blocks_per_seq,
)
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


def host_pages(wanted: int, max_blocks: int, one_page: int) -> int:
    """`wanted` pages (scratch included) cut to HOST_KV_SHARE of the host's available memory, yet
    holding one request of `max_blocks` pages: the pool where the devices report no memory (the
    CPU, all of whose devices' shares are host memory). `one_page`: its host bytes."""
    available = host_available_bytes()
    if available is None:
        return wanted
    return max(min(wanted, pages_in(available, HOST_KV_SHARE, one_page)), max_blocks + 1)


def pages_in(free: int, fraction: float, one_page: int) -> int:
    """The pages (scratch page included) that `fraction` of `free` bytes holds."""
    return int(free * fraction) // one_page


def pool_config(cfg: EngineConfig, max_num_seqs: int, tree: TreeSpec | None, one_page: Callable[[], int],
                free: int | None, devices: int = 1) -> PoolConfig:
    """The pool as served: `cfg.num_pages`, else `kv_memory_fraction` of the `free` bytes in pages of
    `one_page()` bytes (each device holds its share of every page), else, where the `devices` report
    no memory, every one of `max_num_seqs` slots at min(max_model_len, 1024) tokens plus one request
    at max_model_len, within the host's memory (`host_pages`). ConfigError when the memory holds no
    request at max_model_len."""
    max_blocks = blocks_per_seq(cfg.max_model_len, cfg.page_size, tree)
    num_pages = cfg.num_pages
    if num_pages is None and free is not None:
        num_pages = pages_in(free, cfg.kv_memory_fraction, one_page())
        if num_pages - 1 < max_blocks:
            raise ConfigError(f"engine config: {cfg.kv_memory_fraction} of the {free / 2**30:.2f} GiB free holds "
                              f"{max(num_pages - 1, 0) * cfg.page_size} tokens of KV; one request at max_model_len "
                              f"{cfg.max_model_len} needs {max_blocks * cfg.page_size}: lower max_model_len, "
                              "raise kv_memory_fraction or free memory")
    elif num_pages is None:
        wanted = max_num_seqs * -(-min(cfg.max_model_len, 1024) // cfg.page_size) + max_blocks + 1
        num_pages = host_pages(wanted, max_blocks, devices * one_page())
    return PoolConfig(page_size=cfg.page_size, num_pages=num_pages, max_blocks_per_seq=max_blocks,
                      page_reservation=cfg.page_reservation, prefix_caching=cfg.prefix_caching,
                      kv_memory_fraction=cfg.kv_memory_fraction)


# Memory held on the device beyond an engine's own weights when its pool is sized, from which the
# start-up line says so: another engine of the process, most often, shrinking this one's pool.
HELD_ELSEWHERE_NOTE_BYTES = 1 << 30


def pool_line(cfg: ServedConfig, sized_from: int | None, given: bool, elsewhere: int | None = None) -> str:
    """The start-up line on the KV pool: its size in tokens and in rows at max_model_len, and what
    sized it (`given`: EngineConfig.num_pages; `sized_from`: the free bytes it was taken from;
    `elsewhere`: bytes in use on the device beyond the engine's weights then)."""
    pool = cfg.pool
    tokens = (pool.num_pages - 1) * pool.page_size
    source = ("EngineConfig.num_pages" if given
              else f"{pool.kv_memory_fraction:g} of {sized_from / 2**30:.2f} GiB free" if sized_from is not None
              else "no memory reported: every slot at min(max_model_len, 1024) tokens, within "
                   f"{HOST_KV_SHARE:g} of the host's available memory")
    if elsewhere is not None and elsewhere >= HELD_ELSEWHERE_NOTE_BYTES:
        source += (f"; {elsewhere / 2**30:.2f} GiB of the device was already held by something else, another "
                   "engine of this process perhaps (LLM.close() releases one)")
    return (f"KV pool: {pool.num_pages - 1} pages of {pool.page_size} tokens = {tokens} tokens, "
            f"{tokens // cfg.max_model_len} rows at max_model_len {cfg.max_model_len} ({source}); "
            f"pages {pool.page_reservation.replace('_', ' ')}, prefix caching {'on' if pool.prefix_caching else 'off'}")
