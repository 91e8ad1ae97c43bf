"""scripts/serve_load.py on the tiny chat model: the server under 1 and 64 concurrent streams (the
official `openai` client) against the same engine in process, every request answered in full both
ways. The ratio is printed, not asserted: a 2-core machine times nothing reliably."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[1]
ENGINE = "--num-draft 3 --tree none --speculation always --batch-buckets 1,64 --max-num-seqs 64 --max-model-len 128"


@pytest.mark.slow
def test_serve_load_measures_the_server_against_its_engine_in_process(chat_models, tmp_path):
    target, draft = chat_models
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Say {i} in words." for i in range(16)))
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "scripts" / "serve_load.py"), "--target", str(target), "--draft", str(draft),
           "--engine", ENGINE, "--streams", "1,64", "--requests", "8", "--requests-per-stream", "1",
           "--max-tokens", "8",
           "--serve-flags=--engine-process", "--serve-flags=--engine-process --api-server-count 2",
           "--prompt-file", str(prompts), "--start-timeout", "240", "--out-dir", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "serve_load.json").read_text())
    assert [row["streams"] for row in result["in_process"]] == [1, 64]
    # Every request in full: 8 at one stream, one a stream at 64.
    assert [row["tokens"] for row in result["in_process"]] == [8 * 8, 64 * 8]
    assert [s["serve_flags"] for s in result["servers"]] == ["--engine-process",
                                                             "--engine-process --api-server-count 2"]
    for server in result["servers"]:
        assert [row["streams"] for row in server["rows"]] == [1, 64]
        assert [row["server"]["tokens"] for row in server["rows"]] == [8 * 8, 64 * 8]
        for row in server["rows"]:
            assert row["ratio"] > 0 and row["server"]["ttft_p50_ms"] is not None
            assert row["server"]["engine_cpu_share"] >= 0
        assert server["server_metrics"]["speculation"]  # the bucket choices /metrics reports
        # ... and the engine's in process, over the same buckets (speculation "always": the chain at each)
        assert result["in_process_speculation"].keys() == server["server_metrics"]["speculation"].keys()
    assert set(result["in_process_speculation"].values()) == {"chain K=3"}
    assert [len(row["server"]["http_cpu_shares"]) for s in result["servers"] for row in s["rows"]] == [1, 1, 2, 2]
    print(done.stdout[-1500:])
