"""Reading one family for a routing decision: a scan of its nodes, or its routing index.

:func:`zml.routing.route` walks the chain; for each family it calls :func:`_scan` (a fleet
without indexes) or :func:`_indexed` (a :class:`zml.routing_index.FamilyIndex`), which return
the viable candidates (or the family's rejection reason), and the chosen family's
``choose`` applies the near-best window, the two choices and prefix affinity. The calls
without a policy use :func:`_scan_least_loaded` / :func:`_indexed_least_loaded`. Both ways of
reading give the same decisions (a property test keeps them equal); the rules are in
:mod:`zml.routing`'s docstring.
"""

from __future__ import annotations

import math
import random
import zlib
from bisect import bisect_right
from collections.abc import Sequence, Set as AbstractSet

from .routing_index import FamilyIndex, base_key, failing_of
from .routing_types import (
    _CIRCUIT,
    _EXCLUDED,
    _HEALTH,
    _INF,
    _LATENCY,
    _NO_NODES,
    _OVER,
    AFFINITY_LOAD_FACTOR,
    CHARS_PER_TOKEN,
    NEAR_BEST_MS,
    NEAR_BEST_SHARE,
    PRIOR_SERVICE_MS,
    TIE_MS,
    FleetView,
    NodeView,
)

__all__ = ["affinity_bound", "prompt_tokens_from_chars"]

_NONE: frozenset[int] = frozenset()
"""No excluded nodes (a decision without exclusions builds no set)."""


def _family_reason(n_over: int, n_lat: int, n_circ: int, n_health: int, n_excl: int) -> str:
    # Most frequent reason; ties go to the earlier one in this order.
    reason = _OVER
    top = n_over
    if n_lat > top:
        reason, top = _LATENCY, n_lat
    if n_circ > top:
        reason, top = _CIRCUIT, n_circ
    if n_health > top:
        reason, top = _HEALTH, n_health
    if n_excl > top:
        reason = _EXCLUDED
    return reason


# The scan below is the hot path (a family can hold thousands of nodes): plain local variables,
# no allocation per node that is not kept, no exceptions. The per-node reason counts only matter
# when the family ends with no viable node. A viable node whose prediction is already outside
# the near-best window of the best seen so far is not kept (unless affinity needs every viable
# node); the window only shrinks as the best improves, so the final filter is exact.


def prompt_tokens_from_chars(chars: int) -> int:
    """The prompt-size rule: ``ceil(chars / CHARS_PER_TOKEN)`` tokens (0 for no text)."""
    return -(-max(0, chars) // CHARS_PER_TOKEN)


def _window(best: float) -> float:
    return best * (1.0 + NEAR_BEST_SHARE) + NEAR_BEST_MS


def _node_prediction(
    node: NodeView, prior: float, own_ms: float, ms_per_token: float
) -> float:
    """The documented prediction of one node: ``base_key(node) + own_ms``."""
    return base_key(node, prior, ms_per_token) + own_ms


Kept = tuple[float, int, NodeView]
"""A viable node as the scan keeps it: (base key, registry position in the family, node)."""


def _scan(
    nodes: Sequence[NodeView],
    now: float,
    threshold: float,
    limit: float,
    exclude: AbstractSet[str],
    prior: float,
    own_ms: float,
    ms_per_token: float,
    keep_all: bool,
) -> tuple[list[Kept], float, float, str]:
    """Scan one family: (kept viable nodes, best pred, U, reason).

    The reason only means something when nothing was kept (no viable node).
    """
    has_exclude = bool(exclude)
    n_excl = n_circ = n_health = n_over = n_lat = 0
    sum_load = 0
    sum_cap = 0
    best = hi = _INF
    kept: list[Kept] = []
    for pos, node in enumerate(nodes):
        if has_exclude and node.id in exclude:
            n_excl += 1
            continue
        if not node.circuit_allows(now):
            n_circ += 1
            continue
        if node.health < threshold:
            n_health += 1
            continue
        load = node.load
        mc = node.max_concurrency
        sum_load += load
        sum_cap += mc
        if mc <= 0 or load >= mc + node.max_queue:
            n_over += 1
            continue
        key = node.ttft_ms
        if key is None:
            key = prior
        if ms_per_token:
            tokens = getattr(node, "prefill_tokens", 0)
            if tokens:
                key += tokens * ms_per_token
        if load >= mc:
            service = node.service_ms
            if service is None:
                service = PRIOR_SERVICE_MS
            key += (load - mc + 1) * service / mc
        pred = key + own_ms
        if pred > limit:
            n_lat += 1
            continue
        if pred > hi and not keep_all:
            continue
        kept.append((key, pos, node))
        if pred < best:
            best = pred
            hi = _window(pred)
    if kept:
        return kept, best, sum_load / sum_cap, ""
    if not nodes:
        return kept, _INF, _INF, _NO_NODES
    return kept, _INF, _INF, _family_reason(n_over, n_lat, n_circ, n_health, n_excl)


def _p2c(n: int, rng: random.Random) -> tuple[int, int]:
    """Two distinct indices in range(n) drawn with ``rng`` (n >= 2)."""
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    if j >= i:
        j += 1
    return i, j


def _less_loaded(a: NodeView, b: NodeView) -> bool:
    """Whether ``b`` is strictly less loaded than ``a`` (load per slot)."""
    return b.load / max(b.max_concurrency, 1) < a.load / max(a.max_concurrency, 1)


class _ScanFound:
    """A scanned family with viable nodes."""

    __slots__ = ("best", "kept", "own_ms", "prior", "util")

    def __init__(self, kept: list[Kept], best: float, util: float, own_ms: float,
                 prior: float) -> None:
        self.kept = kept
        self.best = best
        self.util = util
        self.own_ms = own_ms
        self.prior = prior

    def choose(self, rng: random.Random, affinity_key: str | None) -> tuple[float, NodeView]:
        own = self.own_ms
        if affinity_key is not None:
            picked = _affinity_pick([(k + own, n) for k, _, n in self.kept], affinity_key)
            if picked is not None:
                return picked
        hi = _window(self.best)
        near = sorted(item for item in self.kept if item[0] + own <= hi)
        n = len(near)
        if n == 1:
            return near[0][0] + own, near[0][2]
        i, j = _p2c(n, rng)
        if _less_loaded(near[i][2], near[j][2]):
            i = j
        return near[i][0] + own, near[i][2]


class _IndexFound:
    """An indexed family with viable nodes: candidates ``ordered[a:b]`` minus ``skip``."""

    __slots__ = ("a", "b", "best", "ix", "limit", "own_ms", "skip", "skipped", "util")

    def __init__(self, ix: FamilyIndex, skip: AbstractSet[int],
                 skipped: list[tuple[float, int]], a: int, b: int, best: float, util: float,
                 own_ms: float, limit: float) -> None:
        self.ix = ix
        self.skip = skip
        self.skipped = skipped
        self.a = a
        self.b = b
        self.best = best
        self.util = util
        self.own_ms = own_ms
        self.limit = limit

    def choose(self, rng: random.Random, affinity_key: str | None) -> tuple[float, NodeView]:
        ix = self.ix
        own = self.own_ms
        ordered = ix.ordered
        nodes = ix.nodes
        if affinity_key is not None:
            viable: list[tuple[float, NodeView]] = []
            for key, pos in ordered:
                pred = key + own
                if pred > self.limit:
                    break
                if pos not in self.skip:
                    viable.append((pred, nodes[pos]))
            picked = _affinity_pick(sorted_by_registry(viable, ix), affinity_key)
            if picked is not None:
                return picked
        a = self.a
        skipped = self.skipped
        m = self.b - a - len(skipped)
        if m == 1:
            key, pos = ordered[_nth(ordered, a, skipped, 0)]
            return key + own, nodes[pos]
        i, j = _p2c(m, rng)
        ki, pi = ordered[_nth(ordered, a, skipped, i)]
        kj, pj = ordered[_nth(ordered, a, skipped, j)]
        if _less_loaded(nodes[pi], nodes[pj]):
            return kj + own, nodes[pj]
        return ki + own, nodes[pi]


def _skipped(
    failing: list[tuple[float, int]], extra: list[tuple[float, int] | None],
    low: tuple[float, int], top: tuple[float, int],
) -> list[tuple[float, int]]:
    """The entries in ``(low, top]`` of ``failing`` (sorted) and ``extra``, sorted: the ones a
    window ``seq[a:b]`` (``seq[a] == low``, ``seq[b - 1] == top``) holds but must skip."""
    if not failing or failing[-1] <= low or failing[0] > top:
        found: list[tuple[float, int]] = []
    else:
        found = failing[bisect_right(failing, low):bisect_right(failing, top)]
    if extra:
        more = [e for e in extra if e is not None and low < e <= top]
        if more:
            found = sorted(found + more)
    return found


def _nth(seq: list[tuple[float, int]], a: int, skipped: list[tuple[float, int]], r: int) -> int:
    """The index in ``seq`` of the ``r``-th entry from ``seq[a]`` on that is not in
    ``skipped`` (entries of ``seq`` after ``seq[a]``, sorted)."""
    idx = a + r
    for entry in skipped:
        if entry <= seq[idx]:
            idx += 1
        else:
            break
    return idx


def sorted_by_registry(
    viable: list[tuple[float, NodeView]], ix: FamilyIndex
) -> list[tuple[float, NodeView]]:
    """Viable (pred, node) pairs in registry order (affinity's order, as the scan keeps it)."""
    by_id = ix.by_id
    return sorted(viable, key=lambda item: by_id[item[1].id])


def _indexed(
    ix: FamilyIndex,
    now: float,
    threshold: float,
    limit: float,
    exclude: AbstractSet[str],
    own_ms: float,
) -> _IndexFound | str:
    """The indexed twin of ``_scan``: a found family, or the family's rejection reason."""
    nodes = ix.nodes
    if not nodes:
        return _NO_NODES
    fail = failing_of(ix, now, threshold)
    circuit = fail.circuit
    n_circ = fail.n_circ
    n_health = fail.n_health
    fail_load = fail.load
    fail_cap = fail.cap
    n_excl = 0
    extra: AbstractSet[int] = _NONE  # excluded nodes that pass checks 2-3
    if exclude:
        extra = excluded = set()
        by_id = ix.by_id
        for node_id in exclude:
            pos = by_id.get(node_id)
            if pos is None:
                continue
            n_excl += 1
            failed = circuit.get(pos)
            if failed is None:
                node = nodes[pos]
                fail_load += node.load
                fail_cap += node.max_concurrency
                excluded.add(pos)
            elif failed:
                n_circ -= 1  # check 1 comes first: it counts as excluded
            else:
                n_health -= 1
    entries = ix.entries
    ordered = ix.ordered
    size = len(ordered)
    a = 0
    while a < size and (ordered[a][1] in circuit or ordered[a][1] in extra):
        a += 1
    best = ordered[a][0] + own_ms if a < size else _INF
    if a >= size or best > limit:
        in_order = len(fail.entries) + sum(1 for pos in extra if entries[pos] is not None)
        n_over = len(nodes) - size - (len(circuit) + len(extra) - in_order)
        n_lat = size - in_order
        return _family_reason(n_over, n_lat, n_circ, n_health, n_excl)
    hi = _window(best)
    if limit < hi:
        hi = limit
    b = bisect_right(ordered, (hi - own_ms, _INF), a)
    while b < size and ordered[b][0] + own_ms <= hi:
        b += 1
    while b > a + 1 and ordered[b - 1][0] + own_ms > hi:
        b -= 1
    skipped = _skipped(fail.entries, [entries[pos] for pos in extra], ordered[a],
                       ordered[b - 1])
    skip = circuit.keys() | extra if extra else circuit.keys()
    util = (ix.sum_load - fail_load) / (ix.sum_cap - fail_cap)
    return _IndexFound(ix, skip, skipped, a, b, best, util, own_ms, limit)


def _affinity_score(key: str, node_id: str) -> int:
    return zlib.crc32(f"{key}\x1f{node_id}".encode())


def affinity_bound(sum_load: int, sum_cap: int, max_concurrency: int) -> int:
    """The bounded-load cap of one node under affinity: ``ceil(AFFINITY_LOAD_FACTOR x
    (sum_load + 1) x max_concurrency / sum_cap)`` (sums over the family's viable nodes)."""
    if sum_cap <= 0:
        return 0
    return math.ceil(AFFINITY_LOAD_FACTOR * (sum_load + 1) * max_concurrency / sum_cap - 1e-9)


def _affinity_pick(
    kept: Sequence[tuple[float, NodeView]], key: str
) -> tuple[float, NodeView] | None:
    """Rendezvous hashing with bounded loads over the viable nodes (None: none within bound)."""
    sum_load = 0
    sum_cap = 0
    for _, node in kept:
        sum_load += node.load
        sum_cap += node.max_concurrency
    chosen: tuple[float, NodeView] | None = None
    top = -1
    for item in kept:
        node = item[1]
        if node.load + 1 > affinity_bound(sum_load, sum_cap, node.max_concurrency):
            continue
        score = _affinity_score(key, node.id)
        if score > top:
            top = score
            chosen = item
    return chosen


def _scan_least_loaded(
    nodes: Sequence[NodeView],
    now: float,
    threshold: float,
    exclude: AbstractSet[str],
) -> tuple[list[Kept], float, str]:
    """Scan a family for its least loaded viable nodes (no policy): (ties sorted by (ratio,
    position), their best ratio, reason)."""
    has_exclude = bool(exclude)
    n_excl = n_circ = n_health = n_over = 0
    best = lo = hi = _INF
    ties: list[Kept] = []
    drift = False
    for pos, node in enumerate(nodes):
        load = node.load
        mc = node.max_concurrency
        ratio = load / mc if mc > 0 else _INF
        if ratio > hi:
            continue
        if has_exclude and node.id in exclude:
            n_excl += 1
            continue
        if not node.circuit_allows(now):
            n_circ += 1
            continue
        if node.health < threshold:
            n_health += 1
            continue
        if mc <= 0 or load >= mc + node.max_queue:
            n_over += 1
            continue
        if ratio < lo:
            best = ratio
            lo = ratio - TIE_MS
            hi = ratio + TIE_MS
            ties = [(ratio, pos, node)]
        else:
            ties.append((ratio, pos, node))
            if ratio < best:
                best = ratio
                lo = ratio - TIE_MS
                hi = ratio + TIE_MS
                drift = True
    if drift:
        ties = [t for t in ties if t[0] <= hi]
    if ties:
        ties.sort(key=_ratio_pos)
        return ties, best, ""
    if not nodes:
        return ties, best, _NO_NODES
    return ties, best, _family_reason(n_over, 0, n_circ, n_health, n_excl)


def _ratio_pos(item: Kept) -> tuple[float, int]:
    return item[0], item[1]


class _RatioScan:
    """A scanned family's least loaded viable nodes (no policy), sorted by (ratio, position)."""

    __slots__ = ("ties",)

    def __init__(self, ties: list[Kept]) -> None:
        self.ties = ties

    def count(self, hi: float) -> int:
        ties = self.ties
        n = 0
        while n < len(ties) and ties[n][0] <= hi:
            n += 1
        return n

    def get(self, r: int) -> NodeView:
        return self.ties[r][2]


class _RatioIndexed:
    """An indexed family's least loaded viable nodes: ``by_ratio[a:]`` minus the failing and
    the excluded nodes."""

    __slots__ = ("a", "extra", "failing", "ix", "skipped")

    def __init__(self, ix: FamilyIndex, a: int, failing: list[tuple[float, int]],
                 extra: AbstractSet[int]) -> None:
        self.ix = ix
        self.a = a
        self.failing = failing
        """The sorted ``by_ratio`` entries of the nodes failing checks 2-3."""
        self.extra = extra
        """The excluded nodes that pass checks 2-3."""
        self.skipped: list[tuple[float, int]] = []

    def count(self, hi: float) -> int:
        by_ratio = self.ix.by_ratio
        a = self.a
        b = bisect_right(by_ratio, (hi, _INF), a)
        if b <= a:
            return 0
        entries = self.ix.ratio_entries
        self.skipped = _skipped(self.failing, [entries[pos] for pos in self.extra],
                                by_ratio[a], by_ratio[b - 1])
        return b - a - len(self.skipped)

    def get(self, r: int) -> NodeView:
        ix = self.ix
        node: NodeView = ix.nodes[ix.by_ratio[_nth(ix.by_ratio, self.a, self.skipped, r)][1]]
        return node


def _indexed_least_loaded(
    ix: FamilyIndex, now: float, threshold: float, exclude: AbstractSet[str]
) -> tuple[_RatioIndexed | None, float, str]:
    """The indexed twin of ``_scan_least_loaded``: (candidates, best ratio, reason)."""
    nodes = ix.nodes
    if not nodes:
        return None, _INF, _NO_NODES
    fail = failing_of(ix, now, threshold)
    circuit = fail.circuit
    n_circ = fail.n_circ
    n_health = fail.n_health
    n_excl = 0
    extra: AbstractSet[int] = _NONE  # excluded nodes that pass checks 2-3
    if exclude:
        extra = excluded = set()
        by_id = ix.by_id
        for node_id in exclude:
            pos = by_id.get(node_id)
            if pos is None:
                continue
            n_excl += 1
            failed = circuit.get(pos)
            if failed is None:
                excluded.add(pos)
            elif failed:
                n_circ -= 1
            else:
                n_health -= 1
    by_ratio = ix.by_ratio
    size = len(by_ratio)
    a = 0
    while a < size and (by_ratio[a][1] in circuit or by_ratio[a][1] in extra):
        a += 1
    if a >= size:
        entries = ix.ratio_entries
        in_order = len(fail.ratio_entries)
        in_order += sum(1 for pos in extra if entries[pos] is not None)
        n_over = len(nodes) - size - (len(circuit) + len(extra) - in_order)
        return None, _INF, _family_reason(n_over, 0, n_circ, n_health, n_excl)
    return _RatioIndexed(ix, a, fail.ratio_entries, extra), by_ratio[a][0], ""


def _saving(fleet: FleetView, family: str, next_family: str | None) -> float:
    """Relative cost saving of staying on ``family`` rather than moving to ``next_family``."""
    if next_family is None:
        return 0.5
    this_cost = fleet.family_cost(family)
    next_cost = fleet.family_cost(next_family)
    if this_cost is None or next_cost is None:
        return 0.5
    if next_cost <= 0:
        return 0.0
    s = (next_cost - this_cost) / next_cost
    return 0.0 if s < 0.0 else 1.0 if s > 1.0 else s
