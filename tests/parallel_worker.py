"""Multi-device checks for tests/test_parallel.py, run in a subprocess.

The pytest process may already have initialised jax with one CPU device; this script is started
with XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu so it sees 8, and
prints one JSON object on its last stdout line.

    python tests/parallel_worker.py equivalence   # logits + greedy decode at tp 1, 2, 8
    python tests/parallel_worker.py hlo           # collectives of compiled verify / draft programs
    python tests/parallel_worker.py layout        # shard shapes vs jax; params_from_hf(place=...)
    python tests/parallel_worker.py engine        # the engine's tokens and programs (ENGINE_TPS)
    python tests/parallel_worker.py invariant     # batch-invariant logits per device at tp 2, 4
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from runner_probe import pending_proposals, set_proposals, trace_iteration, trace_prefill

from eagle3_jax import presets
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import eagle3 as E
from eagle3_jax.model import llama as L
from eagle3_jax.parallel import sharding as S
from eagle3_jax.runner import sampling, steps
from eagle3_jax.runner.speculators import Chain, DraftStart
from eagle3_jax.sampling_params import SamplingParams

jax.config.update("jax_default_matmul_precision", "highest")

PAGE = 8


# Tensor-parallel degrees compared with one device: 2 splits the kv heads by 4 and 8 by 1 (kvh 8),
# and 8 replicates what it cannot divide (kvh 2). 4 adds no case the other two miss.
TPS = (1, 2, 8)


def small_cfg(kv_heads: int, layers: int = 2, tie: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=layers,
                       num_heads=8, num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                       tie_word_embeddings=tie)


def small_draft(target: ModelConfig) -> DraftConfig:
    return DraftConfig(vocab_size=target.vocab_size, draft_vocab_size=128, hidden_size=32,
                       intermediate_size=64, num_heads=8, num_kv_heads=8, head_dim=4,
                       rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                       max_position_embeddings=512, target_hidden_size=target.hidden_size)


def random_params(cfg: ModelConfig, seed: int = 0) -> L.LlamaParams:
    """Host (numpy) f32 weights with init_params' shapes: std 0.1 matrices (larger logit gaps than
    0.02, so greedy argmax has no near-ties), norms around 1."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: L.init_params(cfg, jax.random.key(0), jnp.float32))
    return jax.tree.map(lambda x: (rng.standard_normal(x.shape) * 0.1 + (x.ndim == 1)).astype(np.float32),
                        shapes)


def block_tables(batch: int, blocks: int) -> np.ndarray:
    # Row b owns pages 1 + b*blocks ... (page 0 is the scratch page).
    return np.arange(1, 1 + batch * blocks, dtype=np.int32).reshape(batch, blocks)


def empty_cache(cfg: ModelConfig, batch: int, blocks: int) -> L.KVCache:
    shape = (cfg.num_layers, 1 + batch * blocks, PAGE, cfg.num_kv_heads, cfg.head_dim)
    return L.KVCache(k=np.zeros(shape, np.float32), v=np.zeros(shape, np.float32))


def setup(cfg: ModelConfig, params, tp: int, batch: int, blocks: int):
    """(step, params, cache) on a tp-way mesh; step -> (logits, hidden, captures, cache)."""
    mesh = S.make_mesh(tp)
    params = S.shard_params(params, mesh, S.llama_param_specs(cfg, tp))
    cache = S.shard_params(empty_cache(cfg, batch, blocks), mesh, S.llama_cache_specs(cfg, tp))
    return S.jit_forward(cfg, mesh, with_logits=True), params, cache


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def run_equivalence() -> dict:
    """Per config: logits of a prefill (T=8) and a verify-shaped step (T=4), the captures, and 16
    greedily decoded tokens (single-token forward + argmax of the vocab-sharded logits) at each
    tp, against tp 1 (which is the plain single-device program)."""
    out = {}
    batch, blocks, prompt_len, steps = 2, 4, 8, 16

    @jax.jit
    def pick(lg):  # last position's argmax [B, 1] and the smallest top-1 minus top-2 gap
        last = lg[:, -1]
        top2 = jax.lax.top_k(last, 2)[0]
        return jnp.argmax(last, axis=-1, keepdims=True).astype(jnp.int32), jnp.min(top2[:, 0] - top2[:, 1])

    for kvh in (8, 2):
        cfg = small_cfg(kvh)
        host = random_params(cfg, seed=kvh)
        rng = np.random.default_rng(kvh)
        prompt = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
        vtok = rng.integers(0, cfg.vocab_size, (batch, 4)).astype(np.int32)
        pos = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), (batch, prompt_len))
        vpos = np.broadcast_to(np.arange(4, dtype=np.int32), (batch, 4))
        bt = block_tables(batch, blocks)
        per_tp = {}
        for tp in TPS:
            step, params, cache = setup(cfg, host, tp, batch, blocks)
            prefill_logits, _, captures, cache = step(params, prompt, pos, cache, bt)
            tok, _ = pick(prefill_logits)
            generated, margins = [tok], []
            for s in range(steps - 1):
                p = np.full((batch, 1), prompt_len + s, np.int32)
                lg, _, _, cache = step(params, tok, p, cache, bt)
                tok, margin = pick(lg)
                generated.append(tok)
                margins.append(float(margin))
            # A verify-shaped step (T=4) over everything cached so far.
            verify_logits, _, _, cache = step(params, vtok, vpos + prompt_len + steps - 1, cache, bt)
            per_tp[tp] = dict(
                prefill=np.asarray(prefill_logits), verify=np.asarray(verify_logits),
                captures=np.asarray(captures), tokens=np.concatenate([np.asarray(t) for t in generated], 1),
                margin=min(margins), logits_sharding=str(prefill_logits.sharding.spec),
                cache_sharding=str(cache.k.sharding.spec))
        ref = per_tp[1]
        out[f"kvh{kvh}"] = {str(tp): dict(
            prefill_rel=rel(r["prefill"], ref["prefill"]), verify_rel=rel(r["verify"], ref["verify"]),
            captures_rel=rel(r["captures"], ref["captures"]), tokens=r["tokens"].tolist(),
            min_top2_margin=r["margin"], logits_sharding=r["logits_sharding"],
            cache_sharding=r["cache_sharding"]) for tp, r in per_tp.items()}
    return out


_COLLECTIVE = re.compile(r"=\s*(.+?)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(-start)?\(")


def collectives(hlo: str) -> list[dict]:
    """[{op, shapes}] for each collective instruction in compiled HLO text (async forms counted
    at their -start). XLA's combiner may merge several into one tuple-shaped instruction: `shapes`
    lists each operand's dims, so len(shapes) counts the logical collectives."""
    found = []
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if m:
            found.append(dict(op=m.group(2), shapes=_dims(m.group(1))))
    return found


def _dims(shape_text: str) -> list[list[int]]:
    """'f32[8,4,64]{2,1,0}' or a tuple of them -> [[8, 4, 64], ...]."""
    return [[int(d) for d in dims.split(",") if d] for dims in re.findall(r"\[([\d,]*)\]", shape_text)]


def run_hlo() -> dict:
    tp, batch, t, blocks = 8, 8, 4, 4
    out = {}
    for kvh in (8, 2):
        cfg = small_cfg(kvh)
        mesh = S.make_mesh(tp)
        pspecs = S.llama_param_specs(cfg, tp)
        params = jax.eval_shape(lambda cfg=cfg: random_params(cfg))
        cache = jax.eval_shape(lambda cfg=cfg: empty_cache(cfg, batch, blocks))
        ins, outs = S.forward_shardings(mesh, pspecs, S.llama_cache_specs(cfg, tp))
        lspec = jax.sharding.NamedSharding(mesh, S.logits_spec(cfg.vocab_size, tp))
        rep = jax.sharding.NamedSharding(mesh, S.REPLICATED)

        pin_kv = S.cache_pin(mesh, cfg.num_kv_heads)  # as the engine's steps

        def verify(params, tokens, positions, cache, bt, pin_kv=pin_kv, cfg=cfg):
            hidden, captures, cache = L.forward(params, cfg, tokens, positions, cache, bt, pin_kv=pin_kv)
            return L.logits(params, hidden), captures, cache

        tok = jax.ShapeDtypeStruct((batch, t), jnp.int32)
        bts = jax.ShapeDtypeStruct((batch, blocks), jnp.int32)
        fn = jax.jit(verify, in_shardings=ins, out_shardings=(lspec, rep, outs[2]), donate_argnums=(3,))
        hlo = fn.lower(params, tok, tok, cache, bts).compile().as_text()
        weight_shapes = sorted({tuple(x.shape) for x in jax.tree.leaves(params)})
        # Greedy acceptance needs the argmax of vocab-sharded logits: what does that cost?
        am = jax.jit(lambda lg: jnp.argmax(lg, axis=-1), in_shardings=lspec, out_shardings=rep)
        am_hlo = am.lower(jax.ShapeDtypeStruct((batch, t, cfg.vocab_size), jnp.float32)).compile().as_text()
        out[f"kvh{kvh}"] = dict(num_layers=cfg.num_layers, collectives=collectives(hlo),
                                weight_shapes=[list(s) for s in weight_shapes],
                                argmax_collectives=collectives(am_hlo))

    out["draft_programs"] = run_draft_programs(tp, batch, t, blocks)
    out["runners"] = run_runner_hlo()
    return out


def run_draft_programs(tp: int, batch: int, t: int, blocks: int) -> dict:
    """The draft extend (T tokens) and one chain step as programs of their own at `tp`, greedy
    and sampling, fed as the engine feeds them (replicated captures, drafter, draft KV):
    collectives of each."""
    cfg = small_cfg(8)
    dcfg = small_draft(cfg)
    mesh = S.make_mesh(tp)
    rep = jax.sharding.NamedSharding(mesh, S.REPLICATED)
    dps = S.named(mesh, S.draft_param_specs(dcfg, tp, own_embedding=True))
    kvs = S.named(mesh, S.draft_cache_specs(dcfg, tp))
    dparams = jax.eval_shape(lambda: E.init_draft_params(dcfg, jax.random.key(1), jnp.float32, True))
    kv = jax.eval_shape(lambda: L.KVCache.zeros(1, 1 + batch * blocks, PAGE, dcfg.num_kv_heads, dcfg.head_dim,
                                                jnp.float32))
    ints = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    caps = jax.ShapeDtypeStruct((batch, t, dcfg.num_captures * cfg.hidden_size), jnp.float32)
    bts = jax.ShapeDtypeStruct((batch, blocks), jnp.int32)
    chain = Chain(3)
    row = sampling.row_sampling_from_params([SamplingParams(temperature=0.7)] * batch, [0] * batch)
    zeros = jnp.zeros(batch, jnp.int32)
    at = DraftStart(token=zeros, position=zeros, h=jnp.zeros((batch, dcfg.hidden_size)), history=None, row=row,
                    keys=jnp.zeros((batch, 2), jnp.uint32))
    carry = jax.eval_shape(lambda: chain.start(steps.DraftContext(dcfg, "xla", "xla", False, None), at))
    out = {}
    for greedy in (True, False):
        scfg = steps.StepConfig(target=cfg, draft=dcfg, speculator=chain, mesh=mesh, greedy=greedy)

        def extend(dp, tokens, captures, positions, kv, bt, index, scfg=scfg):
            return steps._draft_extend(dp, scfg, None, tokens, captures, positions, kv, bt, index)

        def step(dp, carry, kv, bt, scfg=scfg):
            return chain.draft_step(scfg.draft_context, dp, None, carry, kv, bt, 1)

        ext = jax.jit(extend, in_shardings=(dps, rep, rep, rep, kvs, rep, rep), out_shardings=(rep, kvs))
        one = jax.jit(step, in_shardings=(dps, rep, kvs, rep), out_shardings=(rep, kvs))
        index = jax.ShapeDtypeStruct((batch,), jnp.int32)
        out["greedy" if greedy else "sampling"] = dict(
            extend=collectives(ext.lower(dparams, ints, caps, ints, kv, bts, index).compile().as_text()),
            step=collectives(one.lower(dparams, carry, kv, bts).compile().as_text()))
    return out


def _runner(cfg: ModelConfig, dcfg: DraftConfig | None, tp: int, own_embedding: bool = True):
    from eagle3_jax.config import EngineConfig
    from eagle3_jax.runner.runner import ModelRunner, place_weights
    from eagle3_jax.runner.served import DeviceFacts, served_config

    engine_cfg = EngineConfig(batch_buckets=(4,), prefill_buckets=(16,), prefill_batch_buckets=(1,),
                              num_speculative_tokens=3 if dcfg else 0, page_size=PAGE, num_pages=64, max_model_len=64)
    dparams = None if dcfg is None else E.init_draft_params(dcfg, jax.random.key(1), jnp.float32, own_embedding)
    mesh = S.make_mesh(tp)
    weights = place_weights(cfg, jax.tree.map(jnp.asarray, random_params(cfg)), dcfg, dparams, mesh)
    served = served_config(engine_cfg, cfg, dcfg, DeviceFacts.of(mesh), jnp.float32)  # as an engine settles it
    return ModelRunner(served, cfg, dcfg, weights, mesh)


def run_runner_hlo() -> dict:
    """Collectives of fused iterations the engine worker does not build: the greedy decode of an
    engine without a drafter (tp 8), and the greedy EAGLE-3 iteration of a drafter that reads
    the target's embedding (8B layout: a replicated copy under tp; tp 4). Bucket 4, K=3."""
    cfg = small_cfg(8)
    bare = _runner(cfg, None, 8)
    wide = _runner(cfg, DraftConfig.like_target(cfg, 128), 4, own_embedding=False)  # the target's width

    def compiled(runner, k: int) -> list[dict]:
        return collectives(trace_iteration(runner, 4, runner.config(Chain(k), True)).lower().compile().as_text())

    return dict(no_drafter_tp8=compiled(bare, 0), target_embedding_tp4=compiled(wide, 3))


def run_layout() -> dict:
    """(1) jax's own NamedSharding.shard_shape on a real 8-device mesh agrees with
    sharding.shard_shape (which plan.py uses without devices) for every 70B target / drafter
    weight; (2) params_from_hf(place=make_place(...)) lands sharded and equal to the host weights."""
    mesh = S.make_mesh(8)
    mismatches, checked = [], 0
    cfg, dcfg = presets.llama33_70b()
    trees = (
        (jax.eval_shape(lambda: L.init_params(cfg, jax.random.key(0))), S.llama_param_specs(cfg, 8)),
        (jax.eval_shape(lambda: E.init_draft_params(dcfg, jax.random.key(0), own_embedding=True)),
         S.draft_param_specs(dcfg, 8, own_embedding=True)),
    )
    for shapes, specs in trees:
        for (path, x), spec in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                   jax.tree.leaves(specs, is_leaf=lambda v: isinstance(v, jax.sharding.PartitionSpec))):
            checked += 1
            theirs = jax.sharding.NamedSharding(mesh, spec).shard_shape(x.shape)
            if tuple(theirs) != S.shard_shape(x.shape, spec, 8):
                mismatches.append(f"{jax.tree_util.keystr(path)} {x.shape} {spec}: jax {theirs}")
    return dict(shard_shape_checked=checked, shard_shape_mismatches=mismatches, place=run_place())


def run_place() -> dict:
    """params_from_hf(place=make_place(...)) gives sharded arrays equal to the host weights."""
    from eagle3_jax.weights.llama import params_from_hf, params_to_hf

    out = {}
    for kvh, tie in ((8, False), (2, True)):
        cfg = small_cfg(kvh, tie=tie)
        host = random_params(cfg)
        tensors = params_to_hf(host)
        mesh = S.make_mesh(8)
        specs = S.llama_param_specs(cfg, 8)
        loaded = params_from_hf(tensors, cfg, jnp.float32, place=S.make_place(mesh, specs))
        equal = all(bool(np.array_equal(np.asarray(a), np.asarray(b)))
                    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(loaded)))
        placed = {}
        for name, x in (("embed", loaded.embed), ("wqkv", loaded.layers[0].wqkv),
                        ("w_gate_up", loaded.layers[0].w_gate_up), ("wo", loaded.layers[0].wo),
                        ("norm", loaded.norm)):
            placed[name] = dict(spec=str(x.sharding.spec), devices=len(x.sharding.device_set),
                                shard_shapes=sorted({tuple(s.data.shape) for s in x.addressable_shards}))
        out[f"kvh{kvh}_tie{int(tie)}"] = dict(equal=equal, placed=placed)
    return out


# Which proposal of an iteration is made wrong, in turn (None: none): all, one, none, two accepted.
WRONG = (None, 1, 0, 2)


def forced_run(engine, prompts, ref, k: int, target_only_every: int) -> dict:
    """Greedy decoding of `prompts` with each row's proposals overwritten after every step by its
    known greedy continuation `ref` (with one wrong by WRONG, rotating per step and row), so the
    iterations accept all, some and none of them; with `target_only_every` n > 0, every n-th step
    runs the target alone (the K=0 program, its draft extend included). -> tokens, per request
    (emitted, accepted) per iteration, the drafter's own proposals each step left, and how many
    iterations ran the target alone."""
    engine.overlap = False  # read each step before forcing the next one's proposals
    done = [0]
    if target_only_every:
        every = target_only_every
        engine.speculation.choice = lambda bucket, constrained=False: None if done[0] % every == every - 1 else 0
    target_only = sum(engine.stats.target_only_iterations.values())
    reqs = [engine.add_request(p, SamplingParams(max_tokens=len(r))) for p, r in zip(prompts, ref)]
    history, drafted = [[] for _ in reqs], [[] for _ in reqs]
    while engine.has_unfinished():
        before = [(len(r.output), r.metrics.accepted, r.finished) for r in reqs]
        engine.step()
        done[0] += 1
        for i, r in enumerate(reqs):
            if before[i][0] and not before[i][2]:
                history[i].append([len(r.output) - before[i][0], r.metrics.accepted - before[i][1]])
            if r.finished or not r.output:
                continue
            n = len(r.output)
            drafted[i].append(pending_proposals(engine.runner, r.slot).tolist())
            drafts = (ref[i][n:n + k] + [0] * k)[:k]
            wrong = WRONG[(done[0] + i) % len(WRONG)]
            if wrong is not None:
                drafts[wrong] = (drafts[wrong] + 1) % engine.step_cfg.target.vocab_size
            set_proposals(engine.runner, r.slot, drafts)
    vars(engine).pop("choice", None)  # the engine's own choice again
    return dict(tokens=[r.output for r in reqs], history=history, drafted=drafted,
                target_only_iterations=sum(engine.stats.target_only_iterations.values()) - target_only)


# The engine's degrees per kv-head count: at kvh 8, 2 and 8 split the cache (and the collectives
# of both are counted); at kvh 2, 8 replicates it (2 would split it as at kvh 8).
ENGINE_TPS = {8: (1, 2, 8), 2: (1, 8)}


def run_engine() -> dict:
    """Greedy speculative decoding through the whole engine (prefill, fused iterations with a
    random drafter, K=3) at ENGINE_TPS for both head layouts: tokens per tp; then the same
    engine with forced proposals (`forced_run`; at kvh 8 with target-only steps too); and at
    kvh 8 the collectives of the programs it ran (EAGLE-3 and target-only iterations; at tp 8
    also the sampling iteration and the prefill). Last, an engine drafting the tree (3, 2, 5)
    (what a GPU engine drafts beside its chain by default, at another shape) at the same tps:
    its tokens and the iterations that ran the tree."""
    from eagle3_jax.config import EngineConfig, TreeSpec

    out = {"tree": {}}
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    engine_cfg = EngineConfig(batch_buckets=(4,), prefill_buckets=(16,), prefill_batch_buckets=(1,),
                              num_speculative_tokens=3, page_size=PAGE, num_pages=64, max_model_len=64)
    tree_cfg = dataclasses.replace(engine_cfg, tree=TreeSpec(3, 2, 5), speculation="always")
    for kvh, tps in ENGINE_TPS.items():
        cfg = small_cfg(kvh)
        params = jax.tree.map(jnp.asarray, random_params(cfg))
        dcfg = small_draft(cfg)
        models = (cfg, params, dcfg, E.init_draft_params(dcfg, jax.random.key(1), jnp.float32, own_embedding=True))
        res, hlo, tree = {}, {}, {}
        for tp in tps:
            engine, tokens = _serve(models, engine_cfg, tp, prompts)
            ref = res["1"]["tokens"] if tp > 1 else tokens
            forced = forced_run(engine, prompts, ref, 3, target_only_every=3 if kvh == 8 else 0)
            res[str(tp)] = dict(tokens=tokens, forced=forced)
            if kvh == 8 and tp > 1:
                hlo[str(tp)] = program_collectives(engine.runner, sampling_and_prefill=tp == 8)
            tree_engine, tree_tokens = _serve(models, tree_cfg, tp, prompts)
            tree[str(tp)] = dict(tokens=tree_tokens, tree_iterations=sum(
                tree_engine.stats.proposal_iterations.get(tree_cfg.tree.label, {}).values()))
        out[f"kvh{kvh}"], out["tree"][f"kvh{kvh}"] = res, tree
        if hlo:
            out["hlo"] = hlo
    out["shapes"] = dict(B=4, K=3, D=64, V=256, layers=small_cfg(8).num_layers)
    return out


def _serve(models: tuple, engine_cfg, tp: int, prompts: list[list[int]]):
    """An engine of models (target config, params, draft config, params) at tp, its greedy
    replies of 12 tokens to prompts -> (engine, tokens per prompt)."""
    from eagle3_jax.engine.engine import Engine

    engine = Engine(*models, engine_cfg, mesh=S.make_mesh(tp) if tp > 1 else None)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    engine.run(reqs)
    return engine, [r.output for r in reqs]


def program_collectives(runner, sampling_and_prefill: bool) -> dict:
    """Collectives of the runner's greedy fused iterations, EAGLE-3 (K=3) and target-only (K=0, the
    draft extend inside), at bucket 4 (runner_probe.trace_iteration: the programs the engine ran,
    found built); optionally of the sampling EAGLE-3 iteration and a one-prompt prefill of 16."""
    def compiled(traced) -> list[dict]:
        return collectives(traced.lower().compile().as_text())

    res = {name: compiled(trace_iteration(runner, 4, runner.config(Chain(k), True))) for name, k in (("eagle", 3),
                                                                                                    ("decode", 0))}
    if sampling_and_prefill:
        res["eagle_sampling"] = compiled(trace_iteration(runner, 4, runner.config(Chain(3), False)))
        res["prefill"] = compiled(trace_prefill(runner, 1, 16, runner.config(Chain(3), True)))
    return res


def run_invariant() -> dict:
    """The batch-invariant target per device (steps.StepConfig.per_device) at tp 2 and 4, in bf16:
    logits of one prompt as one prefill, in verify-sized chunks and token by token, in a batch of
    two and alone; each compared bit for bit with the decode's, and to tp 1's within rounding."""
    cfg = small_cfg(8)
    params = jax.tree.map(lambda x: jnp.asarray(x * (4 if x.ndim > 1 else 1), jnp.bfloat16), random_params(cfg, 5))
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    page, blocks = 16, 2

    def logits(params, tokens, positions, cache, table, scfg):
        hidden, _, cache = steps._target(params, scfg, tokens, positions, cache, table)
        return steps._logits(params, scfg, hidden), cache

    step = jax.jit(logits, static_argnames="scfg", donate_argnames="cache")

    def run(tp: int, rows: np.ndarray, chunks: list[int]) -> np.ndarray:
        mesh = S.make_mesh(tp) if tp > 1 else None
        scfg = steps.StepConfig(target=cfg, draft=None, mesh=mesh, batch_invariant=True)
        shape = (cfg.num_layers, 1 + len(rows) * blocks, page, cfg.num_kv_heads, cfg.head_dim)
        cache = L.KVCache(k=jnp.zeros(shape, jnp.bfloat16), v=jnp.zeros(shape, jnp.bfloat16))
        p = params
        if mesh is not None:
            p = S.shard_params(params, mesh, S.llama_param_specs(cfg, tp))
            cache = S.shard_params(cache, mesh, S.llama_cache_specs(cfg, tp))
        table, outs, start = block_tables(len(rows), blocks), [], 0
        for c in chunks:
            pos = np.broadcast_to(np.arange(start, start + c, dtype=np.int32), (len(rows), c))
            out, cache = step(p, rows[:, start:start + c], pos, cache, table, scfg=scfg)
            outs.append(np.asarray(out.astype(jnp.float32)))
            start += c
        return np.concatenate(outs, axis=1)

    one = run(1, tokens, [12])
    out = {}
    for tp in (2, 4):
        decode = run(tp, tokens, [1] * 12)
        out[str(tp)] = dict(prefill_equal=bool(np.array_equal(run(tp, tokens, [12]), decode)),
                            verify_equal=bool(np.array_equal(run(tp, tokens, [4, 4, 4]), decode)),
                            alone_equal=bool(np.array_equal(run(tp, tokens[1:], [4, 8])[0], decode[1])),
                            rel_to_tp1=rel(decode, one))
    return out


if __name__ == "__main__":
    task = sys.argv[1]
    result = {"equivalence": run_equivalence, "hlo": run_hlo, "layout": run_layout, "engine": run_engine,
              "invariant": run_invariant}[task]()
    result["device_count"] = jax.device_count()
    print(json.dumps(result))
