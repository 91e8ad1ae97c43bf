"""The run: every selected phase, then the report; `python -m eagle3_jax.bench` and `eagle3-jax
bench`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from eagle3_jax import assets
from eagle3_jax.arguments import UsageError
from eagle3_jax.bench import profile
from eagle3_jax.bench.collectives import allreduce_shapes, measure_links, use_allreduce
from eagle3_jax.bench.common import Result, log
from eagle3_jax.bench.costs import measure_ceilings
from eagle3_jax.bench.harness import step_models
from eagle3_jax.bench.options import Options, build_parser
from eagle3_jax.bench.peer import peer_worker, phase_peer
from eagle3_jax.bench.phases import phase_8b, phase_smollm2, phase_tp
from eagle3_jax.bench.report import device_name, plot, report_markdown, summary_ratios
from eagle3_jax.parallel import sharding


def run(opts: Options, command: str) -> tuple[dict, list[Result], dict, list[str]]:
    """Every selected phase; the peer first, before JAX takes the GPU's memory."""
    start = time.perf_counter()
    results: list[Result] = []
    info: dict[str, Any] = {}
    notes: list[str] = []
    phase_s: dict[str, float] = {}

    failed: list[str] = []

    def timed(name, fn, *args):
        """Run one phase; one that fails is reported (note, traceback on stderr) and the others
        still run, so an expensive run keeps what it measured."""
        log(f"phase {name}")
        t = time.perf_counter()
        try:
            rows, info[name] = fn(*args)
            results.extend(rows)
        except Exception as e:  # noqa: BLE001  (reported; main exits non-zero)
            traceback.print_exc()
            failed.append(name)
            notes.append(f"phase {name} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        phase_s[name] = time.perf_counter() - t
        log(f"phase {name} {'FAILED' if name in failed else 'done'} in {phase_s[name]:.0f} s")

    if "peer" in opts.phases:
        timed("peer", phase_peer, opts, notes)
    meta = {"device": device_name(), "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "command": command,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
    ceilings = None
    if {"smollm2", "8b"} & set(opts.phases):
        t = time.perf_counter()
        ceilings = measure_ceilings(opts.bandwidth_gb, opts.matmul_size)
        meta["ceilings"] = {**dataclasses.asdict(ceilings), "copy_gb": opts.bandwidth_gb, "matmul_n": opts.matmul_size}
        phase_s["ceilings"] = time.perf_counter() - t
    mesh = link = None
    if opts.tp > 1 and {"8b", "tp"} & set(opts.phases):
        try:
            mesh = sharding.make_mesh(opts.tp)
        except sharding.ShardingError as e:
            raise UsageError(f"--tp: {e}") from None
        t = time.perf_counter()
        target, _ = step_models(opts)
        link, rows, info["allreduce"] = measure_links(
            opts, mesh, opts.dtype, allreduce_shapes(target, opts.batches_8b, max(opts.num_draft)))
        results.extend(rows)
        meta["allreduce"] = {"tp": link.tp, "implementation": opts.allreduce, "algbw": link.algbw,
                             "busbw": link.busbw, "seconds": {str(list(k)): v for k, v in link.seconds.items()}}
        phase_s["allreduce"] = time.perf_counter() - t
    if "smollm2" in opts.phases:
        timed("smollm2", phase_smollm2, opts, ceilings, notes)
    if "8b" in opts.phases:
        timed("8b", phase_8b, opts, ceilings, notes, mesh, link)
    if "tp" in opts.phases:
        timed("tp", phase_tp, opts, notes)
    meta.update(phase_s=phase_s, total_s=time.perf_counter() - start, failed=failed)
    return meta, results, info, notes


def write_report(out_dir: Path, meta: dict, results: Sequence[Result], info: dict, notes: Sequence[str]) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = report_markdown(meta, results, info, notes)
    (out_dir / "bench.md").write_text(markdown)
    (out_dir / "bench.json").write_text(json.dumps(
        {"meta": meta, "info": info, "notes": list(notes), "ratios": summary_ratios(results),
         "results": [dataclasses.asdict(r) for r in results]}, indent=1, default=str))
    plot(results, out_dir / "bench.png")
    return markdown


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.peer_worker:
        spec_path, out_path = args.peer_worker
        Path(out_path).write_text(json.dumps(peer_worker(json.loads(Path(spec_path).read_text()))))
        return 0
    opts = Options.from_args(args)
    if opts.target == assets.DEFAULT_TARGET and {"smollm2", "peer"} & set(opts.phases):
        assets.prepare_default_target()  # as LLM() does: downloaded and converted on first use
    if opts.profile:
        profile.keep_command_buffers()  # before the first use of a device
    use_allreduce(opts.allreduce, opts.tp)  # XLA_FLAGS too: checked in a child process, then set
    meta, results, info, notes = run(opts, " ".join(shlex.quote(a) for a in sys.argv))
    print(write_report(opts.out_dir, meta, results, info, notes))
    return 1 if meta["failed"] else 0

