"""bench.md, bench.json and bench.png: tables, ratios, legend and plot."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import jax

from eagle3_jax.bench.common import (
    LLAMA31_8B,
    LLAMA33_70B,
    Column,
    Result,
    markdown_table,
)

SMOLLM2_COLUMNS = [
    Column("mode", "mode"),
    Column("batch", "batch", "{}"),
    Column("bucket", "bucket", "{}"),
    Column("tok_s", "tok/s", "{:.0f}"),
    Column("speedup", "speedup", "{:.2f}x"),
    Column("speculative_iterations", "spec. iters", "{}"),
    Column("target_only_iterations", "target-only iters", "{}"),
    Column("tpot_ms", "TPOT ms", "{:.2f}"),
    Column("ttft_ms", "TTFT ms", "{:.1f}"),
    Column("tokens_per_request", "tok/req", "{:.0f}"),
    Column("acceptance_length", "accept len", "{:.2f}"),
    Column("acceptance_rates", "accept rate by pos", "{:.2f}"),
    Column("iter_ms", "wall/iter ms", "{:.2f}"),
    Column("step_ms", "steady step ms", "{:.2f}"),
    Column("host_ms_per_step", "host ms/step", "{:.2f}"),
    Column("dispatch_ms_per_step", "of which dispatch", "{:.2f}"),
    Column("device_wait_ms_per_step", "wait ms/step", "{:.2f}"),
    Column("gc_ms_per_step", "GC ms/step", "{:.3f}"),
    Column("gc_full_passes", "full GCs", "{}"),
    Column("device_ms", "device ms/iter", "{:.2f}"),
    Column("floor_ms", "floor ms/iter", "{:.3f}"),
    Column("idle_frac", "device idle", "{:.0%}"),
    Column("device_busy_ms", "busy ms/iter (profiler)", "{:.2f}"),
    Column("idle_measured", "device idle (profiler)", "{:.0%}"),
    Column("compile_s", "compile s", "{:.0f}"),
    Column("warmup_s", "warm-up s", "{:.1f}"),
]
STEP_COLUMNS = [
    Column("mode", "step"),
    Column("batch", "batch", "{}"),
    Column("ms", "ms/call", "{:.2f}"),
    Column("floor_ms", "floor ms", "{:.2f}"),
    Column("pct_of_floor", "% of floor", "{:.0f}%"),
    Column("bound", "floor set by"),
    Column("gb", "GB (floor)", "{:.1f}"),
    Column("gemm", "GEMMs"),
    Column("device_busy_ms", "busy ms (profiler)", "{:.2f}"),
    Column("tok_s_assumed", "tok/s at ASSUMED L", "{:.0f}"),
    Column("speedup_assumed", "speedup at ASSUMED L", "{:.2f}x"),
]
STEP_TP_COLUMNS = [
    Column("device_floor_ms", "HBM/compute floor ms", "{:.2f}"),
    Column("ar_floor_ms", "all-reduce floor ms", "{:.3f}"),
    Column("ar_count", "all-reduces/call", "{}"),
    Column("ar_count_hlo", "in HLO", "{}"),
    Column("ar_mb", "all-reduced MB/GPU", "{:.2f}"),
    Column("ar_latency_ms", "all-reduces at measured latency ms", "{:.2f}"),
]
ALLREDUCE_COLUMNS = [
    Column("mode", "array per device"),
    Column("mb", "MB", "{:.3f}"),
    Column("us", "us per all-reduce", "{:.1f}"),
    Column("algbw_gbs", "algbw GB/s", "{:.2f}"),
    Column("busbw_gbs", "busbw GB/s", "{:.2f}"),
    Column("hlo_allreduces", "all-reduces in HLO", "{}"),
    Column("implementation", "implementation"),
]
TP_COLUMNS = [
    Column("mode", "run"),
    Column("tp", "TP", "{}"),
    Column("batch", "prompts", "{}"),
    Column("tokens", "tokens", "{}"),
    Column("identical", "same tokens as TP=1 (same run)"),
    Column("mismatched", "mismatched tokens", "{}"),
    Column("first_mismatch", "first mismatch"),
    Column("identical_target_tp1", "same tokens as target-only TP=1"),
    Column("acceptance_length", "accept len", "{:.2f}"),
    Column("iterations", "iterations", "{}"),
    Column("speculative_iterations", "of them speculative", "{}"),
    Column("s", "s (load + compile + generate)", "{:.1f}"),
]
PEER_COLUMNS = [
    Column("mode", "peer"),
    Column("batch", "batch", "{}"),
    Column("tok_s", "tok/s", "{:.0f}"),
    Column("ms_per_token", "ms/token/seq", "{:.2f}"),
    Column("tokens", "tokens", "{}"),
    Column("requests", "requests", "{}"),
    Column("warmup_s", "compile + warm-up s", "{:.1f}"),
]
SECTIONS = (
    ("smollm2", "Engine end to end: target-only vs EAGLE-3", SMOLLM2_COLUMNS),
    ("allreduce", "All-reduce across the tensor-parallel devices", ALLREDUCE_COLUMNS),
    ("8b", "Step functions: {shapes}, random weights, synthetic slot state", STEP_COLUMNS),
    ("tp", "Tensor parallelism: greedy tokens at TP=N vs TP=1 through the engine", TP_COLUMNS),
    ("peer", "Peer: Hugging Face transformers, static cache + torch.compile", PEER_COLUMNS),
)
STEP_SHAPES = {
    LLAMA31_8B: "Llama-3.1-8B",
    "llama-3.1-8b": "Llama-3.1-8B",
    LLAMA33_70B: "Llama-3.3-70B",
    "llama3.3-70b": "Llama-3.3-70B",
}

LEGEND = """\
Measured vs derived:
- measured: tok/s (tokens generated / wall time of the rounds, prefill included); TPOT (per request,
  (last token - first token time) / (tokens - 1), mean); TTFT (submission -> first token read by the
  host, mean; times from RequestMetrics); tok/req; acceptance length and
  rate by position (RequestMetrics); wall/iter (wall / iterations dispatched, prefill included);
  steady step (median wall time of a step with the whole batch running, no prefill); host ms/step,
  wait ms/step (EngineStats); GC ms/step and full GCs (Python's garbage collections during the
  rounds, timed by gc.callbacks: their time per step, and the full passes); device ms/iter (the
  iterate step alone, back to back, median of rounds: the larger of device time and dispatch time);
  compile s (every shape of the mode compiled on a thread pool); warm-up s (Engine.warmup after
  that, loading them; with --no-parallel-compile it compiles them itself, as a user's LLM() does); 8b ms/call
  (median of rounds, back to back); peer tok/s; memory bandwidth and matmul rate.
- derived: speedup (tok/s over target-only at the same batch); device idle = 1 - device ms/iter /
  steady step ms (an estimate); with --profile, busy ms/iter = the union of the GPU's kernel intervals
  over one more round run under JAX's profiler, per iteration, and device idle (profiler) = 1 - that /
  wall/iter of the unprofiled rounds; floor = max(bytes / memory bandwidth, FLOPs / matmul rate) for the
  fewest bytes (weights once per pass, each row's KV of the stated context once) and the FLOPs of
  the call; % of floor = floor / measured; tok/s at ASSUMED L = B x L / ms per call, L assumed
  and NOT measured (target-only decode: L = 1); speedup at ASSUMED L = that over decode's at the same
  batch.
- comparing modes: each mode runs on an engine of its own, built and timed after the one before.
  Where the host is the limit (steps of about 1 ms), two engines with the same settings differed by
  up to 10% in host ms/step (experiments/auto_host_probe.py); device ms/iter and acceptance do
  not move with it.
- tensor parallelism (--tp N): bytes and FLOPs are per device (each holds 1/N of every target
  weight matrix, of the lm_head and of the KV heads, and the whole drafter, replicated); the floor
  adds all-reduce floor = all-reduced bytes / algbw of the large all-reduce measured in this run.
  All-reduces per call = the Megatron layout's, the target's only: 2 per layer + 1 (embedding) of
  [B, T, D] (the replicated drafter has none); "in HLO" counts them in the compiled program (XLA may
  combine some into one tuple all-reduce: operands are counted). The logits all-gathers (the
  sampler's vocab_logits) are not in the floor. "all-reduces at measured latency" = the sum over the
  call's all-reduces of the time one all-reduce of that shape took in the all-reduce table
  (decode-sized ones are latency-bound), under the run's --allreduce implementation.
- tp phase: measured (token equality of greedy runs through the engine)."""


def summary_ratios(results: Sequence[Result]) -> list[str]:
    """Headline ratios, each with the floor or the figure that bounds it."""
    by = {(r.phase, r.mode, r.batch): r.values for r in results}
    lines = []
    for r in results:
        if r.phase == "smollm2" and r.mode != "target-only":
            base = by[("smollm2", "target-only", r.batch)]
            lines.append(
                f"{r.mode} / target-only, batch {r.batch}: {r.values['speedup']:.2f}x tok/s at acceptance "
                f"length {r.values['acceptance_length']:.2f}; device ms/iter {r.values['device_ms']:.2f} "
                f"vs {base['device_ms']:.2f} (floors {r.values.get('floor_ms', float('nan')):.3f} vs "
                f"{base.get('floor_ms', float('nan')):.3f})"
            )
    modes = list(dict.fromkeys(r.mode for r in results if r.phase == "smollm2"))
    for p in (r for r in results if r.phase == "peer" and r.values.get("model") == "target"):
        for mode in modes:
            if ours := by.get(("smollm2", mode, p.batch)):
                lines.append(
                    f"ours {mode} / {p.mode}, batch {p.batch}: {ours['tok_s'] / p.values['tok_s']:.2f}x "
                    f"tok/s ({ours['tok_s']:.0f} vs {p.values['tok_s']:.0f})"
                )
    big = [r for r in results if r.phase == "peer" and r.values.get("model") == "8b"]
    decode = [r for r in results if r.phase == "8b" and r.mode.startswith("decode") and r.batch == 1]
    if big and decode:
        v = decode[0].values
        lines.append(
            f"8B shapes, batch 1: our decode step {v['ms']:.2f} ms (step alone) vs {big[0].mode} "
            f"{big[0].values['ms_per_token']:.2f} ms/token (generate end to end); "
            f"floor {v['floor_ms']:.2f} ms"
        )
    for r in results:
        if r.phase == "8b" and "ar_floor_ms" in r.values and not r.mode.startswith("verify"):
            v = r.values
            lines.append(
                f"TP={v['tp']} {r.mode}, batch {r.batch}: {v['ms']:.2f} ms vs floor {v['floor_ms']:.2f} ms "
                f"({v['pct_of_floor']:.0f}%; HBM/compute {v['device_floor_ms']:.2f} + all-reduce "
                f"{v['ar_floor_ms']:.3f}; {v['ar_count']} all-reduces of {v['ar_mb']:.2f} MB in all, "
                f"{v['ar_latency_ms']:.2f} ms at measured latency; compiled program: "
                f"{v.get('ar_count_hlo', '-')} all-reduces, {v.get('ar_mb_hlo', float('nan')):.2f} MB)"
            )
    for r in results:
        if r.phase == "tp" and "identical" in r.values:
            lines.append(
                f"TP={r.values['tp']} vs TP=1, {r.mode}: greedy tokens identical: {r.values['identical']} "
                f"({r.values['tokens']} tokens, {r.batch} prompts, {r.values['mismatched']} mismatched)"
            )
    return lines


def _describe(info: dict) -> list[str]:
    return [f"- {k}: {v}" for k, v in info.items() if not isinstance(v, dict) or k == "parallel compile s"]


def report_markdown(meta: dict, results: Sequence[Result], info: dict, notes: Sequence[str]) -> str:
    out = [
        "# eagle3-jax bench",
        "",
        f"- device: {meta['device']}",
        f"- jax {meta['jax']}, Python {meta['python']}",
        f"- date: {meta['date']}",
        f"- command: `{meta['command']}`",
        f"- run took {meta['total_s']:.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in meta["phase_s"].items()) + ")",
    ]
    if c := meta.get("ceilings"):
        kernels = ", ".join(f"{k} {v / 1e12:.2f}" for k, v in c["bandwidths"].items())
        out.append(
            f"- ceilings measured in this run: memory {c['bandwidth'] / 1e12:.2f} TB/s, the best of ({kernels}; "
            f"TB/s over {c['copy_gb']:g} GB of random data, bytes read + written); bf16 matmul "
            f"{c['flops'] / 1e12:.0f} TFLOP/s ({c['matmul_n']}^3, random data)"
        )
    for phase, title, columns in SECTIONS:
        rows = [r for r in results if r.phase == phase]
        if phase in info:
            if phase == "8b":
                model = str(info[phase].get("model"))
                shapes = STEP_SHAPES.get(model, Path(model).name)
                tp = rows[0].values.get("tp", 1) if rows else 1
                title = title.format(shapes=f"{shapes} shapes" + (f" at TP={tp}" if tp > 1 else ""))
                columns = columns + STEP_TP_COLUMNS if tp > 1 else columns
            out += [
                "",
                f"## {title}",
                "",
                *_describe(info[phase]),
                "",
                markdown_table(rows, columns) if rows else "(no rows)",
            ]
    if ratios := summary_ratios(results):
        out += ["", "## Ratios", "", *[f"- {line}" for line in ratios]]
    if notes:
        out += ["", "## Notes", "", *[f"- {n}" for n in notes]]
    return "\n".join(out + ["", LEGEND, ""])


def plot(results: Sequence[Result], path: Path) -> Path | None:
    """tok/s and speedup against batch size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in dict.fromkeys(r.mode for r in results if r.phase == "smollm2"):
        rows = [r for r in results if r.phase == "smollm2" and r.mode == mode]
        ax1.plot([r.batch for r in rows], [r.values["tok_s"] for r in rows], "o-", label=f"ours, {mode}")
        if mode != "target-only":
            ax2.plot(
                [r.batch for r in rows], [r.values["speedup"] for r in rows], "o-", label=f"SmolLM2 {mode}, measured"
            )
    for r in results:
        if r.phase == "peer" and r.values.get("model") == "target":
            ax1.plot(
                [r.batch],
                [r.values["tok_s"]],
                "k^",
                label=r.mode if r.batch == min(x.batch for x in results if x.phase == "peer") else None,
            )
    for mode in dict.fromkeys(r.mode for r in results if r.phase == "8b" and r.mode.startswith("EAGLE")):
        rows = [r for r in results if r.phase == "8b" and r.mode == mode]
        ax2.plot(
            [r.batch for r in rows],
            [r.values["speedup_assumed"] for r in rows],
            "s--",
            label=f"step phase {mode}, ASSUMED L (step times)",
        )
    for ax, ylabel in ((ax1, "output tok/s"), (ax2, "speedup over target-only")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a phase-subset run may leave a panel empty
            ax.legend(fontsize=7)
    ax1.set_yscale("log")
    ax1.set_title("SmolLM2 end to end (peer: triangles)", fontsize=9)
    ax2.set_title("speedup: SmolLM2 measured; step phase from step times at an ASSUMED L", fontsize=9)
    ax2.axhline(1.0, color="gray", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def device_name() -> str:
    d = jax.devices()[0]
    name = f"{d.platform}: {d.device_kind}" + (f" x {jax.device_count()}" if jax.device_count() > 1 else "")
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if out.returncode == 0 and out.stdout.strip():
            name += f" (nvidia-smi: {out.stdout.strip().splitlines()[0]})"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return name
