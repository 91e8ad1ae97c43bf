"""The engine's compiled programs kept on disk, beside JAX's persistent compilation cache, under a key
computed without tracing: a later start loads each program without tracing or lowering it.

JAX's own cache is keyed by the lowered module, so a start that finds every program there still
traces and lowers each one first, holding the GIL: about a second of host time per program for a
30-layer target (its layers are a Python loop), most of a second start on a GPU. Here the key is
what determines the program without building it: the package's source, jax's version and
configuration, XLA_FLAGS, the devices, the program's kind, shape and static config, and the shape,
dtype and placement of every argument. An entry is `jax.experimental.serialize_executable`'s
(the executable JAX's cache would hold, with its argument and result trees); one that fails to
load is compiled again and rewritten. Only a program compiled in this process is kept: one JAX
loaded from its own cache serializes without all its code on the CPU (it loads, then fails to
run: "Function ... not found"), so it is left to JAX's cache until a start compiles it. On the
CPU the engine keeps none (`beside_compilation_cache`): a program kept by one engine and loaded by
a second in the same process failed to run there the same way (a fresh process loads and runs it).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable

from eagle3_jax.model import invariant_gemm

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent.parent
SUBDIRECTORY = "eagle3-programs"  # under jax_compilation_cache_dir

# jax settings that change where things are kept or what is logged, not what a program computes.
_UNRELATED_SETTINGS = frozenset({
    "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size", "jax_log_compiles",
    "jax_explain_cache_misses", "jax_logging_level", "jax_debug_log_modules", "jax_raise_persistent_cache_errors",
    "jax_pprint_use_color",
})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a function's repr names its address: not part of the key


@functools.cache
def _code_fingerprint() -> str:
    """What every program depends on in its code: this package's source and tile tables (read once a
    process, as invariant_gemm reads its tables), jax's and jaxlib's versions."""
    digest = hashlib.sha256()
    # The source, and the data it compiles from: the tuned GEMM tiles shipped and any read over them.
    for path in [*sorted(PACKAGE.rglob("*.py")), invariant_gemm.TUNED_TILES_FILE]:
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    if tables := os.environ.get(invariant_gemm.TUNED_TILES_ENV):
        digest.update(Path(tables).read_bytes() if Path(tables).is_file() else tables.encode())
    import jaxlib

    digest.update(repr((jax.__version__, jaxlib.__version__)).encode())
    return digest.hexdigest()


def _settings() -> tuple:
    """What every program depends on in its settings, read at each key (a process may change them
    between two engines): jax's configuration, the XLA flags."""
    settings = sorted((k, repr(v)) for k, v in jax.config.values.items() if k not in _UNRELATED_SETTINGS)
    return os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), settings


_this_thread = threading.local()  # .loaded: JAX's cache answered this thread's compile
_listening = threading.Lock()


@functools.cache
def _listen_for_cache_hits() -> None:
    def on_event(event: str, **_kw) -> None:
        if event == "/jax/compilation_cache/cache_hits":  # recorded in the compiling thread
            _this_thread.loaded = True

    jax.monitoring.register_event_listener(on_event)


def _leaf_signature(leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return f"{leaf.aval.str_short()}@{leaf.sharding!r}"
    array = np.asarray(leaf)
    return f"{array.dtype}{list(array.shape)}@host"


def program_key(name: str, static: Any, args: tuple, kwargs: dict, devices: Sequence[jax.Device]) -> str:
    """The key of the program `name` with its static config `static` (hashable, repr'd), called on
    `args`, `kwargs` (the dynamic ones) on `devices`."""
    leaves, tree = jax.tree.flatten((args, kwargs))
    device = devices[0]
    parts = (_code_fingerprint(), _settings(), device.client.platform, device.client.platform_version,
             [(d.id, d.device_kind) for d in devices], name, _ADDRESS.sub("", repr(static)), str(tree),
             [_leaf_signature(leaf) for leaf in leaves])
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableStore:
    """Compiled programs by `program_key`, as files in `directory` (None: nothing is kept)."""

    def __init__(self, directory: str | Path | None, devices: Sequence[jax.Device]):
        self.directory = None if directory is None else Path(directory) / SUBDIRECTORY
        self.devices = list(devices)

    @classmethod
    def beside_compilation_cache(cls, devices: Sequence[jax.Device]) -> ExecutableStore:
        """The store under JAX's persistent cache directory, where one is set, off the CPU (the
        module docstring)."""
        on_cpu = devices[0].platform == "cpu"
        return cls(None if on_cpu else jax.config.jax_compilation_cache_dir, devices)

    def _path(self, key: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{key}.program"

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The program stored under `key`, loaded onto the devices; None where none is (or it does
        not load: a stale or partial file, which the next `save` replaces)."""
        path = self._path(key)
        if path is None or not path.exists():
            return None
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             backend=self.devices[0].client,
                                                             execution_devices=self.devices)
        except Exception as e:  # noqa: BLE001 - any unreadable entry is compiled again
            log.warning("compiled program %s did not load (%s: %s): compiling it again", path.name,
                        type(e).__name__, e)
            return None

    def build(self, key: str, compile_: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The program under `key`: loaded, else `compile_()` and kept where it compiled here (not
        loaded from JAX's cache: the module docstring). Safe from several threads."""
        compiled = self.load(key)
        if compiled is not None:
            return compiled
        with _listening:
            _listen_for_cache_hits()
        _this_thread.loaded = False
        compiled = compile_()
        if not _this_thread.loaded:
            self.save(key, compiled)
        return compiled

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` under `key` (written to a temporary name, then renamed: a reader never sees
        half a file). A program that cannot be serialized is not kept."""
        path = self._path(key)
        if path is None:
            return
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.partial")
            partial.write_bytes(blob)
            partial.replace(path)
        except Exception as e:  # noqa: BLE001 - the program still runs; the next start compiles it
            log.warning("compiled program %s not kept (%s: %s)", path.name, type(e).__name__, e)
