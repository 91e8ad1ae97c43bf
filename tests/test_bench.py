"""CPU smoke test of `eagle3-jax bench`: every phase end to end on a tiny random model.

No timing assertions: only that each phase produced its rows, with positive figures, and that the
report files were written. The tiny target has no tokenizer, so prompts are token ids. Its
drafter has the shapes the 8b phase derives from the same config (draft_config_like), and both
phases use the same engine sizes, so the 8b phase reuses the engine's compiled iterate steps.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from eagle3_jax import bench
from eagle3_jax.config import ModelConfig
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.model.llama import init_params
from eagle3_jax.weights.eagle3 import save_drafter
from eagle3_jax.weights.llama import save_llama

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,))
BATCHES = (1, 2)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, draft = root / "target", root / "draft"
    target.mkdir()
    save_llama(init_params(TINY, jax.random.PRNGKey(0), jnp.float32), target)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "eos_token_id": 2,
              **bench.hf_config_dict(TINY)}
    (target / "config.json").write_text(json.dumps(config))
    dcfg = bench.draft_config_like(TINY)
    save_drafter(init_draft_params(dcfg, jax.random.PRNGKey(1), jnp.float32), dcfg, draft)
    out = root / "out"
    argv = ["--out-dir", str(out), "--target", str(target), "--draft", str(draft), "--step-model", str(target),
            "--batches", ",".join(map(str, BATCHES)), "--num-draft", "1", "--per-step", "--prompts", "2", "--max-tokens", "6",
            "--max-model-len", "64", "--max-model-len-8b", "64", "--prefill-buckets", "32", "--context", "16",
            "--calls", "2", "--rounds", "2", "--bandwidth-gb", "0.01", "--matmul-size", "128",
            "--peer-batches", "1", "--peer-prompts", "1", "--no-peer-8b", "--dtype", "f32"]
    assert bench.main(argv) == 0
    return out, json.loads((out / "bench.json").read_text())


def _rows(data, phase):
    return [r for r in data["results"] if r["phase"] == phase]


def test_files_written(report):
    out, _ = report
    for name in ("bench.md", "bench.json", "bench.png"):
        assert (out / name).stat().st_size > 0


def test_engine_rows(report):
    out, data = report
    rows = _rows(data, "smollm2")
    modes = ("target-only", "EAGLE-3 K=1", "EAGLE-3 K=1 per-step")
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for m in modes for b in BATCHES]
    for r in rows:
        v = r["values"]
        for key in ("tok_s", "tokens", "tpot_ms", "ttft_ms", "iter_ms", "host_ms_per_step", "device_ms", "floor_ms"):
            assert v[key] > 0, (r["mode"], r["batch"], key, v[key])
        assert v["acceptance_length"] >= 1.0
        assert 0.0 <= v["idle_frac"] <= 1.0
        assert v["requests"] == max(2, r["batch"])
        assert len(v["acceptance_rates"]) == (0 if r["mode"] == "target-only" else 1)
    markdown = (out / "bench.md").read_text()
    for mode in modes:
        for b in BATCHES:
            assert f"| {mode} | {b} |" in markdown


def test_step_rows(report):
    out, data = report
    rows = _rows(data, "8b")
    kinds = list(dict.fromkeys(r["mode"] for r in rows))
    assert [k.split(" ")[0] for k in kinds] == ["decode,", "EAGLE-3", "verify"]
    assert len(rows) == len(kinds) * len(BATCHES)
    for r in rows:
        v = r["values"]
        assert v["ms"] > 0 and v["floor_ms"] > 0 and v["pct_of_floor"] > 0 and v["gb"] > 0
        if not r["mode"].startswith("verify"):
            assert v["tok_s_assumed"] > 0 and v["speedup_assumed"] > 0
    assert not [n for n in data["notes"] if "compile(s)" in n]  # nothing compiled inside a timed run
    assert data["meta"]["ceilings"]["bandwidth"] > 0


def test_peer_rows(report):
    _, data = report
    rows = _rows(data, "peer")
    if not rows:  # torch or transformers missing: the peer says so and is skipped
        assert any("peer" in n for n in data["notes"])
        return
    assert [(r["mode"], r["batch"]) for r in rows] == [("HF target", 1)]
    assert rows[0]["values"]["tok_s"] > 0 and rows[0]["values"]["tokens"] > 0


def test_table_formatter():
    rows = [bench.Result("x", "m", 4, {"a": 1.234, "b": [0.5, 0.25], "c": float("nan")})]
    cols = [bench.Column("mode", "mode"), bench.Column("batch", "B", "{}"), bench.Column("a", "A"),
            bench.Column("b", "rates"), bench.Column("c", "C"), bench.Column("missing", "M")]
    assert bench.markdown_table(rows, cols).splitlines() == [
        "| mode | B | A | rates | C | M |", "|---|---|---|---|---|---|", "| m | 4 | 1.23 | 0.50 0.25 | - | - |"]


def test_floor_counts_weights_and_kv():
    target, draft = bench.llama31_8b()
    decode = bench.target_cost(target, batch=1, new_tokens=1, context=0, itemsize=2)
    assert decode.bytes == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)  # all but the embedding
    kv = bench.target_cost(target, batch=4, new_tokens=1, context=1000, itemsize=2).bytes - decode.bytes
    assert kv == pytest.approx(4 * 1000 * 32 * 2 * 8 * 128 * 2)
    it = bench.iteration_cost(target, draft, 3, 1, 0, 2)
    per_pass = bench.draft_cost(draft, 1, 1, 0, 2, first=False).bytes
    assert it.bytes - bench.target_cost(target, 1, 4, 0, 2).bytes == pytest.approx(
        3 * per_pass + 2 * 3 * 4096 * 4096)  # K passes of the midlayer + lm_head, fc once
