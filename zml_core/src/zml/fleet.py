"""Live state of the fleet: reservations, load, latency estimates, health, circuit breakers.

Routing decides from this state; dispatch changes it. Three rules keep it honest:

* A slot is **reserved at decision time**, under the fleet's lock, before any I/O: two tasks
  (or threads, or clients sharing the fleet) can never both take a node's last slot. The
  reservation is released exactly once, on every path (success, error, cancellation).
* Node state **belongs to one Fleet** (and so to the client that owns it): two clients share
  capacity accounting only when they are handed the same Fleet object on purpose
  (``Client(fleet=other.fleet)``); nothing is shared by accident, and nothing lives at module
  level.
* Observations are cheap EWMAs, updated when a call ends: the time to first token from
  streamed calls only (a whole answer's first token is never seen, so its time says nothing
  of it), the service time from every call; a node's ``load`` is the larger of the client's
  own reservations and what the node last reported on ``/metrics``.

Health score (0..1): an EWMA of call outcomes (success 1, failure 0, weight ``HEALTH_ALPHA``)
and of probe results; after a failure it recovers linearly without traffic, at a rate of 1 per
``HEALTH_RECOVERY_S`` (so back to 1 within ``HEALTH_RECOVERY_S``), so a node skipped for low
health is tried again later.

Priors (``family_prior``): until a node's time to first token is observed, routing predicts
it from the family's profile, the idle figures of the simulated node model
(``zml.sim.profiles``): a fixed part ``ttft_ms`` and a prefill throughput
``prefill_tokens_per_s``. ``FAMILY_PRIORS`` holds them per built-in family (a copy, so that
the core does not import the simulator; a test keeps the two equal), an unknown family gets
the A100's, and ``[accelerators.NAME.sim]`` ``ttft_ms`` / ``prefill_tokens_per_s`` override
them. They are optimistic on purpose (an idle node, no network): an unobserved node ranks with
or ahead of observed ones, so it is tried rather than starved.

Circuit breaker, per node: ``CIRCUIT_FAILURES`` consecutive failures open it for
``CIRCUIT_COOLDOWN_S``; then it is half-open and admits one trial request; success closes it,
failure opens it again (``NodeState.circuit_at(now)`` and ``Fleet.status`` show the state at a
time: ``half_open`` from the end of the cooldown).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .config import Registry
from .ledger import SlotLedger
from .node_state import LoadMark, NodeState
from .node_urls import redact_url
from .routing_index import FamilyIndex
from .strategies import StrategyState

__all__ = [
    "CIRCUIT_COOLDOWN_S",
    "CIRCUIT_FAILURES",
    "DEFAULT_PRIOR",
    "EWMA_ALPHA",
    "FAMILY_PRIORS",
    "HEALTH_ALPHA",
    "HEALTH_RECOVERY_S",
    "Fleet",
    "LoadMark",
    "NodeState",
    "Reservation",
    "report_load",
]

EWMA_ALPHA = 0.2
HEALTH_ALPHA = 0.3
HEALTH_RECOVERY_S = 30.0
CIRCUIT_FAILURES = 5
CIRCUIT_COOLDOWN_S = 10.0

FAMILY_PRIORS: Mapping[str, tuple[float, float]] = MappingProxyType({
    "H100": (10.0, 27712.0),
    "H100_PCIe": (10.0, 21183.0),
    "MI300X": (10.0, 36633.0),
    "A100": (10.0, 8742.0),
    "L4": (10.0, 3390.0),
    "CPU": (20.0, 714.0),
    "H200": (10.0, 27712.0),
    "B200": (10.0, 63045.0),
    "L40S": (10.0, 10143.0),
})
"""``(ttft_ms, prefill_tokens_per_s)`` per built-in family (the profiles of zml.sim)."""
DEFAULT_PRIOR: tuple[float, float] = FAMILY_PRIORS["A100"]
"""The prior of a family that is not in ``FAMILY_PRIORS``."""
_plugin_log = logging.getLogger("zml.plugins")

_LOWER_PRIORS = MappingProxyType({k.lower(): v for k, v in FAMILY_PRIORS.items()})

@dataclass
class Reservation:
    """A slot taken on a node for one attempt; :meth:`Fleet.release` gives it back once.

    ``lease_id`` is set once a cross-process ledger (see :mod:`zml.ledger`) granted a lease.
    """

    node: NodeState
    taken_at: float
    trial: bool = False
    released: bool = False
    lease_id: str | None = None
    prompt_tokens: int = 0
    """The request's prompt size, counted in the node's ``tokens_in_flight`` while held."""
    prefilling: bool = False
    """True until the attempt's first token: ``prompt_tokens`` count in ``prefill_tokens``."""


def report_load(node: NodeState, now: float, reported_load: int,
                mark: LoadMark | None = None) -> None:
    """A load report that says nothing about liveness (a shared ledger's lease count, say):
    :meth:`Fleet.report_load` on the fleet ``node`` belongs to."""
    node.fleet.report_load(node, now, reported_load, mark)


class Fleet:
    """The nodes of one registry, indexed for routing (satisfies ``routing.FleetView``)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.lock: threading.RLock = threading.RLock()
        """Guards every decision and state change on this fleet's nodes: decisions take
        microseconds, and one lock is what makes "never oversubscribe" hold across threads."""
        self._waiters: list[Callable[[], None]] = []
        self._nodes: dict[str, NodeState] = {}
        self._index: dict[tuple[str, str], list[NodeState]] = {}
        self._serving: dict[str, list[NodeState]] = {}
        for cfg in registry.nodes:
            state = NodeState(cfg, self)
            state.tokens_in_flight = 0  # prompt tokens of this client's requests in flight
            state.prefill_tokens = 0  # ... of those still waiting for their first token
            self._nodes[cfg.id] = state
            for model in cfg.models:
                self._index.setdefault((model, cfg.family), []).append(state)
                self._serving.setdefault(model, []).append(state)
        self._families = tuple(registry.families)
        self._priors = {name: _prior(name, acc) for name, acc in registry.families.items()}
        self._strategy_states: dict[str, StrategyState] = {}
        # Whole-answer attempts still counted as prefilling: (predicted first token, seq, r).
        self._prefill_due: list[tuple[float, int, Reservation]] = []
        self._prefill_seq = itertools.count()
        # The routing index (zml.routing_index): one FamilyIndex per (model, family), and for
        # each node the (index, position) pairs to bring up to date when its state changes.
        self._family_indexes: dict[tuple[str, str], FamilyIndex] = {}
        self._memberships: dict[str, list[tuple[FamilyIndex, int]]] = {
            n.id: [] for n in self._nodes.values()
        }
        for (model, family), members in self._index.items():
            ttft, tps = self.family_prior(family)
            ix = FamilyIndex(members, ttft, tps)
            self._family_indexes[(model, family)] = ix
            for pos, member in enumerate(members):
                self._memberships[member.id].append((ix, pos))
        self._costs = {name: acc.cost_per_hour for name, acc in registry.families.items()}
        self._degraded: set[NodeState] = set()
        self._empty: tuple[NodeState, ...] = ()
        self.ledger: SlotLedger | None = None
        """A cross-process slot ledger (set by a shared-state plugin), or None."""
        self._ledger_reported = False

    # --- capacity notifications ------------------------------------------------------------

    def add_capacity_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) whenever a slot on this fleet may have freed."""
        with self.lock:
            self._waiters.append(callback)

    def remove_capacity_listener(self, callback: Callable[[], None]) -> None:
        """Stop calling ``callback`` (no error if it was already removed)."""
        with self.lock, contextlib.suppress(ValueError):
            self._waiters.remove(callback)

    def notify_capacity(self) -> None:
        """Tell the listeners that capacity may have freed (each decides whom to wake)."""
        with self.lock:
            listeners = tuple(self._waiters)
        for wake in listeners:
            wake()

    def report_load(self, node: NodeState, now: float, reported_load: int,
                    mark: LoadMark | None = None) -> None:
        """Merge a load report that says nothing about liveness (a shared ledger's lease
        count, say) into ``node.load``; wake queued requests when the load went down. (A
        probe's report goes through :meth:`record_probe`, which also feeds health.) ``mark``:
        as for :meth:`record_probe`, taken before the count was read."""
        with self.lock:
            freed = self._merge_report(node, now, reported_load, mark)
        if freed:
            self.notify_capacity()

    def _merge_report(self, node: NodeState, now: float, reported_load: int | None,
                      mark: LoadMark | None) -> bool:
        """Take a load report (call with the lock held); True if the node's load went down."""
        before = node.load
        if mark is not None and reported_load is not None:
            reported_load = max(0, reported_load - (node.released - mark.released))
        node.reported_load = reported_load
        node.reported_at = now
        node._update_load()
        self._touch(node)
        return node.load < before

    # --- routing.FleetView ------------------------------------------------------------------

    def families(self) -> Sequence[str]:
        """Accelerator families in registry order."""
        return self._families

    def family_cost(self, family: str) -> float | None:
        """The family's ``cost_per_hour``, or None when not configured."""
        return self._costs.get(family)

    def nodes_for(self, model: str, family: str) -> Sequence[NodeState]:
        """Nodes of ``family`` serving ``model`` (an index lookup)."""
        return self._index.get((model, family), self._empty)

    def family_index(self, model: str, family: str) -> FamilyIndex | None:
        """The routing index of ``family``'s nodes serving ``model`` (None: none serve it)."""
        return self._family_indexes.get((model, family))

    def _touch(self, node: NodeState) -> None:
        # Bring the routing index up to date with ``node`` (callers hold the lock).
        for ix, pos in self._memberships[node.id]:
            ix.update(pos)

    def family_prior(self, family: str) -> tuple[float, float | None]:
        """``(ttft_ms, prefill_tokens_per_s)`` routing assumes for the family (module docs)."""
        prior = self._priors.get(family)
        if prior is None:
            prior = _prior(family, None)
        return prior

    def serving(self, model: str) -> Sequence[NodeState]:
        """Every node serving ``model``, in registry order (the baseline strategies' pool)."""
        return self._serving.get(model, self._empty)

    def strategy_state(self, name: str) -> StrategyState:
        """The memory of baseline strategy ``name`` on this fleet (round-robin's cursor)."""
        state = self._strategy_states.get(name)
        if state is None:
            state = self._strategy_states[name] = StrategyState()
        return state

    # --- queries ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[NodeState]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, node_id: str) -> NodeState:
        """The node with this id (KeyError when unknown)."""
        return self._nodes[node_id]

    def serves(self, model: str) -> bool:
        """Whether any node of the registry serves ``model``."""
        return any((model, f) in self._index for f in self._families)

    @property
    def in_flight(self) -> int:
        """Requests this process has in flight on the fleet's nodes (reserved slots)."""
        return sum(n.in_flight for n in self._nodes.values())

    def status(self, now: float | None = None) -> list[dict[str, Any]]:
        """A plain snapshot of every node, for ``zml fleet status`` and tests (health as of
        ``now``, default the monotonic clock)."""
        with self.lock:
            now = time.monotonic() if now is None else now
            self.refresh(now)
            return [
                {
                    "id": n.id,
                    "family": n.family,
                    "url": redact_url(n.url),
                    "in_flight": n.in_flight,
                    "reported_load": n.reported_load,
                    "load": n.load,
                    "max_concurrency": n.max_concurrency,
                    "max_queue": n.max_queue,
                    "health": round(n.health, 3),
                    "circuit": n.circuit_at(now),
                    "ttft_ms": None if n.observed_ttft_ms is None
                    else round(n.observed_ttft_ms, 1),
                    "base_ttft_ms": None if n.ttft_ms is None else round(n.ttft_ms, 1),
                    "service_ms": None if n.service_ms is None else round(n.service_ms, 1),
                }
                for n in self._nodes.values()
            ]

    # --- state changes (callers hold self.lock when deciding + reserving) -------------------

    def refresh(self, now: float) -> None:
        """Let degraded nodes' health recover with time (cheap: only degraded nodes), and end
        the prefill of whole-answer attempts whose predicted first token has passed."""
        due = self._prefill_due
        while due and due[0][0] <= now:
            self._prefilled(heapq.heappop(due)[2])
        if not self._degraded:
            return
        for node in list(self._degraded):
            elapsed = now - node.health_at
            if elapsed <= 0:
                continue
            # A constant rate (0 to 1 in HEALTH_RECOVERY_S): the same recovery however often
            # routing refreshes (a rate proportional to the deficit would slow down with every
            # refresh and, under steady traffic, never reach 1).
            recovered = min(1.0, node.health + elapsed / HEALTH_RECOVERY_S)
            node.health = recovered
            node.health_at = now
            if recovered >= 1.0:
                self._degraded.discard(node)
                self._touch(node)
            else:
                for ix, _ in self._memberships[node.id]:
                    ix.version += 1  # its health changed: routing's failing cache is stale

    def reserve(self, node: NodeState, now: float, prompt_tokens: int = 0,
                prefill_by: float | None = None) -> Reservation:
        """Take a slot on ``node`` (call under :attr:`lock`, in the same critical section as
        the routing decision); ``prompt_tokens`` is the request's prompt size.

        ``prefill_by``: for an answer that comes whole (not streamed), whose first token the
        client never sees, when to count its prompt as prefilled (its predicted TTFT); a
        streamed attempt's prompt counts until :meth:`first_token`."""
        node.in_flight += 1
        node._update_load()
        tokens = prompt_tokens if prompt_tokens > 0 else 0
        node.tokens_in_flight += tokens
        node.prefill_tokens += tokens
        trial = node.open_until is not None and now >= node.open_until
        if trial:
            node.trial_in_flight = True
        self._touch(node)
        reservation = Reservation(node, now, trial, prompt_tokens=tokens, prefilling=tokens > 0)
        if tokens and prefill_by is not None:
            heapq.heappush(self._prefill_due, (prefill_by, next(self._prefill_seq), reservation))
        return reservation

    def first_token(self, reservation: Reservation) -> None:
        """The attempt holding ``reservation`` has its first token: its prompt is no longer
        prefill ahead of the node's next request."""
        if not reservation.prefilling:
            return
        with self.lock:
            self._prefilled(reservation)

    def _prefilled(self, reservation: Reservation) -> None:
        # Under the lock: the reservation's prompt leaves its node's prefill_tokens (once).
        if reservation.prefilling:
            reservation.prefilling = False
            node = reservation.node
            node.prefill_tokens -= reservation.prompt_tokens
            self._touch(node)

    def release(self, reservation: Reservation) -> bool:
        """Give the slot back; False if it was already released (so double release is safe)."""
        with self.lock:
            if reservation.released:
                return False
            reservation.released = True
            node = reservation.node
            node.in_flight -= 1
            node.released += 1
            node.tokens_in_flight -= reservation.prompt_tokens
            if reservation.prefilling:
                reservation.prefilling = False
                node.prefill_tokens -= reservation.prompt_tokens
            if node.reported_load and reservation.taken_at <= node.reported_at:
                # The node's last report counted this request; it is gone now.
                node.reported_load -= 1
            node._update_load()
            if reservation.trial:
                node.trial_in_flight = False
            self._touch(node)
        if reservation.lease_id is not None and self.ledger is not None:
            try:
                self.ledger.release(node, reservation.lease_id)
            except Exception as exc:  # "must not raise": the local slot is free all the same
                self._ledger_failed(exc)
        self.notify_capacity()
        return True

    def _ledger_failed(self, exc: Exception) -> None:
        level = logging.DEBUG if self._ledger_reported else logging.WARNING
        self._ledger_reported = True
        _plugin_log.log(level, "the slot ledger %s raised in release (the local slot is freed; "
                        "further errors are logged at DEBUG)", type(self.ledger).__name__,
                        exc_info=exc)

    def lease_refused(self, reservation: Reservation, now: float) -> None:
        """The ledger says ``reservation``'s node is full (other processes hold its slots):
        free the local slot and treat the node as full until the next load report."""
        self.release(reservation)
        node = reservation.node
        with self.lock:
            node.reported_load = node.max_concurrency + node.max_queue
            node.reported_at = now
            node._update_load()
            self._touch(node)

    def record_success(
        self,
        node: NodeState,
        now: float,
        ttft_s: float | None,
        service_s: float | None,
        explained_ms: float = 0.0,
    ) -> None:
        """A call on ``node`` succeeded: update latency EWMAs, health and the circuit.

        ``ttft_s`` is the call's time to first token, known for a stream only: a whole
        (non-streamed) answer passes None, and the TTFT estimates stay as they are (its time
        is all service time, ``service_s``). ``explained_ms`` is the part of the call's TTFT
        that routing predicted from the request itself (its prefill, the requests ahead of
        it); the base TTFT routing learns (``ttft_ms``) is the observed TTFT less that part,
        and ``observed_ttft_ms`` the raw one.
        """
        with self.lock:
            if ttft_s is not None:
                observed = ttft_s * 1000.0
                node.observed_ttft_ms = _ewma(node.observed_ttft_ms, observed)
                node.ttft_ms = _ewma(node.ttft_ms, max(0.0, observed - explained_ms))
            if service_s is not None:
                node.service_ms = _ewma(node.service_ms, service_s * 1000.0)
            node.consecutive_failures = 0
            node.open_until = None
            if node.health < 1.0:
                node.health = min(1.0, node.health + HEALTH_ALPHA * (1.0 - node.health))
                node.health_at = now
            self._touch(node)

    def record_failure(self, node: NodeState, now: float) -> None:
        """A call on ``node`` failed (a node-side failure): health down, maybe open the circuit."""
        with self.lock:
            node.health = node.health * (1.0 - HEALTH_ALPHA)
            node.health_at = now
            self._degraded.add(node)
            node.consecutive_failures += 1
            if node.open_until is not None or node.consecutive_failures >= CIRCUIT_FAILURES:
                node.open_until = now + CIRCUIT_COOLDOWN_S
            self._touch(node)

    def load_mark(self, node: NodeState) -> LoadMark:
        """Mark this client's requests on ``node`` now, just before a probe reads its load."""
        return LoadMark(node.released)

    def record_probe(
        self, node: NodeState, now: float, *, healthy: bool, reported_load: int | None,
        mark: LoadMark | None = None,
    ) -> None:
        """An active probe's result: liveness feeds health; reported load merges into ``load``.

        With the probe's ``mark``, the report is taken less this client's requests that ended
        since the mark: the node may have counted them, and a release made before the report
        arrived cannot take itself off it. As when a request in flight now ends (see
        :meth:`release`), a request is taken to be in the report when it may be, so a report
        errs towards a lower load, never towards holding a node full for a request that is
        gone."""
        with self.lock:
            freed = self._merge_report(node, now, reported_load, mark)
            if healthy:
                node.health += HEALTH_ALPHA * (1.0 - node.health)
            else:
                node.health = 0.0
                self._degraded.add(node)
            node.health_at = now
            self._touch(node)
        if freed:
            self.notify_capacity()


def _prior(family: str, acc: Any) -> tuple[float, float | None]:
    prior = FAMILY_PRIORS.get(family) or _LOWER_PRIORS.get(family.lower(), DEFAULT_PRIOR)
    ttft, tps = prior
    sim = getattr(acc, "sim", None)
    if sim is not None:
        ttft = sim.ttft_ms if sim.ttft_ms is not None else ttft
        tps = sim.prefill_tokens_per_s if sim.prefill_tokens_per_s is not None else tps
    return float(ttft), float(tps)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else old + EWMA_ALPHA * (sample - old)
