"""Property tests of zml.routing over random fleets and policies.

Besides direct invariants (the chosen node passes every check; chain order; trace shape;
determinism), every result is compared with a deliberately naive reference written from the
documented rules: per-node reasons computed one node at a time, no shortcuts.
"""

from __future__ import annotations

import random
import typing
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings, strategies as st

from tests.zml.random_fleets import MODEL, NOW, POOL, Fleet, Node, Policy, fleets, policies
from zml.routing import (
    COST_LATENCY_MARGIN,
    HIGH_WATER,
    NEAR_BEST_MS,
    NEAR_BEST_SHARE,
    PRIOR_SERVICE_MS,
    PRIOR_TTFT_MS,
    REJECTION_REASONS,
    Decision,
    NoRoute,
    route,
)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Policy | None, Fleet, frozenset[str], str | None, int]:
    fleet = draw(fleets())
    policy = draw(st.none() | policies)
    ids = [n.id for n in fleet.nodes]
    exclude = frozenset(draw(st.lists(st.sampled_from(ids), max_size=3))) if ids else frozenset()
    pinned = draw(st.none() | st.sampled_from(POOL))
    if draw(st.integers(0, 3)) > 0:
        pinned = None
    return policy, fleet, exclude, pinned, draw(st.integers(0, 2**32 - 1))


# ---------------------------------------------------------------------------------------------
# reference model, from the documented rules


def ref_pred(n: Node) -> float:
    ttft = PRIOR_TTFT_MS if n.ttft_ms is None else n.ttft_ms
    service = PRIOR_SERVICE_MS if n.service_ms is None else n.service_ms
    ahead = max(0, n.load - n.max_concurrency + 1)
    return ttft + ahead * service / n.max_concurrency


def ref_reason(n: Node, exclude: frozenset[str], threshold: float, limit: float) -> str | None:
    if n.id in exclude:
        return "excluded_after_failure"
    if not n.circuit_allows(NOW):
        return "circuit_open"
    if n.health < threshold:
        return "health_score_below_threshold"
    if n.load >= n.max_concurrency + n.max_queue:
        return "all_nodes_over_capacity"
    if ref_pred(n) > limit:
        return "latency_target_exceeded"
    return None


TIE_ORDER = [
    "all_nodes_over_capacity",
    "latency_target_exceeded",
    "circuit_open",
    "health_score_below_threshold",
    "excluded_after_failure",
]


@dataclass
class RefFamily:
    family: str
    checked: int
    viable: list[Node]
    util: float
    reason: str | None  # hard reason when nothing is viable


def ref_family(
    fleet: Fleet, family: str, exclude: frozenset[str], threshold: float, limit: float
) -> RefFamily:
    nodes = list(fleet.nodes_for(MODEL, family))
    reasons = [ref_reason(n, exclude, threshold, limit) for n in nodes]
    viable = [n for n, r in zip(nodes, reasons, strict=True) if r is None]
    passing = [
        n
        for n, r in zip(nodes, reasons, strict=True)
        if r not in ("excluded_after_failure", "circuit_open", "health_score_below_threshold")
    ]
    cap = sum(n.max_concurrency for n in passing)
    util = sum(n.load for n in passing) / cap if cap else float("inf")
    reason: str | None = None
    if not viable:
        if not nodes:
            reason = "no_nodes_for_model"
        else:
            counts = Counter(r for r in reasons if r is not None)
            reason = max(TIE_ORDER, key=lambda r: (counts[r], -TIE_ORDER.index(r)))
    return RefFamily(family, len(nodes), viable, util, reason)


def ref_chain(policy: Policy, pinned: str | None) -> list[str]:
    return [pinned] if pinned is not None else list(policy.accelerator_chain)


def ref_policy_outcome(
    policy: Policy, fleet: Fleet, exclude: frozenset[str], pinned: str | None
) -> tuple[str | None, list[tuple[str, int, str | None]], set[str]]:
    """(chosen family or None, expected trace, ids of the nodes the choice may fall on)."""
    chain = ref_chain(policy, pinned)
    target = policy.latency_target_ms
    if target is None:
        limit = float("inf")
    elif policy.cost_priority == "cost":
        limit = target * COST_LATENCY_MARGIN
    else:
        limit = target
    trace: list[tuple[str, int, str | None]] = []
    soft: int | None = None
    fams: list[RefFamily] = []
    for i, family in enumerate(chain):
        rf = ref_family(fleet, family, exclude, policy.health_threshold, limit)
        fams.append(rf)
        if not rf.viable:
            trace.append((family, rf.checked, rf.reason))
            continue
        ceiling = HIGH_WATER
        if policy.cost_priority == "balanced":
            s = 0.5
            if i + 1 < len(chain):
                this, nxt = fleet.family_cost(family), fleet.family_cost(chain[i + 1])
                if this is not None and nxt is not None:
                    s = 0.0 if nxt == 0 else min(1.0, max(0.0, (nxt - this) / nxt))
            ceiling = HIGH_WATER + 0.2 * s
        if policy.cost_priority != "cost" and rf.util >= ceiling - 1e-12:
            trace.append((family, rf.checked, "above_high_water"))
            soft = i if soft is None else soft
            continue
        trace.append((family, rf.checked, None))
        return family, trace, near_best_ids(rf.viable)
    if soft is not None:
        trace[soft] = (trace[soft][0], trace[soft][1], None)
        return chain[soft], trace, near_best_ids(fams[soft].viable)
    return None, trace, set()


def near_best_ids(nodes: list[Node]) -> set[str]:
    """The near-best window: within NEAR_BEST_SHARE and NEAR_BEST_MS of the best prediction."""
    low = min(ref_pred(n) for n in nodes)
    return {n.id for n in nodes if ref_pred(n) <= low * (1 + NEAR_BEST_SHARE) + NEAR_BEST_MS}


def best_ids(nodes: list[Node], key: typing.Callable[[Node], float]) -> set[str]:
    low = min(key(n) for n in nodes)
    return {n.id for n in nodes if key(n) <= low + 1e-9}


def ref_plain_outcome(
    fleet: Fleet, exclude: frozenset[str], pinned: str | None
) -> tuple[str | None, list[tuple[str, int, str | None]], set[str]]:
    families = [pinned] if pinned is not None else list(fleet.families())
    fams = [ref_family(fleet, f, exclude, 0.5, float("inf")) for f in families]
    viable = [n for rf in fams for n in rf.viable]
    if not viable:
        return None, [(rf.family, rf.checked, rf.reason) for rf in fams], set()
    ids = best_ids(viable, lambda n: n.load / n.max_concurrency)
    return "?", [(rf.family, rf.checked, rf.reason) for rf in fams], ids


def run(
    policy: Policy | None, fleet: Fleet, exclude: frozenset[str], pinned: str | None, seed: int
) -> Decision | NoRoute:
    return route(
        policy,
        MODEL,
        fleet,
        now=NOW,
        rng=random.Random(seed),
        pinned_family=pinned,
        exclude=exclude,
    )


def as_tuples(result: Decision | NoRoute) -> list[tuple[str, int, str | None]]:
    return [(e.family, e.nodes_checked, e.rejected_reason) for e in result.evaluated]


# ---------------------------------------------------------------------------------------------
# properties


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_chosen_node_passes_every_check(
    case: tuple[Policy | None, Fleet, frozenset[str], str | None, int],
) -> None:
    policy, fleet, exclude, pinned, seed = case
    result = run(policy, fleet, exclude, pinned, seed)
    if not isinstance(result, Decision):
        return
    n = result.node
    threshold = 0.5 if policy is None else policy.health_threshold
    assert n.load < n.max_concurrency + n.max_queue
    assert n.health >= threshold
    assert n.circuit_allows(NOW)
    assert n.id not in exclude
    assert n.family == result.family
    assert result.predicted_ttft_ms == ref_pred(n)  # type: ignore[arg-type]
    if policy is not None and policy.latency_target_ms is not None:
        margin = COST_LATENCY_MARGIN if policy.cost_priority == "cost" else 1.0
        assert result.predicted_ttft_ms <= policy.latency_target_ms * margin


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_chain_order_and_trace_shape(
    case: tuple[Policy | None, Fleet, frozenset[str], str | None, int],
) -> None:
    policy, fleet, exclude, pinned, seed = case
    result = run(policy, fleet, exclude, pinned, seed)
    families = [e.family for e in result.evaluated]
    if policy is None:
        expected_order = [pinned] if pinned is not None else list(fleet.families())
        assert families == expected_order
    else:
        chain = ref_chain(policy, pinned)
        if isinstance(result, NoRoute):
            assert families == chain  # every chain family exactly once, in order
        else:
            assert families == chain[: len(families)]  # a prefix of the chain: order, no dups
    if isinstance(result, NoRoute):
        assert result.policy == (None if policy is None else policy.name)
        assert result.final_error == "no_viable_node"
        assert all(e.rejected_reason in REJECTION_REASONS for e in result.evaluated)
        ctx = result.context()
        assert list(ctx) == ["policy", "evaluated", "final_error", "recommendation"]
        assert isinstance(ctx["recommendation"], str) and ctx["recommendation"]
        return
    chosen = families.index(result.family)
    assert result.evaluated[chosen].rejected_reason is None
    assert [e.rejected_reason for e in result.evaluated].count(None) == 1
    for e in result.evaluated[:chosen]:
        assert e.rejected_reason is not None
        if policy is not None:
            assert e.rejected_reason in (*REJECTION_REASONS, "above_high_water")
    if policy is not None and policy.cost_priority == "cost":
        # no earlier family had a viable node, and the walk stopped at the chosen one
        assert all(e.rejected_reason in REJECTION_REASONS for e in result.evaluated[:chosen])
        assert chosen == len(families) - 1


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_matches_the_reference_model(
    case: tuple[Policy | None, Fleet, frozenset[str], str | None, int],
) -> None:
    policy, fleet, exclude, pinned, seed = case
    result = run(policy, fleet, exclude, pinned, seed)
    if policy is None:
        family, trace, ids = ref_plain_outcome(fleet, exclude, pinned)
        if family is None:
            assert isinstance(result, NoRoute)
            assert as_tuples(result) == trace
            return
        assert isinstance(result, Decision)
        assert result.node.id in ids
        for (f, checked, reason), got in zip(trace, result.evaluated, strict=True):
            assert (got.family, got.nodes_checked) == (f, checked)
            if f == result.family:
                assert got.rejected_reason is None
            elif reason is None:
                assert got.rejected_reason == "not_selected"
            else:
                assert got.rejected_reason == reason
        return
    family, trace, ids = ref_policy_outcome(policy, fleet, exclude, pinned)
    assert as_tuples(result) == trace
    if family is None:
        assert isinstance(result, NoRoute)
    else:
        assert isinstance(result, Decision)
        assert result.family == family
        assert result.node.id in ids


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_same_seed_same_node(
    case: tuple[Policy | None, Fleet, frozenset[str], str | None, int],
) -> None:
    policy, fleet, exclude, pinned, seed = case
    first = run(policy, fleet, exclude, pinned, seed)
    again = run(policy, fleet, exclude, pinned, seed)
    assert type(first) is type(again)
    assert first.evaluated == again.evaluated
    if isinstance(first, Decision) and isinstance(again, Decision):
        assert first.node is again.node
        assert first.predicted_ttft_ms == again.predicted_ttft_ms
    else:
        assert first == again


@settings(max_examples=100, deadline=None)
@given(fleets(), policies, st.integers(0, 2**32 - 1))
def test_loads_and_states_are_not_mutated(fleet: Fleet, policy: Policy, seed: int) -> None:
    before = [(n.load, n.health, n.ttft_ms, n.service_ms, n.circuit_is_open) for n in fleet.nodes]
    run(policy, fleet, frozenset(), None, seed)
    run(None, fleet, frozenset(), None, seed)
    after = [(n.load, n.health, n.ttft_ms, n.service_ms, n.circuit_is_open) for n in fleet.nodes]
    assert after == before
