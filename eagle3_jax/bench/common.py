"""Shared by the bench modules: phase names, step-model presets, the progress log, results and the
table formatter."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from eagle3_jax.presets import llama31_8b, llama33_70b, smollm2_135m

PHASES = ("smollm2", "8b", "peer", "tp")
DEFAULT_PHASES = ("smollm2", "8b", "peer")
LLAMA31_8B = "llama3.1-8b"
LLAMA33_70B = "llama-3.3-70b"
# --step-model names of the presets (eagle3_jax/presets.py), spelled either way.
STEP_PRESETS = {LLAMA31_8B: llama31_8b, "llama-3.1-8b": llama31_8b, LLAMA33_70B: llama33_70b,
                "llama3.3-70b": llama33_70b, "smollm2-135m": smollm2_135m}
_START = time.perf_counter()


def log(message: str) -> None:
    """Progress on stderr, stamped with seconds since start (the tables come at the end)."""
    print(f"[bench {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class CollectorPauses:
    """Python's garbage collections seen while a `collector_pauses` block ran."""

    passes: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])  # per generation
    seconds: float = 0.0  # all passes

    @property
    def full_passes(self) -> int:
        return self.passes[2]


@contextlib.contextmanager
def collector_pauses() -> Iterator[CollectorPauses]:
    """Count and time the cyclic garbage collector's passes while the block runs (`gc.callbacks`).
    Why: a full pass walks every tracked object of the process and stalls the engine's host loop
    meanwhile; a bench that builds engine after engine grows that heap (engine.freeze_heap)."""
    pauses, started = CollectorPauses(), []

    def on(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.passes[info["generation"]] += 1
            pauses.seconds += time.perf_counter() - started.pop()

    gc.callbacks.append(on)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(on)


@dataclasses.dataclass
class Result:
    """One table row: a (mode, batch) of one phase and its named figures."""

    phase: str  # "smollm2" | "8b" | "peer" | "tp" | "allreduce"
    mode: str
    batch: int
    values: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Column:
    key: str  # "mode", "batch" or a key of Result.values
    header: str
    fmt: str = "{:.2f}"


def markdown_table(rows: Sequence[Result], columns: Sequence[Column]) -> str:
    """A Markdown table of `rows`; '-' where a figure is missing."""

    def cell(row: Result, col: Column) -> str:
        value = {"mode": row.mode, "batch": row.batch}.get(col.key, row.values.get(col.key))
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if isinstance(value, (list, tuple)):
            return " ".join(col.fmt.format(v) for v in value) or "-"
        return col.fmt.format(value) if isinstance(value, (int, float)) else str(value)

    lines = ["| " + " | ".join(c.header for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, c) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


