"""Device activity from a JAX profiler trace: how busy the GPU was, and with which kernels.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes a Chrome-trace JSON
(`perfetto_trace.json.gz`) in which each GPU is a process named "/device:GPU:<n>..." whose
complete ("X") events are the kernels and copies it ran. Busy time is the union of those
intervals, so kernels overlapping on several streams count once; idle is the rest of the window.

XLA runs a program's kernels as a CUDA graph, but by default it falls back to launching them one
by one while a profiler is active (which changes the host's cost, not the kernels'). Set
`--xla_enable_command_buffers_during_profiling=true` to keep the graphs
(`keep_command_buffers`, which `eagle3-jax bench --profile` calls).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

KEEP_GRAPHS_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def keep_command_buffers() -> None:
    """Ask XLA to keep its CUDA graphs under the profiler. XLA reads XLA_FLAGS when the backend
    starts, so call this before the first use of a device."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "command_buffers_during_profiling" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {KEEP_GRAPHS_FLAG}".strip()


def kernel_family(name: str) -> str:
    """A kernel's name without XLA's instance numbers: each unrolled layer's fusions get their own
    ("loop_add_fusion.3", "gemm_fusion_dot_17"), and what one step spends is per family."""
    return re.sub(r"([._]\d+)+$", "", name)


@dataclasses.dataclass(frozen=True)
class DeviceActivity:
    window_us: float  # the span asked about
    busy_us: float  # union of the device's event intervals inside it
    events: int  # device events that started inside it
    by_name: tuple[tuple[str, int, float], ...]  # (name, count, total us), largest total first

    @property
    def idle_frac(self) -> float:
        return 1.0 - self.busy_us / self.window_us if self.window_us > 0 else 0.0


def load_trace(profile_dir: str | Path) -> list[dict]:
    """The events of the newest perfetto_trace.json.gz under `profile_dir`."""
    files = sorted(Path(profile_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {profile_dir} "
                                "(jax.profiler.trace(..., create_perfetto_trace=True) writes one)")
    with gzip.open(files[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_pids(events: Iterable[dict], prefix: str = "/device:GPU") -> set[int]:
    """Process ids the trace names as devices ("/device:GPU:0", ...)."""
    return {e["pid"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name" and str(e["args"]["name"]).startswith(prefix)}


def union_us(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def device_activity(events: Sequence[dict], start_us: float, end_us: float, top: int = 15,
                    group: Callable[[str], str] = kernel_family) -> DeviceActivity:
    """Busy time of the devices' events within [start_us, end_us] (trace timestamps, us); the
    largest events grouped by `group(name)`."""
    pids = device_pids(events)
    clipped, names = [], collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in pids:
            continue
        s, d = float(e["ts"]), float(e.get("dur", 0.0))
        lo, hi = max(s, start_us), min(s + d, end_us)
        if hi <= lo:
            continue
        clipped.append((lo, hi))
        if start_us <= s:
            names[group(e["name"])][0] += 1
            names[group(e["name"])][1] += d
    by_name = sorted(((n, c, t) for n, (c, t) in names.items()), key=lambda x: -x[2])[:top]
    return DeviceActivity(window_us=end_us - start_us, busy_us=union_us(clipped),
                          events=sum(c for c, _ in names.values()), by_name=tuple(by_name))


def host_activity(events: Sequence[dict], start_us: float, end_us: float, thread: tuple[int, int],
                  top: int = 20) -> tuple[tuple[str, int, float, float], ...]:
    """What the host thread `thread` ((pid, tid), e.g. `marker_thread`'s) did within
    [start_us, end_us]: its events (Python frames "$file.py:line function" and the runtime's own,
    "PjitFunction(name)", "numpy asarray", ...) grouped by name as (name, count, total us, self us),
    largest self time first (then by name). Self time leaves out the events nested inside, so the
    self times add up to the thread's traced time."""
    spans = sorted(((float(e["ts"]), float(e.get("dur", 0.0)), e["name"]) for e in events
                    if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) == thread
                    and start_us <= float(e["ts"]) and float(e["ts"]) + float(e.get("dur", 0.0)) <= end_us),
                   key=lambda x: (x[0], -x[1]))
    totals = collections.defaultdict(lambda: [0, 0.0, 0.0])  # name -> [count, total, self]
    stack: list[list] = []  # [end, name, self] of the open events enclosing the current one
    for ts, dur, name in spans:
        while stack and stack[-1][0] <= ts:
            _, done, own = stack.pop()
            totals[done][2] += own
        if stack:
            stack[-1][2] -= dur  # the parent's self time excludes this child
        totals[name][0] += 1
        totals[name][1] += dur
        stack.append([ts + dur, name, dur])
    for _, done, own in stack:
        totals[done][2] += own
    rows = sorted(((n, c, t, own) for n, (c, t, own) in totals.items()), key=lambda x: (-x[3], x[0]))
    return tuple(rows[:top])


def marker_thread(events: Sequence[dict], name: str) -> tuple[int, int]:
    """(pid, tid) of the thread that recorded the host event `name`: the one that ran the profiled
    code. Found by the event, not by a thread name: taken by the name "python", the host
    breakdown came back empty from every jax 0.11.2 GPU trace."""
    for e in events:
        if e.get("ph") == "X" and e.get("name") == name:
            return e["pid"], e["tid"]
    raise KeyError(f"no event named {name!r} in the trace")


def marker_span(events: Sequence[dict], name: str) -> tuple[float, float]:
    """(start, end) us of the host event called `name` (a jax.profiler.TraceAnnotation)."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
             if e.get("ph") == "X" and e.get("name") == name]
    if not spans:
        raise KeyError(f"no event named {name!r} in the trace")
    return min(s for s, _ in spans), max(t for _, t in spans)


def profile_region(fn: Callable, out_dir: str | Path, marker: str = "profiled-region", host: bool = False):
    """Run `fn()` under JAX's profiler, trace in `out_dir`; `fn` waits for its own device work.
    -> (what fn returned, DeviceActivity over its span), plus the host thread's `host_activity`
    with `host`."""
    import jax  # here: the trace readers above need no JAX

    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 2  # the runtime's host events (dispatch, argument handling, copies)
    options.python_tracer_level = 1 if host else 0  # Python frames: asked for, not left to the version's default
    with (jax.profiler.trace(str(out_dir), create_perfetto_trace=True, profiler_options=options),
          jax.profiler.TraceAnnotation(marker)):
        result = fn()
    events = load_trace(out_dir)
    span = marker_span(events, marker)
    if host:
        return result, device_activity(events, *span), host_activity(events, *span, marker_thread(events, marker))
    return result, device_activity(events, *span)


# ---- kernels by source line --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelSite:
    """One kernel launch of a compiled program, as its optimized HLO schedules it."""

    instruction: str  # the ENTRY instruction ("loop_add_fusion.3", "pallas_call.12", "copy.4")
    kernel: str  # the kernel name a trace shows for it ("" where the HLO does not say: custom calls)
    frames: tuple[tuple[str, str, int], ...]  # (file, function, line) of its source, innermost first


_LAUNCHES = ("fusion", "custom-call", "copy")  # ENTRY instructions that each run one kernel on the GPU


def hlo_kernel_sites(hlo_text: str) -> list[KernelSite]:
    """The kernel launches of an optimized HLO module (`compiled.as_text()`), in schedule order,
    each with its source stack from the module's FileNames / FunctionNames / FileLocations /
    StackFrames tables (a frame's parent_frame_id is its parent's id + 1; 1: none)."""
    tables: dict[str, dict[int, str]] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    section, sites, in_entry = None, [], False
    for line in hlo_text.splitlines():
        if line in tables:
            section = line
        elif line.startswith("ENTRY"):
            section, in_entry = None, True
        elif in_entry:
            if line.startswith("}"):
                break
            m = re.match(r"\s*(?:ROOT )?%(\S+) = .*? ([a-z-]+)\(", line)
            if m and m.group(2) in _LAUNCHES:
                frame = re.search(r"stack_frame_id=(\d+)", line)
                kernel = re.search(r'deduplicated_name="([^"]+)"', line)
                kernel = (kernel.group(1) if kernel else m.group(1)) if m.group(2) == "fusion" else ""
                sites.append((m.group(1), kernel.replace(".", "_"), int(frame.group(1)) if frame else 0))
        elif section and (m := re.match(r"(\d+) (.*)$", line)):
            tables[section][int(m.group(1))] = m.group(2)
    field = lambda text, name: int(re.search(rf"{name}=(\d+)", text).group(1))

    def frames(frame_id: int) -> tuple[tuple[str, str, int], ...]:
        out = []
        while frame_id in tables["StackFrames"] and len(out) < 64:
            entry = tables["StackFrames"][frame_id]
            loc = tables["FileLocations"][field(entry, "file_location_id")]
            out.append((tables["FileNames"][field(loc, "file_name_id")].strip('"').rsplit("/", 1)[-1],
                        tables["FunctionNames"][field(loc, "function_name_id")].strip('"'), field(loc, "line")))
            frame_id = field(entry, "parent_frame_id") - 1
        return tuple(out)

    return [KernelSite(name, kernel, frames(frame)) for name, kernel, frame in sites]


def call_kernels(events: Sequence[dict], calls: int, module: str | None = None) -> list[tuple[str, float]]:
    """The device kernels of one call of a program run `calls` times back to back: (name, median
    us over the calls) in launch order. module: only the events of that HLO module ("jit_f")."""
    pids = device_pids(events)
    kernels = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") in pids
                      and (module is None or e.get("args", {}).get("hlo_module") == module)),
                     key=lambda e: float(e["ts"]))
    n = len(kernels) // calls
    per_call = [kernels[i * n:(i + 1) * n] for i in range(calls)]
    return [(per_call[0][j]["name"], sorted(float(c[j].get("dur", 0.0)) for c in per_call)[calls // 2])
            for j in range(n)]


def align_kernels(sites: Sequence[KernelSite], kernels: Sequence[tuple[str, float]]
                  ) -> list[tuple[KernelSite | None, tuple[str, float] | None]]:
    """Pair a program's scheduled launches with one call's kernels (`call_kernels`), in order: an
    edit-distance alignment scoring equal names, and a custom call against a kernel no fusion
    names, as matches (XLA may add a copy the HLO does not show, or run a fusion as no kernel)."""
    n, m = len(sites), len(kernels)

    def score(i: int, j: int) -> int:
        name = kernels[j][0]
        if sites[i].kernel and sites[i].kernel == name:
            return 2
        fusion_like = name.startswith(("loop_", "input_", "gemm_", "wrapped_", "memcpy", "memset"))
        return 1 if not sites[i].kernel and not sites[i].instruction.startswith("copy") and not fusion_like else -1

    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n + 1):
        best[i][0] = -i
    for j in range(m + 1):
        best[0][j] = -j
    for i in range(1, n + 1):
        row, up = best[i], best[i - 1]
        for j in range(1, m + 1):
            row[j] = max(up[j - 1] + score(i - 1, j - 1), up[j] - 1, row[j - 1] - 1)
    pairs, i, j = [], n, m
    while i > 0 or j > 0:
        if i > 0 and j > 0 and best[i][j] == best[i - 1][j - 1] + score(i - 1, j - 1):
            pairs.append((sites[i - 1], kernels[j - 1]))
            i, j = i - 1, j - 1
        elif i > 0 and best[i][j] == best[i - 1][j] - 1:
            pairs.append((sites[i - 1], None))
            i -= 1
        else:
            pairs.append((None, kernels[j - 1]))
            j -= 1
    return pairs[::-1]


def source_label(site: KernelSite | None, package_files: Callable[[str], bool], depth: int = 2) -> str:
    """'file:line function < ...' of the `depth` innermost frames that `package_files` accepts."""
    if site is None:
        return "(no HLO launch)"
    ours = [f"{f}:{line} {fn}" for f, fn, line in site.frames if package_files(f)][:depth]
    return " < ".join(ours) or "(no source)"


def kernels_by_source(pairs, package_files: Callable[[str], bool], depth: int = 2) -> list[tuple[str, int, float]]:
    """(source label, kernels, us) per call, largest first, from `align_kernels`' pairs."""
    totals = collections.defaultdict(lambda: [0, 0.0])
    for site, kernel in pairs:
        if kernel is not None:
            t = totals[source_label(site, package_files, depth)]
            t[0] += 1
            t[1] += kernel[1]
    return sorted(((label, c, us) for label, (c, us) in totals.items()), key=lambda x: -x[2])


def profile_calls(call: Callable, state, calls: int, out_dir: str | Path):
    """Run `call` (state -> (state, out), state donated) `calls` times back to back under JAX's
    profiler, trace in `out_dir`. -> (state, DeviceActivity over the round)."""
    import jax

    def calls_back_to_back():
        s = jax.block_until_ready(state)
        for _ in range(calls):
            s, out = call(s)
        return jax.block_until_ready((s, out))[0]

    return profile_region(calls_back_to_back, out_dir)
