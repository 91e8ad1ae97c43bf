"""Make Pallas' Triton lowering find the Triton dialect's Python module, once per process.

Why: lowering a Pallas kernel to Triton IR asks MLIR's Python bindings for the type of each value
it builds, and the bindings then look for the value's dialect module ("tt") under their search
prefix, `jaxlib.mlir.dialects.tt`, which does not exist: jaxlib ships it as
`jaxlib.triton.dialect`. A failed import is not remembered, so every lookup searches `sys.path`
again: about 22,000 failed imports per SmolLM2 iteration program, half of its lowering time (a
chain of 4 at two rows, lowered for CUDA on a CPU: 5.7 -> 2.8 s; the tree (6, 8, 31) at one row
8.4 -> 3.5 s). Lowering holds the GIL, so it is the part of a warm-up that a thread pool of
compilations cannot overlap. Registering the real module under the searched name makes the
first lookup succeed; the IR built is byte for byte the same.
"""

from __future__ import annotations

import sys

TRITON_NAMESPACE = "tt"  # the Triton dialect's MLIR namespace


def register() -> None:
    """Put jaxlib's Triton dialect module where MLIR's bindings look for it (a no-op where jaxlib
    has no Triton dialect or the bindings no search prefix)."""
    try:
        from jax._src.lib.triton import dialect
        from jaxlib.mlir._mlir_libs import _mlir

        prefixes = list(_mlir.globals.dialect_search_modules)
    except (ImportError, AttributeError):
        return
    for prefix in prefixes:
        sys.modules.setdefault(f"{prefix}.{TRITON_NAMESPACE}", dialect)
