"""engine/pages.py and the scheduler's pages on demand: content keys, reference counts, the prefix
cache and its eviction, growth before each iteration, preemption of the newest request, and how
many rows a pool runs at once against reserving every page up front. Host code only."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import served

from eagle3_jax.config import EngineConfig
from eagle3_jax.engine.pages import ROOT_KEY, PagePool, page_key, page_keys
from eagle3_jax.engine.scheduler import Scheduler
from eagle3_jax.sampling_params import SamplingParams

PAGE = 4
VOCAB = 100
K = 3  # a chain: 2 (K + 1) = 8 positions in flight


def scheduler(num_pages: int, buckets=(2, 4), max_model_len: int = 64, reservation: str = "on_demand",
              page_size: int = PAGE, prefix_caching: bool = True) -> Scheduler:
    cfg = EngineConfig(batch_buckets=buckets, page_size=page_size, num_pages=num_pages, max_model_len=max_model_len,
                       page_reservation=reservation, prefix_caching=prefix_caching)
    return Scheduler(served(cfg), VOCAB, K)


def generate(s: Scheduler, req, n: int) -> None:
    req.output.extend([7] * n)  # as the engine appends collected tokens


def schedule(s: Scheduler) -> tuple[list, list]:
    """s.schedule(), each admitted request's prefill then dispatched whole, as the engine does with
    no rows decoding."""
    admitted, preempted = s.schedule()
    for req in admitted:
        s.prefill_dispatched(req, req.context_len)
    return admitted, preempted


def test_page_keys_chain_each_full_page_and_the_token_after_it():
    tokens = list(range(10))
    keys = page_keys(tokens, PAGE)
    assert len(keys) == 2  # tokens 8, 9: no full page; page 1 is followed by token 8
    assert keys[0] == page_key(ROOT_KEY, [0, 1, 2, 3, 4])
    assert keys[1] == page_key(keys[0], [4, 5, 6, 7, 8])
    assert page_keys(tokens[:8], PAGE) == keys[:1]  # page 1 has no token after it yet
    assert page_keys(tokens, PAGE, known=keys[:1]) == keys  # extended, not recomputed
    other = page_keys([0, 1, 2, 3, 4, 5, 6, 7, 9, 9], PAGE)
    assert other[0] == keys[0] and other[1] != keys[1]  # the next page's first token is part of the key
    assert page_keys([9, 1, 2, 3, 4, 5, 6, 7, 8], PAGE)[1] != keys[1]  # and so is every earlier token


def test_pool_counts_holders_and_keeps_released_cached_pages_until_evicted():
    pool = PagePool(6)  # pages 1..5
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_free == 2 and pool.num_held == 3
    pool.publish(a[:2], [b"x", b"y"])
    assert pool.match([b"x", b"y", b"z"]) == [1, 2]  # the longest cached prefix, now held twice
    assert pool.refs(1) == pool.refs(2) == 2 and pool.match([b"y"]) == [2] and pool.refs(2) == 3
    pool.release([2])
    pool.release(a)
    assert pool.num_held == 2 and pool.num_free == 3  # 1 and 2 still held by the match
    pool.release([1, 2])
    assert pool.num_held == 0 and pool.num_free == 5
    assert pool.match([b"x", b"y"]) == [1, 2]  # idle pages stay cached
    pool.release([1, 2])
    # Allocation takes free pages first, then evicts the idle one released longest ago.
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.allocate(1) == [2]  # released [1, 2] last page first: 2 was idle longest
    assert pool.match([b"x"]) == [1] and pool.match([b"y"]) == []  # y was evicted with its page
    assert pool.allocate(1) is None  # 1 is held: nothing left
    assert pool.num_free == 0


def test_pool_without_prefix_caching_frees_released_pages():
    pool = PagePool(4, prefix_caching=False)
    pages = pool.allocate(2)
    pool.publish(pages, [b"x", b"y"])
    assert pool.match([b"x"]) == []
    pool.release(pages)
    assert pool.num_free == 3 and pool.allocate(3) == [1, 2, 3]


def test_a_running_request_holds_its_tokens_and_two_iterations_in_flight():
    s = scheduler(num_pages=64)
    req = s.add([1] * 5, SamplingParams(max_tokens=40))
    assert s.schedule() == ([req], [])
    assert len(req.pages) == 4  # 5 + 8 = 13 positions; reserving 5 + 40 + 8 would take 14 pages
    generate(s, req, 1)  # the first token: still 5 in the KV
    s.schedule()
    assert len(req.pages) == 4
    generate(s, req, 4)  # 9 in the KV: 17 positions
    s.schedule()
    assert len(req.pages) == 5
    np.testing.assert_array_equal(s.block_tables[req.slot, :5], req.pages)
    s.finish(req, "length")
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.capacity


def test_the_newest_request_is_preempted_and_queued_first_with_its_tokens():
    s = scheduler(num_pages=9, buckets=(4,))  # 8 pages: 32 positions
    a, b, c = (s.add([i] * 4, SamplingParams(max_tokens=20)) for i in (1, 2, 3))
    assert schedule(s) == ([a, b], [])  # 3 pages each (4 + 8 positions); c's 3 do not fit
    generate(s, a, 5)
    generate(s, b, 1)
    assert schedule(s) == ([], [])  # a: 8 in the KV + 8 = 4 pages; b still 3
    assert (len(a.pages), len(b.pages), s.pool.num_free) == (4, 3, 1)
    generate(s, a, 4)
    generate(s, b, 4)
    admitted, preempted = schedule(s)  # a: 12 + 8 = 5 pages, b: 8 + 8 = 4: 9 > 8
    assert preempted == [b] and admitted == []  # nothing is admitted in a step that preempted
    assert list(s.waiting) == [b, c] and b.output == [7] * 5 and (b.slot, b.pages) == (None, [])
    assert b.metrics.preemptions == 1 and list(s.running.values()) == [a] and len(a.pages) == 5
    # Readmitted first once a finishes. Its two full pages were cached when it let them go; the
    # second holds its last KV position, which it prefills again (at least one token).
    s.finish(a, "stop")
    assert schedule(s) == ([b, c], [])
    assert b.num_cached == 4 and b.context_len == 8 and b.metrics.cached_tokens == 4
    assert s.pool.num_held == len(b.pages) + len(c.pages) == 4 + 3


def test_preemption_frees_the_pool_for_the_older_request_even_when_it_was_alone_with_it():
    s = scheduler(num_pages=9, buckets=(2,))
    a, b = s.add([1] * 4, SamplingParams(max_tokens=20)), s.add([2] * 4, SamplingParams(max_tokens=20))
    s.schedule()
    for _ in range(20):  # both grow until one of them must go
        generate(s, a, 1)
        generate(s, b, 1)
        _, preempted = s.schedule()
        if preempted:
            break
    assert preempted == [b] and a.slot is not None  # the older one keeps running


def test_a_request_shares_the_cached_prefix_and_prefills_at_least_one_token():
    s = scheduler(num_pages=64)
    system = list(range(10, 22))  # 12 tokens: three full pages
    first = s.add(system + [1, 2], SamplingParams(max_tokens=4))
    schedule(s)
    schedule(s)  # its prefill dispatched a step ago: its pages are published now
    second = s.add(system + [3], SamplingParams(max_tokens=4))
    same = s.add(system, SamplingParams(max_tokens=4))
    admitted, _ = schedule(s)
    assert admitted == [second, same]
    # Page 2 is keyed with the token after it (1 in `first`, 3 in `second`): two pages reused.
    assert second.num_cached == 8 and second.pages[:2] == first.pages[:2]
    assert same.num_cached == 8  # all 12 cached up to page 2, but the last token is prefilled
    assert s.pool.refs(first.pages[0]) == 3
    for req in (first, second, same):
        s.finish(req, "stop")
    assert s.pool.num_held == 0 and s.pool.num_free == s.pool.capacity


def test_requests_admitted_in_one_step_do_not_share_what_neither_has_written():
    s = scheduler(num_pages=64)
    a, b = (s.add(list(range(10, 22)) + [1], SamplingParams(max_tokens=4)) for _ in range(2))
    assert s.schedule() == ([a, b], [])
    assert b.num_cached == 0 and not set(a.pages) & set(b.pages)


def rows_running(reservation: str, requests: int = 600, prompt_len: int = 100, reply: int = 200,
                 max_tokens: int = 2048, page: int = 16) -> tuple[float, int]:
    """Serve `requests` prompts on a pool of 16 rows at max_tokens, each reply stopping after
    `reply` tokens, one token a step: -> (rows running per step on average, preemptions)."""
    s = scheduler(num_pages=16 * max_tokens // page + 1, buckets=(256,), max_model_len=4096,
                  reservation=reservation, page_size=page, prefix_caching=False)
    for i in range(requests):
        s.add([i % VOCAB] * prompt_len, SamplingParams(max_tokens=max_tokens))
    running, preemptions = [], 0
    while s.waiting or s.running:
        preemptions += len(s.schedule()[1])
        running.append(len(s.running))
        for req in list(s.running.values()):
            req.output.append(5)
            if len(req.output) == reply:
                s.finish(req, "stop")
    return float(np.mean(running)), preemptions


def test_capacity_on_demand_runs_several_times_the_rows_of_reserving_every_page():
    """max_tokens 2048 and replies of 200 on the same pool: reserving every page a request can
    need holds 15 rows (135 pages each of 2,048), pages on demand many more, and the pool running
    dry now and then preempts a few."""
    whole, never = rows_running("whole")
    on_demand, preemptions = rows_running("on_demand")
    assert never == 0 and whole == pytest.approx(15, abs=0.5)
    assert on_demand >= 4 * whole
    assert preemptions > 0


class ReportingDevice:
    """A device as jax reports one with memory statistics (a GPU's; the CPU's report none)."""

    def __init__(self, limit: int, in_use: int):
        self.stats = {"bytes_limit": limit, "bytes_in_use": in_use}

    def memory_stats(self):
        return self.stats


def test_pool_sized_from_the_least_free_memory_of_its_devices():
    import jax

    from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig
    from eagle3_jax.runner.kv_memory import free_bytes, page_bytes

    target = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                         max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,))
    draft = DraftConfig.like_target(target, 100)
    # K and V, 16 tokens, bf16: the target's 4 layers x 4 heads x 8 and the drafter's 1 x 4 x 8.
    assert page_bytes(target, draft, 16, "bfloat16") == 2 * 16 * (128 + 32) * 2
    assert page_bytes(target, draft, 16, "bfloat16", tp=2) == 2 * 16 * (64 + 32) * 2  # heads split, drafter whole
    assert page_bytes(target, None, 16, "float32", tp=3) == 2 * 16 * 128 * 4  # 4 heads do not split 3 ways
    cfg = EngineConfig(max_model_len=64, page_size=16, kv_memory_fraction=0.5)
    one = page_bytes(target, draft, 16, "bfloat16")
    devices = [ReportingDevice(1000 * one, 100 * one), ReportingDevice(1000 * one, 200 * one)]
    free = free_bytes(devices)
    assert (free, served(cfg, draft, target, free).pool.num_pages) == (800 * one, 400)
    assert free_bytes(jax.devices("cpu")) is None  # nothing reported: no pool sized from memory
    with pytest.raises(ConfigError, match=r"holds 16 tokens of KV; one request at max_model_len 64 needs"):
        served(cfg, draft, target, free_bytes([ReportingDevice(4 * one, 0)]))


def test_a_cpu_pool_takes_at_most_a_quarter_of_the_hosts_available_memory(monkeypatch):
    """The CPU reports no memory: every slot at min(max_model_len, 1024) tokens, unless a quarter of
    the host's available memory holds less; one request at max_model_len always fits. Each CPU
    device's share of a page is host memory."""
    from eagle3_jax.config import DraftConfig, ModelConfig
    from eagle3_jax.runner import kv_memory

    target = ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                         num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
                         max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,))
    draft = DraftConfig.like_target(target, 100)
    cfg = EngineConfig(max_model_len=64, page_size=16)
    one = kv_memory.page_bytes(target, draft, 16, "float32")
    wanted = 8 * 4 + 8 + 1  # 8 slots x 4 pages, one request at 64 tokens + two iterations (8), scratch
    available = kv_memory.host_available_bytes()
    assert available is not None and available > 0  # Linux says

    def pool(host_bytes: int | None, devices: int = 1) -> int:
        monkeypatch.setattr(kv_memory, "host_available_bytes", lambda: host_bytes)
        return kv_memory.pool_config(cfg, 8, None, lambda: one, None, devices).num_pages

    assert pool(None) == pool(4 * wanted * one) == pool(1 << 40) == wanted
    assert pool(4 * 20 * one) == 20
    assert pool(4 * 20 * one, devices=2) == 10  # two devices' shares
    assert pool(0) == 8 + 1
