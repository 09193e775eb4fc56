"""Prometheus metrics of one server, in its own registry (several servers may share a process in
tests). Names follow SGLang's, under the moelora: prefix. The engine thread updates them; the LoRA
manager's counters are read when scraped."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from moelora.engine import LoRAStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, lora_stats: LoRAStats):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("moelora:num_running_reqs", "Requests in the running batch", registry=r)
        self.waiting = Gauge("moelora:num_queue_reqs", "Requests waiting to be scheduled", registry=r)
        self.prompt_tokens = Counter("moelora:prompt_tokens", "Prompt tokens of requests that started", registry=r)
        self.generation_tokens = Counter("moelora:generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("moelora:requests_finished", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.ttft = Histogram("moelora:time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("moelora:inter_token_latency_seconds", "Between consecutive tokens of a request",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_LoRACollector(lora_stats))

    def expose(self, prefix: str, read: Callable[[], dict[str, float]]) -> None:
        """Counters read when scraped: prefix + each name of read()'s (moelora/engine/step_stats.py and
        the engine loop's ThreadStats say what they count)."""
        self.registry.register(_CountersCollector(prefix, read))

    def set_queues(self, running: int, waiting: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)

    def first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.ttft.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def next_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.inc(tokens)

    def finished(self, reason: str | None) -> None:
        self.requests.labels(finish_reason=reason or "unknown").inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _LoRACollector(Collector):
    """The LoRA manager's slot counters, as counters."""

    def __init__(self, stats: LoRAStats):
        self.stats = stats

    def collect(self):
        for name, doc in [("slot_hits", "Adapters of a step already in a GPU slot"),
                          ("slot_loads", "Adapters copied from host memory into a GPU slot"),
                          ("slot_evictions", "GPU slots taken over from another adapter"),
                          ("disk_loads", "Adapters read and validated from disk")]:
            yield CounterMetricFamily(f"moelora:lora_{name}", doc, value=getattr(self.stats, name))


class _CountersCollector(Collector):
    """Counters kept elsewhere (plain numbers the engine thread adds to), as counters."""

    def __init__(self, prefix: str, read: Callable[[], dict[str, float]]):
        self.prefix, self.read = prefix, read

    def collect(self):
        for name, value in self.read().items():
            yield CounterMetricFamily(f"{self.prefix}{name}", f"{name} (see the module that counts it)", value=value)
