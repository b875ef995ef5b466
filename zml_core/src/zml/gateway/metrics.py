"""``GET /metrics``: the gateway's Prometheus metrics, in a registry of each app's own.

Each gateway app owns a ``prometheus_client.CollectorRegistry`` (never the process-wide default
one), so that two apps in one process, as in tests, count apart. Node gauges are read from the
client's fleet state when scraped, not kept up to date per request.

=========================================  =========  ======================================
metric                                     type       labels
=========================================  =========  ======================================
``zml_gateway_requests_total``             counter    policy, family, node, outcome
``zml_gateway_ttft_seconds``               histogram  policy, family (streams: first chunk)
``zml_gateway_request_duration_seconds``   histogram  policy, family, stream
``zml_gateway_requests_in_flight``         gauge
``zml_gateway_node_health``                gauge      node, family (0..1)
``zml_gateway_node_circuit_open``          gauge      node, family (1 = open)
``zml_gateway_node_in_flight``             gauge      node, family (this process's requests)
=========================================  =========  ======================================

``outcome`` is ``ok``, ``cancelled`` (the client went away), ``routing_error``,
``invalid_request``, ``unauthorized``, ``forbidden``, ``node_error``, ``timeout``,
``stream_error`` (a stream broke after its first chunk) or ``error``. ``policy`` is empty for
a request without a policy or refused before one was chosen (a client's header value is never
a label: label values stay bounded by the configuration), ``family`` and ``node`` when no node
was chosen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "GatewayMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _FleetCollector(Collector):
    """Node gauges from ``client.fleet.status()`` at scrape time."""

    def __init__(self, status: Callable[[], list[dict[str, Any]]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        health = GaugeMetricFamily("zml_gateway_node_health",
                                   "Node health score as zml sees it (0..1).",
                                   labels=["node", "family"])
        circuit = GaugeMetricFamily("zml_gateway_node_circuit_open",
                                    "1 when the node's circuit breaker is open.",
                                    labels=["node", "family"])
        in_flight = GaugeMetricFamily("zml_gateway_node_in_flight",
                                      "Requests this gateway process has on the node.",
                                      labels=["node", "family"])
        for node in self._status():
            labels = [str(node["id"]), str(node["family"])]
            health.add_metric(labels, float(node["health"]))
            circuit.add_metric(labels, 1.0 if node["circuit"] == "open" else 0.0)
            in_flight.add_metric(labels, float(node["in_flight"]))
        yield health
        yield circuit
        yield in_flight


class GatewayMetrics:
    """The metrics of one gateway app (its own CollectorRegistry)."""

    def __init__(self, fleet_status: Callable[[], list[dict[str, Any]]]) -> None:
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.requests: Counter = Counter(
            "zml_gateway_requests", "Chat completion requests by policy, family, node, outcome.",
            ["policy", "family", "node", "outcome"], registry=self.registry)
        self.ttft: Histogram = Histogram(
            "zml_gateway_ttft_seconds", "Time from request to the first streamed chunk sent.",
            ["policy", "family"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.duration: Histogram = Histogram(
            "zml_gateway_request_duration_seconds", "Time from request to its last byte sent.",
            ["policy", "family", "stream"], buckets=_DURATION_BUCKETS, registry=self.registry)
        self.in_flight: Gauge = Gauge(
            "zml_gateway_requests_in_flight", "Chat completion requests being served.",
            registry=self.registry)
        self.registry.register(_FleetCollector(fleet_status))

    def finished(self, policy: str | None, family: str, node: str, outcome: str,
                 stream: bool, seconds: float) -> None:
        """Count one finished request."""
        name = policy or ""
        self.requests.labels(name, family, node, outcome).inc()
        if outcome == "ok":
            self.duration.labels(name, family, "true" if stream else "false").observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
