"""Prometheus metrics under `eagle3_jax:`, with vLLM's names where vLLM has the metric, and those
also under vLLM's own prefix, `vllm:`, so that dashboards built for vLLM read them. Written by the
engine thread only (or, the engine in a process of its own, by the thread reading its records);
prometheus-client makes reading them from the HTTP side safe."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from eagle3_jax.engine.scheduler import RequestMetrics

PREFIX = "eagle3_jax:"
VLLM_PREFIX = "vllm:"
# The metrics vLLM has under these names (counters without their _total), meaning the same here.
VLLM_METRICS = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens", "generation_tokens",
    "request_success", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"})
# Seconds; vLLM's buckets for the same histograms, trimmed.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                         0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str):
        registry = CollectorRegistry()  # ours; /metrics reads `self.registry`: them and their vLLM names
        label = {"labelnames": ["model_name"], "registry": registry}

        def gauge(name, doc, *labels):
            return Gauge(PREFIX + name, doc, labelnames=["model_name", *labels], registry=registry)

        def counter(name, doc, *labels):
            # prometheus-client appends _total itself.
            return Counter(PREFIX + name.removesuffix("_total"), doc, labelnames=["model_name", *labels],
                           registry=registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.").labels(model_name)
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.").labels(model_name)
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV pages in use (1 = all).").labels(model_name)
        self.choice = gauge("speculation_choice", "1 for what each batch bucket runs now, its short "
                            "timing probes aside: a proposal (tree or chain) or target-only.", "bucket", "choice")
        self.model_name = model_name
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens admitted.").labels(model_name)
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.").labels(model_name)
        self.finished = counter("request_success_total", "Requests finished, by reason.", "finished_reason")
        self.drafts = counter("spec_decode_num_drafts_total", "Iterations that verified proposals.").labels(model_name)
        self.draft_tokens = counter("spec_decode_num_draft_tokens_total", "Proposals verified.").labels(model_name)
        self.accepted = counter("spec_decode_num_accepted_tokens_total", "Proposals accepted.").labels(model_name)
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos_total",
                                        "Proposals accepted at each draft position.", "position")
        self.preemptions = counter("num_preemptions_total", "Requests preempted (their KV freed, recomputed "
                                   "on readmission).").labels(model_name)
        self.prefix_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix "
                                      "cache.").labels(model_name)
        self.prefix_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.").labels(
            model_name)
        self.steps = counter("engine_steps_total", "Engine steps run (each an iteration of the running batch, "
                             "with any prefill).").labels(model_name)
        self._engine_totals = (0, 0, 0, 0)  # the engine's preemptions, prefix queries and hits, steps counted so far
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between tokens (an iteration's "
                             "several accepted tokens share its interval).", buckets=TOKEN_LATENCY_BUCKETS,
                             **label).labels(model_name)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
                             buckets=LATENCY_BUCKETS, **label).labels(model_name)
        self._choices: dict[int, str] = {}
        self.registry = CollectorRegistry()
        self.registry.register(WithVllmNames(registry))

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def tokens(self, arrival_time: float, token_time: float, count: int, previous_time: float | None) -> None:
        """`count` new tokens of a request that arrived at `arrival_time`, collected at `token_time`;
        the ones before them at `previous_time` (None: these are its first). Plain times, not the
        request's RequestMetrics: the engine's process sends them each step for every running row."""
        self.generation_tokens.inc(count)
        if previous_time is None:
            self.ttft.observe(token_time - arrival_time)
        else:
            for _ in range(count):
                self.itl.observe((token_time - previous_time) / count)

    def finish(self, finish_reason: str, m: RequestMetrics) -> None:
        self.finished.labels(self.model_name, finish_reason).inc()
        if m.last_token_time is not None:
            self.e2e.observe(m.last_token_time - m.arrival_time)
        self.drafts.inc(m.speculative_iterations)
        self.draft_tokens.inc(m.drafted)
        self.accepted.inc(m.accepted)
        for position, count in enumerate(m.accepted_at):
            self.accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def engine_state(self, running: int, waiting: int, pages_free: int, pages: int, stats=None) -> None:
        """The gauges now; with the engine's `stats` (EngineStats), its cumulative counts since the last call."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(1 - pages_free / pages)
        if stats is not None:
            totals = (stats.preemptions, stats.prefix_queried_tokens, stats.prefix_hit_tokens, stats.steps)
            for counter, now, before in zip((self.preemptions, self.prefix_queries, self.prefix_hits, self.steps),
                                            totals, self._engine_totals):
                counter.inc(max(now - before, 0))  # a stats reset starts the engine's counts again
            self._engine_totals = totals

    def choices(self, table: dict[int, str], labels: list[str]) -> dict[int, str]:
        """Set each bucket's current choice (`labels`: every choice there is); -> the buckets whose
        choice changed, with the new one."""
        for bucket, chosen in table.items():
            for label in labels:
                self.choice.labels(self.model_name, str(bucket), label).set(float(label == chosen))
        changed = {b: c for b, c in table.items() if self._choices.get(b) != c}
        self._choices = dict(table)
        return changed


class WithVllmNames(Collector):
    """`source`'s metrics, those of VLLM_METRICS twice: under VLLM_PREFIX as well (one count, two
    names), read at each scrape."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            yield family
            name = family.name.removeprefix(PREFIX)
            if family.name.startswith(PREFIX) and name in VLLM_METRICS:
                renamed = Metric(VLLM_PREFIX + name, family.documentation, family.type, family.unit)
                renamed.samples = [s._replace(name=VLLM_PREFIX + s.name.removeprefix(PREFIX)) for s in family.samples]
                yield renamed
