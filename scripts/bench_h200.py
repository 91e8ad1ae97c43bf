#!/usr/bin/env python3
"""The H200 benchmark in one go: `eagle3-jax bench` with the H200 settings on one GPU (the
Hugging Face peer, SmolLM2 with its drafter end to end, the Llama-3.1-8B step functions), and the
Llama-3.3-70B step functions under tensor parallelism on several GPUs. BENCHMARKS.md's "SmolLM2
end to end", "Llama-3.1-8B step functions" and "Llama-3.3-70B tensor parallel" are its runs.

    python3 scripts/bench_h200.py --out-dir "$OUT"            # everything, about 6 to 8 minutes
    python3 scripts/bench_h200.py --out-dir "$OUT" --only 8b --batches 1,8
    python3 scripts/bench_h200.py --out-dir "$OUT" --only 8b,tp --step-model llama-3.3-70b --tp 2 --batches-8b 1,8
    python3 scripts/bench_h200.py --out-dir "$OUT" --only 8b --step-model llama-3.3-70b --tp 4 --allreduce one-shot

The last, on 2 H200s: the all-reduce between them (a large array, and each decode-sized
activation), the 70B step functions at TP=2 with random bf16 weights created on their shards
(about 75 GB per GPU: 70.6 GB of target, 3.2 GB of drafter, replicated, plus 1.4 GB of KV), and
the tp phase: greedy tokens at TP=2 against TP=1 through the engine, on a small f32 model. The
fourth runs the 70B steps at TP=4 with XLA's one-shot all-reduce kernel instead of NCCL's.

Runs the peer (Hugging Face, torch.compile) first, then measures the memory bandwidth and matmul
rate, then the engine on SmolLM2 (target-only vs EAGLE-3, batches 1..64), then the 8B-shaped step
functions; prints the tables and writes bench.md, bench.json and bench.png to --out-dir. Every
`eagle3-jax bench` flag passes through (`--help` lists them); the flags below are this script's.

The device machine has no network, so what the run reads must travel with the working tree:
  - the target: --target (default: the converted one in the user's cache, assets.DEFAULT_TARGET),
    or the SmolLM2 GGUF given with --gguf (one file, or its parts in order), converted there first
    (needs the `gguf` package);
  - the MT-bench questions: --questions FILE, else .stage/question.jsonl when present, else the
    cached asset (~/.cache/eagle3_jax): without one of these the run stops before using the GPU.
Budget (defaults): 8 MT-bench prompts at batch 1 (8 rounds), 4 rounds of 2 at batch 2, 2 of 4 at
batch 4, one round of b prompts at b >= 8; 256 tokens; the peer at batch 1 (--peer-batches 1,8
for more).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# XLA's autotuner logs a 'Delay kernel timed out' warning per kernel timed; keep errors only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# NCCL (which XLA's all-reduces use) must not use NVLink multicast on the shared GPU hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from eagle3_jax import assets  # noqa: E402  (after the path insert)


def prepare_target(target: Path, gguf_parts: list[str]) -> None:
    """Convert the SmolLM2 GGUF (parts concatenated in order) into `target` unless already there."""
    if (target / "model.safetensors").is_file():
        return
    if not gguf_parts:
        raise SystemExit(f"no converted target at {target} and no --gguf to convert from")
    from eagle3_jax.weights.gguf_convert import convert_gguf

    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "SmolLM2-135M-Instruct.gguf"
        with open(whole, "wb") as out:
            for part in gguf_parts:
                with open(part, "rb") as f:
                    shutil.copyfileobj(f, out)
        digest = assets.sha256(whole)
        if digest != assets.SMOLLM2_GGUF.sha256:
            raise SystemExit(f"the GGUF parts join to sha256 {digest}, not the pinned {assets.SMOLLM2_GGUF.sha256}")
        start = time.perf_counter()
        convert_gguf(whole, target, progress=False)
        (target / "PREPARED").write_text(assets.prepared_stamp())
    print(f"converted the GGUF into {target} in {time.perf_counter() - start:.0f} s", flush=True)


def find_questions(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    staged = REPO / ".stage" / "question.jsonl"
    if staged.is_file():
        return str(staged)
    cached = assets.cache_dir() / assets.MTBENCH.package / assets.MTBENCH.version / assets.MTBENCH.member
    if cached.is_file():
        return str(cached)
    raise SystemExit("no MT-bench questions: pass --questions FILE or put question.jsonl in .stage/ "
                     f"(copy it from {cached} on a machine that has it)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                add_help=False)
    p.add_argument("--gguf", nargs="+", default=[], help="SmolLM2 GGUF file, or its parts in order")
    p.add_argument("--questions", default=None)
    p.add_argument("--target", default=str(assets.DEFAULT_TARGET))
    p.add_argument("-h", "--help", action="store_true")
    ours, rest = p.parse_known_args()
    from eagle3_jax import bench, cli
    from eagle3_jax.bench.common import DEFAULT_PHASES

    if ours.help:
        p.print_help()
        print("\n`eagle3-jax bench` flags:\n")
        bench.build_parser("bench_h200.py").print_help()
        return 0
    start = time.perf_counter()
    smi = shutil.which("nvidia-smi")
    if smi:
        print(subprocess.run([smi, "--query-gpu=name,memory.total,memory.used,clocks.sm,clocks.mem,driver_version",
                              "--format=csv"], capture_output=True, text=True).stdout, flush=True)
    only = bench.build_parser().parse_known_args(rest)[0].only or DEFAULT_PHASES  # this script runs on a GPU
    argv = ["--target", ours.target, *rest]
    if "smollm2" in only or "peer" in only:
        prepare_target(Path(ours.target), ours.gguf)
        argv += ["--questions", find_questions(ours.questions)]
    rc = cli.main(["bench", *argv])  # its mistakes in one line, as `eagle3-jax bench`
    print(f"bench_h200: {time.perf_counter() - start:.0f} s in all", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
