"""The routing index: per (model, family), the nodes kept in the order routing reads them.

A routing decision must not scan the fleet: at 10,000 nodes a scan costs about a millisecond
per decision. A :class:`FamilyIndex` holds what a decision needs about one family's nodes
serving one model, kept current by the fleet as load, latency, health and circuits change
(:class:`zml.fleet.Fleet` calls :meth:`FamilyIndex.update` from every state change), so that a
decision reads O(log n + s) entries, s being the few *suspect* nodes:

* ``ordered``: a sorted list of ``(key, pos)`` for the nodes with room
  (``load < max_concurrency + max_queue``), ``key`` being the node's request-independent
  prediction :func:`base_key` and ``pos`` its registry position in the family (ties);
* ``suspects``: the positions of nodes whose circuit is not closed or whose health is below 1,
  the only nodes that can fail routing's checks 2 and 3 (they are few; a node leaves when it
  recovers);
* ``sum_load`` and ``sum_cap``: the family's total load and slots.

The index is data: :mod:`zml.routing` stays a pure function and reads it as part of the
fleet snapshot it is given (``fleet.family_index(model, family)``), under the fleet's lock.
A fleet without indexes (a test double, a replay fleet) is scanned instead; both give the
same decisions (a property test keeps them equal).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import Any

__all__ = ["Failing", "FamilyIndex", "base_key"]

PRIOR_SERVICE_MS = 2000.0  # equal to zml.routing.PRIOR_SERVICE_MS (routing imports this module)


def base_key(node: Any, prior: float, ms_per_token: float) -> float:
    """A node's predicted TTFT without the request's own prefill (zml.routing module docs):
    its base TTFT or ``prior``, plus the prefill of its requests without a first token, plus,
    when the slots are taken, the requests ahead."""
    key: float = node.ttft_ms
    if key is None:
        key = prior
    if ms_per_token:
        tokens = getattr(node, "prefill_tokens", 0)
        if tokens:
            key += tokens * ms_per_token
    load = node.load
    mc = node.max_concurrency
    if load >= mc > 0:
        service = node.service_ms
        if service is None:
            service = PRIOR_SERVICE_MS
        key += (load - mc + 1) * service / mc
    return key


class Failing:
    """Which suspects fail routing's checks 2 (circuit) and 3 (health), for one threshold.

    It holds as long as no suspect changed (``version``) and ``now`` stays in ``[since,
    until)``: between two circuit deadlines (``open_until``) no circuit changes its answer by
    itself, and health changes only through the fleet (which bumps the version).
    """

    __slots__ = ("cap", "circuit", "entries", "load", "n_circ", "n_health", "ratio_entries",
                 "since", "threshold", "until", "version")

    def __init__(self, threshold: float, version: int, since: float, until: float,
                 circuit: dict[int, bool], load: int, cap: int, n_circ: int, n_health: int,
                 entries: list[tuple[float, int]],
                 ratio_entries: list[tuple[float, int]]) -> None:
        self.threshold: float = threshold
        self.version: int = version
        self.since: float = since
        self.until: float = until
        self.circuit: dict[int, bool] = circuit
        """Failing position -> True when it fails the circuit check, False for health."""
        self.load: int = load
        self.cap: int = cap
        self.n_circ: int = n_circ
        self.n_health: int = n_health
        self.entries: list[tuple[float, int]] = entries
        """The failing nodes' entries in ``ordered``, sorted."""
        self.ratio_entries: list[tuple[float, int]] = ratio_entries
        """The failing nodes' entries in ``by_ratio``, sorted."""


def failing_of(ix: FamilyIndex, now: float, threshold: float) -> Failing:
    """The failing suspects of ``ix`` at ``now`` (cached on the index while valid)."""
    cached = ix.failing
    if (cached is not None and cached.version == ix.version and cached.threshold == threshold
            and cached.since <= now < cached.until):
        return cached
    nodes = ix.nodes
    entries = ix.entries
    since = -math.inf
    until = math.inf
    circuit: dict[int, bool] = {}
    load = cap = n_circ = n_health = 0
    for pos in ix.suspects:
        node = nodes[pos]
        deadline = getattr(node, "open_until", None)
        if deadline is not None:
            if deadline > now:
                until = min(until, deadline)
            else:
                since = max(since, deadline)
        if not node.circuit_allows(now):
            circuit[pos] = True
            n_circ += 1
        elif node.health < threshold:
            circuit[pos] = False
            n_health += 1
        else:
            continue
        load += node.load
        cap += node.max_concurrency
    failing_entries = sorted(e for e in (entries[p] for p in circuit) if e is not None)
    ratios = ix.ratio_entries
    failing_ratios = sorted(e for e in (ratios[p] for p in circuit) if e is not None)
    result = Failing(threshold, ix.version, since, until, circuit, load, cap, n_circ, n_health,
                     failing_entries, failing_ratios)
    ix.failing = result
    return result


class FamilyIndex:
    """One family's nodes serving one model, indexed for routing (module docs)."""

    __slots__ = (
        "by_id",
        "by_ratio",
        "entries",
        "failing",
        "loads",
        "ms_per_token",
        "nodes",
        "ordered",
        "prior",
        "ratio_entries",
        "sum_cap",
        "sum_load",
        "suspects",
        "version",
    )

    def __init__(self, nodes: Sequence[Any], prior: float,
                 prefill_tokens_per_s: float | None) -> None:
        self.nodes: list[Any] = list(nodes)
        """Every node, in registry order (a node's ``pos`` is its index here)."""
        self.by_id: dict[str, int] = {n.id: i for i, n in enumerate(self.nodes)}
        self.prior: float = prior
        self.ms_per_token: float = 1000.0 / prefill_tokens_per_s if prefill_tokens_per_s else 0.0
        self.ordered: list[tuple[float, int]] = []
        self.entries: list[tuple[float, int] | None] = [None] * len(self.nodes)
        self.by_ratio: list[tuple[float, int]] = []
        """``(load / max_concurrency, pos)`` of the nodes with room, sorted (calls without a
        policy choose the least loaded)."""
        self.ratio_entries: list[tuple[float, int] | None] = [None] * len(self.nodes)
        self.loads: list[int] = [0] * len(self.nodes)
        self.suspects: set[int] = set()
        self.version: int = 0
        """Bumped whenever a suspect node changes (what ``failing`` was computed from)."""
        self.failing: Failing | None = None
        """A pure cache, written by routing: which suspects fail checks 2-3, valid for one
        health threshold, one ``version`` and a span of ``now`` (see :class:`Failing`)."""
        self.sum_load: int = 0
        self.sum_cap: int = sum(n.max_concurrency for n in self.nodes)
        for pos in range(len(self.nodes)):
            self.update(pos)

    def update(self, pos: int) -> None:
        """Bring node ``pos``'s entries up to date with its state (call under the fleet lock)."""
        node = self.nodes[pos]
        old = self.entries[pos]
        old_ratio = self.ratio_entries[pos]
        load = node.load
        self.sum_load += load - self.loads[pos]
        self.loads[pos] = load
        mc = node.max_concurrency
        if mc > 0 and load < mc + node.max_queue:
            # (an entry that did not change stays where it is: a success changes no load)
            entry = (base_key(node, self.prior, self.ms_per_token), pos)
            if entry != old:
                if old is not None:
                    del self.ordered[bisect_left(self.ordered, old)]
                insort(self.ordered, entry)
                self.entries[pos] = entry
            ratio = (load / mc, pos)
            if ratio != old_ratio:
                if old_ratio is not None:
                    del self.by_ratio[bisect_left(self.by_ratio, old_ratio)]
                insort(self.by_ratio, ratio)
                self.ratio_entries[pos] = ratio
        elif old is not None:
            del self.ordered[bisect_left(self.ordered, old)]
            assert old_ratio is not None  # both entries exist together
            del self.by_ratio[bisect_left(self.by_ratio, old_ratio)]
            self.entries[pos] = None
            self.ratio_entries[pos] = None
        suspects = self.suspects
        if pos in suspects:
            self.version += 1
        if node.health < 1.0 or getattr(node, "open_until", None) is not None:
            if pos not in suspects:
                suspects.add(pos)
                self.version += 1
        else:
            suspects.discard(pos)
