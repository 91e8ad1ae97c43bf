"""`eagle3-jax` command line: prepare, generate, chat, bench, train-draft, plan, convert-draft."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target directory (default: SmolLM2-135M-Instruct, prepared on first use)")
    p.add_argument("--draft", default="default",
                   help="drafter directory in the public EAGLE-3 layout; 'none' for the target alone "
                        "(default: the shipped drafter when the target is the default)")
    p.add_argument("--num-draft", type=int, default=3, help="K, draft tokens per iteration")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--speculation", choices=("auto", "always"), default="auto",
                   help="auto: speculate at a batch size only while it beats the target alone, from costs "
                        "timed in warm-up and the measured acceptance; always: at every batch size")
    p.add_argument("--speculative-max-batch", type=int, default=None,
                   help="batch buckets above this run the target alone, in either mode (default: no cap)")
    p.add_argument("--batch-buckets", default=None,
                   help="comma-separated decode batch sizes to compile (default: what the prompts need)")


def _llm(args, num_prompts: int = 1):
    from eagle3_jax.api import LLM
    from eagle3_jax.config import EngineConfig

    draft = None if args.draft == "none" else args.draft
    if args.batch_buckets:
        buckets = tuple(int(b) for b in args.batch_buckets.split(","))
    else:  # powers of two from 2 up to the batch: compile only what this run can use
        buckets = tuple(2 ** i for i in range(1, max(1, num_prompts - 1).bit_length() + 1))
    # Prompts per prefill call: likewise, no more than this run has.
    rows = tuple(sorted({1, min(num_prompts, EngineConfig.prefill_batch_buckets[-1])}))
    cfg = EngineConfig(batch_buckets=buckets, prefill_batch_buckets=rows, max_model_len=args.max_model_len,
                       speculation=args.speculation, speculative_max_batch=args.speculative_max_batch)
    return LLM(target=args.target, draft=draft, num_speculative_tokens=args.num_draft, engine_config=cfg)


def _sampling(args):
    from eagle3_jax.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)


def cmd_prepare(args) -> int:
    from eagle3_jax import assets

    path = assets.prepare_default_target()
    print(f"target ready: {path}")
    return 0


def cmd_generate(args) -> int:
    from eagle3_jax.assets import mtbench_questions

    prompts = args.prompt or [q["turns"][0] for q in mtbench_questions()[:args.mtbench]]
    llm = _llm(args, len(prompts))
    start = time.perf_counter()
    outputs = llm.generate(prompts, _sampling(args))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "error": out.error, "acceptance_length": round(out.metrics.acceptance_length, 3),
                  "acceptance_rates": [round(r, 3) for r in out.metrics.acceptance_rates]}
        if args.json:
            print(json.dumps(record))
        elif out.error:
            print(f"error: {out.error}", file=sys.stderr)
        else:
            print(out.text)
            print(f"[{len(out.token_ids)} tokens, {out.finish_reason}, acceptance length "
                  f"{out.metrics.acceptance_length:.2f}]", file=sys.stderr)
    ok = [o for o in outputs if not o.error]
    if ok and not args.json:
        tokens = sum(len(o.token_ids) for o in ok)
        iters = sum(o.metrics.iterations for o in ok)
        emitted = sum(o.metrics.emitted for o in ok)
        print(f"{len(ok)} request(s), {tokens} tokens in {elapsed:.2f} s; mean acceptance length "
              f"{emitted / max(iters, 1):.2f} tokens per target forward", file=sys.stderr)
    return 1 if len(ok) < len(outputs) else 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    params = _sampling(args)
    history = []
    print("eagle3-jax chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = []
        for delta in llm.stream(history, params):
            print(delta.text, end="", flush=True)
            reply.extend(delta.token_ids)
            if delta.output is not None:
                print(f"\n[acceptance length {delta.output.metrics.acceptance_length:.2f}]", file=sys.stderr)
        history.append({"role": "assistant", "content": llm.decode(reply)})
    return 0


def cmd_convert_draft(args) -> int:
    from eagle3_jax.weights.eagle3 import convert_bin_to_safetensors

    print(convert_bin_to_safetensors(args.src, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("prepare", help="download and convert the default target (SmolLM2-135M-Instruct)")

    p = sub.add_parser("generate", help="generate for prompts (chat template applied)")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", help="a user message; repeat for a batch")
    p.add_argument("--mtbench", type=int, default=1, help="without --prompt: the first N MT-bench questions")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")

    p = sub.add_parser("chat", help="interactive chat, streaming")
    _add_model_args(p)
    _add_sampling_args(p)

    p = sub.add_parser("convert-draft", help="pytorch_model.bin drafter -> model.safetensors (needs torch)")
    p.add_argument("src")
    p.add_argument("--out", default=None)

    # Subcommands whose arguments live with their code.
    for name, help_text in (("bench", "benchmark target-only vs EAGLE-3"),
                            ("train-draft", "train an EAGLE-3 drafter for a target"),
                            ("plan", "per-device memory plan for tensor parallelism")):
        sub.add_parser(name, help=help_text, add_help=False)

    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        from eagle3_jax.bench import main as bench_main
        return bench_main(rest)
    if args.command == "train-draft":
        from eagle3_jax.train.loop import main as train_main
        return train_main(rest)
    if args.command == "plan":
        from eagle3_jax.parallel.plan import main as plan_main
        return plan_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return {"prepare": cmd_prepare, "generate": cmd_generate, "chat": cmd_chat,
            "convert-draft": cmd_convert_draft}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
