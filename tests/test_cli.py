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
import socket
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


SERVE_FLAG_MISTAKES = [
    (["--port", "0"], "--port"),
    (["--port", "99999"], "--port"),
    (["--max-num-seqs", "x"], "--max-num-seqs"),
    (["--max-waiting", "0"], "--max-waiting"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
    (["--num-draft", "100"], "--num-draft"),
    (["--api-server-count", "0"], "--api-server-count"),
]


@pytest.mark.parametrize("flags, flag", SERVE_FLAG_MISTAKES)
def test_serve_flag_mistakes_are_one_line_and_fast(flags, flag):
    proc, seconds = run_cli("serve", *flags)
    line = one_line_error(proc)
    assert line.startswith(f"eagle3-jax serve: error: argument {flag}") and flags[1] in line
    assert seconds < FLAG_SECONDS, f"{seconds:.1f} s: a flag mistake must not wait for a model to load"


def test_serve_more_than_one_http_process_needs_the_engine_in_a_process_of_its_own():
    proc, seconds = run_cli("serve", "--no-engine-process", "--api-server-count", "2")
    assert one_line_error(proc) == ("eagle3-jax serve: error: --api-server-count 2 needs the engine in a process of "
                                    "its own (leave out --no-engine-process): the HTTP processes share it")
    assert seconds < FLAG_SECONDS, f"{seconds:.1f} s: a flag mistake must not wait for a model to load"


def test_serve_address_mistakes_are_one_line_before_the_model_loads(tiny_target):
    """A port in use, a host that does not resolve or is not this machine's: found by binding as
    uvicorn does, before JAX starts (not once the model has loaded)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flags, words in [
            (["--port", str(port)], f"--port {port}: 127.0.0.1:{port} is in use"),
            (["--host", "localhost", "--port", str(port)], f"--port {port}: localhost:{port} is in use"),
            (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: the name does not resolve"),
            (["--host", "192.0.2.1"], "--host 192.0.2.1: not an address of this machine"),  # TEST-NET-1
        ]:
            proc, _ = run_cli("serve", "--target", str(tiny_target), "--draft", "none", *flags, report_loaded=True)
            assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
            assert proc.stderr.startswith(f"eagle3-jax serve: error: {words}"), proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
            assert json.loads(proc.stdout.strip().splitlines()[-1])["backend"] is False


def test_serve_logging_leaves_out_jaxs_tpu_probe_only():
    """JAX, started with no platform named, tries a TPU first and logs at info that libtpu is not
    there: `serve`'s logging leaves that line out and keeps JAX's other records."""
    probe = ("import logging, jax; from eagle3_jax.serve.server import configure_logging; configure_logging('info'); "
             "jax.devices(); logging.getLogger('jax._src.xla_bridge').warning('a real warning')")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "WARNING jax._src.xla_bridge: a real warning" in proc.stderr
    assert "libtpu" not in proc.stderr and "backend 'tpu'" not in proc.stderr, proc.stderr


def test_serve_runs_uvloop_and_httptools_where_they_import_else_asyncio_and_h11(monkeypatch):
    from eagle3_jax.serve import server

    assert server.event_loop_and_http("asyncio", "h11") == ("asyncio", "h11")
    for module in ("uvloop", "httptools"):
        monkeypatch.setitem(sys.modules, module, None)  # an import of it fails, as where it is not installed
    assert server.event_loop_and_http() == ("asyncio", "h11")
    with pytest.raises(server.MissingPackage, match="--loop uvloop: the package uvloop is not installed"):
        server.event_loop_and_http("uvloop")
    with pytest.raises(server.MissingPackage, match=r"--http httptools: .* or give --http h11"):
        server.event_loop_and_http("auto", "httptools")


def test_flag_messages_say_what_is_allowed():
    proc, _ = run_cli("generate", "--num-draft", "100")
    assert "outside 0..16" in one_line_error(proc)
    proc, _ = run_cli("generate", "--top-p", "2")
    assert "(0, 1]" in one_line_error(proc)
    proc, _ = run_cli("generate", "--prompt", "  ")
    assert "argument --prompt: the prompt is empty" in one_line_error(proc)
    proc, _ = run_cli("serve", "--port", "65536")
    assert "argument --port: 65536 is outside 1..65535" in one_line_error(proc)
    proc, _ = run_cli("generate", "--mtbench", "81")
    assert "outside 1..80" in one_line_error(proc)
    proc, _ = run_cli("chat", "--bogus")
    assert one_line_error(proc) == ("eagle3-jax chat: error: unrecognized arguments: --bogus "
                                    "(see eagle3-jax chat --help)")


# ---- paths: checked right after parsing -------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
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


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory) -> Path:
    return _drafter(tmp_path_factory.mktemp("tiny_drafter"), DraftConfig.like_target(TINY, draft_vocab_size=64))


def with_config(path: Path, model: Path, config: bytes) -> Path:
    """`path`: `model`'s weights beside a config.json holding `config`."""
    path.mkdir()
    for weights in model.glob("*.safetensors"):
        (path / weights.name).symlink_to(weights)
    (path / "config.json").write_bytes(config)
    return path


# Valid JSON that is no object, and bytes that are no UTF-8 text; whether the CLI runs on it too (it
# words every ConfigError alike, so one kind of each is enough there: a CLI start is seconds).
NOT_A_CONFIG = [(b"[]", "holds an array, not the JSON object", True),
                (b"null", "holds null, not the JSON object", False),
                (b"42", "holds a number, not the JSON object", False),
                (b'{"model_type": "ll\xffama"}', "not UTF-8 text", True)]


@pytest.mark.parametrize("config, words, through_cli", NOT_A_CONFIG)
def test_a_config_json_that_is_not_an_object_is_one_line(tiny_target, tiny_drafter, tmp_path, config, words,
                                                         through_cli):
    from eagle3_jax.api import LLM

    target = with_config(tmp_path / "target", tiny_target, config)
    draft = with_config(tmp_path / "draft", tiny_drafter, config)
    if through_cli:
        proc, _ = run_cli("generate", "--target", str(target), "--draft", "none", "--prompt", "hi")
        line = one_line_error(proc)
        assert f"{target / 'config.json'}: {words}" in line, line
        proc, _ = run_cli("generate", "--target", str(tiny_target), "--draft", str(draft), "--prompt", "hi")
        line = one_line_error(proc)
        assert f"--draft {draft}: {draft / 'config.json'}: {words}" in line, line
    # The library raises the same ConfigError, naming the file.
    for kwargs, bad in (({"target": target, "draft": None}, target), ({"target": tiny_target, "draft": draft}, draft)):
        with pytest.raises(ConfigError) as e:
            LLM(**kwargs, warmup=False, progress=False)
        assert str(e.value).startswith(f"{bad / 'config.json'}: {words}"), e.value


def test_config_field_of_the_wrong_type_says_the_type_in_words(tmp_path):
    config = json.loads((presets.CONFIGS / "Llama-3.1-8B-Instruct" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": "4096"}))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(tmp_path / "config.json")
    assert "field 'hidden_size' must be an integer, got '4096'" in str(e.value) and "<class" not in str(e.value)
    draft = json.loads((presets.CONFIGS / "EAGLE3-LLaMA3.1-Instruct-8B" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**draft, "eagle_config": [2, 16, 29]}))
    with pytest.raises(ConfigError, match="field 'eagle_config' must be an object, got"):
        DraftConfig.from_json(tmp_path / "config.json")


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


# ---- bench and train-draft ----------------------------------------------------------------------
def main_error(capsys, *argv: str) -> str:
    """The single stderr line of `eagle3-jax ARGV` run in this process, which must exit with 2."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:  # argparse's errors exit from inside parsing
        code = e.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, lines)
    return lines[0]


def test_bench_mistakes_are_one_line_before_anything_starts(tmp_path):
    """A subprocess each: exit 2, one line, and JAX never started a backend (nothing allocated)."""
    for args, message in [
        (("--target", str(tmp_path / "nope")), f"eagle3-jax bench: error: --target {tmp_path / 'nope'}: no such "
                                               "directory"),
        (("--only", "8b", "--step-draft", str(tmp_path)), f"eagle3-jax bench: error: --step-draft {tmp_path}: no "
                                                          "drafter config.json there"),
    ]:
        proc, seconds = run_cli("bench", *args, report_loaded=True)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert lines[0].startswith(message), lines[0]
        assert json.loads(proc.stdout.strip().splitlines()[-1])["backend"] is False
        assert seconds < 2 * FLAG_SECONDS


@pytest.mark.parametrize("args, message", [
    (("--batches", "0"), "argument --batches: '0': 0 must be at least 1"),
    (("--batches", "1,x"), "argument --batches: '1,x': 'x' is not an integer"),
    (("--num-draft", "0"), "argument --num-draft: '0': K must be at least 1 (the target alone always runs)"),
    (("--num-draft", "2,17"), "argument --num-draft: '2,17': K = 17 is outside 0..16"),
    (("--only", "smollm2,gpu"), "argument --only: 'smollm2,gpu': choose phases from smollm2, 8b, peer, tp"),
    (("--prompts", "-1"), "argument --prompts: -1 must be at least 1"),
    (("--tree", "2,2,7"), "argument --tree: tokens must be at most the 6 candidates of steps=2, top_k=2, got 7"),
    (("--only", "tp"), "--only tp compares TP=N with TP=1: give --tp N with N >= 2"),
    (("--questions", "/nonexistent/question.jsonl"), "--questions /nonexistent/question.jsonl: no such file"),
    (("--only", "8b", "--step-model", "nope"), "--step-model nope: neither a preset"),
    (("--only", "8b", "--context", "1000"), "--context 1000 + 10 calls x 4 tokens + 4 exceed --max-model-len-8b 1024"),
])
def test_bench_flag_mistakes(capsys, args, message):
    line = main_error(capsys, "bench", *args)
    assert line.startswith(f"eagle3-jax bench: error: {message}"), line


def test_bench_defaults_fit_the_machine(monkeypatch):
    """On the CPU the bench leaves out the 8b phase (a random Llama-3.1-8B: 32 GB in f32) and the
    peer, and runs short; on an accelerator it runs the full defaults. Told by JAX_PLATFORMS here,
    without starting a backend."""
    from eagle3_jax.bench.options import Options, build_parser

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    cpu = Options.from_args(build_parser().parse_args([]))
    assert (cpu.phases, cpu.batches, cpu.prompts, cpu.max_tokens) == (("smollm2",), (1, 2, 4), 2, 32)
    assert (cpu.bandwidth_gb, cpu.matmul_size) == (0.25, 1024)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    gpu = Options.from_args(build_parser().parse_args([]))
    assert (gpu.phases, gpu.batches, gpu.prompts, gpu.max_tokens) == (("smollm2", "8b", "peer"),
                                                                      (1, 2, 4, 8, 16, 32, 64), 8, 256)
    assert (gpu.bandwidth_gb, gpu.matmul_size) == (4.0, 8192)
    given = Options.from_args(build_parser().parse_args(["--batches", "8,2", "--only", "smollm2"]))
    assert (given.batches, given.phases) == ((2, 8), ("smollm2",))


def test_bench_8b_phase_that_would_not_fit_the_host_is_refused(capsys, monkeypatch):
    """On the CPU the 8b phase's weights are host memory: Llama-3.1-8B in f32 (32 GB) is refused on
    a 24 GB machine before anything is allocated; SmolLM2's shapes are not."""
    from eagle3_jax.bench.options import Options, build_parser

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 10**9 // 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: pages[name])
    line = main_error(capsys, "bench", "--only", "8b")
    assert line.startswith("eagle3-jax bench: error: --only 8b: the random weights of --step-model llama3.1-8b take "
                           "32 GB (f32) and this machine has 24 GB: on the CPU give --step-model smollm2-135m"), line
    assert Options.from_args(build_parser().parse_args(["--only", "8b", "--step-model", "smollm2-135m"])).tp == 1


@pytest.fixture(scope="module")
def tiny_target_with_tokenizer(tiny_target) -> Path:
    (tiny_target / "tokenizer.json").write_text("{}")  # only its presence is checked before loading
    return tiny_target


@pytest.mark.parametrize("args, message", [
    (("--steps", "0"), "argument --steps: 0 must be at least 1"),
    (("--lr", "-1"), "train config: lr must be 0 or more, got -1.0"),
    (("--warmup-frac", "1.5"), "train config: warmup_frac must be in [0, 1), got 1.5"),
    (("--length-buckets", "0,8"), "train config: length_buckets must be positive lengths, got (0, 8)"),
    (("--dtype", "fp8"), "argument --dtype: invalid choice: 'fp8'"),
    (("--init", "/nonexistent/drafter"), "--init /nonexistent/drafter: no such directory"),
    (("--sharegpt", "/nonexistent/sharegpt.json"), "--sharegpt /nonexistent/sharegpt.json: no such file"),
    (("--regenerate", "--magpie", "5", "--no-prompt-filters"), "Magpie requests need the prompt filters"),
])
def test_train_draft_flag_mistakes(capsys, tiny_target_with_tokenizer, tmp_path, args, message):
    line = main_error(capsys, "train-draft", "--target", str(tiny_target_with_tokenizer), "--out",
                      str(tmp_path / "out"), *args)
    assert line.startswith(f"eagle3-jax train-draft: error: {message}"), line
    assert not (tmp_path / "out").exists()


def test_train_draft_target_mistakes(capsys, tiny_target, tmp_path):
    line = main_error(capsys, "train-draft", "--target", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert line.startswith(f"eagle3-jax train-draft: error: --target {tmp_path / 'nope'}: no such directory"), line
    assert "eagle3-jax prepare" in line  # what to do
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).symlink_to(tiny_target / name)
    line = main_error(capsys, "train-draft", "--target", str(bare), "--out", str(tmp_path / "out"))
    assert line.startswith(f"eagle3-jax train-draft: error: --target {bare}: no tokenizer in it"), line
    assert main_error(capsys, "train-draft", "--target", str(bare)).endswith(
        "the following arguments are required: --out (see eagle3-jax train-draft --help)")


def test_train_draft_mistake_in_a_subprocess_starts_nothing(tmp_path):
    proc, seconds = run_cli("train-draft", "--target", str(tmp_path), "--out", str(tmp_path / "out"),
                            report_loaded=True)
    assert f"eagle3-jax train-draft: error: --target {tmp_path}: no config.json in it" in proc.stderr
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["backend"] is False
    assert seconds < 2 * FLAG_SECONDS


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


def test_overlong_prompt_names_max_model_len(chat_models):
    """A chat prompt past the context, on the tiny byte-tokenized chat target: one line naming the flag."""
    target, _ = chat_models
    proc, _ = run_cli("generate", "--target", str(target), "--prompt", "tell me more " * 40, "--max-model-len", "64",
                      "--max-tokens", "4", "--draft", "none", timeout=600)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("eagle3-jax generate: error:")]
    assert len(errors) == 1, proc.stderr
    assert "the context holds 64" in errors[0] and "--max-model-len" in errors[0]


# ---- the real model ----------------------------------------------------------------------------
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
