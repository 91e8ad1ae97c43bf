"""The peer phase: Hugging Face transformers (static cache, torch.compile), in a child process."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_jax import assets
from eagle3_jax.bench.common import Result
from eagle3_jax.bench.harness import hf_config_dict, step_models
from eagle3_jax.bench.options import Options
from eagle3_jax.bench.phases import load_prompts
from eagle3_jax.config import ModelConfig


def _tokenizer(directory: Path):
    if not (directory / "tokenizer.json").is_file() and not (directory / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def peer_spec(opts: Options) -> tuple[dict, str]:
    """What the child times: the target's directory, the same prompt token ids as ours (chat
    template applied here), EOS, and the 8B config."""
    cfg = ModelConfig.from_json(opts.target / "config.json")
    tok = _tokenizer(opts.target)
    encode = None
    if tok is not None:
        def encode(text):
            return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    prompts, source = load_prompts(
        opts.questions, encode, cfg.vocab_size, max(opts.peer_prompts, max(opts.peer_batches))
    )
    eos = set(cfg.eos_token_ids) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None else set())
    pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else min(eos, default=0)
    spec = {
        "target": str(opts.target),
        "prompts": [[int(t) for t in p] for p in prompts],
        "eos": sorted(eos),
        "pad": int(pad),
        "max_tokens": opts.max_tokens,
        "ignore_eos": opts.ignore_eos,
        "batches": list(opts.peer_batches),
        "prompts_at_1": opts.peer_prompts,
        "big": None,
    }
    if opts.peer_8b and opts.tp == 1:  # the peer runs on one GPU: no big model meant for several
        spec["big"] = {"name": opts.step_model, "config": hf_config_dict(step_models(opts)[0]), "prompt_len": 128}
    return spec, source


def phase_peer(opts: Options, notes: list[str]) -> tuple[list[Result], dict]:
    """Time the peer in a child process (JAX kept off the GPU there) and read its rows back."""
    spec, source = peer_spec(opts)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(
            os.environ,
            JAX_PLATFORMS="cpu",
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join(p for p in (str(assets.REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        )
        cmd = [sys.executable, "-m", "eagle3_jax.bench", "--peer-worker", str(spec_path), str(out_path)]
        try:
            proc = run_isolated(cmd, env, opts.peer_timeout)
        except subprocess.TimeoutExpired:
            notes.append(f"peer abandoned after {opts.peer_timeout:.0f} s (--peer-timeout)")
            return [], {"skipped": "timeout"}
        if proc.returncode != 0 or not out_path.is_file():
            tail = (proc.stderr or proc.stdout or "").strip()
            print(tail[-3000:], file=sys.stderr)
            notes.append(f"peer failed (exit {proc.returncode}): {tail.splitlines()[-1] if tail else 'no output'}")
            return [], {"skipped": "failed"}
        out = json.loads(out_path.read_text())
    notes.extend(out["notes"])
    rows = [Result("peer", r.pop("mode"), r.pop("batch"), r) for r in out["rows"]]
    return rows, {**out["info"], "prompts": source}


def run_isolated(cmd: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Run `cmd` in a process group of its own and, when it ends (or times out), kill whatever it
    left in that group: torch.compile's worker processes must not compete with the engine's host
    loop for the CPU in the phases that follow. Output goes through files, which a leftover
    process cannot hold open the way it holds a pipe."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def peer_worker(spec: dict) -> dict:
    """In the child: transformers' generate with a static cache, compiled, greedy."""
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig
    except ImportError as e:
        return {"rows": [], "info": {"skipped": str(e)}, "notes": [f"peer skipped: {e}"]}
    transformers.logging.set_verbosity_error()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "recipe": PEER_RECIPE if cuda else "eager",
    }
    notes = [] if cuda else ["peer ran on the CPU in f32, not compiled (no CUDA): not a GPU figure"]
    rows = []

    def attempt(mode, load, batch, groups, run_spec):
        try:
            rows.append(time_generate(load(), mode, batch, groups, run_spec, cuda))
        except Exception as e:  # noqa: BLE001 (one model failing, however, leaves the other's figures)
            notes.append(f"peer {mode}, batch {batch} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        finally:
            gc.collect()  # the compiled call holds the model in a cycle
            if cuda:
                torch.cuda.empty_cache()

    target = spec["target"]
    for b in spec["batches"]:
        n = spec["prompts_at_1"] if b == 1 else b
        groups = [spec["prompts"][i : i + b] for i in range(0, n, b)]
        attempt(
            f"HF {Path(target).name}",
            lambda: AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device),
            b,
            groups,
            spec,
        )
    if big := spec["big"]:

        def load_big():
            with torch.device(device):
                return AutoModelForCausalLM.from_config(LlamaConfig(**big["config"]), dtype=dtype)

        ids = torch.randint(
            0, big["config"]["vocab_size"], (big["prompt_len"],), generator=torch.Generator().manual_seed(0)
        ).tolist()
        attempt(f"HF {big['name']} (random weights)", load_big, 1, [[ids]], {**spec, "eos": [], "ignore_eos": True})
        if rows and rows[-1]["mode"].endswith("(random weights)"):
            rows[-1]["model"] = "8b"
    return {"rows": rows, "info": info, "notes": notes}


PEER_RECIPE = (
    "generation_config.cache_implementation='static' and generation_config.compile_config="
    "CompileConfig(fullgraph=True, mode='reduce-overhead', dynamic=False): generate() compiles the "
    "decode step (CUDA graphs), prefill runs eager; greedy; prompts left-padded to one width. "
    "(model.forward = torch.compile(...) instead failed on the H200: 'accessing tensor output of "
    "CUDAGraphs that has been overwritten by a subsequent run', in StaticCache.update)"
)


def time_generate(model, mode: str, batch: int, groups: list[list[list[int]]], spec: dict, cuda: bool) -> dict:
    """Compile on two warm-up generates, then time one generate per group of prompts."""
    import torch
    from transformers import CompileConfig

    model.eval()
    if cuda:
        model.generation_config.cache_implementation = "static"
        model.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead", dynamic=False)
    width = max(len(p) for g in groups for p in g)  # one prompt width: one prefill shape
    eos, pad = spec["eos"], spec["pad"]
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def generate(group):
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=model.device)
        extra = {"min_new_tokens": spec["max_tokens"]} if spec["ignore_eos"] else {}
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=spec["max_tokens"],
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=eos or None,
                **extra,
            )
        return out[:, width:].tolist()

    def generated(row: list[int]) -> int:  # tokens up to and including the first EOS
        return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))

    start = time.perf_counter()
    for _ in range(2):
        generate(groups[0])
    sync()
    warmup_s = time.perf_counter() - start
    tokens, wall = 0, 0.0
    for group in groups:
        sync()
        start = time.perf_counter()
        out = generate(group)
        sync()
        wall += time.perf_counter() - start
        tokens += sum(generated(r) for r in out)
    return {
        "mode": mode,
        "batch": batch,
        "model": "target",
        "tok_s": tokens / wall,
        "ms_per_token": 1e3 * wall * batch / tokens,
        "tokens": tokens,
        "requests": sum(map(len, groups)),
        "warmup_s": warmup_s,
        "prompt_width": width,
    }
