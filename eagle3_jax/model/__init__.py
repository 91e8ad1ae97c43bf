"""The math: pure functions over parameter pytrees, no I/O (layers, the Llama target, the EAGLE-3
draft head, the Pallas kernels)."""
