"""Prometheus metrics of the Responses API's store: entries, bytes, evictions."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ResponseStoreMetrics:
    """Registered on a server's registry; the store reports through `record_store` after each change."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        labels = ["model_name"]
        self.entries = Gauge("pagedllm_responses_store_entries", "Responses held by the Responses API's store",
                             labelnames=labels, registry=registry).labels(model_name)
        self.bytes = Gauge("pagedllm_responses_store_bytes", "Bytes (as JSON) the Responses API's store holds",
                           labelnames=labels, registry=registry).labels(model_name)
        self.evictions = Counter("pagedllm_responses_store_evictions", "Stored responses evicted to keep the store "
                                 "within its bounds (least recently used first)", labelnames=labels,
                                 registry=registry).labels(model_name)
        self._num_evicted = 0

    def record_store(self, num_entries: int, num_bytes: int, num_evicted: int) -> None:
        self.entries.set(num_entries)
        self.bytes.set(num_bytes)
        if num_evicted > self._num_evicted:
            self.evictions.inc(num_evicted - self._num_evicted)
            self._num_evicted = num_evicted
