"""What the tests read and write of a ModelRunner beyond what serving asks of it: its slots' pending
proposals and token histories, its cached KV, the device addresses of its buffers, and its programs
traced. Serving never needs these, so they live here, reaching into the runner's own fields
(`_state`, `_pinned`, `_params`, `_draft_params`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from eagle3_jax.runner.runner import ModelRunner
from eagle3_jax.runner.steps import StepConfig, iterate_in_place_step, prefill_step


def set_proposals(runner: ModelRunner, slot: int, drafts: Sequence[int], parents: Sequence[int] | None = None) -> None:
    """Overwrite one slot's pending proposals: the next iteration verifies them. A chain's drafts are
    K target ids; a tree's are its T nodes' target ids, with `parents` [T]: node i+1's parent in the
    verify layout (0 the root, else an earlier node)."""
    s = runner._state.slots
    if (parents is None) != (s.parents is None):
        raise ValueError("parents are given for a tree's proposals, and only for those")
    s = s.replace(drafts=s.drafts.at[slot].set(np.asarray(drafts, np.int32)))
    if parents is not None:
        parents = np.asarray(parents, np.int32)
        if not all(0 <= p <= i for i, p in enumerate(parents)):
            raise ValueError(f"parents {parents.tolist()}: node i+1's parent must be 0 (the root) .. i")
        s = s.replace(parents=s.parents.at[slot].set(parents))
    runner._state = runner._state.replace(slots=s)


def pending_proposals(runner: ModelRunner, slot: int) -> np.ndarray:
    """One slot's pending proposals on the host, target ids [P]: what the next iteration verifies."""
    return np.asarray(runner._state.slots.drafts[slot])


def read_history(runner: ModelRunner, slot: int) -> np.ndarray | None:
    """`slot`'s token history [M] on the host (None: not kept)."""
    history = runner._state.slots.history
    return None if history is None else np.asarray(history[slot])


def read_kv(runner: ModelRunner, block_table: np.ndarray, positions: Sequence[int], draft: bool = False
            ) -> tuple[np.ndarray, np.ndarray]:
    """The target's (or, `draft`, the drafter's) cached keys and values of one row at `positions` [M],
    through its block table [nb] (the scheduler's row of the slot): -> (k, v) [L, M, kvh, hd], on the host."""
    page_size = runner._state.target_kv.k.shape[2]
    positions = np.asarray(positions)
    pages = np.asarray(block_table)[positions // page_size]
    offsets = positions % page_size
    kv = runner._state.draft_kv if draft else runner._state.target_kv
    return np.asarray(kv.k[:, pages, offsets]), np.asarray(kv.v[:, pages, offsets])


def buffer_addresses(runner: ModelRunner) -> list[int]:
    """The device address of every state buffer (they never move while serving)."""
    return [x.unsafe_buffer_pointer() for x in jax.tree.leaves(runner._state)]


def pinned_batch(runner: ModelRunner, slots: np.ndarray, tables: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """The device copies of slots [B] and block tables [B, nb] an iteration reads (`PinnedBatch`)."""
    return runner._pinned.get(slots, tables)


def trace_iteration(runner: ModelRunner, bucket: int, cfg: StepConfig):
    """The fused iteration at `bucket`, traced on padding rows passed as serving passes them
    (`PinnedBatch`): the very program an iteration runs (`.lower()` for its HLO, on any platform)."""
    return iterate_in_place_step(cfg, bucket).trace(runner._params, runner._draft_params, runner._state,
                                                    *pinned_batch(runner, *runner.padding_rows(bucket)), cfg=cfg)


def trace_prefill(runner: ModelRunner, rows: int, size: int, cfg: StepConfig):
    """The prefill program of `rows` x `size` tokens under `cfg`, traced."""
    return prefill_step.trace(runner._params, runner._draft_params, runner._state,
                              *runner._padding_prefill(rows, size), cfg=cfg)
