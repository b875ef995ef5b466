"""Fixtures and helpers shared by the end-to-end tests (real loopback sockets, simulated nodes).

The e2e tests poll a simulated node's counters (it sees a disconnect or finishes its bookkeeping
a moment after the client has its answer), run one body on either client kind, and start small
fleets described by ``[[nodes]]`` tables. Those pieces were copied from file to file; they live
here once. Import the plain functions with ``from tests.e2e.conftest import wait_for, settled``
(the suite runs with ``--import-mode=importlib`` and ``tests`` is a package). The fixtures
(``hostile``, and the per-module ``setup`` made by :func:`fleet_fixture`) need no import.

Every poll has a timeout: it is a safety net so that a regression fails instead of hanging,
never a timed assertion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import pytest

import zml
from tests.e2e.hostile import HostileNode, serving

POLL_S = 0.005
"""How long the polls below sleep between two looks at what they wait for."""

PROD: Mapping[str, Any] = MappingProxyType(
    {"accelerator_chain": ("H100", "MI300X"), "cost_priority": "cost"})
"""The ``prod`` policy of the two-family fleets: H100 first, then MI300X, cheapest node first."""


def two_family_nodes(max_concurrency: int = 4) -> list[dict[str, Any]]:
    """``[[nodes]]`` tables of the usual two-family fleet: ``h100-a`` (H100) and ``mi-a``
    (MI300X), each with ``max_concurrency`` slots. A fresh list on every call."""
    return [
        {"id": "h100-a", "family": "H100", "max_concurrency": max_concurrency},
        {"id": "mi-a", "family": "MI300X", "max_concurrency": max_concurrency},
    ]


# --- polling ----------------------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Block until ``predicate()`` is true; AssertionError naming ``what`` after ``timeout`` s.

    It blocks the calling thread (and so an event loop it is called from: some tests rely on
    that to show that something happened without the loop turning)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL_S)


async def await_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """:func:`wait_for` for async tests: sleeps on the event loop between two looks."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


def settled(node: Any, timeout: float = 15.0) -> Any:
    """The simulated node's stats once every request it received has ended.

    Its counters are updated a moment after the client sees the answer, so they are polled
    until nothing runs or waits and completed + aborted + rejected + dropped equals
    ``requests_total``. The timeout is a safety net: the stats are then returned as they are,
    for the caller's assertions to fail on."""
    deadline = time.monotonic() + timeout
    while True:
        s = node.stats
        ended = s.completed_total + s.aborted_total + s.rejected_total + s.dropped_total
        if (s.running == 0 and s.waiting == 0 and ended == s.requests_total) \
                or time.monotonic() > deadline:
            return s
        time.sleep(POLL_S)


# --- one body on either client ------------------------------------------------------------------


def run_client(kind: str, setup: Any, body: Callable[[Any], Any], **client_kwargs: Any) -> Any:
    """Run ``body(client)`` on a sync Client (``kind == "sync"``), or ``await body(client)`` on
    an AsyncClient that does not probe; return what it returns. Either way the client must
    have released every slot when the body ends, however it ends."""
    if kind == "sync":
        with zml.Client(config=setup.path, **client_kwargs) as client:
            try:
                return body(client)
            finally:
                assert client.fleet.in_flight == 0

    async def main() -> Any:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None,
                                   **client_kwargs) as client:
            try:
                return await body(client)
            finally:
                assert client.fleet.in_flight == 0

    return asyncio.run(main())


async def collect(stream: Any) -> list[Any]:
    """Every chunk of an async stream, read to its end (wrap it in a task to read it aside)."""
    return [c async for c in stream]


# --- fleets -------------------------------------------------------------------------------------


def fleet_fixture(
    nodes: Sequence[Mapping[str, Any]],
    policies: Mapping[str, Mapping[str, Any]] | None,
    time_scale: float = 1.0,
) -> Any:
    """A ``setup`` fixture for a test module: ``setup = fleet_fixture(NODES, POLICIES, 0.05)``
    starts those simulated nodes (``sim_fleet`` of tests/conftest.py) for each test that asks
    for ``setup`` and gives the SimSetup (its ``path`` and ``node(id)``)."""

    @pytest.fixture(name="setup")
    def setup(sim_fleet: Any) -> Any:
        return sim_fleet(nodes, policies, time_scale=time_scale)

    return setup


@pytest.fixture
def hostile() -> Iterator[HostileNode]:
    """A hostile node on a free loopback port; ``hostile.url("keepalive")`` is one of its nodes."""
    with serving() as node:
        yield node
