"""Multi-device checks for tests/test_parallel.py, run in a subprocess.

The pytest process may already have initialised jax with one CPU device; this script is started
with XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu so it sees 8, and
prints one JSON object on its last stdout line.

    python tests/parallel_worker.py equivalence   # logits + greedy decode at tp 1, 2, 4, 8
    python tests/parallel_worker.py hlo           # collectives of compiled verify / draft steps
    python tests/parallel_worker.py layout        # shard shapes vs jax; params_from_hf(place=...)
"""

from __future__ import annotations

import functools
import json
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

from eagle3_jax import presets
from eagle3_jax.config import DraftConfig, ModelConfig
from eagle3_jax.model import eagle3 as E
from eagle3_jax.model import llama as L
from eagle3_jax.parallel import sharding as S

jax.config.update("jax_default_matmul_precision", "highest")

PAGE = 8


def small_cfg(kv_heads: int, layers: int = 4, tie: bool = False) -> ModelConfig:
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
        cfg = small_cfg(kvh, layers=2)
        host = random_params(cfg, seed=kvh)
        rng = np.random.default_rng(kvh)
        prompt = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
        vtok = rng.integers(0, cfg.vocab_size, (batch, 4)).astype(np.int32)
        pos = np.broadcast_to(np.arange(prompt_len, dtype=np.int32), (batch, prompt_len))
        vpos = np.broadcast_to(np.arange(4, dtype=np.int32), (batch, 4))
        bt = block_tables(batch, blocks)
        per_tp = {}
        for tp in (1, 2, 4, 8):
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

    # The draft head at tp 8 (70B layout: own embedding, hidden != target hidden).
    cfg = small_cfg(8)
    dcfg = small_draft(cfg)
    mesh = S.make_mesh(tp)
    dspecs = S.draft_param_specs(dcfg, tp, own_embedding=True)
    dparams = jax.eval_shape(lambda: E.init_draft_params(dcfg, jax.random.key(1), jnp.float32, True))
    dcache = jax.eval_shape(lambda: L.KVCache.zeros(1, 1 + batch * blocks, PAGE, dcfg.num_kv_heads,
                                                    dcfg.head_dim, jnp.float32))
    rep = jax.sharding.NamedSharding(mesh, S.REPLICATED)
    cache_s = S.named(mesh, S.draft_cache_specs(dcfg, tp))
    lspec = jax.sharding.NamedSharding(mesh, S.logits_spec(dcfg.draft_vocab_size, tp))

    pin_draft = S.cache_pin(mesh, dcfg.num_kv_heads)

    def draft_first_step(dp, captures, tokens, positions, cache, bt):
        h = E.fuse_captures(dp, captures)
        h, cache = E.draft_forward(dp, dcfg, None, tokens, h, positions, cache, bt, pin_kv=pin_draft)
        return E.draft_logits(dp, dcfg, h), h, cache

    fn = jax.jit(draft_first_step, in_shardings=(S.named(mesh, dspecs), rep, rep, rep, cache_s, rep),
                 out_shardings=(lspec, rep, cache_s), donate_argnums=(4,))
    caps = jax.ShapeDtypeStruct((batch, t, 3 * cfg.hidden_size), jnp.float32)
    tok = jax.ShapeDtypeStruct((batch, t), jnp.int32)
    bts = jax.ShapeDtypeStruct((batch, blocks), jnp.int32)
    hlo = fn.lower(dparams, caps, tok, tok, dcache, bts).compile().as_text()
    out["draft"] = dict(collectives=collectives(hlo),
                        weight_shapes=[list(s) for s in sorted({tuple(x.shape) for x in jax.tree.leaves(dparams)})])

    # A fused iteration as the engine builds it: verify (T=4) + greedy pick + draft extend over the
    # same positions from the target's captures + one chain step, all in one executable. With the
    # activation constraints of sharding.py, and (for the report only) without them.
    params = jax.eval_shape(lambda: random_params(cfg))
    cache = jax.eval_shape(lambda: empty_cache(cfg, batch, blocks))
    pspecs = S.llama_param_specs(cfg, tp)

    def fused(params, dparams, tokens, positions, cache, dcache, bt, constrain):
        m = mesh if constrain else None
        pins = (S.cache_pin(m, cfg.num_kv_heads), S.cache_pin(m, dcfg.num_kv_heads))
        hidden, captures, cache = L.forward(params, cfg, tokens, positions, cache, bt, pin_kv=pins[0])
        hidden, captures = S.replicate((hidden, captures), m)
        picked = jnp.argmax(S.vocab_logits(L.logits(params, hidden), m), axis=-1).astype(jnp.int32)
        h = S.replicate(E.fuse_captures(dparams, captures), m)
        h, dcache = E.draft_forward(dparams, dcfg, params.embed, picked, h, positions, dcache, bt, pin_kv=pins[1])
        h = S.replicate(h, m)
        d1 = jnp.argmax(S.vocab_logits(E.draft_logits(dparams, dcfg, h[:, -1:]), m), axis=-1)
        h2, dcache = E.draft_forward(dparams, dcfg, params.embed, d1.astype(jnp.int32), h[:, -1:],
                                     positions[:, -1:] + 1, dcache, bt, pin_kv=pins[1])
        h2 = S.replicate(h2, m)
        d2 = jnp.argmax(S.vocab_logits(E.draft_logits(dparams, dcfg, h2), m), axis=-1)
        return picked, jnp.concatenate([d1, d2], axis=1).astype(jnp.int32), cache, dcache

    tcache_s = S.named(mesh, S.llama_cache_specs(cfg, tp))
    for constrain in (True, False):
        fn = jax.jit(functools.partial(fused, constrain=constrain),
                     in_shardings=(S.named(mesh, pspecs), S.named(mesh, dspecs), rep, rep, tcache_s, cache_s, rep),
                     out_shardings=(rep, rep, tcache_s, cache_s), donate_argnums=(4, 5))
        hlo = fn.lower(params, dparams, tok, tok, cache, dcache, bts).compile().as_text()
        out["fused_constrained" if constrain else "fused_unconstrained"] = dict(collectives=collectives(hlo))
    out["fused_weight_shapes"] = [list(s) for s in sorted({tuple(x.shape) for x in jax.tree.leaves((params, dparams))})]
    out["shapes"] = dict(B=batch, T=t, D=cfg.hidden_size, H_draft=dcfg.hidden_size, V=cfg.vocab_size,
                         V_draft=dcfg.draft_vocab_size, layers=cfg.num_layers)
    return out


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
        cfg = small_cfg(kvh, layers=2, tie=tie)
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


def run_engine() -> dict:
    """Greedy speculative decoding through the whole engine (prefill, fused iterations with a
    random drafter, K=3) at tp 1, 2, 4, 8 for both head layouts: tokens per tp."""
    from eagle3_jax.config import EngineConfig
    from eagle3_jax.engine.engine import Engine
    from eagle3_jax.sampling_params import SamplingParams

    out = {}
    prompts = [[int(t) for t in np.random.default_rng(i).integers(0, 256, 5 + 7 * i)] for i in range(3)]
    for kvh in (8, 2):
        cfg = small_cfg(kvh)
        params = jax.tree.map(jnp.asarray, random_params(cfg))
        dcfg = small_draft(cfg)
        dparams = E.init_draft_params(dcfg, jax.random.key(1), jnp.float32, own_embedding=True)
        engine_cfg = EngineConfig(batch_buckets=(4,), prefill_buckets=(16,), prefill_batch_buckets=(1,),
                                  num_speculative_tokens=3, page_size=PAGE, num_pages=64, max_model_len=64)
        res = {}
        for tp in (1, 2, 4, 8):
            engine = Engine(cfg, params, dcfg, dparams, engine_cfg, mesh=S.make_mesh(tp) if tp > 1 else None)
            reqs = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
            engine.run(reqs)
            res[str(tp)] = [r.output for r in reqs]
        out[f"kvh{kvh}"] = res
    return out


if __name__ == "__main__":
    task = sys.argv[1]
    result = {"equivalence": run_equivalence, "hlo": run_hlo, "layout": run_layout, "engine": run_engine}[task]()
    result["device_count"] = jax.device_count()
    print(json.dumps(result))
