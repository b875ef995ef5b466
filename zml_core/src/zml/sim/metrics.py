"""Prometheus exposition of a simulated node, under the metric names of the backend it imitates.

zml's fleet probes read queue depth and in-flight counts from `/metrics`, and each serving
stack names them differently; the simulated node answers with the names of its `kind` so the
probes are exercised as against the real thing:

| kind     | running                                 | waiting                                |
| -------- | --------------------------------------- | -------------------------------------- |
| vllm     | `vllm:num_requests_running{model_name}` | `vllm:num_requests_waiting{model_name}`|
| sglang   | `sglang:num_running_reqs{model_name}`   | `sglang:num_queue_reqs{model_name}`    |
| tgi      | `tgi_batch_current_size`                | `tgi_queue_size`                       |
| llamacpp | `llamacpp:requests_processing`          | `llamacpp:requests_deferred`           |
| openai   | (no /metrics: 404)                      |                                        |

Every kind also exposes `zml_sim_requests_total`, `zml_sim_requests_aborted_total` and
`zml_sim_requests_running_peak`. Values are read from the node at scrape time by a custom
collector, so serving a request never touches prometheus_client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "LoadSnapshot", "MetricsExporter"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content-Type of the exposition."""

_LABELLED = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs"),
}
_UNLABELLED = {
    "tgi": ("tgi_batch_current_size", "tgi_queue_size"),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred"),
}


@dataclass(frozen=True)
class LoadSnapshot:
    """What a scrape reports: per-model load and the node's counters."""

    running: Mapping[str, int]
    waiting: Mapping[str, int]
    requests_total: int
    aborted_total: int
    running_peak: int


class _NodeCollector(Collector):
    def __init__(self, kind: str, snapshot: Callable[[], LoadSnapshot]) -> None:
        self._kind = kind
        self._snapshot = snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._snapshot()
        if self._kind in _LABELLED:
            running_name, waiting_name = _LABELLED[self._kind]
            running = GaugeMetricFamily(running_name, "Requests generating now.", labels=["model_name"])
            waiting = GaugeMetricFamily(waiting_name, "Requests waiting for a slot.", labels=["model_name"])
            for model, value in snap.running.items():
                running.add_metric([model], value)
            for model, value in snap.waiting.items():
                waiting.add_metric([model], value)
            yield running
            yield waiting
        elif self._kind in _UNLABELLED:
            running_name, waiting_name = _UNLABELLED[self._kind]
            yield GaugeMetricFamily(running_name, "Requests generating now.", value=sum(snap.running.values()))
            yield GaugeMetricFamily(waiting_name, "Requests waiting for a slot.", value=sum(snap.waiting.values()))
        yield CounterMetricFamily(
            "zml_sim_requests", "Chat requests received.", value=snap.requests_total
        )
        yield CounterMetricFamily(
            "zml_sim_requests_aborted", "Requests dropped because the client went away.", value=snap.aborted_total
        )
        yield GaugeMetricFamily(
            "zml_sim_requests_running_peak",
            "Most requests generating at once since start or the last reset.",
            value=snap.running_peak,
        )


class MetricsExporter:
    """A per-node registry rendering the node's load in the text format."""

    def __init__(self, kind: str, snapshot: Callable[[], LoadSnapshot]) -> None:
        self.registry: CollectorRegistry = CollectorRegistry(auto_describe=False)
        self.registry.register(_NodeCollector(kind, snapshot))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
