"""How zml chooses the node that serves a request.

``route(policy, model, fleet, now=..., rng=..., prompt_tokens=..., prefix_blocks=...)`` is a
pure function: it reads a snapshot of
the fleet, reads no clock (``now`` is passed in), does no I/O, changes nothing, and draws
randomness only from the ``random.Random`` it is given, so the same inputs and the same seed
always give the same answer. It returns a :class:`Decision` (the node, its family, the
predicted time to first token and a trace of every family looked at) or a :class:`NoRoute`
whose :meth:`NoRoute.context` is the ``RoutingError.routing_context`` dict.

Constants
---------
``PRIOR_TTFT_MS = 200.0``
    Time to first token assumed for a node until one has been observed.
``PRIOR_SERVICE_MS = 2000.0``
    Whole-request service time assumed for a node until one has been observed.
``COST_LATENCY_MARGIN = 1.25``
    Under ``cost_priority = "cost"`` a node is accepted up to 1.25 x ``latency_target_ms``.
``HIGH_WATER = 0.8``
    Utilisation at which ``"latency"`` leaves a family for the next one in the chain.
``BALANCED_SPAN = 0.2``
    How far above ``HIGH_WATER`` ``"balanced"`` may hold to a family when staying saves money.
``TIE_MS = 1e-9``
    Without a policy, load ratios closer than this are a tie.
``NEAR_BEST_SHARE = 0.25`` and ``NEAR_BEST_MS = 25.0``
    The near-best window: a viable node predicted within ``best x (1 + 0.25) + 25 ms`` of the
    family's best prediction shares the load with it (no herding).
``CHARS_PER_TOKEN = 4``
    The prompt-size rule: a request's ``prompt_chars`` count as ``ceil(chars / 4)`` tokens
    (:func:`prompt_tokens_from_chars`; a replayed trace passes its token counts).
``AFFINITY_LOAD_FACTOR = 1.25``
    Under ``affinity = "prefix"`` a node takes the request only while its load stays within
    1.25 x its share of the family's load (consistent hashing with bounded loads).
``MAX_IDS_IN_RECOMMENDATION = 5``
    Node ids named in a recommendation before it says "and N more".

Checking a node
---------------
For each node of a family that serves the model, the first check that fails is the node's
rejection reason:

1. its id is in ``exclude`` (the nodes already tried for this request) ->
   ``excluded_after_failure``;
2. its circuit breaker is open (``node.circuit_allows(now)`` is false) -> ``circuit_open``;
3. ``node.health < health_threshold`` -> ``health_score_below_threshold``;
4. no room: ``node.load >= node.max_concurrency + node.max_queue`` ->
   ``all_nodes_over_capacity`` (``load`` counts running and waiting requests; zml may fill a
   node's slots and then its own queue of ``max_queue`` requests);
5. the predicted TTFT is over the latency limit -> ``latency_target_exceeded``.

A node that passes every check is *viable*. (Nodes are expected to have
``max_concurrency >= 1``, ``max_queue >= 0`` and ``load >= 0``; a node with no slot at all is
treated as having no room.)

Predicted time to first token::

    ahead  = max(0, load - max_concurrency + 1)       # requests this one would wait behind
    base   = ttft                                     # the index key (request-independent)
           + prefill(prefill_tokens)                  # prompts on the node without a first token
           + ahead * service / max_concurrency        # only when the slots are taken
    pred   = base + prefill(prompt_tokens)
    prefill(t)     = t / prefill_tokens_per_s x 1000 ms

``ttft`` is the node's base TTFT (``node.ttft_ms``): an EWMA of observed TTFTs less the part
of each call's prediction that the model explained (``Decision.predicted_ttft_ms -
Decision.base_ttft_ms``: its own prefill, the prefill and requests ahead), never below zero
(``Fleet.record_success``), so that a long prompt or a burst is not counted twice. Until one
is observed it is the family's prior ``ttft_ms``; ``service`` is the node's observed service
time (EWMA) or ``PRIOR_SERVICE_MS``. ``prefill_tokens_per_s`` and the prior come from the
fleet's ``family_prior(family)`` (the family's profile, see :mod:`zml.fleet`); a fleet without
one gives ``PRIOR_TTFT_MS`` and no prefill term. ``prefill_tokens`` (the prompt tokens of this
client's requests on the node that have no first token yet: a node prefills one prompt after
another) is read when the node has it. ``load`` counts every request on the node, this
client's in flight included (and what the node reported on ``/metrics``). Priors are the
profile's idle figures, optimistic on purpose: an unobserved node ranks with or ahead of
observed ones and is explored, not starved.

The latency limit: none when the policy has no ``latency_target_ms``; otherwise
``latency_target_ms x COST_LATENCY_MARGIN`` under ``"cost"`` and ``latency_target_ms``
itself under ``"latency"`` and ``"balanced"``.

A family with no viable node is rejected with ``no_nodes_for_model`` when no node of the
family serves the model, and otherwise with the most frequent reason among its nodes, ties
going to the first of ``all_nodes_over_capacity``, ``latency_target_exceeded``,
``circuit_open``, ``health_score_below_threshold``, ``excluded_after_failure``.
``nodes_checked`` is the number of the family's nodes that serve the model.

Choosing the family (with a policy)
-----------------------------------
The families of ``accelerator_chain`` are walked in order (a family repeated in the chain is
walked once; only ``pinned_family`` is walked when one is given, e.g. ``accelerator="H100"``). A family's utilisation ``U`` is the sum of ``load`` over
the sum of ``max_concurrency`` of its nodes that passed checks 1-3, as it is before this
request. A family with at least one viable node is:

* ``"cost"``: accepted. zml holds to the earlier (cheaper, preferred) family up to its full
  capacity, node queues included, accepting up to 1.25 x the latency target.
* ``"latency"``: accepted when ``U < HIGH_WATER`` (0.8); at or above it the family is passed
  over with the soft reason ``above_high_water`` and the walk goes on: zml upgrades before
  the family is exhausted.
* ``"balanced"``: balanced weighs cost saving against latency risk. The family is accepted
  when ``U < HIGH_WATER + BALANCED_SPAN x s`` (between 0.8 and 1.0), where
  ``s = (next_cost - this_cost) / next_cost`` clamped to [0, 1] is the relative saving of
  staying rather than moving to the next family of the chain (``cost_per_hour`` of each);
  ``s = 0.5`` when either cost is unknown or this is the chain's last family, and ``s = 0``
  when the next family costs nothing. Otherwise it is passed over with ``above_high_water``.

(The utilisation comparisons are made with a 1e-12 allowance for binary rounding, so that, for
example, a family at exactly 90% reaches a ceiling of 0.8 + 0.2 x 0.5.)

The first accepted family wins and the walk stops there. When every family with viable nodes
was passed over, the first of them wins after all (a busy family beats none). When no family
has a viable node the result is a ``NoRoute`` (``final_error = "no_viable_node"``).

Within the chosen family (the soft minimum, no herding): the viable nodes predicted within the
near-best window ``best x (1 + NEAR_BEST_SHARE) + NEAR_BEST_MS`` of the lowest prediction are
the candidates; a single candidate is taken as is; otherwise zml samples two distinct
candidates with ``rng`` (power of two choices) and takes the one with the lower
``load / max_concurrency`` (the first sampled when equal). Its prediction is
``Decision.predicted_ttft_ms``. So nodes of nearly equal speed share sequential traffic
evenly, concurrent requests go to the less loaded, and a node clearly slower than the best
(outside the window) is not used while the best has room.

Prefix affinity (``policy.affinity == "prefix"`` and the request has ``prefix_blocks``):
before the soft minimum, the node is chosen by rendezvous hashing of the first block id over
the family's viable nodes with bounded loads. A viable node is *within the load bound* when
``load + 1 <= ceil(AFFINITY_LOAD_FACTOR x (L + 1) x max_concurrency / C)`` where ``L`` and
``C`` are the sums of ``load`` and ``max_concurrency`` over the family's viable nodes
(:func:`affinity_bound`). Among those, the one with the highest
``crc32(f"{block}\x1f{node_id}")`` is chosen: every prompt starting with the same block goes
to the same node while it is within the bound, then to the next in its hash order. When no
viable node is within the bound, the soft minimum decides. Affinity never picks a node the
bound excludes, nor a node that is not viable.

The routing index: when the fleet has ``family_index(model, family)`` (``zml.fleet.Fleet``
does; see :mod:`zml.routing_index`), a family is read through its index instead of being
scanned: the nodes with room sorted by ``(base, position)``, the suspects (circuit not closed
or health below 1, the only nodes checks 2-3 can reject) and the family's load and slot
totals. The best candidate, the window, the utilisation and the rejection reason come from a
few bisections and the suspects and excluded nodes; the two choices are drawn by position
among the window's candidates in the same order as the scan keeps them, so both give the same
decision. Calls without a policy read the index's second ordering, by ``(load /
max_concurrency, position)``; affinity reads every viable node of the chosen family.

The trace (``Decision.evaluated``, ``NoRoute.evaluated``) has one entry per family looked at,
in chain order: ``{"family", "nodes_checked", "rejected_reason"}``. The chosen family's
``rejected_reason`` is ``None``; families passed over show their reason (a rejection reason,
or ``above_high_water``); families after the chosen one appear only if they were evaluated
(i.e. when the winner is a family that was passed over). A ``NoRoute`` lists every family of
the chain exactly once.

No policy (the 0.2 behaviour)
-----------------------------
Without a policy every family of the fleet registry is considered, in registry order (only
``pinned_family`` when one is given), with ``health_threshold`` (default 0.5) and no latency
limit. Among the nodes passing checks 1-4 in all those families, the one with the lowest
``load / max_concurrency`` is chosen: the nodes within ``TIE_MS`` of the lowest ratio are the
candidates (per family in ``(ratio, position)`` order, families in order), and two sampled
with ``rng`` are compared as above.
The trace lists every family considered: the chosen family with ``None``, other families
that had viable nodes with the soft reason ``not_selected``, the others with their rejection
reason. ``NoRoute.policy`` is ``None``.

Rejection reasons
-----------------
The closed set that can appear in a ``NoRoute`` context (``REJECTION_REASONS``):

``no_nodes_for_model``
    No node of the family serves the model.
``health_score_below_threshold``
    The node's health score (0..1, from probes and observed failures) is below the policy's
    ``health_threshold``.
``circuit_open``
    The node's circuit breaker is open after repeated failures; it is skipped until the
    breaker lets a trial request through.
``all_nodes_over_capacity``
    The node's slots and its queue room are all taken.
``latency_target_exceeded``
    The node's predicted time to first token is over the latency limit.
``excluded_after_failure``
    The node was already tried for this request and failed before its first token.

Soft reasons, seen only in a successful decision's trace (``SOFT_REASONS``):
``above_high_water`` (the family was left early under ``"latency"`` or ``"balanced"``) and
``not_selected`` (no policy: the family had viable nodes, but a less loaded node was chosen
elsewhere).

Recommendation
--------------
A ``NoRoute`` carries one recommendation, built from the families' rejection reasons. If any
family was rejected with ``all_nodes_over_capacity`` it is
``"increase fleet capacity or enable queue_on_saturation"`` alone: waiting for room (or more
room) would have served the request, and the other families' reasons stay visible in
``evaluated``. Otherwise it joins with ``"; "``, in this order, one hint per reason present:

* ``health_score_below_threshold``: ``"check the health of nodes <ids>"``;
* ``circuit_open``: ``"nodes <ids> are failing; check them or wait for the circuit breaker to
  close"``;
* ``latency_target_exceeded``: ``"raise latency_target_ms or add capacity to the chain's
  families"``;
* ``no_nodes_for_model``: ``"register nodes serving <model> in the chain's families"`` (``in
  the fleet's families`` without a policy);
* ``excluded_after_failure``: ``"every candidate node failed for this request; see the
  attempts"``.

``<ids>`` names up to 5 of the nodes of the evaluated families that fail that check, in
evaluation order, then "and N more".
"""

from __future__ import annotations

import math
import random
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Hashable, Sequence, Set as AbstractSet
from dataclasses import dataclass
from typing import Literal, Protocol

from .routing_index import FamilyIndex, base_key, failing_of

__all__ = [
    "AFFINITY_LOAD_FACTOR",
    "BALANCED_SPAN",
    "CHARS_PER_TOKEN",
    "COST_LATENCY_MARGIN",
    "HIGH_WATER",
    "MAX_IDS_IN_RECOMMENDATION",
    "NEAR_BEST_MS",
    "NEAR_BEST_SHARE",
    "PRIOR_SERVICE_MS",
    "PRIOR_TTFT_MS",
    "REJECTION_REASONS",
    "SOFT_REASONS",
    "TIE_MS",
    "CostPriority",
    "Decision",
    "FamilyEvaluation",
    "FleetView",
    "NoRoute",
    "NodeView",
    "PolicyView",
    "RejectionReason",
    "affinity_bound",
    "prompt_tokens_from_chars",
    "route",
]

PRIOR_TTFT_MS = 200.0
PRIOR_SERVICE_MS = 2000.0
COST_LATENCY_MARGIN = 1.25
HIGH_WATER = 0.8
BALANCED_SPAN = 0.2
TIE_MS = 1e-9
MAX_IDS_IN_RECOMMENDATION = 5
NEAR_BEST_SHARE = 0.25
NEAR_BEST_MS = 25.0
CHARS_PER_TOKEN = 4
AFFINITY_LOAD_FACTOR = 1.25

RejectionReason = Literal[
    "no_nodes_for_model",
    "health_score_below_threshold",
    "circuit_open",
    "all_nodes_over_capacity",
    "latency_target_exceeded",
    "excluded_after_failure",
]
REJECTION_REASONS: tuple[str, ...] = (
    "no_nodes_for_model",
    "health_score_below_threshold",
    "circuit_open",
    "all_nodes_over_capacity",
    "latency_target_exceeded",
    "excluded_after_failure",
)
SOFT_REASONS: tuple[str, ...] = ("above_high_water", "not_selected")

CostPriority = Literal["cost", "latency", "balanced"]

NO_VIABLE_NODE = "no_viable_node"

_INF = math.inf
_UTIL_ROUNDING = 1e-12  # 0.8 + 0.2 * 0.5 is 0.9000000000000001 in binary; U = 0.9 reaches it
_NO_NODES = "no_nodes_for_model"
_HEALTH = "health_score_below_threshold"
_CIRCUIT = "circuit_open"
_OVER = "all_nodes_over_capacity"
_LATENCY = "latency_target_exceeded"
_EXCLUDED = "excluded_after_failure"
_ABOVE_HIGH_WATER = "above_high_water"
_NOT_SELECTED = "not_selected"


class NodeView(Protocol):
    """What routing reads of one node (read-only)."""

    @property
    def id(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def max_concurrency(self) -> int:
        """Slots: requests the node runs at once (at least 1)."""

    @property
    def max_queue(self) -> int:
        """Requests zml may place in the node's own queue beyond its slots (at least 0)."""

    @property
    def load(self) -> int:
        """Requests on the node now, running and waiting (at least 0)."""

    @property
    def health(self) -> float:
        """Health score, 0..1."""

    @property
    def ttft_ms(self) -> float | None:
        """EWMA of observed time to first token; None until one is observed."""

    @property
    def service_ms(self) -> float | None:
        """EWMA of observed whole-request service time; None until one is observed."""

    def circuit_allows(self, now: float) -> bool:
        """False while the node's circuit breaker is open."""


class FleetView(Protocol):
    """What routing reads of the fleet registry."""

    def families(self) -> Sequence[str]:
        """Every family, in registry order."""

    def family_cost(self, family: str) -> float | None:
        """The family's cost_per_hour, None if not configured."""

    def nodes_for(self, model: str, family: str) -> Sequence[NodeView]:
        """The nodes of the family serving the model (pre-indexed, O(1)); empty if none."""


class PolicyView(Protocol):
    """What routing reads of a policy."""

    @property
    def name(self) -> str: ...
    @property
    def accelerator_chain(self) -> Sequence[str]: ...
    @property
    def latency_target_ms(self) -> float | None: ...
    @property
    def cost_priority(self) -> CostPriority: ...
    @property
    def health_threshold(self) -> float: ...


@dataclass(frozen=True, slots=True)
class FamilyEvaluation:
    """One family looked at: how many of its nodes serve the model and why it was not chosen."""

    family: str
    nodes_checked: int
    rejected_reason: str | None

    def as_dict(self) -> dict[str, object]:
        """The evaluation as a plain dict (``routing.evaluated`` entries, telemetry events)."""
        return {
            "family": self.family,
            "nodes_checked": self.nodes_checked,
            "rejected_reason": self.rejected_reason,
        }


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing decision: the node to send to, and the trace that led to it."""

    node: NodeView
    family: str
    predicted_ttft_ms: float
    evaluated: tuple[FamilyEvaluation, ...]
    base_ttft_ms: float | None = None
    """The node's base TTFT the prediction started from (its ``ttft_ms`` or the family prior);
    ``predicted_ttft_ms - base_ttft_ms`` is the part the model explains (prefill, requests
    ahead), which the fleet takes out of the observed TTFT it learns from (module docs)."""


@dataclass(frozen=True, slots=True)
class NoRoute:
    """No node can take the request; ``context()`` is the RoutingError's routing_context."""

    policy: str | None
    evaluated: tuple[FamilyEvaluation, ...]
    final_error: str
    recommendation: str

    def context(self) -> dict[str, object]:
        """The RoutingError's ``routing_context``: policy, families evaluated, final error."""
        return {
            "policy": self.policy,
            "evaluated": [e.as_dict() for e in self.evaluated],
            "final_error": self.final_error,
            "recommendation": self.recommendation,
        }


# --------------------------------------------------------------------------------------------
# per-family scans (the hot loops)


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


def _predict(node: NodeView) -> float:
    ttft = node.ttft_ms
    if ttft is None:
        ttft = PRIOR_TTFT_MS
    load = node.load
    mc = node.max_concurrency
    if load < mc:
        return ttft
    service = node.service_ms
    if service is None:
        service = PRIOR_SERVICE_MS
    return ttft + (load - mc + 1) * service / mc


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

    __slots__ = ("a", "b", "best", "ix", "limit", "own_ms", "skip", "skip_idx", "util")

    def __init__(self, ix: FamilyIndex, skip: AbstractSet[int], skip_idx: list[int], a: int, b: int,
                 best: float, util: float, own_ms: float, limit: float) -> None:
        self.ix = ix
        self.skip = skip
        self.skip_idx = skip_idx
        self.a = a
        self.b = b
        self.best = best
        self.util = util
        self.own_ms = own_ms
        self.limit = limit

    def _at(self, r: int) -> int:
        idx = self.a + r
        for f in self.skip_idx:
            if f <= idx:
                idx += 1
            else:
                break
        return idx

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
        m = self.b - self.a - len(self.skip_idx)
        if m == 1:
            key, pos = ordered[self._at(0)]
            return key + own, nodes[pos]
        i, j = _p2c(m, rng)
        ki, pi = ordered[self._at(i)]
        kj, pj = ordered[self._at(j)]
        if _less_loaded(nodes[pi], nodes[pj]):
            return kj + own, nodes[pj]
        return ki + own, nodes[pi]


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
    extra: set[int] = set()  # excluded nodes that pass checks 2-3
    if exclude:
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
                extra.add(pos)
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
    skip_idx: list[int] = []
    top = ordered[b - 1]
    for entry in fail.entries:
        if entry > top:
            break
        k = bisect_left(ordered, entry, a, b)
        if a < k < b:
            skip_idx.append(k)
    if extra:
        for pos in extra:
            own_entry = entries[pos]
            if own_entry is not None and own_entry <= top:
                k = bisect_left(ordered, own_entry, a, b)
                if a < k < b:
                    skip_idx.append(k)
        skip_idx.sort()
    skip = circuit.keys() | extra if extra else circuit.keys()
    util = (ix.sum_load - fail_load) / (ix.sum_cap - fail_cap)
    return _IndexFound(ix, skip, skip_idx, a, b, best, util, own_ms, limit)


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
    """An indexed family's least loaded viable nodes: ``by_ratio[a:]`` minus ``skip``."""

    __slots__ = ("a", "ix", "skip", "skip_idx")

    def __init__(self, ix: FamilyIndex, a: int, skip: AbstractSet[int]) -> None:
        self.ix = ix
        self.a = a
        self.skip = skip
        self.skip_idx: list[int] = []

    def count(self, hi: float) -> int:
        ix = self.ix
        by_ratio = ix.by_ratio
        a = self.a
        b = bisect_right(by_ratio, (hi, _INF), a)
        if b <= a:
            return 0
        top = by_ratio[b - 1]
        entries = ix.ratio_entries
        idx: list[int] = []
        for pos in self.skip:
            entry = entries[pos]
            if entry is not None and entry <= top:
                k = bisect_left(by_ratio, entry, a, b)
                if a < k < b:
                    idx.append(k)
        idx.sort()
        self.skip_idx = idx
        return b - a - len(idx)

    def get(self, r: int) -> NodeView:
        idx = self.a + r
        for f in self.skip_idx:
            if f <= idx:
                idx += 1
            else:
                break
        node: NodeView = self.ix.nodes[self.ix.by_ratio[idx][1]]
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
    extra: set[int] = set()
    if exclude:
        by_id = ix.by_id
        for node_id in exclude:
            pos = by_id.get(node_id)
            if pos is None:
                continue
            n_excl += 1
            failed = circuit.get(pos)
            if failed is None:
                extra.add(pos)
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
        in_order = sum(1 for pos in circuit if entries[pos] is not None)
        in_order += sum(1 for pos in extra if entries[pos] is not None)
        n_over = len(nodes) - size - (len(circuit) + len(extra) - in_order)
        return None, _INF, _family_reason(n_over, 0, n_circ, n_health, n_excl)
    skip = circuit.keys() | extra if extra else circuit.keys()
    return _RatioIndexed(ix, a, skip), by_ratio[a][0], ""


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


# --------------------------------------------------------------------------------------------
# recommendation


def _ids(ids: list[str], total: int) -> str:
    text = ", ".join(ids)
    if total > len(ids):
        text += f" and {total - len(ids)} more"
    return text


def _recommend(
    model: str,
    evaluated: Sequence[FamilyEvaluation],
    fleet: FleetView,
    now: float,
    threshold: float,
    exclude: AbstractSet[str],
    scope: str,
) -> str:
    reasons = {e.rejected_reason for e in evaluated}
    if _OVER in reasons:
        return "increase fleet capacity or enable queue_on_saturation"
    hints: list[str] = []
    if _HEALTH in reasons or _CIRCUIT in reasons:
        # Not on the hot path: walk the evaluated families again for the node ids.
        health: list[str] = []
        circuit: list[str] = []
        n_health = n_circuit = 0
        for e in evaluated:
            for node in fleet.nodes_for(model, e.family):
                if node.id in exclude:
                    continue
                if not node.circuit_allows(now):
                    n_circuit += 1
                    if len(circuit) < MAX_IDS_IN_RECOMMENDATION:
                        circuit.append(node.id)
                elif node.health < threshold:
                    n_health += 1
                    if len(health) < MAX_IDS_IN_RECOMMENDATION:
                        health.append(node.id)
        if _HEALTH in reasons:
            hints.append(f"check the health of nodes {_ids(health, n_health)}")
        if _CIRCUIT in reasons:
            hints.append(
                f"nodes {_ids(circuit, n_circuit)} are failing; "
                "check them or wait for the circuit breaker to close"
            )
    if _LATENCY in reasons:
        hints.append("raise latency_target_ms or add capacity to the chain's families")
    if _NO_NODES in reasons or not evaluated:
        hints.append(f"register nodes serving {model} in {scope}")
    if _EXCLUDED in reasons:
        hints.append("every candidate node failed for this request; see the attempts")
    return "; ".join(hints)


# --------------------------------------------------------------------------------------------
# route


def route(
    policy: PolicyView | None,
    model: str,
    fleet: FleetView,
    *,
    now: float,
    rng: random.Random,
    pinned_family: str | None = None,
    exclude: AbstractSet[str] = frozenset(),
    health_threshold: float = 0.5,
    prompt_tokens: int = 0,
    prefix_blocks: Sequence[Hashable] = (),
) -> Decision | NoRoute:
    """Choose the node for one request of ``model`` under ``policy`` (see the module docs).

    ``now`` is the time the circuit breakers are asked about, ``rng`` the only source of
    randomness (power-of-two-choices), ``pinned_family`` restricts the walk to one family,
    ``exclude`` holds the ids of nodes already tried for this request, ``health_threshold``
    applies only when ``policy`` is None (a policy brings its own), ``prompt_tokens`` is the
    request's prompt size (see :func:`prompt_tokens_from_chars`) and ``prefix_blocks`` the ids
    of its leading prefix blocks (used when the policy's ``affinity`` is ``"prefix"``).
    """
    if policy is None:
        return _route_without_policy(
            model, fleet, now, rng, pinned_family, exclude, health_threshold
        )

    mode = policy.cost_priority
    if mode not in ("cost", "latency", "balanced"):
        raise ValueError(
            f"policy {policy.name!r}: cost_priority must be 'cost', 'latency' or 'balanced', "
            f"not {mode!r}"
        )
    chain: Sequence[str]
    if pinned_family is not None:
        chain = (pinned_family,)
    else:
        chain = policy.accelerator_chain
        if len(set(chain)) != len(chain):
            chain = tuple(dict.fromkeys(chain))
    target = policy.latency_target_ms
    if target is None:
        limit = _INF
    elif mode == "cost":
        limit = target * COST_LATENCY_MARGIN
    else:
        limit = float(target)
    threshold = policy.health_threshold
    affinity_key: str | None = None
    if prefix_blocks and getattr(policy, "affinity", None) == "prefix":
        affinity_key = str(prefix_blocks[0])
    keep_all = affinity_key is not None
    family_prior = getattr(fleet, "family_prior", None)
    family_index = getattr(fleet, "family_index", None)
    tokens = prompt_tokens if prompt_tokens > 0 else 0
    walked: list[tuple[str, int, str | None]] = []  # (family, nodes_checked, reason)
    fallback: tuple[int, _ScanFound | _IndexFound] | None = None
    last = len(chain) - 1

    for i, family in enumerate(chain):
        found: _ScanFound | _IndexFound | str
        ix = family_index(model, family) if family_index is not None else None
        if ix is not None:
            checked = len(ix.nodes)
            found = _indexed(ix, now, threshold, limit, exclude, tokens * ix.ms_per_token)
        else:
            nodes = fleet.nodes_for(model, family)
            checked = len(nodes)
            prior = PRIOR_TTFT_MS
            ms_per_token = 0.0
            if family_prior is not None:
                prior, tps = family_prior(family)
                if tps:
                    ms_per_token = 1000.0 / tps
            own_ms = tokens * ms_per_token
            kept, best, util, reason = _scan(
                nodes, now, threshold, limit, exclude, prior, own_ms, ms_per_token, keep_all
            )
            found = _ScanFound(kept, best, util, own_ms, prior) if kept else reason
        if isinstance(found, str):
            walked.append((family, checked, found))
            continue
        if mode != "cost":
            ceiling = HIGH_WATER
            if mode == "balanced":
                nxt = chain[i + 1] if i < last else None
                ceiling += BALANCED_SPAN * _saving(fleet, family, nxt)
            if found.util >= ceiling - _UTIL_ROUNDING:
                if fallback is None:
                    fallback = (len(walked), found)
                walked.append((family, checked, _ABOVE_HIGH_WATER))
                continue
        walked.append((family, checked, None))
        pred, node = found.choose(rng, affinity_key)
        return Decision(node, family, pred, _trace(walked), _base(node, found))

    if fallback is not None:
        index, found = fallback
        family, checked, _ = walked[index]
        walked[index] = (family, checked, None)
        pred, node = found.choose(rng, affinity_key)
        return Decision(node, family, pred, _trace(walked), _base(node, found))

    evaluated = _trace(walked)
    return NoRoute(
        policy.name,
        evaluated,
        NO_VIABLE_NODE,
        _recommend(model, evaluated, fleet, now, threshold, exclude, "the chain's families"),
    )


def _base(node: NodeView, found: _ScanFound | _IndexFound) -> float:
    base = node.ttft_ms
    if base is None:
        return found.prior if isinstance(found, _ScanFound) else found.ix.prior
    return base


def _trace(walked: list[tuple[str, int, str | None]]) -> tuple[FamilyEvaluation, ...]:
    return tuple([FamilyEvaluation(f, n, r) for f, n, r in walked])


def _route_without_policy(
    model: str,
    fleet: FleetView,
    now: float,
    rng: random.Random,
    pinned_family: str | None,
    exclude: AbstractSet[str],
    threshold: float,
) -> Decision | NoRoute:
    families: Sequence[str] = (pinned_family,) if pinned_family is not None else fleet.families()
    family_index = getattr(fleet, "family_index", None)
    scans: list[tuple[str, int, _RatioScan | _RatioIndexed | None, float, str]] = []
    best = _INF
    for family in families:
        ix = family_index(model, family) if family_index is not None else None
        found: _RatioScan | _RatioIndexed | None
        if ix is not None:
            found, ratio, reason = _indexed_least_loaded(ix, now, threshold, exclude)
            checked = len(ix.nodes)
        else:
            nodes = fleet.nodes_for(model, family)
            ties, ratio, reason = _scan_least_loaded(nodes, now, threshold, exclude)
            found = _RatioScan(ties) if ties else None
            checked = len(nodes)
        scans.append((family, checked, found, ratio, reason))
        if ratio < best:
            best = ratio

    if best == _INF:
        evaluated = tuple(FamilyEvaluation(f, n, reason) for f, n, _, _, reason in scans)
        return NoRoute(
            None,
            evaluated,
            NO_VIABLE_NODE,
            _recommend(model, evaluated, fleet, now, threshold, exclude, "the fleet's families"),
        )

    hi = best + TIE_MS
    parts: list[tuple[int, _RatioScan | _RatioIndexed, str]] = []
    total = 0
    for family, _, found, ratio, _ in scans:
        if found is not None and ratio <= hi:
            n = found.count(hi)
            if n:
                parts.append((n, found, family))
                total += n

    def pick(r: int) -> tuple[NodeView, str]:
        for n, found, family in parts:
            if r < n:
                return found.get(r), family
            r -= n
        raise AssertionError("candidate index out of range")  # pragma: no cover

    if total == 1:
        chosen, chosen_family = pick(0)
    else:
        i, j = _p2c(total, rng)
        chosen, chosen_family = pick(i)
        other, other_family = pick(j)
        if _less_loaded(chosen, other):
            chosen, chosen_family = other, other_family
    trace = tuple(
        FamilyEvaluation(
            f,
            n,
            None if f == chosen_family else (_NOT_SELECTED if found is not None else reason),
        )
        for f, n, found, _, reason in scans
    )
    base = chosen.ttft_ms
    return Decision(chosen, chosen_family, _predict(chosen), trace,
                    PRIOR_TTFT_MS if base is None else base)
