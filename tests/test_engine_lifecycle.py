"""An engine's device memory is its own to give back: `LLM.close()`, `with LLM(...)` and dropping
the last reference each release every buffer it holds (weights, KV pool, pinned batches), so engines
built one after another in one process all serve; a closed engine refuses work with a clear error."""

from __future__ import annotations

import gc
import weakref

import jax
import pytest
from conftest import make_llm, served

from eagle3_jax.engine.engine import EngineClosedError
from eagle3_jax.runner import kv_memory
from eagle3_jax.runner.kv_memory import HELD_ELSEWHERE_NOTE_BYTES, pool_line
from eagle3_jax.sampling_params import SamplingParams

PROMPTS = [[1, 5, 7, 3, 9], [4, 4, 8, 1, 6, 2]]
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _live_ids() -> set[int]:
    return {id(a) for a in jax.live_arrays()}


@pytest.mark.slow
def test_engines_built_one_after_another_release_their_memory_and_all_serve(tiny_models):
    target, drafts = tiny_models
    gc.collect()
    before = _live_ids()
    first = make_llm(target, drafts["shared"], warmup=False)
    replies = [o.token_ids for o in first.generate(PROMPTS, PARAMS)]
    held = [a for a in jax.live_arrays() if id(a) not in before]
    assert sum(a.nbytes for a in held) > 0
    first.close()
    assert all(a.is_deleted() for a in held)  # freed now, though `first` is still referenced
    assert not _live_ids() - before
    with pytest.raises(EngineClosedError, match="closed"):
        first.generate(PROMPTS, PARAMS)
    first.close()  # a second close does nothing

    with make_llm(target, drafts["shared"], warmup=False) as second:
        assert [o.token_ids for o in second.generate(PROMPTS, PARAMS)] == replies
    assert not _live_ids() - before

    third = make_llm(target, drafts["shared"], warmup=False)
    runner = weakref.ref(third.engine.runner)
    assert [o.token_ids for o in third.generate(PROMPTS, PARAMS)] == replies
    del third
    gc.collect()
    assert runner() is None and not _live_ids() - before


def test_closing_mid_request_ends_it_as_aborted(tiny_models):
    target, _ = tiny_models
    llm = make_llm(target, None, num_draft=0, warmup=False)
    req = llm.engine.add_request(PROMPTS[0], PARAMS)
    llm.close()
    assert req.finished and req.finish_reason == "abort"
    with pytest.raises(EngineClosedError):
        llm.engine.step()


def test_the_pool_line_says_when_the_device_was_held_elsewhere():
    from eagle3_jax.config import EngineConfig

    cfg = served(EngineConfig(max_model_len=1024, num_pages=1025))
    assert "already held" not in pool_line(cfg, 8 << 30, given=False, elsewhere=HELD_ELSEWHERE_NOTE_BYTES - 1)
    line = pool_line(cfg, 8 << 30, given=False, elsewhere=60 << 30)
    assert "60.00 GiB of the device was already held" in line and "LLM.close()" in line
    assert kv_memory.held_elsewhere(jax.devices("cpu"), ()) is None  # the CPU reports no memory
