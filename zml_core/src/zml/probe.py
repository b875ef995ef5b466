"""Active probes: what a node says about itself on ``/health`` and ``/metrics``.

The client's own accounting only knows the requests *this process* sent. A node's Prometheus
gauges know everything queued on it, from every client, so the prober merges them into
``NodeState.load`` (the larger of the two wins). Each backend names its gauges differently;
:data:`LOAD_GAUGES` maps a node ``kind`` to its (running, waiting) metric names. Parsing uses
``prometheus_client``'s text parser, never a hand-written one.

A node that answers 404 on ``/metrics`` (llama-cpp-python's server, a plain OpenAI-compatible
proxy) simply has no reported load: zml falls back to client-side accounting, quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx2

from .fleet import Fleet, LoadMark, NodeState

__all__ = ["LOAD_GAUGES", "ProbeResult", "Prober", "health_says_up", "parse_load", "probe_node",
           "probe_node_async"]

log: logging.Logger = logging.getLogger("zml.probe")

LOAD_GAUGES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (("vllm:num_requests_running",), ("vllm:num_requests_waiting",)),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",)),
    "tgi": (("tgi_batch_current_size",), ("tgi_queue_size",)),
    "llamacpp": (("llamacpp:requests_processing",), ("llamacpp:requests_deferred",)),
    "openai": ((), ()),
}
"""Per node kind: the gauge names of (running requests, waiting requests)."""

PROBE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one node."""

    node_id: str
    healthy: bool
    running: int | None = None
    waiting: int | None = None
    error: str | None = None
    mark: LoadMark | None = field(default=None, compare=False)
    """How many of the client's requests on the node had ended when ``/metrics`` was asked
    (see :meth:`zml.fleet.Fleet.record_probe`)."""

    @property
    def load(self) -> int | None:
        """Running + waiting, or None when the node reports no load gauges."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)


def parse_load(kind: str, text: str) -> tuple[int | None, int | None]:
    """(running, waiting) from a Prometheus exposition, summed over label sets.

    Returns None for a gauge the text does not contain (or carries only NaN/Inf samples,
    which say nothing about load).
    """
    from prometheus_client.parser import text_string_to_metric_families

    running_names, waiting_names = LOAD_GAUGES.get(kind, LOAD_GAUGES["vllm"])
    wanted = {name: "running" for name in running_names}
    wanted.update({name: "waiting" for name in waiting_names})
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            which = wanted.get(sample.name)
            if which is not None and math.isfinite(sample.value):
                totals[which] = totals.get(which, 0.0) + sample.value
    running = totals.get("running")
    waiting = totals.get("waiting")
    return (
        None if running is None else int(running),
        None if waiting is None else int(waiting),
    )


def health_says_up(status_code: int) -> bool:
    """Whether a ``/health`` answer with this status says the node is up: any status below
    400, and 404 (the server has no such endpoint, which says nothing against it)."""
    return status_code < 400 or status_code == 404


def _interpret(node: NodeState, health: httpx2.Response | BaseException,
               metrics: httpx2.Response | BaseException | None,
               mark: LoadMark | None = None) -> ProbeResult:
    if isinstance(health, BaseException):
        return ProbeResult(node.id, False, error=f"{type(health).__name__}: {health}")
    healthy = health_says_up(health.status_code)
    running = waiting = None
    if isinstance(metrics, httpx2.Response) and metrics.status_code == 200:
        try:
            running, waiting = parse_load(node.kind, metrics.text)
        except ValueError as exc:
            log.debug("node %s: unparseable /metrics: %s", node.id, exc)
    error = None if healthy else f"/health answered {health.status_code}"
    return ProbeResult(node.id, healthy, running, waiting, error, mark)


_Answer = httpx2.Response | BaseException


def _wants_metrics(node: NodeState, health: _Answer) -> bool:
    """Whether to read ``/metrics`` after this ``/health`` answer (not for a dead node, nor
    for a plain OpenAI-compatible server, which has none)."""
    return not isinstance(health, BaseException) and node.kind != "openai"


def probe_node(http: httpx2.Client, node: NodeState) -> ProbeResult:
    """Probe one node with a sync client."""
    health = _get(http, node.url + "/health")
    if not _wants_metrics(node, health):
        return _interpret(node, health, None)
    mark = node.fleet.load_mark(node)
    return _interpret(node, health, _get(http, node.url + "/metrics"), mark)


async def probe_node_async(http: httpx2.AsyncClient, node: NodeState) -> ProbeResult:
    """Probe one node with an async client."""
    health = await _aget(http, node.url + "/health")
    if not _wants_metrics(node, health):
        return _interpret(node, health, None)
    mark = node.fleet.load_mark(node)
    return _interpret(node, health, await _aget(http, node.url + "/metrics"), mark)


def _get(http: httpx2.Client, url: str) -> _Answer:
    try:
        return http.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx2.HTTPError as exc:
        return exc


async def _aget(http: httpx2.AsyncClient, url: str) -> _Answer:
    try:
        return await http.get(url, timeout=PROBE_TIMEOUT_S)
    except httpx2.HTTPError as exc:
        return exc


def apply(fleet: Fleet, results: Iterable[ProbeResult], now: float) -> None:
    """Feed probe results into fleet state."""
    for result in results:
        fleet.record_probe(fleet.node(result.node_id), now, healthy=result.healthy,
                           reported_load=result.load, mark=result.mark)


class Prober:
    """Probes every node of a fleet periodically, from an asyncio task or a thread.

    ``AsyncClient`` runs one in its event loop by default; a sync ``Client`` starts one in a
    daemon thread with ``client.start_probing()``.
    """

    def __init__(self, fleet: Fleet, interval_s: float = 2.0) -> None:
        self.fleet = fleet
        self.interval_s = interval_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    def probe_all(self, http: httpx2.Client) -> list[ProbeResult]:
        """Probe every node once now (sync) and apply the results."""
        results = [probe_node(http, node) for node in self.fleet]
        apply(self.fleet, results, time.monotonic())
        return results

    async def aprobe_all(self, http: httpx2.AsyncClient) -> list[ProbeResult]:
        """Probe every node once now, concurrently, and apply the results."""
        results = await asyncio.gather(*(probe_node_async(http, n) for n in self.fleet))
        apply(self.fleet, results, time.monotonic())
        return list(results)

    @property
    def running(self) -> bool:
        """Whether async probing is under way: a round, or the wait for the next one."""
        task = self._task
        return self._timer is not None or (task is not None and not task.done())

    def start(self, http: httpx2.AsyncClient) -> None:
        """Start probing in the running event loop (idempotent; in a new loop, it moves there).

        A round is a task; between rounds only a loop timer waits, so a loop closed without
        its shutdown (``run_until_complete`` then ``close``) drops the prober silently, with
        no pending task to be destroyed, unless a round is under way at that moment."""
        loop = asyncio.get_running_loop()
        task = self._task
        if self._loop is loop and (self._timer is not None
                                   or (task is not None and not task.done())):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._loop = loop
        self._timer = None
        self._task = loop.create_task(self._round(http))

    async def _round(self, http: httpx2.AsyncClient) -> None:
        try:
            await self.aprobe_all(http)
        except Exception as exc:  # a prober must never die of one bad answer
            log.warning("zml prober: %s", exc)
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is asyncio.current_task():
            self._task = None
            self._timer = loop.call_later(self.interval_s, self._next_round, http)

    def _next_round(self, http: httpx2.AsyncClient) -> None:
        loop = self._loop
        self._timer = None
        if loop is not None and self._task is None:
            self._task = loop.create_task(self._round(http))

    async def stop(self) -> None:
        """Stop probing: the timer, and the round under way (awaited)."""
        timer, self._timer = self._timer, None
        task, self._task = self._task, None
        self._loop = None
        if timer is not None:
            timer.cancel()
        if task is not None and not task.done() and task.get_loop() is asyncio.get_running_loop():
            task.cancel()  # (a round of a loop closed mid-round stays as it is: it never runs)
            with contextlib.suppress(asyncio.CancelledError):
                await task
