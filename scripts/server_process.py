"""`eagle3-jax serve` as a subprocess, for the scripts that drive it over HTTP: on a free port of
127.0.0.1, ready once /health answers 200, stopped by SIGTERM (its graceful shutdown)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(serve_args: list[str], log_path: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """`serve` with `serve_args` (no --port), its output in `log_path` -> (its process, its URL) once
    /health answers; RuntimeError if it exits first, TimeoutError after `timeout` seconds."""
    port = free_port()
    cmd = [sys.executable, "-m", "eagle3_jax.cli", "serve", "--port", str(port), *serve_args]
    log = open(log_path, "w")  # noqa: SIM115 - kept open while the server runs
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout, log_path)
    except TimeoutError:
        proc.kill()
        raise
    return proc, url


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    """Return once `url`/health answers 200; RuntimeError if `proc` exits first (its output in
    `log_path`), TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: see {log_path}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"/health did not answer within {timeout} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_s(pid: int, thread: int | None = None) -> float | None:
    """User + system CPU seconds so far of every thread of process `pid` (/proc/PID/stat), or of
    one `thread` of it (its main thread: `pid`); None where /proc cannot say (not Linux, gone)."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def _spawned(pid: int) -> list[int]:
    """The children of process `pid` that multiprocessing spawned (not its resource tracker)."""
    children = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    children.append(int(child))
    except OSError:
        pass
    return children


def _listening_sockets() -> set[str]:
    """The TCP sockets listening on this machine, as /proc/PID/fd names them ("socket:[inode]")."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        sockets |= {f"socket:[{f[9]}]" for f in map(str.split, lines) if f[3] == "0A"}  # state LISTEN
    return sockets


def _listens(pid: int, sockets: set[str]) -> bool:
    try:
        return any(os.readlink(fd) in sockets for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def http_pids(pid: int) -> list[int]:
    """The server `pid`'s HTTP processes: itself, then (`--api-server-count N`) the N - 1 it spawned,
    which hold its listening socket as it does."""
    sockets = _listening_sockets()
    return [pid, *(child for child in _spawned(pid) if _listens(child, sockets))]


def engine_pid(pid: int) -> int | None:
    """The engine's process among the server `pid`'s children (unless --no-engine-process: the one spawned
    that listens on no socket, the HTTP processes' do), or None."""
    sockets = _listening_sockets()
    return next((child for child in _spawned(pid) if not _listens(child, sockets)), None)
