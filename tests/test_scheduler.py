"""engine/scheduler.py with every page a request can need reserved at admission (page_reservation
"whole"): first-come-first-served admission, finishing, batches padded to buckets, request
validation and per-request metrics. Pages on demand and preemption: tests/test_pages.py. Host code
only: no device, no compile."""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import served

from eagle3_jax.config import EngineConfig
from eagle3_jax.engine.pages import PagePool
from eagle3_jax.engine.scheduler import RequestError, RequestMetrics, Scheduler
from eagle3_jax.sampling_params import SamplingParams

SCRATCH = 0  # page 0: where the block-table rows of free slots point
DUMMY = 0  # slot 0: the padded rows of a batch
VOCAB = 100
K = 3  # draft tokens: a request reserves 2 (K + 1) tokens in flight beyond prompt + max_tokens
PAGE = 4


def scheduler(num_pages: int = 64, buckets=(2, 4), max_model_len: int = 64, k: int = K,
              reservation: str = "whole", prefix_caching: bool = True) -> Scheduler:
    cfg = EngineConfig(batch_buckets=buckets, page_size=PAGE, num_pages=num_pages, max_model_len=max_model_len,
                       page_reservation=reservation, prefix_caching=prefix_caching)
    return Scheduler(served(cfg), VOCAB, k)


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def prefilled(s: Scheduler, reqs) -> None:
    """As the engine: each request's prefill dispatched whole, so it joins the batch."""
    for req in reqs:
        s.prefill_dispatched(req, req.context_len)


def test_page_pool_allocates_lowest_pages_first_and_never_scratch():
    pool = PagePool(6)
    assert (pool.capacity, pool.num_free) == (5, 5)
    assert pool.allocate(0) == [] and pool.num_free == 5  # asking for none takes none
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(4) is None  # 3 free: nothing taken
    assert pool.num_free == 3
    assert pool.allocate(3) == [3, 4, 5]
    assert (pool.num_free, pool.allocate(1)) == (0, None)
    pool.release([1, 2])
    assert pool.num_free == 2
    assert pool.allocate(2) == [1, 2]  # released pages come back in order
    pool.release([3, 4, 5])
    pool.release([1, 2])
    assert sorted(pool.allocate(5)) == [1, 2, 3, 4, 5]


def test_pages_needed_covers_prompt_output_and_two_iterations_in_flight():
    s = scheduler()
    in_flight = 2 * (K + 1)
    assert s.pages_needed(5, 3) == 4  # 5 + 3 + 8 = 16 tokens = 4 pages exactly
    assert s.pages_needed(5, 4) == 5  # 17 tokens: a fifth page
    assert s.pages_needed(1, 1) == -(-(2 + in_flight) // PAGE)
    assert scheduler(k=0).pages_needed(5, 3) == 3  # 5 + 3 + 2 = 10 tokens
    # A tree writes more positions per iteration than it accepts: 2 x 8 in flight here.
    cfg = EngineConfig(batch_buckets=(2,), page_size=PAGE, num_pages=64, max_model_len=64)
    tree = Scheduler(served(cfg), VOCAB, 3, positions_per_iteration=8)
    assert tree.pages_needed(5, 3) == 6  # 5 + 3 + 16 = 24 tokens
    assert tree.add([1] * 5, params(3)).metrics.accepted_at == [0, 0, 0]  # one count per depth, K = 3


def test_admission_is_first_come_first_served_into_the_lowest_free_slots():
    s = scheduler()
    reqs = [s.add([1, 2, 3, 4, 5], params(3)) for _ in range(3)]
    assert [r.id for r in reqs] == [0, 1, 2]
    assert list(s.waiting) == reqs and s.running == {}
    admitted = s.admit()
    assert admitted == reqs
    assert [r.slot for r in reqs] == [1, 2, 3]
    assert s.running == {1: reqs[0], 2: reqs[1], 3: reqs[2]}
    assert not s.waiting
    # Each request reserves every page it can need at admission: 4 pages here, in arrival order.
    assert [r.pages for r in reqs] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert s.pool.num_free == 63 - 12
    for r in reqs:
        np.testing.assert_array_equal(s.block_tables[r.slot, :4], r.pages)
        assert (s.block_tables[r.slot, 4:] == SCRATCH).all()
    assert (s.block_tables[DUMMY] == SCRATCH).all()
    assert (s.block_tables[4] == SCRATCH).all()  # the free slot
    assert s.admit() == []


def test_requests_wait_in_order_when_the_pool_is_short():
    s = scheduler(num_pages=10)  # 9 allocatable pages
    big = s.add([1] * 9, params(11))  # 9 + 11 + 8 = 28 tokens: 7 pages
    bigger = s.add([1] * 9, params(7))  # 24 tokens: 6 pages
    small = s.add([1], params(3))  # 12 tokens: 3 pages, which would fit beside `big`
    assert s.admit() == [big]
    assert s.pool.num_free == 2
    # `bigger` does not fit and `small` waits behind it: first come, first served.
    assert list(s.waiting) == [bigger, small]
    assert (bigger.slot, small.slot) == (None, None)
    assert s.admit() == []
    s.finish(big, "length")
    assert s.admit() == [bigger, small]
    assert bigger.slot == 1 and small.slot == 2  # big's freed slot is reused first
    assert s.pool.num_free == 0


def test_requests_wait_when_every_slot_is_taken():
    s = scheduler(buckets=(2,))  # two slots
    reqs = [s.add([7, 8], params(2)) for _ in range(3)]
    assert s.admit() == reqs[:2]
    assert list(s.waiting) == [reqs[2]]
    s.finish(reqs[1], "stop")
    assert s.admit() == [reqs[2]]
    assert reqs[2].slot == 2


def test_finish_releases_the_slot_and_pages():
    s = scheduler()
    a, b = s.add([1, 2, 3], params(5)), s.add([4, 5], params(2))
    s.admit()
    free_before = s.pool.num_free
    a_pages, a_slot = list(a.pages), a.slot
    s.finish(a, "error", error="boom")
    assert (a.finish_reason, a.error, a.finished) == ("error", "boom", True)
    assert (a.slot, a.pages) == (None, [])
    assert s.pool.num_free == free_before + len(a_pages)
    assert s.running == {b.slot: b}
    assert (s.block_tables[a_slot] == SCRATCH).all()
    assert not b.finished
    # The next request gets the freed slot and pages back.
    c = s.add([1, 2, 3], params(5))
    assert s.admit() == [c]
    assert (c.slot, c.pages) == (a_slot, a_pages)


def test_batch_pads_to_the_bucket_with_the_dummy_slot_and_scratch_rows():
    s = scheduler(buckets=(2, 4, 8))
    reqs = [s.add([1, 2, 3], params(1)) for _ in range(3)]
    s.admit()
    assert s.prefilling == reqs and s.batch()[0] == []  # admitted, not prefilled: no rows yet
    prefilled(s, reqs)
    batch, slots, tables = s.batch()
    assert batch == reqs and s.prefilling == []
    np.testing.assert_array_equal(slots, [1, 2, 3, DUMMY])
    assert slots.dtype == np.int32
    assert tables.shape == (4, s.cfg.pool.max_blocks_per_seq)
    for i, r in enumerate(reqs):
        np.testing.assert_array_equal(tables[i, :len(r.pages)], r.pages)
    assert (tables[3] == SCRATCH).all()
    # One running request pads to the smallest bucket, 2; none still gives a whole bucket.
    s.finish(reqs[0], "stop")
    s.finish(reqs[2], "stop")
    batch, slots, tables = s.batch()
    assert batch == [reqs[1]]
    np.testing.assert_array_equal(slots, [2, DUMMY])
    np.testing.assert_array_equal(tables[0, :len(reqs[1].pages)], reqs[1].pages)
    assert (tables[1] == SCRATCH).all()
    s.finish(reqs[1], "stop")
    batch, slots, tables = s.batch()
    assert batch == []
    np.testing.assert_array_equal(slots, [DUMMY, DUMMY])
    assert (tables == SCRATCH).all()


def test_batch_rows_are_a_copy_of_the_block_tables():
    s = scheduler()
    s.add([1, 2], params(1))
    prefilled(s, s.admit())
    _, _, tables = s.batch()
    tables[:] = 99
    assert (s.block_tables != 99).all()


def test_add_clips_max_tokens_to_the_context_and_stores_python_ints():
    s = scheduler(max_model_len=16)
    req = s.add(np.array([5, 6, 7], np.int64), params(100))
    assert req.max_tokens == 13
    assert req.prompt == [5, 6, 7] and all(type(t) is int for t in req.prompt)
    assert s.add([5], params(4)).max_tokens == 4


def test_add_records_the_arrival_time():
    s = scheduler()
    assert s.add([1], params(1), arrival_time=12.5).metrics.arrival_time == 12.5
    before = time.perf_counter()
    req = s.add([1], params(1))
    assert before <= req.metrics.arrival_time <= time.perf_counter()
    assert (req.metrics.num_draft, req.metrics.accepted_at) == (K, [0, 0, 0])


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ([1.0, 2.0], "prompt token ids must be a flat list of integers"),
    ([[1, 2], [3, 4]], "prompt token ids must be a flat list of integers"),
    (["a"], "prompt token ids must be a flat list of integers"),
    ([1, 2, 100], r"prompt token id 100 at index 2 is outside the vocabulary 0\.\.99"),
    ([3, -1], r"prompt token id -1 at index 1 is outside the vocabulary 0\.\.99"),
    ([1] * 64, r"prompt has 64 tokens; the context holds 64 \(prompt plus at least one generated token\): "
               r"shorten the prompt or raise EngineConfig\.max_model_len"),
    ([1] * 70, "prompt has 70 tokens; the context holds 64"),
])
def test_add_refuses_bad_prompts(prompt, message):
    s = scheduler(max_model_len=64)
    with pytest.raises(RequestError, match=message):
        s.add(prompt, params(4))
    assert not s.waiting


def test_add_refuses_a_stop_token_outside_the_vocabulary():
    s = scheduler()
    with pytest.raises(RequestError, match=r"^stop token id 100 is outside the vocabulary 0\.\.99: the request "
                                           r"could never stop on it$"):
        s.add([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[5, 100]))
    assert not s.waiting
    assert s.add([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[5, 99])).params.stop_token_ids == (5, 99)


def test_add_refuses_a_request_the_whole_pool_cannot_hold():
    s = scheduler(num_pages=5)  # 4 allocatable pages: 16 tokens
    s.add([1] * 4, params(4))  # 4 + 4 + 8 = 16: fits exactly
    message = (r"prompt \+ max_tokens needs 5 KV pages; the whole pool has 4 \(EngineConfig\.num_pages, or "
               r"kv_memory_fraction of the free memory\): lower max_tokens or shorten the prompt")
    with pytest.raises(RequestError, match=message):
        s.add([1] * 4, params(5))
    assert len(s.waiting) == 1
    assert isinstance(RequestError("x"), ValueError)


def test_request_metrics_acceptance():
    m = RequestMetrics(accepted_at=[0, 0, 0], num_draft=3)
    assert (m.acceptance_length, m.acceptance_rates, m.drafted, m.accepted) == (0.0, [0.0, 0.0, 0.0], 0, 0)
    m.record(2)
    m.record(0)
    m.record(3)
    m.record(0, speculative=False)  # a target-only iteration: one token, no drafts
    assert (m.iterations, m.speculative_iterations, m.emitted) == (4, 3, 3 + 1 + 4 + 1)
    assert m.accepted_at == [2, 2, 1]  # 2 accepted: positions 0 and 1; 3 accepted: 0, 1 and 2
    assert m.acceptance_length == pytest.approx(9 / 4)
    # Rates over the speculative iterations only.
    assert m.acceptance_rates == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert (m.drafted, m.accepted) == (9, 5)


def test_request_metrics_token_times():
    m = RequestMetrics()
    assert (m.first_token_time, m.last_token_time) == (None, None)
    m.collected(1.0)
    m.collected(2.5)
    m.collected(4.0)
    assert (m.first_token_time, m.last_token_time) == (1.0, 4.0)


def test_stop_strings_decode_a_tail_and_cut_the_whole_text():
    """A stop string is looked for in a tail of the output (each check after one more token), and
    the text is cut before its first occurrence in the whole output."""
    import types

    from eagle3_jax.engine.scheduler import hit_stop_string

    decoded = []

    def detokenize(ids):  # one character a token: "a", "b", ...
        decoded.append(len(ids))
        return "".join(chr(97 + t) for t in ids)

    req = types.SimpleNamespace(params=SamplingParams(stop=("xyz", "q")), output=[], text=None)
    hits = []
    for t in [0] * 300 + [23, 24, 25, 1]:  # "aaa...axyzb"
        req.output.append(t)
        hits.append(hit_stop_string(req, detokenize))
    assert hits.index(True) == 302 and req.text == "a" * 300
    assert max(decoded[:302]) == 4 * 3 + 8  # tails only, until the hit decodes the whole output
    assert decoded[303] == 303


def streaming(n: int) -> list:
    """n rows decoding with a token read, as `step_calls` reads the decoding ones (their output)."""
    import types

    return [types.SimpleNamespace(output=[1]) for _ in range(n)]


def test_while_rows_decode_a_step_prefills_one_chunk_at_most():
    """engine/prefill.py's plan per step (chunks of 16, the largest prefill bucket; 1 or 4 prompts a
    call). With nothing decoding, a step prefills every chunk of every prompt admitted: a long prompt's
    leading chunks a call each (the only prompt with any), the last chunks grouped by chunk bucket.
    While as many rows stream as prompts prefill, one call at most: the first prompt's next chunk alone,
    or its last chunk joined by the other last chunks of its bucket within two chunks' padded tokens (4
    of 4 tokens, 1 of 16); the scheduler's batch takes a request once its last chunk is dispatched."""
    from eagle3_jax.engine.prefill import step_calls

    cfg = EngineConfig(batch_buckets=(2, 4), page_size=PAGE, num_pages=64, max_model_len=64,
                       prefill_buckets=(4, 16), prefill_batch_buckets=(1, 4))
    s = Scheduler(served(cfg), VOCAB, K)
    long, short, other, last = (s.add(p, params(4)) for p in ([5] * 40, [1, 2, 3], [4, 5], [6] * 9))
    s.admit()

    def plan(decoding: list) -> list[list[tuple[int, int]]]:
        return [[(c.req.id, c.start) for c in call] for call in step_calls(s.prefilling, s.cfg, decoding)]

    assert plan(decoding=[]) == [[(0, 0)], [(0, 16)], [(0, 32), (3, 0)], [(1, 0), (2, 0)]]
    steps = []
    while s.prefilling:  # as the engine dispatches them, four rows streaming
        calls = step_calls(s.prefilling, s.cfg, streaming(4))
        assert len(calls) == 1
        steps.append([(c.req.id, c.start) for c in calls[0]])
        for chunk in calls[0]:
            s.prefill_dispatched(chunk.req, chunk.end(16))
        assert s.batch()[0] == [r for r in (long, short, other, last) if not r.prefilling] == s.decoding
    assert steps == [[(0, 0)], [(0, 16)], [(0, 32)], [(1, 0), (2, 0)], [(3, 0)]]
    assert long.next_chunk is None and s.batch()[0] == [long, short, other, last]


def test_while_rows_decode_short_prompts_share_a_call_of_two_chunks():
    """A few short prompts arriving while as many rows stream join STEP_CHUNKS chunks' padded tokens
    a step (here two of 16 tokens, where one chunk's budget would take one a step), in arrival order."""
    from eagle3_jax.engine.prefill import STEP_CHUNKS, step_calls

    cfg = EngineConfig(batch_buckets=(2, 4), page_size=PAGE, num_pages=64, max_model_len=64,
                       prefill_buckets=(4, 16), prefill_batch_buckets=(1, 2, 4))
    s = Scheduler(served(cfg), VOCAB, K)
    for p in range(4):
        s.add([p + 1] * 9, params(4))
    s.admit()
    assert STEP_CHUNKS == 2
    calls = step_calls(s.prefilling, s.cfg, streaming(4))
    assert [[(c.req.id, c.start) for c in call] for call in calls] == [[(0, 0), (1, 0)]]


def test_a_burst_prefills_every_next_chunk_in_one_step():
    """More prompts prefilling than rows streaming (a burst of arrivals): one step dispatches every
    prompt's next chunk, the leading ones sharing a call, then the last ones grouped as with none
    decoding (chunk bucket 16: four a call; bucket 4 apart). Rows decoding whose first token is not
    read yet do not stream: they count as none."""
    from eagle3_jax.engine.prefill import step_calls

    cfg = EngineConfig(batch_buckets=(2, 8), page_size=PAGE, num_pages=128, max_model_len=64,
                       prefill_buckets=(4, 16), prefill_batch_buckets=(1, 4))
    s = Scheduler(served(cfg), VOCAB, K)
    for p in range(6):
        s.add([p + 1] * 9, params(4))  # ids 0-5: chunk bucket 16
    s.add([7, 8], params(4))  # id 6: chunk bucket 4
    s.admit()

    def plan(decoding: list) -> list[list[tuple[int, int]]]:
        return [[(c.req.id, c.start) for c in call] for call in step_calls(s.prefilling, s.cfg, decoding)]

    burst = [[(0, 0), (1, 0), (2, 0), (3, 0)], [(4, 0), (5, 0)], [(6, 0)]]
    assert plan(streaming(6)) == burst
    assert plan(streaming(7)) == [[(0, 0)]]  # as many streaming as prefilling: one call (4 x 16 > 2 x 16)
    not_read = [type("Row", (), {"output": []})() for _ in range(7)]  # decoding, no token read yet
    assert plan(not_read) == burst
    assert plan(streaming(1) + not_read) == burst

    s2 = Scheduler(served(cfg), VOCAB, K)
    for prompt in ([5] * 40, [1] * 9, [2] * 30, [3] * 3):  # ids 0 (three chunks), 1, 2 (two chunks), 3
        s2.add(prompt, params(4))
    s2.admit()
    calls = step_calls(s2.prefilling, s2.cfg, streaming(1))
    assert [[(c.req.id, c.start) for c in call] for call in calls] == [[(0, 0), (2, 0)], [(1, 0)], [(3, 0)]]
