"""scripts/serve_arrivals.py's own logic, without an engine: the arrival schedule and the latency
figures it reads from the requests' metrics."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from eagle3_jax import SamplingParams
from eagle3_jax.bench.phases import request_latencies
from eagle3_jax.engine.scheduler import Request, RequestMetrics

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_arrivals.py"


@pytest.fixture(scope="module")
def serve_arrivals():
    spec = importlib.util.spec_from_file_location("serve_arrivals", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_poisson_arrivals(serve_arrivals):
    arrivals = serve_arrivals.poisson_arrivals(20_000, 8.0, seed=3)
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    assert np.mean(np.diff(arrivals)) == pytest.approx(1 / 8, rel=0.03)  # mean gap 1 / rate
    np.testing.assert_array_equal(arrivals, serve_arrivals.poisson_arrivals(20_000, 8.0, seed=3))  # seeded
    # Every rate draws the same gaps, scaled: a slower rate is the same schedule stretched.
    np.testing.assert_allclose(
        serve_arrivals.poisson_arrivals(5, 2.0, 0), 4 * serve_arrivals.poisson_arrivals(5, 8.0, 0)
    )
    np.testing.assert_array_equal(serve_arrivals.poisson_arrivals(4, math.inf, 0), np.zeros(4))
    assert serve_arrivals.rate_label(math.inf) == "all at t=0" and serve_arrivals.rate_label(2.0) == "2/s"


def test_latencies_from_request_metrics(serve_arrivals):
    def request(arrival, first, last, tokens):
        metrics = RequestMetrics(arrival_time=arrival, first_token_time=first, last_token_time=last)
        return Request(
            id=0, prompt=[1], params=SamplingParams(), max_tokens=8, metrics=metrics, output=list(range(tokens))
        )

    # TTFT: arrival -> first token, none before it; TPOT: (last - first) / (tokens - 1), none for a
    # one-token reply.
    ttft, tpot = request_latencies([request(1.0, 1.5, 3.5, 5), request(2.0, 2.1, 2.1, 1), request(3.0, None, None, 0)])
    assert ttft == pytest.approx([0.5, 0.1]) and tpot == pytest.approx([0.5])
    assert serve_arrivals.percentile_ms([0.1, 0.2, 0.3], 50) == pytest.approx(200.0)
    assert math.isnan(serve_arrivals.percentile_ms([], 90))
