"""The command line's user errors: each is one line on stderr naming the problem and what to do,
exit code 2, no traceback; flag mistakes are rejected before any model loads (in seconds).

Each run is a subprocess of the real entry point. Mistakes that need a model (a drafter made for
another target, a truncated drafter file) run against a tiny random target written here; the
tests that need the real SmolLM2 are marked slow.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle3_jax import cli, presets
from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig
from eagle3_jax.model.eagle3 import init_draft_params
from eagle3_jax.model.llama import init_params
from eagle3_jax.weights.eagle3 import load_drafter, save_drafter
from eagle3_jax.weights.llama import save_llama

REPO = Path(__file__).resolve().parents[1]
FLAG_SECONDS = 5.0  # a flag mistake is rejected before anything heavy is imported
TINY = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                   tie_word_embeddings=False, eos_token_ids=(2,))
# Runs the CLI with torch hidden: find_spec("torch") is None, as on a machine without it.
NO_TORCH = "import sys; sys.modules['torch'] = None; from eagle3_jax.cli import main; sys.exit(main(sys.argv[1:]))"
# What loading a model would import (the API, the engine, the checkpoint readers, transformers).
MODEL_MODULES = ("eagle3_jax.api", "eagle3_jax.engine", "eagle3_jax.runner", "eagle3_jax.weights.llama",
                 "eagle3_jax.weights.eagle3", "transformers", "torch")
# Runs the CLI, then prints on stdout's last line, as JSON, which of MODEL_MODULES it imported and
# whether JAX started a backend (anything allocated or compiled).
REPORT_LOADED = (
    "import json, sys; from eagle3_jax.cli import main; code = main(sys.argv[1:]); "
    "bridge = sys.modules.get('jax._src.xla_bridge'); "
    f"print(json.dumps({{'modules': [m for m in {MODEL_MODULES!r} if m in sys.modules], "
    "'backend': bool(bridge and bridge.backends_are_initialized())}), flush=True); sys.exit(code)"
)


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120, no_torch: bool = False,
            report_loaded: bool = False):
    """(completed process, seconds) of `eagle3-jax ARGS` in a subprocess, on the CPU; with
    `report_loaded`, stdout ends with REPORT_LOADED's line."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    entry = ["-c", NO_TORCH] if no_torch else ["-c", REPORT_LOADED] if report_loaded else ["-m", "eagle3_jax.cli"]
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, *entry, *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)
    return proc, time.perf_counter() - start


def one_line_error(proc) -> str:
    """The single stderr line of a user error (exit code 2, no traceback)."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    return lines[0]


def host_random(shapes, seed: int):
    """numpy weights of the given shapes (a drafter's d2t all zeros: the identity map); no compiles."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.integer)
                        else (0.02 * rng.standard_normal(s.shape)).astype(s.dtype), shapes)


def write_tiny_target(path: Path) -> Path:
    """TINY with random weights and a config.json, no tokenizer (prompts are token ids)."""
    save_llama(host_random(jax.eval_shape(lambda k: init_params(TINY, k, jnp.float32), jax.random.PRNGKey(0)), 0), path)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": TINY.vocab_size,
              "hidden_size": TINY.hidden_size, "intermediate_size": TINY.intermediate_size,
              "num_hidden_layers": TINY.num_layers, "num_attention_heads": TINY.num_heads,
              "num_key_value_heads": TINY.num_kv_heads, "head_dim": TINY.head_dim, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False, "eos_token_id": 2}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    return write_tiny_target(tmp_path_factory.mktemp("tiny_target"))


def _drafter(path: Path, cfg: DraftConfig) -> Path:
    shapes = jax.eval_shape(lambda k: init_draft_params(cfg, k, jnp.float32), jax.random.PRNGKey(1))
    return save_drafter(host_random(shapes, 1), cfg, path)


@pytest.fixture(scope="module")
def wrong_size_drafter(tmp_path_factory) -> Path:
    """A drafter made for a 48-wide target of the same vocabulary."""
    other = ModelConfig(**{**TINY.__dict__, "hidden_size": 48, "capture_layer_ids": ()})
    return _drafter(tmp_path_factory.mktemp("wrong_size"), DraftConfig.like_target(other, draft_vocab_size=64))


@pytest.fixture(scope="module")
def truncated_drafter(tmp_path_factory) -> Path:
    path = _drafter(tmp_path_factory.mktemp("truncated"), DraftConfig.like_target(TINY, draft_vocab_size=64))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


# ---- flags: rejected while parsing, before anything loads -------------------------------------
FLAG_MISTAKES = [
    (["--num-draft", "-1"], "--num-draft"),
    (["--num-draft", "100"], "--num-draft"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "2"], "--top-p"),
    (["--top-p", "0"], "--top-p"),
    (["--max-model-len", "0"], "--max-model-len"),
    (["--batch-buckets", "2,x"], "--batch-buckets"),
    (["--num-draft", "three"], "--num-draft"),
]


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("flags, flag", FLAG_MISTAKES)
def test_flag_mistakes_are_one_line_and_fast(command, flags, flag):
    proc, seconds = run_cli(command, *flags)
    line = one_line_error(proc)
    assert line.startswith(f"eagle3-jax {command}: error: argument {flag}")
    assert flags[1] in line  # the value given
    assert f"see eagle3-jax {command} --help" in line
    assert seconds < FLAG_SECONDS, f"{seconds:.1f} s: a flag mistake must not wait for a model to load"


def test_flag_messages_say_what_is_allowed():
    proc, _ = run_cli("generate", "--num-draft", "100")
    assert "outside 0..16" in one_line_error(proc)
    proc, _ = run_cli("generate", "--top-p", "2")
    assert "(0, 1]" in one_line_error(proc)
    proc, _ = run_cli("generate", "--prompt", "  ")
    assert "argument --prompt: the prompt is empty" in one_line_error(proc)
    proc, _ = run_cli("generate", "--mtbench", "81")
    assert "outside 1..80" in one_line_error(proc)
    proc, _ = run_cli("chat", "--bogus")
    assert one_line_error(proc) == ("eagle3-jax chat: error: unrecognized arguments: --bogus "
                                    "(see eagle3-jax chat --help)")


# ---- paths: checked right after parsing -------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_missing_directories_are_one_line_and_fast(command, tmp_path):
    missing = tmp_path / "nowhere"
    proc, seconds = run_cli(command, "--target", str(missing))
    line = one_line_error(proc)
    assert f"--target {missing}: no such directory" in line and "config.json" in line
    proc, seconds_draft = run_cli(command, "--draft", str(missing))
    line = one_line_error(proc)
    assert f"--draft {missing}: no such directory" in line and "--draft none" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    proc, _ = run_cli(command, "--target", str(empty))
    assert f"--target {empty}: no config.json in it" in one_line_error(proc)
    (empty / "config.json").write_text("{}")
    proc, _ = run_cli(command, "--draft", str(empty))
    assert f"--draft {empty}: no model.safetensors or pytorch_model.bin in it" in one_line_error(proc)
    assert max(seconds, seconds_draft) < FLAG_SECONDS


# ---- mistakes found in the model files ---------------------------------------------------------
def test_drafter_of_the_wrong_size_names_the_config_field(tiny_target, wrong_size_drafter):
    proc, _ = run_cli("generate", "--target", str(tiny_target), "--draft", str(wrong_size_drafter), "--prompt", "hi")
    line = one_line_error(proc)
    assert "drafter hidden_size 48 does not match the target's hidden_size 32" in line
    assert "fc.weight" not in line
    assert "--draft none" in line  # what to do
    # The library says the same: the config is checked before any tensor.
    with pytest.raises(ConfigError, match="drafter hidden_size 48 does not match the target's hidden_size 32"):
        load_drafter(wrong_size_drafter, TINY, jnp.float32)


def test_truncated_drafter_file_is_one_line(tiny_target, truncated_drafter):
    proc, seconds = run_cli("chat", "--target", str(tiny_target), "--draft", str(truncated_drafter), stdin="")
    line = one_line_error(proc)
    assert str(truncated_drafter / "model.safetensors") in line
    assert "truncated or corrupt" in line
    assert seconds < 60


def test_corrupt_drafter_file_is_one_line(tiny_target, tmp_path):
    draft = _drafter(tmp_path / "d", DraftConfig.like_target(TINY, draft_vocab_size=64))
    (draft / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    proc, _ = run_cli("generate", "--target", str(tiny_target), "--draft", str(draft), "--prompt", "hi")
    assert "not a valid safetensors file" in one_line_error(proc)


# ---- convert-draft ------------------------------------------------------------------------------
def test_convert_draft_mistakes(tmp_path):
    proc, seconds = run_cli("convert-draft", str(tmp_path / "nowhere"))
    assert "no such directory" in one_line_error(proc)
    assert seconds < FLAG_SECONDS
    proc, _ = run_cli("convert-draft", str(tmp_path))
    assert f"{tmp_path}: no pytorch_model.bin to convert" in one_line_error(proc)


def test_convert_draft_without_torch_says_to_install_it(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    proc, _ = run_cli("convert-draft", str(tmp_path), no_torch=True)
    line = one_line_error(proc)
    assert "needs torch: pip install torch" in line
    assert "eagle3-jax convert-draft` on a machine" not in line  # not "run the command you just ran"


# ---- plan: presets and paths -------------------------------------------------------------------
def test_plan_takes_bench_presets_and_shipped_configs():
    by_name, _ = run_cli("plan", "--target", "llama3.1-8b", "--tp", "1", "2")
    assert by_name.returncode == 0, by_name.stderr
    lines = by_name.stdout.splitlines()
    assert lines[0].split() == ["per", "device", "tp=1", "tp=2"]
    # Llama-3.1-8B: 8,030,261,248 bf16 weights, halved over two devices; its drafter included.
    assert lines[2].split() == ["weights:", "target", "16.06", "GB", "8.03", "GB"]
    assert lines[3].split()[:3] == ["weights:", "draft", "0.85"]
    configs = presets.CONFIGS
    by_path, _ = run_cli("plan", "--target", str(configs / "Llama-3.1-8B-Instruct" / "config.json"),
                         "--draft", str(configs / "EAGLE3-LLaMA3.1-Instruct-8B"), "--tp", "1", "2")
    assert by_path.returncode == 0 and by_path.stdout == by_name.stdout
    # Bench's other spelling, the 70B; --draft none leaves the drafter out.
    proc, _ = run_cli("plan", "--target=llama-3.3-70b", "--tp", "8", "--draft", "none")
    assert proc.returncode == 0, proc.stderr
    rows = {line[:25].strip(): line[25:].split() for line in proc.stdout.splitlines()[2:]}
    assert rows["weights: target"] == ["17.64", "GB"] and rows["weights: draft"] == ["0.00", "GB"]


def test_plan_mistakes_are_one_line(tmp_path):
    proc, _ = run_cli("plan", "--target", "llama-9b", report_loaded=True)
    line = one_line_error(proc)
    assert "--target llama-9b: neither a preset (llama3.1-8b" in line
    # Answered before anything heavy: plan's own modules import jax, but nothing a model needs is
    # imported and no backend starts. (What was loaded, not a wall-clock bound: this run imports
    # jax, and under the suite's load it took over 5 s.)
    assert json.loads(proc.stdout.splitlines()[-1]) == {"modules": [], "backend": False}, proc.stdout
    proc, _ = run_cli("plan", "--target", "llama3.1-8b", "--draft", str(tmp_path / "none.json"))
    assert "--draft" in one_line_error(proc)


# ---- help --------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "convert-draft", "prepare"])
def test_every_flag_has_help_and_shows_its_default(command):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices[command]
    formatter = p._get_formatter()
    for action in p._actions:
        if action.dest == "help":
            continue
        assert action.help, f"{command} {action.option_strings or action.dest} has no help"
        if action.option_strings:
            assert "(default" in formatter._get_help_string(action), f"{command} {action.option_strings}"
    proc, _ = run_cli(command, "--help")
    assert proc.returncode == 0 and "usage: eagle3-jax" in proc.stdout
    if command == "generate":
        assert "(default: 3)" in proc.stdout and "(default: 256)" in proc.stdout


# ---- the real model ----------------------------------------------------------------------------
@pytest.mark.slow
def test_overlong_prompt_names_max_model_len(smollm2_dir):
    proc, _ = run_cli("generate", "--prompt", "tell me more " * 40, "--max-model-len", "64", "--max-tokens", "4",
                      "--draft", "none", timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("eagle3-jax generate: error:")]
    assert len(errors) == 1, proc.stderr
    assert "the context holds 64" in errors[0] and "--max-model-len" in errors[0]


@pytest.mark.slow
def test_chat_with_piped_input_ends_each_reply_and_is_quiet(smollm2_dir):
    """Two turns from a pipe, then end of input: each reply on its own line, the next prompt on a
    fresh one; and, without torch, no advisory from transformers."""
    proc, _ = run_cli("chat", "--max-tokens", "8", "--num-draft", "2", stdin="Say hi.\nSay bye.\n", timeout=600,
                      no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "PyTorch was not found" not in proc.stderr
    assert proc.stdout.startswith("> ")
    turns = proc.stdout.split("\n")
    # "> reply one", "> reply two", "> " (end of input), "" (after the final newline).
    assert len(turns) == 4, proc.stdout
    assert all(t.startswith("> ") and len(t) > 2 for t in turns[:2]) and turns[2:] == ["> ", ""]
    assert proc.stderr.count("[acceptance length") == 2
