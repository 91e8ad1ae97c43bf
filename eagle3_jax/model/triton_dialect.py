"""Make Pallas' Triton lowering find the Triton dialect's Python module, once per process.

MLIR's bindings look for the "tt" dialect module under `jaxlib.mlir.dialects`, where jaxlib does not
ship it (it has `jaxlib.triton.dialect`), and do not remember a failed import: one per value lowered,
under the GIL (BENCHMARKS.md, "Start-up"). Registering the real module there ends it; the IR is the same.
"""

from __future__ import annotations

import sys

TRITON_NAMESPACE = "tt"


def register() -> None:
    """Put jaxlib's Triton dialect module where MLIR's bindings look for it (else a no-op)."""
    try:
        from jax._src.lib.triton import dialect
        from jaxlib.mlir._mlir_libs import _mlir

        prefixes = list(_mlir.globals.dialect_search_modules)
    except (ImportError, AttributeError):
        return
    for prefix in prefixes:
        sys.modules.setdefault(f"{prefix}.{TRITON_NAMESPACE}", dialect)
