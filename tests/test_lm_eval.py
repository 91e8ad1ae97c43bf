"""lm-evaluation-harness against `eagle3-jax serve` (scripts/lm_eval_server.py): a tiny random Llama
with a byte tokenizer, served as a subprocess with speculation and without; the harness scores
facts_mc through `local-completions` (log-likelihoods from echo + logprobs) and generates
humaneval_next_line through `local-chat-completions`. Both servers give the same per-item
results, and their log-likelihoods are transformers' (the harness' `--model hf`) on the same
checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY, write_byte_tokenizer

from eagle3_jax.config import DraftConfig, ModelConfig

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
MC, GEN = "facts_mc", "humaneval_next_line"
LIMIT_MC, LIMIT_GEN = 4, 2
ENGINE = "--num-draft 3 --tree none --batch-buckets 1 --max-num-seqs 1"


@pytest.fixture(scope="module")
def long_chat_models(tmp_path_factory):
    """The byte-tokenized tiny target and drafter of conftest's chat_models with room for
    HumanEval's prompts (several hundred bytes each): RoPE to 2048 positions."""
    from eagle3_jax.bench.phases import write_random_models

    vocab = 3 + 256
    cfg = ModelConfig(**{**TINY.__dict__, "vocab_size": vocab, "max_position_embeddings": 2048})
    target, draft = write_random_models(cfg, DraftConfig.like_target(cfg, vocab),
                                        tmp_path_factory.mktemp("long_chat_models"))
    assert write_byte_tokenizer(target) == vocab
    return target, draft


def test_lm_eval_scores_the_same_with_speculation_on_and_off_and_as_transformers(long_chat_models, tmp_path):
    target, draft = long_chat_models
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "lm_eval_server.py"), "--target", str(target), "--draft", str(draft),
           "--engine", ENGINE, "--max-model-len", "1024", "--limit-mc", str(LIMIT_MC), "--limit-gen", str(LIMIT_GEN),
           "--start-timeout", "240", "--out-dir", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "lm_eval.json").read_text())
    on, off, hf = (result["runs"][name] for name in ("spec on", "spec off", "hf"))
    # The first server speculated (its /metrics), the second ran the target alone.
    assert result["speculation"]["spec on"]["drafts"] > 0 and result["speculation"]["spec off"]["drafts"] == 0

    # Every item, each of its 4 choices scored; the same log-likelihoods all three ways.
    assert len(off[MC]["items"]) == LIMIT_MC and all(len(lls) == 4 for lls in off[MC]["items"].values())
    for other in (on, hf):
        assert other[MC]["items"].keys() == off[MC]["items"].keys()
        for doc, lls in off[MC]["items"].items():
            assert other[MC]["items"][doc] == pytest.approx(lls, abs=1e-3)
        assert other[MC]["score"] == off[MC]["score"]

    # Greedy generations: the same text with speculation or without (random bytes up to a newline or
    # max_gen_toks: not empty).
    assert len(off[GEN]["items"]) == LIMIT_GEN and all(off[GEN]["items"].values())
    assert on[GEN]["items"] == off[GEN]["items"] and on[GEN]["score"] == off[GEN]["score"]
    print(done.stdout[-1500:])
