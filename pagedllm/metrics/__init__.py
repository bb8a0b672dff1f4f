"""Serving metrics: per-request latency tracking and their Prometheus exposition."""

from pagedllm.metrics.prometheus import ServerMetrics

__all__ = ["ServerMetrics"]
