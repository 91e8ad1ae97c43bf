"""Make Pallas' Triton lowering find the Triton dialect's Python module, once per process.

MLIR's Python bindings look for each value's dialect module ("tt") under their search prefix,
`jaxlib.mlir.dialects.tt`, which does not exist (jaxlib ships `jaxlib.triton.dialect`), and a
failed import is not remembered: tens of thousands of failed imports a program, about half of its
lowering time, under the GIL (BENCHMARKS.md, "Start-up"). Registering the real module under the
searched name makes the first lookup succeed; the IR is the same.
"""

from __future__ import annotations

import sys

TRITON_NAMESPACE = "tt"  # the Triton dialect's MLIR namespace


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
