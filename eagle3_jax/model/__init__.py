"""The math: pure functions over parameter pytrees, no I/O (layers, the Llama target, the EAGLE-3
draft head, the Pallas kernels)."""

from eagle3_jax.model import triton_dialect

# Once, before any Pallas kernel of this package lowers to Triton: halves the lowering time (triton_dialect.py).
triton_dialect.register()
