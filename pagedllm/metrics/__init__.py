"""Serving metrics: the engine core's stats messages (stats.py, which the engine imports to send them) and their
Prometheus exposition with per-request latency (prometheus.py, the server's)."""

__all__ = ["ServerMetrics"]


def __getattr__(name: str):
    # The engine core imports stats.py without loading prometheus_client; the server asks for ServerMetrics.
    if name == "ServerMetrics":
        from pagedllm.metrics.prometheus import ServerMetrics

        return ServerMetrics
    raise AttributeError(name)
