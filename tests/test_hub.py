"""Targets and drafters by Hugging Face hub id, through huggingface_hub's cache: no hub is
reachable here, so a cache is laid out on disk as huggingface_hub writes it (refs naming commits,
snapshots holding the files) and read with HF_HUB_OFFLINE set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_jax import assets

REPO = Path(__file__).resolve().parents[1]
COMMITS = {"main": "a" * 40, "v2": "b" * 40}


def lay_out_hub_cache(cache: Path, repo_id: str, model: Path) -> dict[str, Path]:
    """`model`'s files as the snapshot of each ref in COMMITS; -> ref: snapshot directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshots = {}
    for ref, commit in COMMITS.items():
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
        snapshots[ref] = shutil.copytree(model, repo / "snapshots" / commit)
    return snapshots


@pytest.fixture
def offline_cache(tmp_path, chat_models, monkeypatch):
    from huggingface_hub import constants

    snapshots = lay_out_hub_cache(tmp_path, "acme/tiny-chat", chat_models[0])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path, snapshots


def test_a_hub_id_resolves_to_its_cached_snapshot_at_a_revision(offline_cache, chat_models):
    cache, snapshots = offline_cache
    assert assets.resolve_model("acme/tiny-chat") == snapshots["main"]
    assert assets.resolve_model("acme/tiny-chat", revision="v2") == snapshots["v2"]
    assert assets.resolve_model(chat_models[0]) == chat_models[0]  # a directory stays as it is
    with pytest.raises(assets.AssetError) as e:
        assets.resolve_model("acme/not-downloaded")
    assert str(cache) in str(e.value) and "HF_HUB_OFFLINE is set" in str(e.value)
    assert "hf download acme/not-downloaded" in str(e.value)


def test_llm_loads_a_target_by_hub_id(offline_cache):
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    llm = LLM("acme/tiny-chat", draft=None, num_speculative_tokens=0, warmup=False, progress=False,
              engine_config=EngineConfig(batch_buckets=(1,), max_model_len=64))
    assert llm.tokenizer is not None and llm.engine.cfg.max_model_len == 64


def run_offline(cache: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "eagle3_jax.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env=env)


def test_cli_names_what_to_do_for_a_hub_id_missing_offline(tmp_path):
    proc = run_offline(tmp_path, "generate", "--target", "acme/not-downloaded", "--prompt", "hi")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "acme/not-downloaded" in line and "HF_HUB_OFFLINE is set" in line


@pytest.mark.slow
def test_cli_generates_from_a_hub_id_offline(tmp_path, chat_models):
    lay_out_hub_cache(tmp_path, "acme/tiny-chat", chat_models[0])
    proc = run_offline(tmp_path, "generate", "--target", "acme/tiny-chat", "--revision", "v2", "--draft", "none",
                       "--prompt", "hi", "--max-tokens", "3", "--max-model-len", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["error"] is None and 1 <= len(record["token_ids"]) <= 3
