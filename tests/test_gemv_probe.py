"""scripts/gemv_probe.py's kernel (in Pallas' interpreter): its split-K partials sum to x @ w, so
the probe's timings compare like with like."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gemv_probe.py"


def test_gemv_partials_sum_to_the_product():
    spec = importlib.util.spec_from_file_location("gemv_probe", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.check() == 0  # asserts agreement with jnp.dot on three shapes and split counts
    # The split count: nearest the programs wanted, each split whole block_k steps of K.
    assert module.splits_for(4096, 4096, 64, 256, 264) == 4  # 64 column tiles x 4
    assert module.splits_for(14336, 4096, 128, 256, 528) == 8  # 14336 = 56 x 256: 16 splits would not divide
    assert module.splits_for(4096, 28672, 128, 256, 264) == 1  # 224 column tiles already
