"""The math: pure functions over parameter pytrees, no I/O (layers, target, draft head, kernels)."""

from eagle3_jax.model import triton_dialect

# Before any Pallas kernel of this package lowers to Triton.
triton_dialect.register()
