"""CPU smoke test of `eagle3-jax bench`: every phase end to end on a tiny random model.

No timing assertions: only that each phase produced its rows, with positive figures, and that the
report files were written. The tiny target has no tokenizer, so prompts are token ids. Its
drafter has the shapes the 8b phase derives from the same config (draft_config_like), and both
phases use the same engine sizes, so the 8b phase reuses the engine's compiled iterate steps.

The tensor-parallel path (--tp 2: the all-reduce measurement, the step phase on a mesh, the tp
phase's TP=2 vs TP=1 tokens) runs as scripts/bench_h200.py in a subprocess with two forced CPU
devices, started first so it overlaps the in-process tests.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import CyclicGarbage

from eagle3_jax import bench
from eagle3_jax.arguments import UsageError
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.model.llama import init_params
from eagle3_jax.weights.eagle3 import save_drafter
from eagle3_jax.weights.llama import save_llama

TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=256, tie_word_embeddings=False, eos_token_ids=(2,))
BATCHES = (1, 2)
REPO = Path(__file__).resolve().parents[1]
TP_BATCH, TP_K, TP_PROMPTS, TP_TOKENS, CHAIN = 2, 3, 2, 12, 4


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """scripts/bench_h200.py --only 8b,tp --tp 2 on two forced CPU devices: TINY's shapes with a
    70B-layout drafter (narrower, own embedding), and the tp phase's small model, shrunk."""
    root = tmp_path_factory.mktemp("bench_tp")
    (root / "step").mkdir()
    (root / "step" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "eos_token_id": 2,
                **bench.hf_config_dict(TINY),
            }
        )
    )
    draft = DraftConfig.like_target(TINY, 128, hidden_size=32, intermediate_size=64, head_dim=8)
    (root / "draft.json").write_text(json.dumps(draft.to_hf()))
    out = root / "out"
    argv = [
        "--only",
        "8b,tp",
        "--tp",
        "2",
        "--out-dir",
        str(out),
        "--step-model",
        str(root / "step"),
        "--step-draft",
        str(root / "draft.json"),
        "--batches-8b",
        str(TP_BATCH),
        "--num-draft",
        str(TP_K),
        "--context",
        "16",
        "--max-model-len-8b",
        "64",
        "--calls",
        "2",
        "--rounds",
        "2",
        "--bandwidth-gb",
        "0.01",
        "--matmul-size",
        "128",
        "--allreduce-mb",
        "0.5",
        "--allreduce-chain",
        str(CHAIN),
        "--allreduce",
        "one-shot",  # a GPU flag: XLA on the CPU knows it and ignores it
        "--tp-check-hidden",
        "64",
        "--tp-check-layers",
        "2",
        "--tp-check-vocab",
        "512",
        "--tp-check-prompts",
        str(TP_PROMPTS),
        "--tp-check-tokens",
        str(TP_TOKENS),
    ]
    flags = [
        f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=2"])
    )
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "bench_h200.py"), *argv],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module", autouse=True)
def _tp_started(tp_run):
    """Start the subprocess before the in-process phases (two cores: it runs alongside them)."""


@pytest.fixture(scope="module")
def tp_report(tp_run):
    proc, out = tp_run
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("bench --tp 2 timed out")
    assert proc.returncode == 0, stderr[-4000:]
    assert "# eagle3-jax bench" in stdout
    return json.loads((out / "bench.json").read_text()), (out / "bench.md").read_text()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    target, draft = root / "target", root / "draft"
    target.mkdir()
    save_llama(init_params(TINY, jax.random.PRNGKey(0), jnp.float32), target)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "eos_token_id": 2,
        **bench.hf_config_dict(TINY),
    }
    (target / "config.json").write_text(json.dumps(config))
    dcfg = bench.draft_config_like(TINY)
    save_drafter(init_draft_params(dcfg, jax.random.PRNGKey(1), jnp.float32), dcfg, draft)
    out = root / "out"
    argv = [
        "--only",
        "smollm2,8b,peer",  # every default phase of an accelerator, on tiny shapes (the CPU's default is smollm2)
        "--out-dir",
        str(out),
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--step-model",
        str(target),
        "--batches",
        ",".join(map(str, BATCHES)),
        "--num-draft",
        "1",
        "--per-step",
        "--prompts",
        "2",
        "--max-tokens",
        "6",
        "--max-model-len",
        "64",
        "--max-model-len-8b",
        "64",
        "--prefill-buckets",
        "32",
        "--context",
        "16",
        "--prefill-batch-buckets",
        "1,2",  # the 2 prompts of a round share a prefill call
        "--calls",
        "2",
        "--rounds",
        "2",
        "--bandwidth-gb",
        "0.01",
        "--matmul-size",
        "128",
        "--peer-batches",
        "1",
        "--peer-prompts",
        "1",
        "--no-peer-8b",
        "--dtype",
        "f32",
        "--profile",
        str(root / "prof"),
    ]
    assert bench.main(argv) == 0
    return out, json.loads((out / "bench.json").read_text())


def _rows(data, phase):
    return [r for r in data["results"] if r["phase"] == phase]


@pytest.mark.slow
def test_files_written(report):
    out, _ = report
    for name in ("bench.md", "bench.json", "bench.png"):
        assert (out / name).stat().st_size > 0


def default_bucket(mode: str, batch: int) -> int:
    """The engine's default for the mode: the target alone runs one request on one row, a chain
    pads it to two."""
    return max(batch, 1 if mode == "target-only" else 2)


@pytest.mark.slow
def test_engine_rows(report):
    out, data = report
    rows = _rows(data, "smollm2")
    modes = ("target-only", "EAGLE-3 K=1", "EAGLE-3 K=1 per-step", "EAGLE-3 K=1 auto")
    assert [(r["mode"], r["batch"]) for r in rows] == [(m, b) for m in modes for b in BATCHES]
    for r in rows:
        v = r["values"]
        assert v["bucket"] == default_bucket(r["mode"], r["batch"])
        iterations = (v["speculative_iterations"], v["target_only_iterations"])
        if r["mode"] == "target-only":
            assert iterations[0] == 0 and iterations[1] > 0
        elif r["mode"].endswith("auto"):  # the policy chose, per iteration
            assert sum(iterations) > 0
        else:  # the fixed EAGLE-3 rows speculate at every batch size
            assert iterations[0] > 0 and iterations[1] == 0
        for key in ("tok_s", "tokens", "tpot_ms", "ttft_ms", "iter_ms", "host_ms_per_step", "device_ms", "floor_ms"):
            assert v[key] > 0, (r["mode"], r["batch"], key, v[key])
        assert v["acceptance_length"] >= 1.0
        assert 0.0 <= v["idle_frac"] <= 1.0
        assert v["device_busy_ms"] >= 0 and 0.0 <= v["idle_measured"] <= 1.0  # --profile (no GPU here: busy 0)
        assert v["requests"] == max(2, r["batch"])
        assert len(v["acceptance_rates"]) == (0 if r["mode"] == "target-only" else 1)
        assert v["gc_passes"] >= v["gc_full_passes"] >= 0 and v["gc_ms_per_step"] >= 0
    markdown = (out / "bench.md").read_text()
    for mode in modes:
        for b in BATCHES:
            assert f"| {mode} | {b} | {default_bucket(mode, b)} |" in markdown
    assert [n for n in data["notes"] if n.startswith("EAGLE-3 K=1 auto: speculation policy") and "break-even" in n]
    # --profile: where each row's host thread spent its time: the compiled programs' dispatch and
    # the engine's own frames are among its largest self times (the order of the small ones varies).
    host_notes = [n for n in data["notes"] if "the host thread's self time per iteration" in n]
    assert len(host_notes) == len(modes) * len(BATCHES)
    assert all("PjitFunction(" in n and ("engine.py" in n or "runner.py" in n) for n in host_notes)


@pytest.mark.slow
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
    # --profile traced every step: one trace per step, its device time in the row (no GPU here: 0)
    traces = list((out.parent / "prof").rglob("perfetto_trace.json.gz"))
    assert len(traces) == len(rows) + len(_rows(data, "smollm2"))  # a round per smollm2 row too
    assert all(0 <= r["values"]["device_idle_pct"] <= 100 for r in rows)
    assert set(data["info"]["8b"]["device kernels per call (--profile: family, us, count)"]) == {
        f"{r['mode']}, batch {r['batch']}" for r in rows
    }


@pytest.mark.slow
def test_peer_rows(report):
    _, data = report
    rows = _rows(data, "peer")
    if not rows:  # torch or transformers missing: the peer says so and is skipped
        assert any("peer" in n for n in data["notes"])
        return
    assert [(r["mode"], r["batch"]) for r in rows] == [("HF target", 1)]
    assert rows[0]["values"]["tok_s"] > 0 and rows[0]["values"]["tokens"] > 0


def test_device_activity_from_a_trace():
    """Busy time is the union of the device's events within the window (overlapping streams count
    once, an event straddling the window's start counts its part inside), host events are not the
    device's, and the window comes from a host annotation."""
    from eagle3_jax.bench import profile

    def x(pid, ts, dur, name, tid=0):
        return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}

    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0 (NVIDIA H200)"}},
        x(1, 100, 30, "probe-round"),
        x(1, 100, 30, "host work"),
        x(2, 95, 7, "gemm_fusion_dot.1"),
        x(2, 100, 10, "gemm_fusion_dot.2"),
        x(2, 105, 10, "attention", tid=1),
        x(2, 120, 5, "gemm_fusion_dot_3.1"),
        x(2, 140, 5, "after the window"),
    ]
    start, end = profile.marker_span(events, "probe-round")
    act = profile.device_activity(events, start, end)
    assert (start, end) == (100.0, 130.0)
    assert act.busy_us == 20.0  # [100, 115) and [120, 125)
    assert act.idle_frac == pytest.approx(1 - 20 / 30)
    assert act.events == 3  # started inside: two of the gemm family (layers' instances), one attention
    assert act.by_name == (("gemm_fusion_dot", 2, 15.0), ("attention", 1, 10.0))
    assert profile.union_us([(0, 10), (2, 3), (10, 12), (20, 21)]) == 13
    with pytest.raises(KeyError, match="no event named"):
        profile.marker_span(events, "missing")


def test_host_activity_self_times():
    """The host thread's events by name, self time excluding nested events (hand-sized trace);
    the thread is the one that recorded the marker, whatever it is called."""
    from eagle3_jax.bench import profile

    def x(ts, dur, name, tid=7):
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name}

    events = [
        {"ph": "M", "pid": 1, "tid": 8, "name": "thread_name", "args": {"name": "python"}},
        x(0, 165, "profiled-region"),
        x(0, 100, "$driver.py:1 step"),
        x(5, 40, "PjitFunction(iterate)"),
        x(10, 20, "Execute"),  # nested twice
        x(50, 30, "numpy asarray"),
        x(110, 50, "$driver.py:1 step"),
        x(115, 10, "PjitFunction(iterate)"),
        x(20, 60, "elsewhere", tid=8),
        x(170, 5, "after the window"),
    ]
    thread = profile.marker_thread(events, "profiled-region")
    assert thread == (1, 7)
    rows = profile.host_activity(events, 0, 165, thread)
    assert rows == (
        ("$driver.py:1 step", 2, 150.0, 70.0),  # 100 - 40 - 30, plus 50 - 10
        ("PjitFunction(iterate)", 2, 50.0, 30.0),
        ("numpy asarray", 1, 30.0, 30.0),
        ("Execute", 1, 20.0, 20.0),
        ("profiled-region", 1, 165.0, 15.0),
    )  # 165 - 100 - 50
    assert sum(r[3] for r in rows) == 165.0  # self times add up to the top-level span
    with pytest.raises(KeyError, match="missing"):
        profile.marker_thread(events, "missing")


def _scaled_tanh(x):
    y = jnp.sin(x) * 2
    return jnp.tanh(y @ x.T) + 1


def test_kernels_by_source_line():
    """A compiled program's kernel launches carry their source lines (the optimized HLO's stack
    tables), pair in order with one call's kernels in a trace (an extra copy the HLO does not show
    left unpaired, another module's kernels left out, durations the median over the calls), and
    group by line."""
    import inspect

    from eagle3_jax.bench import profile

    text = jax.jit(_scaled_tanh).lower(jnp.ones((8, 8))).compile().as_text()
    sites = profile.hlo_kernel_sites(text)
    first = inspect.getsourcelines(_scaled_tanh)[1]
    lines = [next(line for f, fn, line in site.frames if fn == "_scaled_tanh") for site in sites]
    assert len(sites) >= 2 and set(lines) == {first + 1, first + 2} and lines == sorted(lines)
    assert all(site.frames[0][0] == "test_bench.py" and site.kernel for site in sites)

    def x(ts, dur, name, module="jit__scaled_tanh"):
        return {"ph": "X", "pid": 2, "tid": 0, "ts": ts, "dur": dur, "name": name, "args": {"hlo_module": module}}

    names = [site.kernel for site in sites]
    events = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    for call, scale in enumerate((1.0, 3.0, 2.0)):  # medians: the middle call's durations
        t = 100.0 * call
        events += [x(t, scale, names[0]), x(t + 10, 7.0, "memcpy32_post")]
        events += [x(t + 20 + i, scale * (i + 2), name) for i, name in enumerate(names[1:])]
        events.append(x(t + 50, 1.0, "elsewhere", module="jit_other"))
    one_call = profile.call_kernels(events, 3, "jit__scaled_tanh")
    assert one_call == [(names[0], 2.0), ("memcpy32_post", 7.0)] + [(n, 2.0 * (i + 2)) for i, n in enumerate(names[1:])]
    pairs = profile.align_kernels(sites, one_call)
    assert [(s and s.instruction, k and k[0]) for s, k in pairs] == (
        [(sites[0].instruction, names[0]), (None, "memcpy32_post")] + [(s.instruction, s.kernel) for s in sites[1:]])
    rows = profile.kernels_by_source(pairs, {"test_bench.py"}.__contains__, depth=1)
    want = {"(no HLO launch)": (1, 7.0)}
    for line, us in zip(lines, [2.0] + [2.0 * (i + 2) for i in range(len(names) - 1)]):
        count, total = want.get(f"test_bench.py:{line} _scaled_tanh", (0, 0.0))
        want[f"test_bench.py:{line} _scaled_tanh"] = (count + 1, total + us)
    assert {label: (count, us) for label, count, us in rows} == want
    assert [us for _, _, us in rows] == sorted((us for _, _, us in rows), reverse=True)


def test_collector_pauses_counts_and_times_collections():
    from eagle3_jax.bench.common import collector_pauses

    callbacks = list(gc.callbacks)
    with collector_pauses() as pauses:
        for _ in range(3):
            CyclicGarbage()
            gc.collect()
        gc.collect(0)
    assert pauses.passes[2] == pauses.full_passes >= 3 and pauses.passes[0] >= 1
    assert pauses.seconds > 0
    seen = list(pauses.passes)
    gc.collect()  # after the block: not counted, the callback gone
    assert pauses.passes == seen and gc.callbacks == callbacks


def test_table_formatter():
    rows = [bench.Result("x", "m", 4, {"a": 1.234, "b": [0.5, 0.25], "c": float("nan")})]
    cols = [
        bench.Column("mode", "mode"),
        bench.Column("batch", "B", "{}"),
        bench.Column("a", "A"),
        bench.Column("b", "rates"),
        bench.Column("c", "C"),
        bench.Column("missing", "M"),
    ]
    assert bench.markdown_table(rows, cols).splitlines() == [
        "| mode | B | A | rates | C | M |",
        "|---|---|---|---|---|---|",
        "| m | 4 | 1.23 | 0.50 0.25 | - | - |",
    ]


def test_floor_counts_weights_and_kv():
    target, draft = bench.llama31_8b()
    decode = bench.target_cost(target, batch=1, new_tokens=1, context=0, itemsize=2)
    assert decode.bytes == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=0.01)  # all but the embedding
    kv = bench.target_cost(target, batch=4, new_tokens=1, context=1000, itemsize=2).bytes - decode.bytes
    assert kv == pytest.approx(4 * 1000 * 32 * 2 * 8 * 128 * 2)
    it = bench.iteration_cost(target, draft, 3, 1, 0, 2)
    per_pass = bench.draft_cost(draft, 1, 1, 0, 2, first=False).bytes
    assert it.bytes - bench.target_cost(target, 1, 4, 0, 2).bytes == pytest.approx(
        3 * per_pass + 2 * 3 * 4096 * 4096
    )  # K passes of the midlayer + lm_head, fc once


# ---- tensor parallelism ----------------------------------------------------------------------------
@pytest.mark.slow
def test_tp_tokens_identical(tp_report):
    data, markdown = tp_report
    rows = _rows(data, "tp")
    assert [(r["mode"], r["values"]["tp"]) for r in rows] == [
        ("target-only", 1),
        (f"EAGLE-3 K={TP_K}", 1),
        ("target-only", 2),
        (f"EAGLE-3 K={TP_K}", 2),
    ]
    for r in rows:
        v = r["values"]
        assert r["batch"] == TP_PROMPTS and v["tokens"] == TP_PROMPTS * TP_TOKENS
        assert v["acceptance_length"] >= 1.0
        # The EAGLE-3 runs verified drafts at every iteration (none fell back to the target alone).
        assert v["iterations"] > 0
        assert v["speculative_iterations"] == (v["iterations"] if r["mode"].startswith("EAGLE") else 0)
        if v["tp"] == 2:  # against the same mode at TP=1
            assert (v["identical"], v["mismatched"], v["first_mismatch"]) == ("yes", 0, None), v
        if (r["mode"], v["tp"]) != ("target-only", 1):  # greedy EAGLE-3 is lossless, at every TP
            assert v["identical_target_tp1"] == "yes", (r["mode"], v)
    assert data["info"]["tp"]["identical"] == "yes"
    assert "greedy tokens identical: yes" in markdown


@pytest.mark.slow
def test_tp_allreduce_measured(tp_report):
    data, _ = tp_report
    rows = _rows(data, "allreduce")
    # The target's activations only: the replicated drafter all-reduces nothing.
    shapes = [f"{[TP_BATCH, t, TINY.hidden_size]} float32" for t in (1, TP_K + 1)]
    assert [r["mode"] for r in rows[1:]] == shapes and rows[0]["mode"].endswith("(bandwidth)")
    for r in rows:
        v = r["values"]
        assert v["hlo_allreduces"] == CHAIN  # every psum of the chain stayed an all-reduce
        assert v["us"] > 0 and v["algbw_gbs"] > 0
        assert v["busbw_gbs"] == pytest.approx(v["algbw_gbs"] * 2 * (2 - 1) / 2)
        assert v["implementation"] == "one-shot"
    meta = data["meta"]["allreduce"]
    assert meta["tp"] == 2 and meta["algbw"] > 0 and len(meta["seconds"]) == 1 + len(shapes)
    # --allreduce one-shot: its flag was in XLA_FLAGS when jax started, and the report says so.
    assert meta["implementation"] == "one-shot"
    assert "--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true" in data["meta"]["xla_flags"].split()
    assert data["info"]["allreduce"]["implementation"].startswith("one-shot (--allreduce; XLA_FLAGS: --xla_gpu_")
    assert data["info"]["8b"]["all-reduce implementation"] == "one-shot"


@pytest.mark.slow
def test_tp_step_rows(tp_report):
    data, markdown = tp_report
    rows = _rows(data, "8b")
    assert [(r["mode"].split(" ")[0], r["batch"]) for r in rows] == [("decode,", 2), ("EAGLE-3", 2), ("verify", 2)]
    # TINY has 2 layers: target 2 per layer + embedding, in every step; the drafter none.
    expected = {"decode,": 5, "EAGLE-3": 5, "verify": 5}
    for r in rows:
        v = r["values"]
        assert v["tp"] == 2
        assert v["ar_count"] == v["ar_count_hlo"] == expected[r["mode"].split(" ")[0]], (r["mode"], v)
        assert v["ar_mb_hlo"] == pytest.approx(v["ar_mb"])  # f32 here: activations and all-reduces alike
        assert v["ar_floor_ms"] > 0 and v["device_floor_ms"] > 0
        assert v["floor_ms"] == pytest.approx(v["device_floor_ms"] + v["ar_floor_ms"])
        assert v["ms"] > 0 and math.isfinite(v["ar_latency_ms"]) and v["ar_latency_ms"] > 0
        assert v["pct_of_floor"] == pytest.approx(100 * v["floor_ms"] / v["ms"])
    assert not [n for n in data["notes"] if "compile(s)" in n or "the floor counts" in n], data["notes"]
    info = data["info"]["8b"]
    held = info["weight bytes"]
    # Each of the 2 devices holds half of every target matrix (norms replicated, so a bit more) and
    # the whole drafter.
    assert held["target_whole"] / 2 < held["target"] < held["target_whole"] / 2 + 4 * 64 * 8
    assert held["draft"] == held["draft_whole"]
    assert info["drafter"] == "replicated on every device (no collective in the draft extend or steps), with its " \
        "own embedding (70B layout)"
    assert "Step functions: step shapes at TP=2" in markdown and "all-reduce floor ms" in markdown


def test_tp_floor_70b():
    """Per-device bytes and the all-reduces of Llama-3.3-70B + its drafter at TP=2 (no devices)."""
    target, draft = bench.llama33_70b()
    decode = bench.target_cost(target, batch=8, new_tokens=1, context=0, itemsize=2, tp=2)
    # bf16 over 2 devices: one byte per parameter read, all but the embedding (a lookup) and norms.
    assert decode.bytes == pytest.approx(70_553_706_496 - 128256 * 8192 - 161 * 8192)
    assert decode.allreduces == ((8, 1, 8192),) * 161 and decode.allreduce_bytes == 161 * 8 * 8192 * 2
    it = bench.iteration_cost(target, draft, 3, 8, 0, 2, tp=2)
    assert it.allreduces == ((8, 4, 8192),) * 161  # the target's verify; the replicated drafter none
    # ... and every device reads the whole drafter: the same draft bytes as at tp 1.
    one_device = bench.iteration_cost(target, draft, 3, 8, 0, 2)
    draft_bytes = one_device.bytes - bench.target_cost(target, 8, 4, 0, 2).bytes
    assert it.bytes - bench.target_cost(target, 8, 4, 0, 2, tp=2).bytes == pytest.approx(draft_bytes)
    c, link = bench.Ceilings(4e12, 1e15), bench.LinkCeilings(2, 2e11)
    assert it.floor_s(c, link) == pytest.approx(it.bytes / 4e12 + it.allreduce_bytes / 2e11)
    with pytest.raises(ValueError, match="all-reduce bandwidth"):
        it.floor_s(c)
    assert bench.LinkCeilings(4, 1e11).busbw == pytest.approx(1.5e11)
    # kv heads (8) do not divide 16: wqkv and the KV cache stay whole on every device.
    kv = [
        bench.target_cost(target, 1, 1, 1000, 2, tp=tp).bytes - bench.target_cost(target, 1, 1, 0, 2, tp=tp).bytes
        for tp in (1, 8, 16)
    ]
    assert kv[1] == pytest.approx(kv[0] / 8) and kv[2] == pytest.approx(kv[0])
    # ... and so are wqkv's q columns (one fused weight): at tp 16 each device reads all of q/k/v.
    d, q, k_v, inter = 8192, 64 * 128, 2 * 8 * 128, 28672
    per_layer = (d * q + 3 * d * inter) / 16 + d * (q + k_v)  # wo + MLP split; wqkv whole
    assert bench.target_cost(target, 1, 1, 0, 2, tp=16).bytes == pytest.approx(2 * (80 * per_layer + 128256 * d / 16))


def test_allreduce_option_errors():
    def parse(*argv):  # a step model whose random weights fit any machine's memory check
        args = [*argv, "--step-model", "smollm2-135m"]
        return bench.Options.from_args(bench.build_parser().parse_args(args))

    assert parse("--only", "8b", "--tp", "2", "--allreduce", "nvshmem").allreduce == "nvshmem"
    assert parse("--only", "8b").allreduce == "default"
    with pytest.raises(UsageError, match=r"^--allreduce: unknown implementation 'two-shot'; choose from default, "
                                         r"one-shot, nvshmem$"):
        parse("--only", "8b", "--tp", "2", "--allreduce", "two-shot")
    with pytest.raises(UsageError, match=r"^--allreduce one-shot chooses the all-reduce of a tensor-parallel run: "
                                         r"give --tp N with N >= 2$"):
        parse("--only", "8b", "--allreduce", "one-shot")


def test_allreduce_flag_xla_rejects_is_one_line(monkeypatch):
    """A flag this jax's XLA does not know stops the bench before the run, with XLA's reason in one
    line (XLA itself would abort the process at backend start), and leaves XLA_FLAGS as it was."""
    from jax._src import xla_bridge

    from eagle3_jax.bench import collectives

    monkeypatch.setitem(collectives.ALLREDUCE_FLAGS, "made-up", ("--xla_gpu_made_up_all_reduce=true",))
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(SystemExit) as e:
        collectives.use_allreduce("made-up", 2)
    assert str(e.value) == (f"--allreduce made-up: jax {jax.__version__}'s XLA does not run with "
                            "--xla_gpu_made_up_all_reduce=true: Unknown flag in XLA_FLAGS: "
                            "--xla_gpu_made_up_all_reduce=true")
    assert os.environ.get("XLA_FLAGS") == before
    assert collectives.use_allreduce("default", 2) == ""  # nothing to check or set
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    with pytest.raises(SystemExit, match="jax has already started its backend"):
        collectives.use_allreduce("one-shot", 2)


def test_hlo_collectives_parser():
    hlo = """
  %all-reduce-start = bf16[8,4,8192]{2,1,0} all-reduce-start(%fusion.1), channel_id=1, to_apply=%add
  %all-reduce-done = bf16[8,4,8192]{2,1,0} all-reduce-done(%all-reduce-start)
  %psum = (f32[8,4,64]{2,1,0}, f32[8,4,64]{2,1,0}) all-reduce(%a, %b), replica_groups={{0,1}}, to_apply=%add
  %ag = f32[8,4,256]{2,1,0} all-gather(%x), dimensions={2}
  %f = f32[8,4,64]{2,1,0} fusion(%psum), kind=kLoop
"""
    assert bench.hlo_collectives(hlo) == {
        "all-reduce": [((8, 4, 8192), 8 * 4 * 8192 * 2), ((8, 4, 64), 8 * 4 * 64 * 4), ((8, 4, 64), 8 * 4 * 64 * 4)],
        "all-gather": [((8, 4, 256), 8 * 4 * 256 * 4)],
    }


def test_peer_process_group_is_reaped(tmp_path):
    """The peer's child process runs in a group of its own; what it leaves behind (torch.compile's
    workers) is killed when it returns, and its output still comes back."""
    from eagle3_jax.bench.peer import run_isolated

    pid_file = tmp_path / "pid"
    code = (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); print('out'); print('err', file=sys.stderr); sys.exit(3)"
    )
    done = run_isolated([sys.executable, "-c", code], dict(os.environ), timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    stat = Path(f"/proc/{int(pid_file.read_text())}/stat")

    def alive():  # a killed process not yet reaped (a zombie) is not running
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 5
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()  # killed: the sleep would have run for a minute
    with pytest.raises(subprocess.TimeoutExpired):
        run_isolated([sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ), timeout=0.5)


def test_the_shipped_drafter_serves_smollm2_converted_anywhere(tmp_path):
    """Without --draft the bench measures the shipped drafter wherever it fits the target, so a
    SmolLM2-135M-Instruct converted to another directory (as on a GPU machine without the default
    checkpoint) is not measured with a random drafter; a target it does not fit gets a random one,
    labelled as such."""
    from eagle3_jax import assets, presets
    from eagle3_jax.bench.phases import resolve_draft

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text(json.dumps(presets.SMOLLM2_135M))
    (elsewhere / "model.safetensors").touch()  # what the bench checks before loading: the file is there
    opts = bench.Options.from_args(bench.build_parser().parse_args(["--target", str(elsewhere)]))
    smollm2, _ = presets.smollm2_135m()
    path, label = resolve_draft(opts, smollm2, tmp_path)
    assert path == assets.DEFAULT_DRAFT
    assert label == f"trained drafter {assets.DEFAULT_DRAFT.name}"
    path, label = resolve_draft(opts, TINY, tmp_path)
    assert path.parent == tmp_path
    assert label.startswith("RANDOM drafter")
    assert DraftConfig.from_json(path / "config.json").vocab_size == TINY.vocab_size
