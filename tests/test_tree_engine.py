"""Dynamic draft trees served by the engine (EngineConfig.tree): greedy output token-identical to
the target alone, the accepted path's target KV as a plain prefill of the accepted sequence leaves
it, no compiles after warm-up (with target-only iterations between speculative ones), sampled rows,
and the errors of bad trees. A tiny random target and drafters written by the tests; SmolLM2 with
the shipped drafter drafts a tree in tests/test_engine.py.

The vocabulary is small (12 tokens), so the random drafter's top-k often holds the target's next
token and trees are accepted past their first level; the forced-tree test chooses each tree itself,
its true path on a random branch, to reach every depth."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import TINY_VOCAB, served, tree_with_path
from runner_probe import read_kv, set_proposals

from eagle3_jax import SamplingParams, TreeSpec
from eagle3_jax.config import ConfigError, EngineConfig, default_batch_buckets
from eagle3_jax.engine.scheduler import Scheduler
from eagle3_jax.runner.speculators import Chain, Tree

VOCAB = TINY_VOCAB
# Mixed lengths in one batch: one prompt of 19 tokens is prefilled in two chunks of the 16-token bucket.
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 0], [4], [3, 3, 3, 3, 3]]
MAX_TOKENS = 40
ENGINE = dict(batch_buckets=(4,), prefill_buckets=(16,), prefill_batch_buckets=(4,), max_model_len=64, num_pages=64,
              speculation="always", freeze_heap=False)
SPECS = [TreeSpec(2, 2, 3), TreeSpec(3, 2, 5), TreeSpec(4, 4, 8), TreeSpec(6, 8, 31), TreeSpec.chain(3)]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def make(target, draft, tree: TreeSpec | None, warmup: bool = False, **engine):
    from eagle3_jax.api import LLM

    return LLM(target, draft, warmup=warmup, progress=False,
               engine_config=EngineConfig(**{**ENGINE, "tree": tree, **engine}))


@pytest.fixture(scope="module")
def alone(tiny_models):
    return make(tiny_models[0], None, None)


@pytest.fixture(scope="module")
def reference(alone):
    """The target alone, greedy, MAX_TOKENS per prompt."""
    return [o.token_ids for o in alone.generate(PROMPTS, greedy())]


@pytest.fixture(scope="module")
def tree_llm(tiny_models):
    """TreeSpec(3, 2, 5) with the shared drafter, built once for the tests that step it by hand."""
    return make(tiny_models[0], tiny_models[1]["shared"], TreeSpec(3, 2, 5))


# ---- greedy: token-identical -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["shared", "own"])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_greedy_tree_is_token_identical_to_the_target_alone(tiny_models, reference, spec, drafter):
    target, drafters = tiny_models
    # (6, 8, 31) reserves 47 positions an iteration: room past the 64 of the others
    llm = make(target, drafters[drafter], spec, max_model_len=128, num_pages=128)
    runner = llm.engine.runner
    if spec.is_chain:  # served as the chain: the same programs as num_speculative_tokens=3
        assert runner.speculator == Chain(3)
    else:
        assert runner.speculator == Tree(spec)
    outputs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outputs] == reference
    for o in outputs:
        assert len(o.metrics.accepted_at) == spec.steps  # counted by depth
        # The prefill gave the first token; each iteration one more than it accepted.
        assert o.metrics.emitted + 1 >= len(o.token_ids) and o.metrics.iterations < MAX_TOKENS
        assert o.metrics.emitted == o.metrics.iterations + sum(o.metrics.accepted_at)
    accepted = np.sum([o.metrics.accepted_at for o in outputs], axis=0)
    assert accepted[0] > 0  # proposals were accepted: the path's KV moved, the extend read the path
    assert all(np.diff(accepted) <= 0)  # a depth is reached only through the ones above it


@pytest.mark.slow
def test_pallas_attention_engine_is_token_identical(tiny_models, reference):
    """Every prefill, verify and draft step on the Pallas kernels (the GPU's default; interpreted
    here), the tree's verify and draft levels under their masks: exactly the target alone's tokens
    (XLA attention), with proposals accepted. (The chain's steps take the same kernels without a
    mask: tests/test_model.py and tests/test_pallas_attention.py compare them with the XLA form.)"""
    spec = TreeSpec(3, 2, 5)
    from jax.sharding import Mesh

    from eagle3_jax.runner.served import DeviceFacts, attention_kind

    target, drafters = tiny_models
    llm = make(target, drafters["shared"], spec, attention="pallas")
    assert llm.engine.step_cfg.attention == "pallas"
    outputs = llm.generate(PROMPTS, greedy(16))
    assert [o.token_ids for o in outputs] == [ref[:16] for ref in reference]
    assert sum(o.metrics.accepted for o in outputs) > 0
    assert attention_kind(EngineConfig(), DeviceFacts.of(None)) == "xla"  # "auto" off the GPU
    with pytest.raises(ConfigError, match="tensor parallelism"):
        attention_kind(EngineConfig(attention="pallas"), DeviceFacts.of(Mesh(np.array(jax.devices()[:1]), ("tp",))))


@pytest.mark.slow
def test_pallas_prefill_tiles_match_the_xla_engine(tiny_models, monkeypatch):
    """Prefill chunks of 128 tokens (256 query rows a kv head, too tall for one tile) attend in
    query tiles (`pallas_attention.attend_prefill`, interpreted here) in the target and the
    drafter: a 150-token prompt in two chunks, the second starting mid-context and padded, beside
    short prompts in the 16-token bucket -> the XLA engine's tokens, and the KV its prefill leaves
    (the target's second layer reads the first's attention, the drafter's KV the target's layers)."""
    from eagle3_jax.model import pallas_attention

    tiled = []
    attend_prefill = pallas_attention.attend_prefill
    monkeypatch.setattr(pallas_attention, "attend_prefill", lambda *a: tiled.append(a[0].shape) or attend_prefill(*a))
    target, drafters = tiny_models
    long = np.random.default_rng(7).integers(0, VOCAB, 150).tolist()
    prompts = [long, *PROMPTS[:2]]
    engine = dict(max_model_len=256, prefill_buckets=(16, 128))
    xla = make(target, drafters["shared"], None, **engine)
    reference = [o.token_ids for o in xla.generate(prompts, greedy(12))]
    assert not tiled
    llm = make(target, drafters["shared"], None, attention="pallas", **engine)
    outputs = llm.generate(prompts, greedy(12))
    assert [o.token_ids for o in outputs] == reference
    assert sum(o.metrics.accepted for o in outputs) > 0
    assert {shape[1] for shape in tiled} == {128}  # [B, T, H, hd]: the 128-token chunks only
    assert len(tiled) == 3  # the prefill program's target layers (2) and drafter (1), traced once
    for draft in (False, True):
        for got, want in zip(prefill_kv(llm, long, draft), prefill_kv(xla, long, draft)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# ---- forced trees: every depth, on any branch; the KV a plain prefill leaves ------------------
def prefill_kv(llm, sequence: list[int], draft: bool = False):
    """The target's (`draft`: the drafter's) KV [L, len, kvh, hd] after a plain prefill of `sequence`."""
    engine = llm.engine
    engine.overlap = False
    req = engine.add_request(sequence, greedy(4))
    engine.step()  # the prefill (and one iteration, writing from position len(sequence) on)
    kv = read_kv(engine.runner, engine.scheduler.block_tables[req.slot], range(len(sequence)), draft)
    while engine.has_unfinished():
        engine.step()
    engine.overlap = True
    return kv


@pytest.mark.slow
def test_forced_trees_accept_their_path_and_leave_the_kv_a_prefill_leaves(tree_llm, alone, reference):
    """Each iteration verifies a tree set by hand, whose true path (the target's own tokens) is
    0..steps deep on a random branch among wrong nodes: the row accepts exactly that path, emits
    the target alone's tokens, and the target's and the drafter's KV of everything accepted
    equal a plain prefill of the accepted sequence, read from the runner (`read_kv`)."""
    engine, spec = tree_llm.engine, TreeSpec(3, 2, 5)
    rng = np.random.default_rng(0)
    prompt, ref = PROMPTS[1], reference[1]
    engine.overlap = False  # read each iteration before forcing the next tree
    req = engine.add_request(prompt, greedy())
    engine.step()  # the prefill and one iteration on the drafter's own tree
    depths = []
    while len(req.output) + spec.steps + 2 < MAX_TOKENS:
        n = len(req.output)
        depth = int(rng.integers(spec.steps + 1))
        tokens, parents = tree_with_path(spec, ref[n:n + depth + 1], VOCAB, rng)
        set_proposals(engine.runner, req.slot, tokens, parents)
        accepted = req.metrics.accepted
        engine.step()
        assert req.metrics.accepted - accepted == depth
        assert req.output == ref[:n + depth + 1]
        depths.append(depth)
    assert set(depths) == set(range(spec.steps + 1))
    cached = prompt + req.output[:-1]  # the last token is not in the cache yet
    table = engine.scheduler.block_tables[req.slot]
    got = {cache: read_kv(engine.runner, table, range(len(cached)), cache == "draft") for cache in ("target", "draft")}
    while engine.has_unfinished():
        engine.step()
    engine.overlap = True
    assert req.output == ref
    # The drafter's reference: its prefill over the sequence, each position paired with the next
    # token (the last with the target's next one, the accepted path's last emitted token).
    want = {"target": prefill_kv(alone, cached), "draft": prefill_kv(tree_llm, cached, draft=True)}
    for cache in ("target", "draft"):
        for got_kv, want_kv in zip(got[cache], want[cache]):
            np.testing.assert_allclose(got_kv, want_kv, rtol=1e-5, atol=1e-6, err_msg=cache)


def test_set_proposals_checks_the_tree(tree_llm):
    runner = tree_llm.engine.runner
    with pytest.raises(ValueError, match="parents are given for a tree's proposals"):
        set_proposals(runner, 1, [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match=r"parents \[0, 0, 3, 1, 2\]: node i\+1's parent"):
        set_proposals(runner, 1, [1, 2, 3, 4, 5], [0, 0, 3, 1, 2])


# ---- compiles, target-only iterations, sampled rows ---------------------------------------------
@pytest.mark.slow
def test_auto_switches_between_the_tree_and_the_chain_without_compiles(tiny_models, reference):
    """"auto" over the tree (3, 2, 5), the chain of 3 and the target alone, its cost table making
    bucket 4 run the tree and bucket 2 the chain: the batch starts on the tree and moves to the
    chain as requests finish, each verifying a row whose pending proposal the other drafted as
    having none. Warm-up built every program: serving greedy and sampled requests compiles
    nothing, the greedy output is the target alone's, and both proposals' acceptance was measured."""
    spec = TreeSpec(3, 2, 5)
    llm = make(tiny_models[0], tiny_models[1]["shared"], spec, warmup=True, batch_buckets=(2, 4), speculation="auto",
               step_costs=((2, 1.0, 100.0, 0.5), (4, 1.0, 0.5, 100.0)))
    engine = llm.engine
    assert [p.facts.spec for p in engine.proposals] == [spec, TreeSpec.chain(3)]
    assert [c.choice for c in engine.speculation.table()] == ["chain K=3", "tree 3,2,5"]
    built = engine.num_compilations
    lengths = [8, 16, 24, 40]
    outputs = llm.generate(PROMPTS, [greedy(n) for n in lengths])
    assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(reference, lengths)]
    by_proposal = engine.stats.proposal_iterations
    assert set(by_proposal) == {"tree 3,2,5", "chain K=3"}
    assert set(by_proposal["tree 3,2,5"]) == {4} and set(by_proposal["chain K=3"]) == {2}
    assert all(est.rows > 0 for est in engine.speculation.acceptance)
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=i, ignore_eos=True) for i in range(2)]
    llm.generate(PROMPTS[:2], sampled)
    llm.generate(PROMPTS, [greedy(12), sampled[0], greedy(12), sampled[1]])
    assert engine.num_compilations == built, "serving tree requests compiled after warm-up"
    assert "tree 3,2,5: acceptance length L" in engine.speculation.report()


@pytest.mark.slow
def test_a_tree_bounds_its_chain_which_is_measured_on_its_own_rows(tiny_models, reference):
    """"auto" over the tree (3, 2, 5) and the chain of 3 at costs (0.5 and 0.6 against the target
    alone's 1.0) where the chain, at its optimistic prior (4 tokens), beats what the tree measures.
    The tree's verifies measure a lower bound of what the chain would accept (its top-1 chain
    inside the tree, `Speculation.top1`), never above the tree's own; the rule reads the chain's
    own estimate, raised to that bound only where the bound is higher, so the chain runs and is
    measured on its own rows. Rows of the draft-q rule, whose chain would have sampled, leave the
    bound as it was."""
    spec = TreeSpec(3, 2, 5)
    llm = make(tiny_models[0], tiny_models[1]["shared"], spec, speculation="auto", step_costs=((4, 1.0, 0.5, 0.6),))
    engine, speculation = llm.engine, llm.engine.speculation
    outputs = llm.generate(PROMPTS, greedy())
    assert [o.token_ids for o in outputs] == reference
    assert set(engine.stats.proposal_iterations) == {"tree 3,2,5", "chain K=3"}
    (tree, chain), bound = speculation.own, speculation.top1[1]
    assert speculation.top1[0] is None and 0 < bound.rows <= tree.rows and chain.rows > 0
    assert 1.0 <= bound.mean <= tree.mean
    assert speculation.acceptance[1].mean == max(chain.mean, bound.mean)
    assert speculation.acceptance[1].rows == chain.rows  # the chain's own record, whatever raised its mean
    draft_q = SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True, draft_acceptance="draft_q")
    trees = sum(engine.stats.proposal_iterations["tree 3,2,5"].values())
    llm.generate(PROMPTS[:1], draft_q)
    assert sum(engine.stats.proposal_iterations["tree 3,2,5"].values()) > trees
    assert speculation.top1[1].rows == bound.rows


@pytest.mark.slow
def test_sampled_rows_with_a_tree(tree_llm, reference):
    """Sampled rows beside greedy ones run the sampling program over the tree (point-mass
    acceptance, asked for by the draft-q rule): the greedy rows still give the target alone's
    tokens, a sampled row gives MAX_TOKENS tokens of the vocabulary, the same ones for its seed
    whatever else is in the batch, other ones for another seed, and its metrics add up."""
    def sampled(seed):
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True,
                              draft_acceptance="draft_q")

    batch = tree_llm.generate(PROMPTS, [greedy(), sampled(1), greedy(), sampled(2)])
    assert batch[0].token_ids == reference[0] and batch[2].token_ids == reference[2]
    for o in (batch[1], batch[3]):
        assert len(o.token_ids) == MAX_TOKENS and all(0 <= t < VOCAB for t in o.token_ids)
        assert o.metrics.emitted + 1 >= MAX_TOKENS
        assert o.metrics.emitted == o.metrics.iterations + sum(o.metrics.accepted_at)
    alone = tree_llm.generate([PROMPTS[1]], sampled(1))[0]
    assert alone.token_ids == batch[1].token_ids  # a row's randomness is its own
    other = tree_llm.generate([PROMPTS[1]], sampled(3))[0]
    assert other.token_ids != batch[1].token_ids
    assert sum(o.metrics.accepted for o in batch) > 0


# ---- a seed fixes the output ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_seed_gives_the_same_tokens_whatever_speculation_does(tiny_models):
    """A seeded request (the coupled rule, its default) gives the same tokens alone and in a
    batch of 8 (beside greedy, unseeded and other seeded rows), with speculation off, with a
    chain of 3 (alone and in the batch), and with a tree under "auto", whose cost table runs the
    tree in the bucket of 1 and the target alone in the bucket of 8. Its proposals are accepted:
    the tokens come through acceptance, not around it."""
    target, drafters = tiny_models
    seeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=MAX_TOKENS - i, temperature=0.0 if i % 3 == 0 else 1.0, ignore_eos=True,
                             seed=None if i % 3 == 1 else 50 + i) for i in range(7)]
    batch = [PROMPTS[1]] + [PROMPTS[i % len(PROMPTS)] for i in range(7)]
    setups = [("target alone", None, None, {}), ("chain of 3", "shared", TreeSpec.chain(3), {}),
              ("tree, auto", "shared", TreeSpec(3, 2, 5),
               dict(speculation="auto", step_costs=((1, 1.0, 0.5, 100.0), (8, 0.5, 100.0, 100.0))))]
    tokens = {}
    for name, drafter, spec, engine in setups:
        llm = make(target, drafters[drafter] if drafter else None, spec,
                   **{**dict(batch_buckets=(1, 8), num_pages=160), **engine})
        alone = llm.generate([PROMPTS[1]], seeded)[0]
        together = llm.generate(batch, [seeded] + others)[0]
        tokens[name, "alone"], tokens[name, "batch of 8"] = alone.token_ids, together.token_ids
        if drafter:
            assert alone.metrics.accepted > 0, name
        if engine:  # the tree ran alone, the target alone in the batch
            assert set(llm.engine.stats.proposal_iterations) == {"tree 3,2,5", "target-only"}
    want = tokens["target alone", "alone"]
    assert len(want) == MAX_TOKENS
    assert {key: got for key, got in tokens.items() if got != want} == {}
    other_seed = dataclasses.replace(seeded, seed=1235)
    assert make(target, None, None).generate([PROMPTS[1]], other_seed)[0].token_ids != want


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    ((0, 2, 2), "steps must be a positive int, got 0"),
    ((2, True, 2), "top_k must be a positive int, got True"),
    ((2, 2, 2.5), "tokens must be a positive int, got 2.5"),
    ((2, 2, 7), "tokens must be at most the 6 candidates of steps=2, top_k=2, got 7"),
])
def test_bad_tree_specs_name_the_field(args, message):
    with pytest.raises(ConfigError, match=f"^{message}$"):
        TreeSpec(*args)


def test_engine_config_tree():
    cfg = EngineConfig(tree=TreeSpec(4, 4, 8), num_speculative_tokens=2)
    assert cfg.num_speculative_tokens == 2 and cfg.max_proposals == 4  # K: the chain "auto" may choose
    chain = EngineConfig(tree=TreeSpec.chain(3), fused_iteration=False)  # the chain of 3: it stands for K
    assert chain.tree == TreeSpec.chain(3) and chain.speculative_proposals == (TreeSpec.chain(3),)
    assert served(chain).speculation.num_speculative_tokens == 3 and served(chain).speculation.tree is None
    # Two iterations of a tree's footprint fit the block tables: (6, 8, 31) writes 47 positions past the length.
    wide = EngineConfig(tree=TreeSpec(6, 8, 31), page_size=16, max_model_len=2048)
    assert TreeSpec(6, 8, 31).positions_per_iteration == 47
    assert wide.max_blocks_per_seq * 16 >= 2048 + 2 * 47 > EngineConfig(max_model_len=2048).max_blocks_per_seq * 16
    with pytest.raises(ConfigError, match=r"engine config: tree must be a TreeSpec\(steps, top_k, tokens\)"):
        EngineConfig(tree=(2, 2, 3))
    with pytest.raises(ConfigError, match=r"engine config: tree.steps must be in 1\.\.16, got 17"):
        EngineConfig(tree=TreeSpec(17, 1, 1))
    with pytest.raises(ConfigError, match=r"engine config: fused_iteration=False does not run a tree"):
        EngineConfig(tree=TreeSpec(2, 2, 3), fused_iteration=False)


def test_engine_config_keeps_the_values_given():
    """Fields stay as given (a chain-shaped tree, no pool size, no slot count); what follows from
    them is a property, or the served configuration, settled the same way each time."""
    cfg = EngineConfig(tree=TreeSpec(4, 1, 4), batch_buckets=(2, 8), max_model_len=64, page_size=16)
    assert cfg.tree == TreeSpec(4, 1, 4) and cfg.num_speculative_tokens == 3
    assert (cfg.num_pages, cfg.max_num_seqs) == (None, None)
    assert cfg.speculative_proposals == (TreeSpec.chain(4),) and cfg.max_proposals == 4
    settled = served(cfg)
    spec, pool = settled.speculation, settled.pool
    assert (spec.tree, spec.num_speculative_tokens, settled.max_num_seqs) == (None, 4, 8)
    assert pool.num_pages == 8 * 4 + pool.max_blocks_per_seq + 1  # 8 slots of 64 tokens, one full row more
    assert served(cfg) == settled and cfg.tree == TreeSpec(4, 1, 4)
    given = EngineConfig(step_costs=[[2, 0.01, 0.02]], num_pages=40)
    assert given.step_costs == ((2, 0.01, 0.02),) and served(given).pool.num_pages == 40


def test_max_num_seqs_is_set_and_checked():
    assert EngineConfig().max_num_seqs is None and served(EngineConfig(batch_buckets=(2, 8))).max_num_seqs == 8
    cfg = EngineConfig(batch_buckets=(2, 8), max_num_seqs=5, page_size=4, num_pages=64, max_model_len=64)
    assert cfg.max_num_seqs == 5 and served(cfg).max_num_seqs == 5
    assert Scheduler(served(cfg), VOCAB, 3).block_tables.shape[0] == 6  # five slots and the dummy
    for buckets, seqs in (((2, 8), 9), (None, 65), ((2, 8), 0)):
        bound = 8 if buckets else 64
        with pytest.raises(ConfigError, match=rf"max_num_seqs must be in 1\.\.{bound} \(the largest batch bucket runs "
                                              rf"them all\), got {seqs}"):
            EngineConfig(batch_buckets=buckets, max_num_seqs=seqs)


@pytest.mark.slow
def test_engine_serves_a_chain_shaped_tree_and_fewer_slots(tiny_models, reference):
    """TreeSpec(4, 1, 4) runs the chain of 4; max_num_seqs 3 under a bucket of 4 serves the four
    prompts three at a time. Greedy output is the target alone's either way."""
    llm = make(tiny_models[0], tiny_models[1]["shared"], TreeSpec(4, 1, 4), max_num_seqs=3)
    engine = llm.engine
    assert engine.runner.speculator == Chain(4)
    spec = engine.cfg.speculation
    assert (spec.tree, spec.num_speculative_tokens, engine.cfg.max_num_seqs) == (None, 4, 3)
    assert engine.scheduler.block_tables.shape[0] == 4
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy())] == reference


def test_llm_arguments_reach_the_step_configs_through_one_served_configuration(tiny_models, monkeypatch):
    """LLM(...) forwards K, the tree and any EngineConfig field by name into one EngineConfig; the
    engine settles it once (`served_config`, tree "auto" chosen there and only there) before the
    runner is built; the engine, its scheduler and speculation bookkeeping, the runner and the
    step configs then read that one object, never a copy of it."""
    from eagle3_jax.api import LLM
    from eagle3_jax.engine import engine as engine_module
    from eagle3_jax.runner import served as served_module

    events, asked = [], []
    settle, build, choose_tree = engine_module.served_config, engine_module.ModelRunner, served_module.default_tree
    monkeypatch.setattr(engine_module, "served_config", lambda cfg, *a: events.append("served") or asked.append(cfg)
                        or settle(cfg, *a))
    monkeypatch.setattr(engine_module, "ModelRunner", lambda *a: events.append("runner") or build(*a))
    monkeypatch.setattr(served_module, "default_tree", lambda *a: events.append("auto") or choose_tree(*a))
    llm = LLM(tiny_models[0], tiny_models[1]["shared"], num_speculative_tokens=5, tree="auto", warmup=False,
              progress=False, engine_config=EngineConfig(**ENGINE), max_model_len=96)
    assert events == ["served", "auto", "runner"]  # settled once, "auto" inside it, then the runner
    (cfg,) = asked
    assert (cfg.num_speculative_tokens, cfg.tree, cfg.max_model_len) == (5, "auto", 96)
    engine, served = llm.engine, llm.engine.cfg
    assert engine.runner.cfg is served and engine.scheduler.cfg is served and served.max_model_len == 96
    assert (served.speculation.num_speculative_tokens, served.speculation.tree) == (5, None)  # no tree on the CPU
    (chain,) = served.speculation.proposals
    assert chain == Chain(5) and engine.speculation.facts == (chain.facts,) and engine.scheduler.num_draft == 5
    assert engine.step_cfg.speculator is chain and engine.iterate_config(4).speculator is chain


def test_default_buckets_follow_what_the_engine_drafts(tiny_models):
    """Given no batch_buckets the engine takes `default_batch_buckets` for its proposals: a lone
    request runs on one row with a tree or the target alone, padded to two with chains only."""
    rest = (2, 4, 8, 16, 32, 64)
    assert default_batch_buckets((TreeSpec.chain(4),)) == rest
    assert default_batch_buckets((TreeSpec(5, 4, 15), TreeSpec.chain(4))) == (1, *rest)
    assert default_batch_buckets(()) == (1, *rest)
    assert EngineConfig().batch_buckets is None and served(EngineConfig()).max_num_seqs == 64
    target, drafters = tiny_models
    for draft, tree, first in ((drafters["shared"], TreeSpec(3, 2, 5), 1), (drafters["shared"], None, 2),
                               (None, None, 1), (drafters["shared"], TreeSpec.chain(3), 2)):
        engine = make(target, draft, tree, batch_buckets=None, speculation="auto").engine
        assert engine.cfg.batch_buckets == (first, *rest[first == 2:]), (draft, tree)
        assert engine.scheduler.bucket(1) == first
    with pytest.raises(ConfigError, match=r"batch_buckets must be increasing positive sizes, got \(\)"):
        EngineConfig(batch_buckets=())


def test_llm_checks_its_tree_before_loading(tmp_path):
    from eagle3_jax.api import LLM

    with pytest.raises(ConfigError, match=r'^tree must be a TreeSpec, "STEPS,TOPK,TOKENS" \(e.g. "6,8,31"\), "auto", '
                                          r'"none" or None, got \[3, 2, 5\]$'):
        LLM(tmp_path / "missing", tree=[3, 2, 5], progress=False)


def test_a_tree_wider_than_the_draft_vocabulary_is_refused(tiny_models):
    # The "own" drafter's draft vocabulary holds 8 of the 12 tokens: a node cannot have 9 children.
    with pytest.raises(ConfigError, match=r"^tree 2,9,3: top_k 9 exceeds the drafter's draft vocabulary of 8 tokens$"):
        make(tiny_models[0], tiny_models[1]["own"], TreeSpec(2, 9, 3))
    assert make(tiny_models[0], tiny_models[1]["own"], TreeSpec(2, 8, 3)).engine.proposals[0].facts.spec.top_k == 8


def test_scheduler_reserves_two_tree_iterations():
    cfg = EngineConfig(batch_buckets=(2,), page_size=4, num_pages=64, max_model_len=64, tree=TreeSpec(3, 2, 5))
    s = Scheduler(served(cfg), VOCAB, 3, Tree(TreeSpec(3, 2, 5)).facts.positions_per_iteration)
    assert Tree(TreeSpec(3, 2, 5)).facts.positions_per_iteration == 8  # max(5 + 1, 3 + 1 + 2 * 2)
    assert s.pages_needed(4, 4) == 6  # 4 + 4 + 2 * 8 = 24 tokens
    assert s.add([1], greedy(1)).metrics.accepted_at == [0, 0, 0]  # by depth
    assert Scheduler(served(cfg), VOCAB, 3).pages_needed(4, 4) == 4  # a chain of 3: 4 + 4 + 2 * 4 = 16 tokens


def test_cli_tree_flag():
    from eagle3_jax import cli

    args = cli.build_parser().parse_args(["generate", "--tree", "3,2,5"])
    assert args.tree == TreeSpec(3, 2, 5)
    assert cli.build_parser().parse_args(["generate"]).tree == "auto"
    assert cli.build_parser().parse_args(["generate", "--tree", "none"]).tree is None


def test_the_default_tree_joins_only_where_auto_can_choose_it():
    from eagle3_jax.config import DEFAULT_TREE, default_tree

    chain = EngineConfig(num_speculative_tokens=4)
    assert default_tree(chain, drafting=True, backend="gpu") == DEFAULT_TREE == TreeSpec(6, 8, 31)
    assert dataclasses.replace(chain, tree=DEFAULT_TREE).speculative_proposals == (DEFAULT_TREE, TreeSpec.chain(4))
    # Not on the CPU, without a drafter or K, under "always", or with a cost table naming the chain alone.
    assert default_tree(chain, drafting=True, backend="cpu") is None
    assert default_tree(chain, drafting=False, backend="gpu") is None
    assert default_tree(EngineConfig(num_speculative_tokens=0), drafting=True, backend="gpu") is None
    assert default_tree(dataclasses.replace(chain, speculation="always"), drafting=True, backend="gpu") is None
    costed = dataclasses.replace(chain, step_costs=((1, 1e-3, 1.1e-3),))
    assert default_tree(costed, drafting=True, backend="gpu") is None
    # A tree the config names is kept, on any backend.
    named = dataclasses.replace(chain, tree=TreeSpec(3, 2, 5))
    assert default_tree(named, drafting=True, backend="cpu") == TreeSpec(3, 2, 5)


def test_llm_tree_argument_is_a_tree_auto_or_none(tmp_path):
    from eagle3_jax.api import LLM

    with pytest.raises(ConfigError, match=r"tree must be a TreeSpec, \"STEPS,TOPK,TOKENS\" .* got 'yes'"):
        LLM(tmp_path / "missing", tree="yes", progress=False)
    # The CLI's spelling is taken, and checked before anything loads.
    with pytest.raises(ConfigError, match="tokens must be at most the 6 candidates of steps=2, top_k=2, got 7"):
        LLM(tmp_path / "missing", tree="2,2,7", progress=False)
    with pytest.raises(ConfigError, match=r"steps 17 is outside 1\.\.16"):
        LLM(tmp_path / "missing", tree="17,1,17", progress=False)
    for accepted in ("3,2,5", "none", "auto"):  # past the tree: the missing target is what fails
        with pytest.raises(FileNotFoundError):
            LLM(tmp_path / "missing", tree=accepted, progress=False)


@pytest.mark.parametrize("value, tree", [
    ("6,8,31", TreeSpec(6, 8, 31)), (" 3, 2, 5 ", TreeSpec(3, 2, 5)), ("auto", "auto"), ("none", None),
    (None, None), (TreeSpec(4, 1, 4), TreeSpec(4, 1, 4)),
])
def test_llm_and_cli_parse_a_tree_alike(value, tree):
    from eagle3_jax import cli
    from eagle3_jax.config import parse_tree

    assert parse_tree(value) == tree
    if isinstance(value, str):
        assert cli.tree_choice(value) == tree


@pytest.mark.parametrize("value, message", [
    ("3,2", "'3,2' is not STEPS,TOPK,TOKENS"),
    ("3,x,5", "'3,x,5' is not STEPS,TOPK,TOKENS"),
    ("2,2,7", "tokens must be at most the 6 candidates of steps=2, top_k=2, got 7"),
    ("17,1,17", "steps 17 is outside 1..16"),
])
def test_cli_bad_tree_is_one_line(capsys, value, message):
    from eagle3_jax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "--tree", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --tree" in err and message in err
