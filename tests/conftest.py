"""Shared fixtures: the real SmolLM2 target (prepared once per machine), MT-bench prompts, and
engines shared across tests so each compiled bucket is built once per test run (and loaded from
JAX's persistent cache in each later module: see _drop_compiled_programs)."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle3_jax import assets
from eagle3_jax.config import DraftConfig, ModelConfig

# The CPU is the test platform; f32 everywhere so parity is meaningful.
jax.config.update("jax_platforms", "cpu")

# Compiling is most of what the tests do, and two XLA flags make it cheaper: LLVM at -O0 (XLA's
# default is -O2), and on top of that the older CPU emitter for fusions (2 cores, empty caches: the
# tensor-parallel engine worker 42 -> 27 s, a tiny engine's tree sampling iteration 5.6 -> 4.4 s
# and its prefill 2.8 -> 2.1 s). SmolLM2's programs compile in about the same time either way and
# run about 1.8x slower than at -O2 (a speculative iteration of 8 rows 454 against 254 ms), but
# compiling them at -O2 costs the suite more than that: a run with its SmolLM2 engine modules at
# -O2 had run 106 tests after 16 minutes, the -O0 one about 200 after 12. Set before jax starts
# its backend; the tests' subprocesses inherit it.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "").split()
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in _FAST_COMPILE if f not in _flags])

# Under xdist each worker gets its share of the cores for OpenMP and BLAS threads: torch's (the
# transformers references of tests/test_model.py, the bench's peer) and those of the subprocesses the
# tests start. With every core each, one worker's torch threads spin against the other worker's XLA:
# on 2 cores next to a busy one, transformers' greedy generate of tests/test_model.py took 13.3 s at 2
# threads and 4.7 s at 1 (that test, in the suite: 50 to 139 s before, about 22 s after). Torch reads
# the variable when it is first imported, which the tests do later.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _CORES_EACH = str(max(1, _cores // _WORKERS))
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, _CORES_EACH)


# Linux caps a process's memory mappings (vm.max_map_count, 65,530 by default) and each XLA CPU
# executable holds its own. Keeping every program of the suite, the full run aborted inside an XLA
# compile in tests/test_train.py, twice at the same test, while that file alone passed; in a later
# run one module added about 35,000 mappings on its own. Dropping the compiled programs once a
# module leaves more than this many keeps the run under the cap and rebuilds little (from JAX's
# persistent cache, where a program was saved).
_DROP_PROGRAMS_AT_MAPPINGS = 20_000
_MAPPINGS = Path("/proc/self/maps")


# The suite runs on two workers, each taking whole modules in collection order (README: `-n 2
# --dist loadfile --no-loadscope-reorder`; xdist would otherwise order modules by their number of
# tests). Collected longest first, no long module is left to run alone at the end; test_model.py
# comes after others of about its length, so that its SmolLM2 programs (those of `target_llm`) are
# in JAX's persistent cache by then, compiled by tests/test_engine.py on the other worker.
LONGEST_MODULES = ("test_engine.py", "test_parallel.py", "test_tree_engine.py", "test_model.py", "test_train.py",
                   "test_bench.py", "test_cli.py", "test_notebook.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    yield
    if _MAPPINGS.exists() and _MAPPINGS.read_bytes().count(b"\n") > _DROP_PROGRAMS_AT_MAPPINGS:
        gc.collect()
        jax.clear_caches()


@pytest.fixture(scope="session")
def smollm2_dir():
    return assets.prepare_default_target(progress=False)


@pytest.fixture(scope="session")
def smollm2_cfg(smollm2_dir):
    return ModelConfig.from_json(smollm2_dir / "config.json")


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def mtbench():
    return assets.user_turns()


@pytest.fixture(scope="session")
def chat_ids(tokenizer, mtbench):
    """Chat-templated MT-bench first turns as token ids."""
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)) for q in mtbench]


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own GGUF loader: an independent reference for our conversion and forward."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = assets.fetch(assets.SMOLLM2_GGUF)
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers' GGUF loading with gguf-py's work done once: it parses the file's header (the
    49,152-entry vocabulary, field by field) once for the config and again for the weights, and
    builds the same tensor-name map once per submodule (397 times for SmolLM2): SmolLM2's load took
    18 s on an idle core, 8 s with these shared. Still transformers' own reader and map (the model's
    tensors compare equal), only not built twice."""
    import gguf

    make_reader, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = make_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


# A tiny random Llama and drafters for the engine's logic: a vocabulary of 12 tokens, so a random
# drafter's proposals are often the target's next token and get accepted (tests/test_engine_tiny.py,
# tests/test_tree_engine.py).
TINY_VOCAB = 12
TINY = ModelConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                   max_position_embeddings=128, tie_word_embeddings=False, eos_token_ids=(2,))



def served(cfg, draft: DraftConfig | None = None, target: ModelConfig = TINY, free_bytes: int | None = None):
    """`cfg` (an EngineConfig) as an engine on one CPU device serves it (runner/served.py), for
    `target` and `draft` (None: no drafter); `free_bytes`: the memory the device reports free."""
    from eagle3_jax.runner.served import DeviceFacts, served_config

    device = DeviceFacts(backend="cpu", name="cpu", hopper=False, tp=None, free_bytes=free_bytes)
    return served_config(cfg, target, draft, device, "bfloat16")

@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """TINY's target directory, and two drafters: one reading the target's embedding ("shared"),
    and one of the 70B layout ("own": narrower, its own embedding, a draft vocabulary of 8 of the
    12 tokens, a RoPE range shorter than the prompts)."""
    from eagle3_jax.bench.phases import write_random_models

    root = tmp_path_factory.mktemp("tiny_models")
    target, shared = write_random_models(TINY, DraftConfig.like_target(TINY, TINY_VOCAB), root / "shared")
    # max_position_embeddings 8: every prompt and reply runs past the drafter's nominal RoPE range.
    narrow = DraftConfig.like_target(TINY, 8, hidden_size=24, intermediate_size=48, head_dim=6,
                                     max_position_embeddings=8)
    _, own = write_random_models(TINY, narrow, root / "own")
    return target, {"shared": shared, "own": own}


# Small shapes keep CPU compilation cheap: prompts over 64 tokens are prefilled in chunks, one
# prompt per prefill call (each prefill shape is two more SmolLM2 programs of 7-10 s each to
# compile on 2 CPU cores: tests/test_engine.py's spec_llm batches its prefills, against the target
# alone's single ones).
# "always": one iteration program per bucket, and every test speculates whatever the CPU's timing;
# tests/test_engine_tiny.py and tests/test_tree_engine.py run "auto" end to end.
# freeze_heap off: a full garbage collection per warm-up (0.4 s or more here) adds up over the suite;
# tests/test_engine.py checks the default's freeze.
TEST_ENGINE = {"batch_buckets": (1, 8), "prefill_buckets": (64,), "prefill_batch_buckets": (1,),
               "max_model_len": 384, "num_pages": 256, "speculation": "always", "freeze_heap": False}


class CyclicGarbage:
    """An object only the cyclic garbage collector frees: it refers to itself."""

    def __init__(self):
        self.me = self


def make_llm(target, draft=None, num_draft=3, warmup=True, **engine):
    """An LLM on the test engine config, warmed up (every program built) unless told otherwise."""
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    return LLM(target=target, draft=draft, num_speculative_tokens=num_draft,
               engine_config=EngineConfig(**{**TEST_ENGINE, **engine}), warmup=warmup, progress=False)


@pytest.fixture(scope="session")
def target_llm(smollm2_dir):
    """SmolLM2 alone, the reference of greedy outputs: each program built on first use (the
    tests' references are greedy, so warming up would also build the sampling ones for nothing)."""
    return make_llm(smollm2_dir, warmup=False)


# A tiny random Llama with a tokenizer and a chat template, for what speaks text (the server, chat):
# byte-level tokens (259: every byte and three specials), so any text encodes and any random
# output decodes, incomplete UTF-8 characters included.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 (2 ends a turn: EOS)


def write_byte_tokenizer(directory: Path) -> int:
    """A byte-level tokenizer with CHAT_TEMPLATE in `directory`; -> its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bytes_ = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate([*CHAT_SPECIALS, *bytes_])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(CHAT_SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(directory))
    return len(vocab)


@pytest.fixture(scope="session")
def chat_models(tmp_path_factory):
    """(target directory with the byte tokenizer, drafter directory)."""
    from eagle3_jax.bench.phases import write_random_models

    root = tmp_path_factory.mktemp("chat_models")
    vocab = 3 + 256
    cfg = ModelConfig(**{**TINY.__dict__, "vocab_size": vocab})
    target, draft = write_random_models(cfg, DraftConfig.like_target(cfg, vocab), root)
    assert write_byte_tokenizer(target) == vocab
    return target, draft


def tree_with_path(spec, truth: list[int], vocab: int, rng) -> tuple[list[int], list[int]]:
    """spec.tokens nodes (tokens, parents in the verify layout) holding truth[:-1] as a root path on a
    random branch, every other node a random token of `vocab`, never truth[d] under the path's node
    at depth d (so the row accepts exactly len(truth) - 1 drafts). truth[d]: the target's token after
    depth d."""
    on_path = sorted(rng.choice(np.arange(1, spec.tokens + 1), len(truth) - 1, replace=False).tolist())
    tokens, parents, depths, path = [], [], [0], [0]  # path: the nodes of the true path so far, by depth
    for i in range(1, spec.tokens + 1):
        if on_path and i == on_path[0]:
            on_path.pop(0)
            parent, token = path[-1], truth[len(path) - 1]
            path.append(i)
        else:
            parent = int(rng.choice([j for j in range(i) if depths[j] < spec.steps]))
            token = int(rng.integers(vocab))
            if parent in path and token == truth[path.index(parent)]:
                token = (token + 1) % vocab  # a wrong child: rejected
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
    return tokens, parents
