#!/usr/bin/env python3
"""lm-evaluation-harness against `eagle3-jax serve`: the same scores with speculation on and off,
and the harness' own transformers model (`--model hf`) on the same target.

    python3 scripts/lm_eval_server.py --limit-gen 20 --gen-completions --out-dir runs/lm_eval   # SmolLM2, CPU
    python3 scripts/lm_eval_server.py --target T --draft D --engine "--tree none" --out-dir "$OUT"

The tasks are scripts/lm_eval_tasks/ (given to the harness with --include_path; its hub datasets
are not needed): facts_mc, 32 four-choice questions scored by log-likelihood through
`local-completions` (echo + logprobs on /v1/completions, the prompt as token ids from the target's
tokenizer), and humaneval_next_line, HumanEval's first solution line generated greedily through
`local-chat-completions` (the server's chat template; with --gen-completions also
humaneval_next_line_raw, the same items as a raw continuation through `local-completions`, which
is how HumanEval is meant to be prompted: a chat model answers the chat with a code fence first).
The server runs twice as a subprocess on 127.0.0.1: with speculation (`--speculation always`, the
drafter --draft) and without (`--draft none`); then `--model hf` (transformers, f32, CPU) scores
facts_mc. Prints a table of each score
with its standard error and how far the per-item results differ (log-likelihoods: the largest
absolute difference; generations: how many are the same text), and writes lm_eval.json under
--out-dir with the per-item results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import server_process  # scripts/: this script's own directory is on the path

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "scripts" / "lm_eval_tasks"
MC, GEN = "facts_mc", "humaneval_next_line"
GEN_RAW = "humaneval_next_line_raw"  # the same items as a raw continuation, no chat template
MODEL = "served"


# ---- the server ----------------------------------------------------------------------------------
def start_server(args, draft: str, out: Path) -> tuple[subprocess.Popen, str]:
    """`eagle3-jax serve` with `draft` ('none': the target alone) -> (its process, its URL), ready."""
    speculation = [] if draft == "none" else ["--speculation", "always"]
    return server_process.start(["--target", args.target, "--draft", draft, "--served-model-name", MODEL,
                                 "--max-model-len", str(args.max_model_len), *speculation, *args.engine.split()],
                                out / "server.log", args.start_timeout)


def speculation_counts(url: str) -> dict:
    """The iterations that verified proposals and the proposals accepted, from the server's /metrics;
    the acceptance length (1 + accepted / drafts) where any were."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^eagle3_jax:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    drafts, accepted = total("spec_decode_num_drafts_total"), total("spec_decode_num_accepted_tokens_total")
    return {"drafts": drafts, "accepted": accepted,
            "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None}


# ---- the harness ---------------------------------------------------------------------------------
def lm_eval(args, model: str, model_args: str, task: str, limit: int, out: Path, *extra: str) -> dict:
    """One `python -m lm_eval` run of `task` (its first `limit` items, samples logged) -> {score,
    stderr, items}: the task's metric and its standard error, and per item (by doc_id) the
    log-likelihood of each choice (facts_mc) or the generated text (humaneval_next_line)."""
    cmd = [args.lm_eval_python, "-m", "lm_eval", "--model", model, "--model_args", model_args,
           "--include_path", str(TASKS), "--tasks", task, "--limit", str(limit), "--log_samples",
           "--output_path", str(out), "--seed", "0", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    (out / "lm_eval.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval {model} {task} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    (results_file,) = out.rglob("results_*.json")
    (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
    metric = "acc" if task == MC else "exact_match"
    scores = json.loads(results_file.read_text())["results"][task]
    items = {}
    for line in samples_file.read_text().splitlines():
        sample = json.loads(line)
        if task == MC:  # resps: per choice [[loglikelihood, is_greedy]]
            items[sample["doc_id"]] = [float(r[0][0]) for r in sample["resps"]]
        else:  # resps: [[text]]
            items[sample["doc_id"]] = sample["resps"][0][0]
    return {"score": scores[f"{metric},none"], "stderr": scores[f"{metric}_stderr,none"], "items": items}


def served_runs(args, draft: str, out: Path) -> tuple[dict, dict]:
    """Both tasks against one server: facts_mc through /v1/completions, humaneval_next_line
    through /v1/chat/completions (and with --gen-completions through /v1/completions too);
    -> (the results by task, the server's speculation counts)."""
    out.mkdir(parents=True, exist_ok=True)
    proc, url = start_server(args, draft, out)
    try:
        completions = (f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={args.target},max_length={args.max_model_len}")
        chat = f"model={MODEL},base_url={url}/v1/chat/completions,num_concurrent={args.num_concurrent}"
        runs = {MC: lm_eval(args, "local-completions", completions, MC, args.limit_mc, out / MC,
                            "--batch_size", str(args.batch_size)),
                GEN: lm_eval(args, "local-chat-completions", chat, GEN, args.limit_gen, out / GEN,
                             "--apply_chat_template")}
        if args.gen_completions:
            runs[GEN_RAW] = lm_eval(args, "local-completions", completions, GEN_RAW, args.limit_gen, out / GEN_RAW,
                                    "--batch_size", str(args.batch_size))
        return runs, speculation_counts(url)
    finally:
        server_process.stop(proc)


def compare(runs: dict) -> dict:
    """Per run and task, the per-item difference from speculation off: for facts_mc the largest
    |log-likelihood difference| over every choice, for a generation task how many texts are the same."""
    base = runs["spec off"]
    diffs = {}
    for name, run in runs.items():
        for task, result in run.items():
            theirs = base[task]["items"]
            if task == MC:
                diffs[name, task] = max(abs(a - b) for doc, lls in result["items"].items()
                                        for a, b in zip(lls, theirs[doc], strict=True))
            else:
                diffs[name, task] = sum(text == theirs[doc] for doc, text in result["items"].items())
    return diffs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory with its tokenizer (default: SmolLM2, prepared)")
    p.add_argument("--draft", default="default", help="the drafter of the speculative run (default: serve's)")
    p.add_argument("--engine", default="", help="more engine flags for both servers, as `serve` takes them")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--limit-mc", type=int, default=32, help="facts_mc items (32 in all)")
    p.add_argument("--limit-gen", type=int, default=20, help="humaneval_next_line items (164 in all)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per /v1/completions request")
    p.add_argument("--num-concurrent", type=int, default=1, help="chat requests in flight")
    p.add_argument("--gen-completions", action="store_true",
                   help="generate humaneval_next_line through /v1/completions too (a raw continuation)")
    p.add_argument("--no-hf", action="store_true", help="skip the harness' transformers model")
    p.add_argument("--lm-eval-python", default=sys.executable, help="the interpreter that has lm_eval")
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    if args.target is None:
        sys.path.insert(0, str(REPO))
        from eagle3_jax import assets

        args.target = str(assets.prepare_default_target())
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)

    runs, speculation = {}, {}
    for name, draft in (("spec on", args.draft), ("spec off", "none")):
        runs[name], speculation[name] = served_runs(args, draft, out / name.replace(" ", "_"))
    if not args.no_hf:
        hf_args = f"pretrained={args.target},dtype=float32,max_length={args.max_model_len}"
        runs["hf"] = {MC: lm_eval(args, "hf", hf_args, MC, args.limit_mc, out / "hf" / MC, "--device", "cpu")}
    diffs = compare(runs)

    print(f"{'run':<9} {'task':<35} {'metric':<11} {'score ± stderr':>17}  per item vs spec off")
    for name, run in runs.items():
        for task, result in run.items():
            metric = "acc" if task == MC else "exact_match"
            same = (f"max |dLL| {diffs[name, task]:.2e}" if task == MC
                    else f"{diffs[name, task]}/{len(result['items'])} same text")
            print(f"{name:<9} {task:<35} {metric:<11} {result['score']:>7.4f} ± {result['stderr']:.4f}  {same}")
    for name, counts in speculation.items():
        print(f"{name}: {counts['drafts']:.0f} speculative iterations, {counts['accepted']:.0f} proposals accepted, "
              f"acceptance length {counts['acceptance_length']}")
    result = {"target": args.target, "draft": args.draft, "engine": args.engine, "limit_mc": args.limit_mc,
              "limit_gen": args.limit_gen, "runs": runs, "speculation": speculation,
              "diffs": [{"run": name, "task": task, "vs_spec_off": d} for (name, task), d in diffs.items()]}
    (out / "lm_eval.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
