"""Prefill packing: the requests prefilling -> this step's prefill calls (`step_calls`). A prompt
longer than the largest chunk bucket (the chunk) prefills in chunks, leading ones and a last one;
every last chunk joins the others of its chunk bucket, up to the largest prefill batch bucket a
call, so a burst of arrivals costs a few prefills, not one per request (BENCHMARKS.md, "Serving
with arrivals").

While rows decode, a step dispatches one call at most before its iteration: the first prefilling
request's next chunk alone, or its last chunk joined by others of its chunk bucket, within
STEP_CHUNKS chunks' padded tokens. So a running stream waits one chunk of a long prompt at most
between two tokens, however long the prompts that arrive (a prompt of n chunks takes n steps), and
a few short prompts still share a call (eight of 128 tokens by default: with one chunk's budget
they would join one a step). With none decoding, a step prefills everything: the prompts' j-th
leading chunks together, up to the largest prefill batch bucket a call, round after round, then
the last chunks (32 prompts of three chunks: 12 calls, not 68; BENCHMARKS.md, "Prefill").

A burst is the exception: where more requests prefill than rows stream (have a token read), a step
dispatches every prefilling request's next chunk, the leading ones sharing calls as a round with
none decoding, then the last ones grouped by chunk bucket. Streams opened at once reach the engine
over a few steps, the first ones decoding already; a call a step would take the rest in eight a
step. Spreading the calls spares the decoding rows no time (each prefill runs once, before some
iteration), it only splits their wait, while each group's first token waits an iteration (the whole
batch's) longer than the group before it and the last group decodes alone at the end. A row whose
first token is not read yet has no gap between tokens to keep short."""

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
        return self.req.tokens[self.start:self.end(largest)]

    def end(self, largest: int) -> int:
        """Where the chunk ends, the next one starts."""
        return min(self.start + largest, self.req.context_len)


def chunks_of(req: Request, largest: int) -> list[PrefillChunk]:
    """The request's chunks not dispatched yet, in order (at admission: from its first token not
    found in the prefix cache)."""
    return [PrefillChunk(req, start) for start in range(req.next_chunk, req.context_len, largest)]


STEP_CHUNKS = 2  # the padded tokens of a step's call of last chunks while rows decode, in chunks


def step_calls(prefilling: Sequence[Request], cfg: ServedConfig, decoding: Sequence[Request]
               ) -> list[list[PrefillChunk]]:
    """The prefill calls a step dispatches, in order, for the requests `prefilling` (admission
    order), the running ones done prefilling `decoding`: with none decoding, every chunk; with
    fewer streaming (a token read) than prefilling, a burst, every request's next chunk; else one
    call at most (module docstring)."""
    largest = cfg.prefill_buckets[-1]
    if not decoding:
        rounds, lasts = collections.defaultdict(list), []  # rounds[j]: each prompt's j-th leading chunk
        for req in prefilling:
            *leading, last = chunks_of(req, largest)
            for j, chunk in enumerate(leading):
                rounds[j].append(chunk)
            lasts.append(last)
        return [call for chunks in rounds.values() for call in group_whole_chunks(chunks, cfg)] + \
            group_last_chunks(lasts, cfg)
    if not prefilling:
        return []
    following = [PrefillChunk(req, req.next_chunk) for req in prefilling]  # each request's next chunk
    leading = [chunk for chunk in following if chunk.end(largest) < chunk.req.context_len]
    lasts = [chunk for chunk in following if chunk.end(largest) == chunk.req.context_len]
    if len(prefilling) > sum(1 for req in decoding if req.output):
        return group_whole_chunks(leading, cfg) + group_last_chunks(lasts, cfg)
    head = following[0]
    if leading and leading[0] is head:
        return [[head]]
    size = _chunk_bucket(head, cfg)
    most = max((rows for rows in cfg.prefill_batch_buckets if rows * size <= STEP_CHUNKS * largest), default=1)
    return [[chunk for chunk in lasts if _chunk_bucket(chunk, cfg) == size][:most]]


def group_whole_chunks(chunks: Sequence[PrefillChunk], cfg: ServedConfig) -> list[list[PrefillChunk]]:
    """Leading chunks (whole: one chunk bucket) grouped into calls, at most the largest prefill batch bucket a call."""
    most = cfg.prefill_batch_buckets[-1]
    return [list(chunks[i:i + most]) for i in range(0, len(chunks), most)]


def group_last_chunks(chunks: Sequence[PrefillChunk], cfg: ServedConfig) -> list[list[PrefillChunk]]:
    """Last chunks grouped into calls: by chunk bucket, at most the largest prefill batch bucket a call."""
    most = cfg.prefill_batch_buckets[-1]
    by_bucket: dict[int, list[PrefillChunk]] = collections.defaultdict(list)
    for chunk in chunks:
        by_bucket[_chunk_bucket(chunk, cfg)].append(chunk)
    return [group[i:i + most] for group in by_bucket.values() for i in range(0, len(group), most)]


def _chunk_bucket(chunk: PrefillChunk, cfg: ServedConfig) -> int:
    return smallest_bucket(cfg.prefill_buckets, len(chunk.tokens(cfg.prefill_buckets[-1])))


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
