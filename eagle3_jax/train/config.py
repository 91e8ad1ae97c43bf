"""`TrainConfig`: everything `train_drafter` is told besides its target and output directories,
checked when made, so a bad value is named before any data or model loads."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3_jax.config import ConfigError
from eagle3_jax.train.objective import TTT_STEPS

if TYPE_CHECKING:
    from eagle3_jax.train.regenerate import RegenerateSpec

# What early stopping watches: name -> (the evaluation's key, "min" or "max" is better).
STOP_METRICS = {"loss": ("loss", "min"), "accept": ("accept_length", "max"), "walk": ("walk_length", "max")}
INITS = ("target", "head", "random")  # or a drafter directory
DTYPES = ("auto", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How `train_drafter` trains a drafter. draft_vocab_size, intermediate_size: None takes the
    default or the `init` drafter's (narrower vocabulary: `narrow_vocab`; wider MLP: `widen_mlp`).
    lr: the peak. reach_top_k: objective.py's (0: every base). length_buckets: row lengths batches
    are grouped by (None: seq_len). time_budget_s: run as many steps as fit. sharegpt None and
    mtbench "auto": fetched. data_cache: npz files read if present, else written. regen: train on
    the target's own replies. ckpt_every: steps between checkpoints, each with a held-out
    evaluation. patience: evaluations without improvement before stopping (0: never)."""

    draft_vocab_size: int | None = None
    intermediate_size: int | None = None
    init: str = "target"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 2048
    lr: float = 1e-3
    warmup_frac: float = 0.03
    ttt_steps: int = TTT_STEPS
    reach_top_k: int = 0
    seed: int = 0
    length_buckets: tuple[int, ...] | None = None
    time_budget_s: float | None = None
    dtype: str = "auto"
    sharegpt: str | Path | None = None
    mtbench: str | Path | None = "auto"
    max_conversations: int | None = None
    data_cache: str | Path | Sequence[str | Path] | None = None
    regen: RegenerateSpec | None = None
    ckpt_dir: str | Path | None = None
    log_dir: str | Path | None = None
    ckpt_every: int = 500
    eval_rows: int = 64
    patience: int = 0
    stop_metric: str = "loss"
    min_delta: float = 0.0
    progress: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "seq_len", "ttt_steps", "ckpt_every"):
            _at_least(self, name, 1)
        for name in ("reach_top_k", "seed", "eval_rows", "patience"):
            _at_least(self, name, 0)
        for name in ("draft_vocab_size", "intermediate_size", "max_conversations"):
            if getattr(self, name) is not None:
                _at_least(self, name, 1)
        if not self.lr >= 0:
            raise ConfigError(f"train config: lr must be 0 or more, got {self.lr}")
        if not 0 <= self.warmup_frac < 1:
            raise ConfigError(f"train config: warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if not self.min_delta >= 0:
            raise ConfigError(f"train config: min_delta must be 0 or more, got {self.min_delta}")
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ConfigError(f"train config: time_budget_s must be positive seconds, got {self.time_budget_s}")
        if self.stop_metric not in STOP_METRICS:
            raise ConfigError(f"train config: stop_metric must be one of {', '.join(STOP_METRICS)}, got "
                              f"{self.stop_metric!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"train config: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.length_buckets is not None and (not self.length_buckets or min(self.length_buckets) < 1):
            raise ConfigError(f"train config: length_buckets must be positive lengths, got {self.length_buckets}")


def _at_least(config: TrainConfig, name: str, least: int) -> None:
    value = getattr(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"train config: {name} must be an integer >= {least}, got {value!r}")
