"""scripts/l2_prefetch_probe.py's touch kernel (in Pallas' interpreter) reads and sums its whole
input, and every timed variant computes the same layer output as the plain one: the probe's
timings compare like with like."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "l2_prefetch_probe.py"


def test_touch_sums_and_the_variants_agree(monkeypatch):
    spec = importlib.util.spec_from_file_location("l2_prefetch_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.check() == 0  # asserts the touch kernel's sum against jnp.sum
    monkeypatch.setattr(probe, "LAYERS", 1)
    args = probe.inputs()
    # A touch adds 1e-30 x the weight's sum to one element: nothing at bf16.
    plain = np.asarray(probe.chain("attention -> gemv")(*args), np.float32)
    for variant in ("(attention | touch xla) -> gemv", "(attention | touch pallas) -> gemv"):
        np.testing.assert_array_equal(np.asarray(probe.chain(variant)(*args), np.float32), plain)
    np.testing.assert_array_equal(np.asarray(probe.chain("touch xla -> gemv")(*args), np.float32),
                                  np.asarray(probe.chain("gemv")(*args), np.float32))
