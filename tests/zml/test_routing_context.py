"""Unit tests of zml.routing: a pinned family, calls without a policy (the 0.2 behaviour),
NoRoute.context() and its recommendation, and that routing only reads its inputs."""

from __future__ import annotations

import typing

import pytest

from tests.zml.routing_world import (
    CAPACITY_HINT,
    MODEL,
    NOW,
    Fleet,
    Node,
    Policy,
    busy_family,
    decision,
    go,
    no_route,
    trace,
)
from zml.routing import REJECTION_REASONS, FamilyEvaluation

# ---------------------------------------------------------------------------------------------
# pinned family


def test_pinned_family_replaces_the_chain() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"))
    fleet = Fleet([Node("h1"), Node("m1", "MI300X"), Node("p1", "H100_PCIe")])
    d = decision(policy, fleet, pinned_family="MI300X")
    assert d.node.id == "m1"
    assert trace(d) == [("MI300X", 1, None)]
    d = decision(policy, fleet, pinned_family="H100_PCIe")  # need not be in the chain
    assert trace(d) == [("H100_PCIe", 1, None)]


def test_pinned_family_without_room_does_not_fall_back() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"))
    fleet = Fleet([Node("h1", load=8), Node("m1", "MI300X")])
    r = no_route(policy, fleet, pinned_family="H100")
    assert r.context()["evaluated"] == [
        {"family": "H100", "nodes_checked": 1, "rejected_reason": "all_nodes_over_capacity"}
    ]


def test_pinned_family_under_balanced_is_treated_as_last() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"), cost_priority="balanced")
    fleet = Fleet([*busy_family("H100", 0.95)], {"H100": 1.0, "MI300X": 100.0})
    # s = 0.5 as the only family -> above high water, but it is the only one: chosen anyway
    d = decision(policy, fleet, pinned_family="H100")
    assert trace(d) == [("H100", 2, None)]


# ---------------------------------------------------------------------------------------------
# no policy (0.2 behaviour)


def test_no_policy_picks_least_loaded_over_all_families() -> None:
    fleet = Fleet(
        [
            Node("h1", max_concurrency=4, load=2),
            Node("m1", "MI300X", max_concurrency=8, load=3),
            Node("p1", "H100_PCIe", health=0.0, load=0),
        ],
        families=("H100", "MI300X", "H100_PCIe", "A100"),
    )
    d = decision(None, fleet)
    assert d.node.id == "m1"
    assert d.family == "MI300X"
    assert trace(d) == [
        ("H100", 1, "not_selected"),
        ("MI300X", 1, None),
        ("H100_PCIe", 1, "health_score_below_threshold"),
        ("A100", 0, "no_nodes_for_model"),
    ]


def test_no_policy_has_no_latency_limit_and_uses_health_threshold_kwarg() -> None:
    fleet = Fleet([Node("h1", ttft_ms=60_000.0, health=0.4)])
    assert decision(None, fleet, health_threshold=0.3).node.id == "h1"
    r = no_route(None, fleet)  # default threshold 0.5
    assert r.policy is None
    assert r.context()["policy"] is None
    assert trace(r) == [("H100", 1, "health_score_below_threshold")]
    assert r.recommendation == "check the health of nodes h1"


def test_no_policy_ignores_the_health_threshold_kwarg_when_a_policy_is_given() -> None:
    fleet = Fleet([Node("h1", health=0.4)])
    policy = Policy(accelerator_chain=("H100",), health_threshold=0.3)
    assert decision(policy, fleet, health_threshold=0.9).node.id == "h1"


def test_no_policy_checks_room_exclude_and_circuit() -> None:
    fleet = Fleet(
        [
            Node("h1", load=8),
            Node("h2", load=0),
            Node("m1", "MI300X", load=0, open_until=NOW + 1),
            Node("m2", "MI300X", load=1),
        ]
    )
    d = decision(None, fleet, exclude={"h2"})
    assert d.node.id == "m2"
    assert trace(d) == [("H100", 2, "all_nodes_over_capacity"), ("MI300X", 2, None)]


def test_no_policy_pinned_family() -> None:
    fleet = Fleet([Node("h1", load=3), Node("m1", "MI300X", load=0)])
    d = decision(None, fleet, pinned_family="H100")
    assert d.node.id == "h1"
    assert trace(d) == [("H100", 1, None)]
    r = no_route(None, fleet, pinned_family="A100")
    assert r.context() == {
        "policy": None,
        "evaluated": [
            {"family": "A100", "nodes_checked": 0, "rejected_reason": "no_nodes_for_model"}
        ],
        "final_error": "no_viable_node",
        "recommendation": f"register nodes serving {MODEL} in the fleet's families",
    }


def test_no_policy_ties_across_families_are_deterministic() -> None:
    fleet = Fleet([Node(f"h{i}", load=1) for i in range(3)] + [Node("m0", "MI300X", load=1)])
    for seed in range(10):
        ids = {decision(None, fleet, seed=seed).node.id for _ in range(3)}
        assert len(ids) == 1
    assert len({decision(None, fleet, seed=s).node.id for s in range(60)}) == 4


def test_no_policy_tie_window_follows_the_true_minimum() -> None:
    big = 10**10
    nodes = [
        Node("a", max_concurrency=big, load=5_000_000_016),  # 0.5 + 1.6e-9: not a tie of c
        Node("b", max_concurrency=big, load=5_000_000_008),  # 0.5 + 0.8e-9
        Node("c", max_concurrency=2, load=1),  # 0.5
    ]
    # ties {b, c}; two choices over them always keeps c, the lower ratio
    assert {decision(None, Fleet(nodes), seed=s).node.id for s in range(40)} == {"c"}


def test_no_policy_prediction_is_reported() -> None:
    fleet = Fleet(
        [Node("h1", max_concurrency=2, load=3, max_queue=4, ttft_ms=100.0, service_ms=400.0)]
    )
    assert decision(None, fleet).predicted_ttft_ms == pytest.approx(100.0 + 2 * 400.0 / 2)


def test_no_policy_empty_fleet() -> None:
    r = no_route(None, Fleet([]))
    assert r.evaluated == ()
    assert r.recommendation == f"register nodes serving {MODEL} in the fleet's families"


# ---------------------------------------------------------------------------------------------
# NoRoute context and recommendations


def test_context_shape_is_exact() -> None:
    policy = Policy(name="llama3-production", accelerator_chain=("H100",))
    r = no_route(policy, Fleet([Node("h1", load=8)]))
    ctx = r.context()
    assert list(ctx) == ["policy", "evaluated", "final_error", "recommendation"]
    evaluated = ctx["evaluated"]
    assert isinstance(evaluated, list)
    assert all(list(e) == ["family", "nodes_checked", "rejected_reason"] for e in evaluated)
    assert ctx["final_error"] == "no_viable_node" == r.final_error
    assert ctx["policy"] == "llama3-production"


def test_seed_example() -> None:
    """The release post's example: H100 has 3 nodes over capacity, MI300X 2 unhealthy ones."""
    nodes = [Node(f"h100-{i}", "H100", 8, 8, 16) for i in range(3)]
    nodes += [Node(f"mi300x-{i}", "MI300X", health=0.2) for i in range(2)]
    fleet = Fleet(nodes, families=("H100", "MI300X", "H100_PCIe"))
    seed_context = {
        "policy": "llama3-production",
        "evaluated": [
            {"family": "H100", "nodes_checked": 3, "rejected_reason": "all_nodes_over_capacity"},
            {
                "family": "MI300X",
                "nodes_checked": 2,
                "rejected_reason": "health_score_below_threshold",
            },
        ],
        "final_error": "no_viable_node",
        "recommendation": "increase fleet capacity or enable queue_on_saturation",
    }
    two = Policy("llama3-production", ("H100", "MI300X"), 500, "balanced")
    assert no_route(two, fleet).context() == seed_context
    three = Policy("llama3-production", ("H100", "MI300X", "H100_PCIe"), 500, "balanced")
    ctx = no_route(three, fleet).context()
    assert ctx == {
        **seed_context,
        "evaluated": [
            *typing.cast(list[object], seed_context["evaluated"]),
            {"family": "H100_PCIe", "nodes_checked": 0, "rejected_reason": "no_nodes_for_model"},
        ],
    }


def test_recommendation_capacity_stands_alone() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X", "H100_PCIe"))
    fleet = Fleet([Node("h1", load=8), Node("m1", "MI300X", open_until=NOW + 1)])
    assert no_route(policy, fleet).recommendation == CAPACITY_HINT


def test_recommendation_joins_hints_in_priority_order() -> None:
    policy = Policy(
        accelerator_chain=("A100", "H100_PCIe", "MI300X", "H100", "TPU"),
        latency_target_ms=200,
        cost_priority="latency",
    )
    fleet = Fleet(
        [
            Node("x1", "A100"),
            Node("p1", "H100_PCIe", ttft_ms=900.0),
            Node("m1", "MI300X", open_until=NOW + 1),
            Node("h1", "H100", health=0.0),
        ]
    )
    r = no_route(policy, fleet, exclude={"x1"})
    assert r.recommendation == "; ".join(
        [
            "check the health of nodes h1",
            "nodes m1 are failing; check them or wait for the circuit breaker to close",
            "raise latency_target_ms or add capacity to the chain's families",
            f"register nodes serving {MODEL} in the chain's families",
            "every candidate node failed for this request; see the attempts",
        ]
    )


def test_recommendation_names_at_most_five_nodes() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"))
    nodes = [Node(f"h{i}", health=0.0) for i in range(4)]
    nodes += [Node(f"m{i}", "MI300X", health=0.0) for i in range(3)]
    r = no_route(policy, Fleet(nodes))
    assert r.recommendation == "check the health of nodes h0, h1, h2, h3, m0 and 2 more"
    circuit = [Node(f"c{i}", open_until=NOW + 1) for i in range(2)]
    r = no_route(Policy(accelerator_chain=("H100",)), Fleet(circuit))
    assert r.recommendation == (
        "nodes c0, c1 are failing; check them or wait for the circuit breaker to close"
    )


def test_context_reasons_are_from_the_closed_set() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"), cost_priority="latency")
    fleet = Fleet([Node("h1", ttft_ms=5000.0), Node("m1", "MI300X", open_until=NOW + 1)])
    for e in no_route(policy, fleet).evaluated:
        assert e.rejected_reason in REJECTION_REASONS


# ---------------------------------------------------------------------------------------------
# purity


def test_route_reads_without_mutating() -> None:
    nodes = [Node("h1", load=3), Node("m1", "MI300X", health=0.0)]
    before = [vars(n).copy() for n in nodes]
    fleet = Fleet(nodes)
    for policy in (None, Policy(), Policy(cost_priority="cost"), Policy(cost_priority="latency")):
        go(policy, fleet, exclude={"x"})
    assert [vars(n) for n in nodes] == before


def test_decision_is_frozen_and_carries_the_node() -> None:
    node = Node("h1")
    d = decision(Policy(accelerator_chain=("H100",)), Fleet([node]))
    assert d.node is node
    assert d.evaluated == (FamilyEvaluation("H100", 1, None),)
    with pytest.raises(AttributeError):
        d.family = "x"  # type: ignore[misc]
