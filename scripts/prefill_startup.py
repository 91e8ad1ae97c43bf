#!/usr/bin/env python3
"""Prefill against its compute floor, and the server's start-up time, measured on a GPU.

    python3 scripts/prefill_startup.py --phase prefill --out-dir "$OUT"
    python3 scripts/prefill_startup.py --phase startup --out-dir "$OUT"
    python3 scripts/prefill_startup.py --phase prefill --shapes 1x200,4x100 --max-model-len 256   # CPU

prefill: the default engine (SmolLM2-135M-Instruct, the shipped drafter, bf16, prefix caching off)
  given each shape's prompts at once (--shapes, N x tokens: distinct MT-bench text, tokenized and
  cut to that length), max_tokens 1. Each shape runs once untimed (its programs compiled), then
  timed: TTFT p50 and max (the engine's RequestMetrics), prompt tok/s (all prompt tokens over the
  first arrival to the last first token), beside the floor: 2 x target parameters x tokens / the
  card's peak dense bf16 FLOP/s (a roofline that ignores attention and the drafter).
startup: `eagle3-jax serve` started twice as a subprocess with one fresh compilation cache
  (JAX_COMPILATION_CACHE_DIR): the seconds to /health answering 200 the first time (everything
  compiled) and the second (read from the cache).
Prints the figures and writes PHASE.json under --out-dir.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import server_process  # scripts/: this script's own directory is on the path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Dense bf16 tensor-core peak of each card, by its datasheet (SXM parts), FLOP/s.
PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


def peak_flops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in device_kind), None)


def target_parameters(target_dir: Path) -> int:
    """The target checkpoint's parameter count, from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                total += math.prod(f.get_slice(name).get_shape())
    return total


def prompts_of(llm, count: int, tokens: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `tokens` tokens: MT-bench text, each starting at its own
    question, repeated as needed and cut."""
    from eagle3_jax import assets

    text = [" ".join(q["turns"]) for q in assets.mtbench_questions()]
    ids = [llm.tokenizer(t)["input_ids"] for t in text]
    out = []
    for i in range(count):
        seq: list[int] = []
        j = i
        while len(seq) < tokens:
            seq += ids[j % len(ids)]
            j += 1
        out.append(seq[:tokens])
    return out


def phase_prefill(args) -> dict:
    import jax

    from eagle3_jax import SamplingParams, assets
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    llm = LLM(engine_config=EngineConfig(prefix_caching=False, max_model_len=args.max_model_len), progress=False)
    engine, params = llm.engine, SamplingParams(max_tokens=1)
    device = jax.devices()[0].device_kind
    n_params, peak = target_parameters(Path(assets.DEFAULT_TARGET)), peak_flops(device)
    rows = []
    for shape in args.shapes.split(","):
        count, tokens = (int(x) for x in shape.split("x"))
        prompts = prompts_of(llm, count, tokens)
        for _timed in (False, True):  # the first pass compiles this shape's programs
            reqs = [engine.add_request(p, params) for p in prompts]
            engine.run(reqs)
        ttft = [r.metrics.first_token_time - r.metrics.arrival_time for r in reqs]
        wall = max(r.metrics.first_token_time for r in reqs) - min(r.metrics.arrival_time for r in reqs)
        floor = 2 * n_params * count * tokens / peak if peak else None
        rows.append(dict(prompts=count, tokens=tokens, ttft_p50_ms=round(1e3 * statistics.median(ttft), 2),
                         ttft_max_ms=round(1e3 * max(ttft), 2), prompt_tok_s=round(count * tokens / wall),
                         floor_ms=None if floor is None else round(1e3 * floor, 3),
                         floor_tok_s=None if floor is None else round(count * tokens / floor),
                         of_floor=None if floor is None else round(floor / wall, 4)))
        print(rows[-1], flush=True)
    return dict(device=device, jax=jax.__version__, target_parameters=n_params, peak_bf16_flops=peak,
                max_model_len=args.max_model_len, rows=rows)


def phase_startup(args) -> dict:
    serve_args = [*args.serve.split()]
    starts = []
    with tempfile.TemporaryDirectory() as cache:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # the servers inherit it
        for name in ("first", "second"):
            t0 = time.perf_counter()
            proc, _ = server_process.start(serve_args, Path(args.out_dir) / f"startup-{name}.log", args.start_timeout)
            seconds = time.perf_counter() - t0
            server_process.stop(proc)
            starts.append(dict(start=name, health_s=round(seconds, 1)))
            print(starts[-1], flush=True)
    return dict(serve_args=serve_args, starts=starts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("prefill", "startup"), required=True)
    p.add_argument("--shapes", default="1x8000,32x1500", help="prefill: prompts x tokens, comma-separated")
    p.add_argument("--max-model-len", type=int, default=8192, help="prefill: the engine's context")
    p.add_argument("--serve", default="", help="startup: serve's flags (its defaults: the shipped models)")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out-dir", default=".")
    args = p.parse_args()
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    out = phase_prefill(args) if args.phase == "prefill" else phase_startup(args)
    out["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (Path(args.out_dir) / f"{args.phase}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
