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
another; a non-streamed request counts until its predicted TTFT has passed, see
``Fleet.reserve``) is read when the node has it. ``load`` counts every request on the node, this
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

import random
from collections.abc import Hashable, Sequence, Set as AbstractSet

from .routing_families import (
    _indexed,
    _indexed_least_loaded,
    _IndexFound,
    _less_loaded,
    _p2c,
    _RatioIndexed,
    _RatioScan,
    _saving,
    _scan,
    _scan_least_loaded,
    _ScanFound,
    affinity_bound,
    prompt_tokens_from_chars,
)
from .routing_index import base_key
from .routing_types import (
    _ABOVE_HIGH_WATER,
    _CIRCUIT,
    _EXCLUDED,
    _HEALTH,
    _INF,
    _LATENCY,
    _NO_NODES,
    _NOT_SELECTED,
    _OVER,
    _UTIL_ROUNDING,
    AFFINITY_LOAD_FACTOR,
    BALANCED_SPAN,
    CHARS_PER_TOKEN,
    COST_LATENCY_MARGIN,
    HIGH_WATER,
    MAX_IDS_IN_RECOMMENDATION,
    NEAR_BEST_MS,
    NEAR_BEST_SHARE,
    NO_VIABLE_NODE,
    PRIOR_SERVICE_MS,
    PRIOR_TTFT_MS,
    REJECTION_REASONS,
    SOFT_REASONS,
    TIE_MS,
    CostPriority,
    Decision,
    FamilyEvaluation,
    FleetView,
    NodeView,
    NoRoute,
    PolicyView,
    RejectionReason,
)

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
            model, fleet, now, rng, pinned_family, exclude, health_threshold,
            prompt_tokens if prompt_tokens > 0 else 0,
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
        if len(chain) > 1 and len(set(chain)) != len(chain):
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
    walked: list[FamilyEvaluation] = []
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
            walked.append(FamilyEvaluation(family, checked, found))
            continue
        if mode != "cost":
            ceiling = HIGH_WATER
            if mode == "balanced":
                nxt = chain[i + 1] if i < last else None
                ceiling += BALANCED_SPAN * _saving(fleet, family, nxt)
            if found.util >= ceiling - _UTIL_ROUNDING:
                if fallback is None:
                    fallback = (len(walked), found)
                walked.append(FamilyEvaluation(family, checked, _ABOVE_HIGH_WATER))
                continue
        walked.append(FamilyEvaluation(family, checked, None))
        pred, node = found.choose(rng, affinity_key)
        return Decision(node, family, pred, tuple(walked), _base(node, found))

    if fallback is not None:
        index, found = fallback
        family, checked, _ = walked[index]
        walked[index] = FamilyEvaluation(family, checked, None)
        pred, node = found.choose(rng, affinity_key)
        return Decision(node, family, pred, tuple(walked), _base(node, found))

    evaluated = tuple(walked)
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


def _route_without_policy(
    model: str,
    fleet: FleetView,
    now: float,
    rng: random.Random,
    pinned_family: str | None,
    exclude: AbstractSet[str],
    threshold: float,
    tokens: int = 0,
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
    # The prediction of the chosen node is the one a policy's walk makes (module docs): its
    # base TTFT or its family's prior, the prefill ahead of it and of this prompt, the queue.
    prior, ms_per_token = PRIOR_TTFT_MS, 0.0
    family_prior = getattr(fleet, "family_prior", None)
    if family_prior is not None:
        prior, tps = family_prior(chosen_family)
        if tps:
            ms_per_token = 1000.0 / tps
    base = chosen.ttft_ms
    return Decision(chosen, chosen_family,
                    base_key(chosen, prior, ms_per_token) + tokens * ms_per_token, trace,
                    prior if base is None else base)
