"""`eagle3-jax bench`: target-only vs EAGLE-3, and our engine vs a Hugging Face peer, in one run.

Four phases, each selectable with `--only` (the first three run by default):

  smollm2  The engine end to end on MT-bench first turns (LLM.encode applies the chat template; the
           harness then runs the Engine.step loop that LLM.generate runs, timestamping each step):
           target-only vs EAGLE-3 (one or more K) at each batch size. Batch b = b prompts submitted
           together; a batch smaller than --prompts runs several rounds. The iterate step timed
           alone gives the device time per iteration, hence the device idle fraction of the loop.
  8b       Llama-3.1-8B shapes (or --step-model llama-3.3-70b, or a checkpoint's) with random weights:
           the compiled step functions timed directly on synthetic slot state (no tokenizer, no
           scheduler): target-only decode (K=0), the EAGLE-3 iteration (K) and the verify forward
           alone (B x (K+1) tokens). With --tp N, under tensor parallelism over N devices: every
           target weight and KV page is created already sharded, the drafter replicated (as the
           engine holds it), and the floor adds the target's all-reduces.
  peer     Hugging Face transformers (static cache, torch.compile) on the same SmolLM2 weights and
           prompt tokens, and on the 8B shapes with random weights, in a child process that runs
           before JAX takes the GPU's memory.
  tp       (needs --tp N >= 2) greedy tokens through the real engine (LLM(tensor_parallel_size=N))
           at TP=N against TP=1, on a small random f32 Llama and a random 70B-layout drafter.

With --tp N and the 8b or tp phase, the all-reduce across the N devices is measured first (a chain
of psums in one program, on a large array and on each decode-sized activation). --allreduce picks
XLA's all-reduce implementation for the whole run (default, one-shot, nvshmem: options.ALLREDUCE_FLAGS),
set in XLA_FLAGS before jax starts, once a child process has run a psum under it.

Every time has its floor: the larger of bytes / memory bandwidth and FLOPs / bf16 matmul rate, for
the fewest bytes and FLOPs the call needs, with both ceilings measured in the same run; under
tensor parallelism, per device, plus the all-reduced bytes over the measured all-reduce bandwidth. Output:
bench.md (the tables, also printed), bench.json (every figure) and bench.png in --out-dir.

Layout: `options` (flags -> Options), `costs` (measured ceilings; bytes and FLOPs -> floors),
`collectives` (tensor parallelism: the all-reduce, sharded random weights, HLO collectives),
`harness` (model configs, engine sizing, compiling, synthetic rows, timing), `phases` (smollm2, 8b,
tp), `peer` (Hugging Face in a child process), `report` (tables, ratios, plot), `main` (the run).
"""

from eagle3_jax.bench.collectives import hlo_collectives
from eagle3_jax.bench.common import Column, Result, markdown_table
from eagle3_jax.bench.costs import (
           Ceilings,
           Cost,
           LinkCeilings,
           draft_cost,
           iteration_cost,
           target_cost,
)
from eagle3_jax.bench.harness import draft_config_like, hf_config_dict
from eagle3_jax.bench.main import main, run, write_report
from eagle3_jax.bench.options import Options, build_parser
from eagle3_jax.presets import llama31_8b, llama33_70b

__all__ = ["Ceilings", "Column", "Cost", "LinkCeilings", "Options", "Result", "build_parser", "draft_config_like",
           "draft_cost", "hf_config_dict", "hlo_collectives", "iteration_cost", "llama31_8b", "llama33_70b", "main",
           "markdown_table", "run", "target_cost", "write_report"]
