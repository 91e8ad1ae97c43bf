"""Tensor parallelism (eagle3_jax.parallel) on the CPU.

Tests that need 8 devices run tests/parallel_worker.py in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8 (this process may already have initialised
jax with one device) and read its JSON. The 70B layout and memory-plan tests only use
jax.eval_shape and run here.
"""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from eagle3_jax import presets
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.model.llama import init_params
from eagle3_jax.parallel import plan as plan_mod
from eagle3_jax.parallel import sharding as S

WORKER = Path(__file__).with_name("parallel_worker.py")
REPO = Path(__file__).resolve().parents[1]
TPS = ("1", "2", "8")  # as parallel_worker.TPS


TASKS = ("equivalence", "hlo", "layout", "engine", "invariant")
_procs: dict[str, subprocess.Popen] = {}


def _start_workers() -> None:
    """Start every worker task at once (they are independent; compilation dominates)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=8"]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for task in TASKS:
        _procs[task] = subprocess.Popen([sys.executable, str(WORKER), task], env=env, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@functools.cache
def worker(task: str) -> dict:
    if not _procs:
        _start_workers()
    proc = _procs[task]
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"parallel_worker {task} timed out")
    if proc.returncode != 0:
        pytest.fail(f"parallel_worker {task} failed ({proc.returncode}):\n{stderr[-4000:]}")
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["device_count"] == 8
    return result


@pytest.fixture(scope="module", autouse=True)
def _reap_workers():
    yield
    for proc in _procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# (a) numerics: every tp computes what one device computes


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["2", "4"])
def test_batch_invariant_logits_per_device_equal_decode(tp):
    """The batch-invariant target under tensor parallelism (per device, partials summed in rank
    order): a prefill, verify-sized chunks and a row alone give the decode's bf16 logits bit for
    bit; and close to one device's (which splits no sum, so rounds otherwise)."""
    r = worker("invariant")[tp]
    assert r["prefill_equal"] and r["verify_equal"] and r["alone_equal"], r
    assert r["rel_to_tp1"] < 0.05, r


@pytest.mark.slow
@pytest.mark.parametrize("kvh", [8, 2])
def test_logits_and_greedy_tokens_match_tp1(kvh):
    res = worker("equivalence")[f"kvh{kvh}"]
    ref_tokens = res["1"]["tokens"]
    assert len(ref_tokens) == 2 and len(ref_tokens[0]) == 16
    for tp in TPS[1:]:
        r = res[tp]
        assert r["prefill_rel"] < 1e-5, (tp, r)
        assert r["verify_rel"] < 1e-5, (tp, r)
        assert r["captures_rel"] < 1e-5, (tp, r)
        assert r["tokens"] == ref_tokens, f"tp {tp} greedy tokens differ"
        # Logits stay vocab-sharded; the cache is split on kv heads when tp divides them.
        assert r["logits_sharding"] == "P(None, None, 'tp')"
        split = kvh % int(tp) == 0
        assert r["cache_sharding"] == ("P(None, None, None, 'tp', None)" if split else "P()"), (tp, r)
    # The greedy comparison means something only if no step was a near-tie.
    assert min(r["min_top2_margin"] for r in res.values()) > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kvh", [8, 2])
def test_speculative_engine_tokens_match_tp1(kvh):
    res = worker("engine")[f"kvh{kvh}"]
    assert [len(t) for t in res["1"]["tokens"]] == [12, 12, 12]
    assert set(res) == {"1", "8"} | ({"2"} if kvh == 8 else set())  # parallel_worker.ENGINE_TPS
    for tp in set(res) - {"1"}:
        assert res[tp]["tokens"] == res["1"]["tokens"], f"tp {tp}: greedy speculative tokens differ from tp 1"


@pytest.mark.slow
@pytest.mark.parametrize("kvh", [8, 2])
def test_tree_engine_tokens_match_tp1(kvh):
    """An engine drafting a tree serves under tensor parallelism (the XLA attention with the
    tree's masks, its candidates and KV moves under the partitioner) with tp 1's greedy tokens."""
    res = worker("engine")["tree"][f"kvh{kvh}"]
    assert [len(t) for t in res["1"]["tokens"]] == [12, 12, 12]
    for tp, r in res.items():
        assert r["tree_iterations"] > 0, f"tp {tp}: the tree never ran"
        assert r["tokens"] == res["1"]["tokens"], f"tp {tp}: the tree's greedy tokens differ from tp 1"


@pytest.mark.slow
@pytest.mark.parametrize("kvh", [8, 2])
def test_accepted_drafts_match_tp1(kvh):
    """The random drafter's own proposals are all rejected; with proposals forced to the greedy
    continuation (one wrong in turn), iterations accept 3, 2, 1 and 0 of them at every tp, emit
    the same tokens, and leave the drafter (replicated, extended over the accepted positions)
    proposing the same tokens as at tp 1."""
    res = worker("engine")[f"kvh{kvh}"]
    ref, forced1 = res["1"]["tokens"], res["1"]["forced"]
    history = [step for row in forced1["history"] for step in row]
    assert {accepted for _, accepted in history} == {0, 1, 2, 3}
    # Each iteration emits its accepted proposals and one more token, but where max_tokens cuts it.
    for row in forced1["history"]:
        assert len(row) >= 3 and all(emitted == accepted + 1 for emitted, accepted in row[:-1]), row
    assert all(len(row) >= 3 for row in forced1["drafted"])
    # kv heads 8: every third step runs the target alone (the K=0 program, its draft extend inside).
    assert (forced1["target_only_iterations"] > 0) == (kvh == 8)
    for tp in res:
        forced = res[tp]["forced"]
        assert forced["tokens"] == ref, f"tp {tp}: forced proposals changed the greedy tokens"
        assert forced["history"] == forced1["history"], f"tp {tp}: accepted counts differ from tp 1"
        assert forced["drafted"] == forced1["drafted"], f"tp {tp}: the drafter proposed other tokens than at tp 1"
        assert forced["target_only_iterations"] == forced1["target_only_iterations"]


# --------------------------------------------------------------------------------------------
# (c) what the partitioner did: a verify-shaped step (B=8, T=4) and the draft's programs at tp 8,
# the engine's iterations at tp 2 and 8


def _weight_like(shapes: list[list[int]], weights: list[list[int]]) -> list[list[int]]:
    """Collective operands that are not [B=8, T=4, ...] activations, or equal a weight's shape."""
    return [s for s in shapes if s[:2] != [8, 4] or s in weights]


@pytest.mark.slow
def test_verify_step_collectives_tp8_kv_split():
    res = worker("hlo")["kvh8"]
    ops = res["collectives"]
    reduces = [s for c in ops if c["op"] == "all-reduce" for s in c["shapes"]]
    # 2 per layer (after wo, after w_down) + 1 for the vocab-parallel embedding lookup (each
    # device looks up the ids in its vocab slice, zeros elsewhere, then sums). The vocab-parallel
    # lm_head needs none: logits stay [B, T, V/tp] per device.
    assert len(reduces) == 2 * res["num_layers"] + 1
    assert all(s == [8, 4, 64] for s in reduces)  # [B, T, D] residual-stream partial sums
    assert not [c for c in ops if c["op"] != "all-reduce"], ops  # no all-gather at all
    # An argmax over vocab-sharded logits [8, 4, 256] moves only per-shard (max, index) partials
    # (on jax 0.10: two all-gathers of [B, T, tp]), never the logits themselves.
    am = res["argmax_collectives"]
    assert am and all(s[-1] <= 8 for c in am for s in c["shapes"]), am


@pytest.mark.slow
def test_verify_step_collectives_tp8_kv_replicated():
    res = worker("hlo")["kvh2"]
    ops, layers = res["collectives"], res["num_layers"]
    operands = [(c["op"], s) for c in ops for s in c["shapes"]]
    residual = [s for op, s in operands if op == "all-reduce" and s == [8, 4, 64]]
    assert len(residual) == 2 * layers + 1  # the Megatron all-reduces, as with kv heads split
    # kv groups (2) do not divide 8: wqkv is replicated. Shardy still splits the projection's
    # output [B, T, G=2, R+2=6, hd=8] (wo's row split propagated back through the attention):
    # G 2 ways x (R+2) 4 ways, padded to 8, each device slicing the replicated weight. k and v
    # then sit on one shard of the R+2 axis and are moved to the rest (jax 0.10, per layer: 4
    # collective-permutes of [B, T, 1, 1|2, hd], one all-reduce of two [B, T, 1, 1, hd]), and
    # gathered over G for the replicated cache write (2 all-gathers of [B, T, kvh, hd]).
    # All are small activations, never weights; a later partitioner may need fewer.
    others = [(op, s) for op, s in operands if not (op == "all-reduce" and s == [8, 4, 64])]
    assert all(s[:2] == [8, 4] and s[-1] == 8 for _, s in others), others
    assert not _weight_like([s for _, s in others], res["weight_shapes"])
    assert all(s == [8, 4, 2, 8] for op, s in others if op == "all-gather"), others
    assert len(others) <= 8 * layers, others
    assert {c["op"] for c in ops} <= {"all-reduce", "all-gather", "collective-permute"}, ops


def _by_op(ops: list[dict]) -> dict[str, list[tuple[int, ...]]]:
    """op -> sorted operand shapes (a combined collective counts once per operand)."""
    found: dict[str, list] = {}
    for c in ops:
        found.setdefault(c["op"], []).extend(tuple(s) for s in c["shapes"])
    return {op: sorted(shapes) for op, shapes in found.items()}


@pytest.mark.slow
def test_draft_programs_have_no_collectives_tp8():
    """The draft extend (fc, embedding, midlayer over T=4) and a chain step (forward, logits, argmax
    or sampling) fed replicated captures: the replicated drafter runs them without a collective."""
    res = worker("hlo")["draft_programs"]
    assert res == {"greedy": {"extend": [], "step": []}, "sampling": {"extend": [], "step": []}}


@pytest.mark.slow
@pytest.mark.parametrize("tp", ["2", "8"])
def test_iteration_collectives_are_the_targets(tp):
    """The engine's compiled greedy EAGLE-3 iteration (verify K+1, accept, draft extend, K draft
    steps) all-reduces exactly what its target-only decode does, 2 per layer + the embedding's,
    at K+1 tokens instead of 1, and gathers only the greedy pick's per-shard partials."""
    res = worker("engine")
    hlo, sh = res["hlo"][tp], res["shapes"]
    b, k, d, layers = sh["B"], sh["K"], sh["D"], sh["layers"]
    eagle, decode = _by_op(hlo["eagle"]), _by_op(hlo["decode"])
    assert set(eagle) == set(decode) == {"all-reduce", "all-gather"}, (eagle, decode)
    assert len(eagle["all-reduce"]) == len(decode["all-reduce"]) == 2 * layers + 1
    assert eagle["all-reduce"] == [(b, k + 1, d)] * (2 * layers + 1)
    assert decode["all-reduce"] == [(b, 1, d)] * (2 * layers + 1)
    # The argmax of vocab-sharded logits moves (max, index) per shard: [B, T, tp], never logits.
    assert len(eagle["all-gather"]) == len(decode["all-gather"]) > 0
    assert set(eagle["all-gather"]) == {(b, k + 1, int(tp))} and set(decode["all-gather"]) == {(b, 1, int(tp))}


@pytest.mark.slow
def test_iteration_collectives_without_drafter_sampling_prefill_tp8():
    res, runners = worker("engine"), worker("hlo")["runners"]
    hlo, sh = res["hlo"]["8"], res["shapes"]
    b, k, d, v, target = sh["B"], sh["K"], sh["D"], sh["V"], 2 * sh["layers"] + 1
    # The target-only program with the draft extend inside = an engine without a drafter.
    assert _by_op(hlo["decode"]) == _by_op(runners["no_drafter_tp8"])
    # Sampling: the target's logits gathered once for the sampler; the drafter samples locally.
    assert _by_op(hlo["eagle_sampling"]) == {"all-reduce": [(b, k + 1, d)] * target, "all-gather": [(b, k + 1, v)]}
    # A prefill (one prompt of 16) with its draft prefill and first proposal: the target's alone.
    prefill = _by_op(hlo["prefill"])
    assert prefill["all-reduce"] == [(1, 16, d)] * target and set(prefill["all-gather"]) == {(1, 8)}
    assert set(prefill) == {"all-reduce", "all-gather"}
    # A drafter that reads the target's embedding (8B layout) holds a replicated copy: no collective.
    wide = _by_op(runners["target_embedding_tp4"])
    assert wide["all-reduce"] == [(b, k + 1, d)] * target and set(wide["all-gather"]) == {(b, k + 1, 4)}
    assert set(wide) == {"all-reduce", "all-gather"}


# --------------------------------------------------------------------------------------------
# (b) the 70B layout at tp 8, and loading straight onto the mesh


def llama70b() -> ModelConfig:
    return presets.llama33_70b()[0]


def drafter70b() -> DraftConfig:
    return presets.llama33_70b()[1]


def _leaves(shapes, specs):
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))
    return [(jax.tree_util.keystr(p), x, s)
            for (p, x), s in zip(jax.tree_util.tree_leaves_with_path(shapes), spec_leaves, strict=True)]


@pytest.mark.slow
def test_70b_target_split_8_ways_drafter_replicated():
    cfg, dcfg = llama70b(), drafter70b()
    target = _leaves(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), S.llama_param_specs(cfg, 8))
    draft_shapes = jax.eval_shape(lambda: init_draft_params(dcfg, jax.random.key(0), own_embedding=True))
    draft_specs = S.draft_param_specs(dcfg, 8, own_embedding=True)
    draft = _leaves(draft_shapes, draft_specs)
    assert len(target) == 80 * 6 + 3 and len(draft) == 12
    for name, x, spec in target:
        total = math.prod(x.shape) * x.dtype.itemsize
        per_device = math.prod(S.shard_shape(x.shape, spec, 8)) * x.dtype.itemsize
        replicated = "norm" in name or name.endswith("d2t")
        assert per_device == (total if replicated else total // 8), (name, x.shape, spec)
        assert replicated or total % 8 == 0
    # The drafter whole on every device: 3.15 GB in bf16 (1.58 GB of it its embedding).
    for _, x, spec in draft:
        assert spec == S.REPLICATED and S.shard_shape(x.shape, spec, 8) == x.shape
    assert S.per_device_bytes(draft_shapes, draft_specs, 8) == 3_152_196_608
    # The worker checked the same shard shapes against jax's own NamedSharding on 8 devices.
    layout = worker("layout")
    assert layout["shard_shape_checked"] == len(target) + len(draft)
    assert layout["shard_shape_mismatches"] == []


@pytest.mark.slow
def test_params_from_hf_place_lands_sharded():
    placed = worker("layout")["place"]
    split = placed["kvh8_tie0"]
    assert split["equal"]
    assert split["placed"]["embed"] == dict(spec="P('tp', None)", devices=8, shard_shapes=[[32, 64]])
    # wqkv [D, G=8, R+2=3, hd]: one kv group (its q head, k and v) per device.
    assert split["placed"]["wqkv"] == dict(spec="P(None, 'tp', None, None)", devices=8,
                                           shard_shapes=[[64, 1, 3, 8]])
    assert split["placed"]["w_gate_up"] == dict(spec="P(None, None, 'tp')", devices=8,
                                                shard_shapes=[[64, 2, 16]])
    assert split["placed"]["wo"]["shard_shapes"] == [[8, 64]]
    assert split["placed"]["norm"] == dict(spec="P()", devices=8, shard_shapes=[[64]])
    rep = placed["kvh2_tie1"]  # kv heads do not divide 8: the whole wqkv replicated; tied embedding split
    assert rep["equal"]
    assert rep["placed"]["wqkv"] == dict(spec="P()", devices=8, shard_shapes=[[64, 2, 6, 8]])
    assert rep["placed"]["embed"]["shard_shapes"] == [[32, 64]]


def test_specs_errors_and_fallbacks():
    cfg = llama70b()
    with pytest.raises(S.ShardingError, match="num_attention_heads 64 is not divisible by tp=3"):
        S.llama_param_specs(cfg, 3)
    specs = S.llama_param_specs(cfg, 16)  # 8 kv heads over 16: replicated wqkv (q too) and cache
    assert specs.layers[0].wqkv == S.REPLICATED and specs.layers[0].w_gate_up == S.GATE_UP
    assert S.llama_param_specs(cfg, 8).layers[0].wqkv == S.QKV_GROUPS
    assert S.llama_cache_specs(cfg, 16).k == S.REPLICATED
    assert S.llama_cache_specs(cfg, 8).k == jax.sharding.PartitionSpec(None, None, None, "tp", None)
    odd_vocab = ModelConfig.from_hf(dict(vocab_size=1001, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=8, tie_word_embeddings=True))
    s = S.llama_param_specs(odd_vocab, 8)
    assert s.embed == S.REPLICATED and s.lm_head is None
    assert S.logits_spec(odd_vocab.vocab_size, 8) == S.REPLICATED
    with pytest.raises(S.ShardingError, match="needs 8 devices"):
        S.make_mesh(8, devices=jax.devices()[:1])


# --------------------------------------------------------------------------------------------
# (d) the memory plan for 70B at tp 2, 4, 8 on 141 GB GPUs


def _hand_70b_weight_bytes(tp: int) -> tuple[int, int]:
    v, d, i, layers, kv = 128256, 8192, 28672, 80, 8 * 128
    layer = (2 * d * d + 2 * d * kv + 3 * d * i) // tp + 2 * d  # q, o, k, v, gate/up/down; norms
    target = 2 * (2 * v * d // tp + layers * layer + d)  # embed + lm_head, layers, final norm
    h, di, dkv, dv, th = 6144, 16384, 8 * 128, 32000, 8192
    whole = 3 * th * h + 2 * h * h + 2 * 2 * h * dkv + h * h + 3 * h * di + h * dv + v * h
    draft = 2 * (whole + 4 * h) + 4 * dv  # replicated: fc, q (2H in), k/v, o, mlp, lm_head, embed; norms; d2t
    return target, draft


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_plan_70b(tp):
    p = plan_mod.plan_memory(llama70b(), drafter70b(), tp, max_batch=8, max_len=8192, page_size=16)
    target, draft = _hand_70b_weight_bytes(tp)
    assert p["weights_target"] == target and p["weights_draft"] == draft
    assert p["draft_own_embedding"]
    # KV per token and device: 80 layers x (K, V) x 8/tp heads x 128 x 2 B, + the drafter's layer
    # with all 8 heads (replicated).
    assert p["kv_bytes_per_token"] == 80 * 2 * (8 // tp) * 128 * 2 + 2 * 8 * 128 * 2
    pages = 8 * 8192 // 16 + 1
    assert p["kv_target"] == pages * 16 * 80 * 2 * (8 // tp) * 128 * 2
    assert p["fits"] and p["max_batch_at_max_len"] >= 8
    assert p["max_kv_tokens"] == p["kv_budget"] // p["kv_bytes_per_token"]


def test_plan_dtype_bytes_sizes_every_float_weight():
    """The bytes per weight asked for apply to the bf16 leaves too (d2t, int32, keeps its 4)."""
    target = llama70b()
    assert plan_mod.target_weight_bytes(target, 1, 4) == 2 * plan_mod.target_weight_bytes(target, 1, 2)
    assert plan_mod.target_weight_bytes(target, 1, 4) == 4 * 70_553_706_496


def test_plan_scaling_and_table():
    plans = [plan_mod.plan_memory(llama70b(), drafter70b(), tp, max_batch=8, max_len=8192, page_size=16)
             for tp in (1, 2, 4, 8)]
    assert not plans[0]["fits"]  # 141 GB of bf16 weights do not fit one 141 GB GPU
    assert [p["max_kv_tokens"] for p in plans] == sorted(p["max_kv_tokens"] for p in plans)
    assert plans[0]["weights_target"] == 2 * 70_553_706_496  # Llama-3.3-70B's parameter count
    table = plan_mod.format_plan(plans)
    assert "tp=8" in table and "weights: target" in table and "max KV tokens" in table


def test_plan_cli(tmp_path, capsys):
    from eagle3_jax import cli

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps(dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, rope_theta=500000.0)))
    (tmp_path / "d.json").write_text(json.dumps(drafter70b().to_hf()))
    assert cli.main(["plan", "--target", str(tmp_path / "t"), "--draft", str(tmp_path / "d.json"),
                     "--tp", "4", "8", "--max-batch", "8", "--max-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "tp=4" in out and "tp=8" in out and "17.64 GB" in out
    assert cli.main(["plan", "--target", str(tmp_path / "t"), "--tp", "3"]) == 2
    assert "not divisible by tp=3" in capsys.readouterr().err
