"""What the engine counts and times as it steps (`Engine.stats`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
    """Per-step timings (host: Python work, of which dispatch: inside the calls that enqueue
    programs; device wait: blocked on results) and what the policy ran, per bucket and proposal."""

    steps: int = 0
    iterations: int = 0
    prefill_calls: int = 0  # prefill programs dispatched (several requests' chunks may share one)
    host_s: float = 0.0
    dispatch_s: float = 0.0
    device_wait_s: float = 0.0
    # A step with a row under a grammar (`constrained_steps`): its read of every result in flight
    # before dispatching (device wait included), its pending proposals read with the grammars' forced
    # tokens written in, and its token masks computed.
    constrained_steps: int = 0
    constrained_read_s: float = 0.0
    forced_s: float = 0.0
    mask_s: float = 0.0
    warmup_s: float = 0.0
    speculative_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count
    target_only_iterations: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> count
    proposal_iterations: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # label -> bucket -> count
    preemptions: int = 0
    # Tokens admitted requests had in their KV once prefilled, and those of them found in the prefix cache.
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0

    def count_iteration(self, bucket: int, label: str, speculative: bool) -> None:
        counts = self.speculative_iterations if speculative else self.target_only_iterations
        counts[bucket] = counts.get(bucket, 0) + 1
        by_bucket = self.proposal_iterations.setdefault(label, {})
        by_bucket[bucket] = by_bucket.get(bucket, 0) + 1

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * self.host_s / max(self.steps, 1)

    @property
    def dispatch_ms_per_step(self) -> float:
        return 1e3 * self.dispatch_s / max(self.steps, 1)

    @property
    def device_wait_ms_per_step(self) -> float:
        return 1e3 * self.device_wait_s / max(self.steps, 1)
