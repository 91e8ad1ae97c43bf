#!/usr/bin/env python3
"""Where does a GPU warm-up's host time go before XLA compiles: tracing, or lowering to MLIR?

    python3 experiments/lowering_probe.py                                   # the chain of 4 at two rows
    python3 experiments/lowering_probe.py --tree 6,8,31 --bucket 1
    python3 experiments/lowering_probe.py --unregister-triton-dialect      # as before model/triton_dialect.py

Builds the engine on the target (SmolLM2-135M-Instruct by default) and times, for one iteration
program, its trace and its lowering for CUDA, with the Pallas kernels lowered to Triton as on a GPU
(not interpreted): runs on any machine, a CPU one too, since lowering builds the Triton module and
not its machine code. Both hold the GIL, so they are the part of a warm-up that compiling on a
thread pool cannot overlap; it also counts the Triton kernels lowered by name, and the failed
imports during lowering.

Here (2-core CPU, jax 0.10.2, bf16; medians of three processes), trace + lowering for CUDA: the
chain of 4 at two rows 1.97 + 5.60 s at first, 0.47 + 0.46 s now; the tree (6, 8, 31) at one row
2.89 + 7.83 s, now 0.69 + 0.67 s. What changed: the Triton dialect's module registered where
MLIR's bindings look for it (`model/triton_dialect.py`; without it about 9,000 failed imports of
it a chain program), and the kernels' layer an operand rather than a constant of their block
specs, their calls jitted, so that a program lowers each kernel once rather than once a layer
(75 Triton kernels in a chain program, now 14). BENCHMARKS.md, "Start-up".
"""

from __future__ import annotations

import argparse
import collections
import importlib.abc
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from eagle3_jax import LLM, TreeSpec
from eagle3_jax.config import EngineConfig
from eagle3_jax.model import pallas_attention, pallas_top_k

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from runner_probe import trace_iteration


class FailedImports(importlib.abc.MetaPathFinder):
    """Counts the module names looked up on sys.path (never in sys.modules), finding none itself."""

    def __init__(self):
        self.names = collections.Counter()

    def find_spec(self, name, path, target=None):
        self.names[name] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="target directory (default: the prepared SmolLM2)")
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--tree", default=None, metavar="STEPS,TOPK,TOKENS")
    ap.add_argument("--bucket", type=int, default=2)
    ap.add_argument("--unregister-triton-dialect", action="store_true",
                    help="drop the Triton dialect's module from where MLIR looks (as before triton_dialect.py)")
    a = ap.parse_args()
    tree = TreeSpec(*map(int, a.tree.split(","))) if a.tree else None
    llm = LLM(target=a.target, num_speculative_tokens=a.num_draft, tree=tree, warmup=False, progress=False,
              dtype=jnp.bfloat16, engine_config=EngineConfig(attention="pallas", batch_buckets=(a.bucket,),
                                                             speculation="always"))
    if a.unregister_triton_dialect:
        for name in [n for n in sys.modules if n.endswith(".tt")]:
            del sys.modules[name]
    # The Triton kernels, as on a GPU (off one, the Pallas modules pick the interpreter).
    pallas_attention._interpret = pallas_top_k._interpret = lambda: False
    jax.default_backend = lambda: "gpu"  # pallas_norm's own check
    engine = llm.engine
    cfg = engine.iterate_config(a.bucket)
    start = time.perf_counter()
    traced = trace_iteration(engine.runner, a.bucket, cfg)
    traced_s = time.perf_counter() - start
    imports = FailedImports()
    sys.meta_path.insert(0, imports)
    start = time.perf_counter()
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    lowered_s = time.perf_counter() - start
    sys.meta_path.remove(imports)
    kernels = collections.Counter(name for name in ("eagle3_rope_write_kv", "eagle3_paged_attention",
                                                    "eagle3_attention_combine", "eagle3_add_rms_norm",
                                                    "eagle3_top_k") for _ in range(text.count(f'"{name}')))
    print(f"{'tree ' + a.tree if tree else f'chain K={a.num_draft}'} at bucket {a.bucket}: trace {traced_s:.2f} s, "
          f"lowering for CUDA {lowered_s:.2f} s, module {len(text) / 1e6:.1f} MB")
    print(f"Triton custom calls in the module: {text.count('xla.gpu.triton')}; by name: {dict(kernels)}")
    print(f"failed imports while lowering: {sum(imports.names.values())}; "
          f"most looked up: {imports.names.most_common(3)}")


if __name__ == "__main__":
    main()
