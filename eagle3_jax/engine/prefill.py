"""Prefill packing: the requests admitted in one step -> prefill calls. A prompt longer than the
largest chunk bucket prefills its leading chunks a call each; every last chunk joins the others of
its chunk bucket, up to the largest prefill batch bucket a call, so a burst of arrivals costs a few
prefills, not one per request (BENCHMARKS.md, "Serving with arrivals")."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from eagle3_jax.config import ServedConfig, smallest_bucket
from eagle3_jax.engine.scheduler import Request
from eagle3_jax.runner.runner import PADDING_PARAMS, PrefillInputs
from eagle3_jax.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Chunk [start, start + the largest chunk bucket) of what a request's prefill writes (its
    prompt; resumed, its generated tokens too but the last)."""

    req: Request
    start: int

    def tokens(self, largest: int) -> list[int]:
        return self.req.tokens[self.start:min(self.start + largest, self.req.context_len)]


def chunks_of(req: Request, largest: int) -> list[PrefillChunk]:
    """The request's chunks in order, from its first token not found in the prefix cache."""
    return [PrefillChunk(req, start) for start in range(req.num_cached, req.context_len, largest)]


def group_last_chunks(chunks: Sequence[PrefillChunk], cfg: ServedConfig) -> list[list[PrefillChunk]]:
    """Last chunks grouped into calls: by chunk bucket, at most the largest prefill batch bucket a call."""
    largest, most = cfg.prefill_buckets[-1], cfg.prefill_batch_buckets[-1]
    by_bucket: dict[int, list[PrefillChunk]] = collections.defaultdict(list)
    for chunk in chunks:
        by_bucket[smallest_bucket(cfg.prefill_buckets, len(chunk.tokens(largest)))].append(chunk)
    return [group[i:i + most] for group in by_bucket.values() for i in range(0, len(group), most)]


def prefill_call(chunks: Sequence[PrefillChunk], cfg: ServedConfig, block_tables: np.ndarray
                 ) -> tuple[PrefillInputs, list[SamplingParams], list[int | None]]:
    """One prefill call over `chunks`, a row each, padded to the smallest batch bucket and chunk
    bucket that hold them: -> (its inputs, each row's sampling params, each row's seed).
    block_tables: the scheduler's [S, nb], by slot."""
    rows = smallest_bucket(cfg.prefill_batch_buckets, len(chunks))
    largest = cfg.prefill_buckets[-1]
    pieces = [c.tokens(largest) for c in chunks]
    size = smallest_bucket(cfg.prefill_buckets, max(map(len, pieces)))
    inputs = PrefillInputs.padding(rows, size, cfg.pool.max_blocks_per_seq)
    for i, (chunk, piece) in enumerate(zip(chunks, pieces)):
        known, start = chunk.req.tokens, chunk.start
        following = known[start + 1:start + len(piece) + 1]  # the ids shifted left by one
        inputs.next_tokens[i] = 0  # a real row: no padding marker
        inputs.tokens[i, :len(piece)] = piece
        inputs.next_tokens[i, :len(following)] = following
        if start + len(piece) == len(known):
            inputs.next_tokens[i, len(piece) - 1] = -1  # the first generated token goes here
        inputs.num_valid[i], inputs.start[i] = len(piece), start
        inputs.slot[i], inputs.block_table[i] = chunk.req.slot, block_tables[chunk.req.slot]
        inputs.num_generated[i] = max(len(chunk.req.output), 1)
    params = [c.req.params for c in chunks] + [PADDING_PARAMS] * (rows - len(chunks))
    seeds = [c.req.seed for c in chunks] + [0] * (rows - len(chunks))
    return inputs, params, seeds
