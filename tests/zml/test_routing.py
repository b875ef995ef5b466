"""Unit tests of zml.routing: node checks, family acceptance per cost_priority, predictions and
ties (see test_routing_context.py for pinned families, calls without a policy and NoRoute)."""

from __future__ import annotations

import random
import typing
from dataclasses import dataclass

import pytest

from tests.zml.routing_world import (
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
from zml import routing
from zml.routing import (
    COST_LATENCY_MARGIN,
    HIGH_WATER,
    NEAR_BEST_MS,
    NEAR_BEST_SHARE,
    PRIOR_SERVICE_MS,
    PRIOR_TTFT_MS,
    REJECTION_REASONS,
    SOFT_REASONS,
    Decision,
    FamilyEvaluation,
    route,
)

# ---------------------------------------------------------------------------------------------
# the module's documented surface


def test_rejection_reasons_is_the_closed_literal_set() -> None:
    assert set(REJECTION_REASONS) == set(typing.get_args(routing.RejectionReason))
    assert len(REJECTION_REASONS) == 6
    assert not set(SOFT_REASONS) & set(REJECTION_REASONS)


def test_docstring_documents_every_reason_and_constant() -> None:
    doc = routing.__doc__ or ""
    for reason in (*REJECTION_REASONS, *SOFT_REASONS):
        assert f"``{reason}``" in doc, reason
    for name, value in [
        ("PRIOR_TTFT_MS", "200.0"),
        ("PRIOR_SERVICE_MS", "2000.0"),
        ("COST_LATENCY_MARGIN", "1.25"),
        ("HIGH_WATER", "0.8"),
        ("BALANCED_SPAN", "0.2"),
        ("TIE_MS", "1e-9"),
        ("MAX_IDS_IN_RECOMMENDATION", "5"),
    ]:
        assert f"``{name} = {value}``" in doc, name
        assert getattr(routing, name) == float(value)
    assert "balanced weighs cost saving against latency risk" in doc


def test_family_evaluation_as_dict_keys() -> None:
    e = FamilyEvaluation("H100", 3, "circuit_open")
    assert list(e.as_dict()) == ["family", "nodes_checked", "rejected_reason"]
    assert e.as_dict() == {"family": "H100", "nodes_checked": 3, "rejected_reason": "circuit_open"}
    with pytest.raises(AttributeError):
        e.family = "x"  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# node checks, one reason at a time


def test_no_nodes_for_model() -> None:
    fleet = Fleet([Node("h1", models=("other-model",))])
    r = no_route(Policy(accelerator_chain=("H100",)), fleet)
    assert trace(r) == [("H100", 0, "no_nodes_for_model")]
    assert r.recommendation == f"register nodes serving {MODEL} in the chain's families"


def test_family_unknown_to_the_fleet_is_no_nodes_for_model() -> None:
    fleet = Fleet([Node("h1")])
    r = decision(Policy(accelerator_chain=("TPUv5", "H100")), fleet)
    assert trace(r) == [("TPUv5", 0, "no_nodes_for_model"), ("H100", 1, None)]


def test_health_below_threshold_rejected_at_threshold_accepted() -> None:
    policy = Policy(accelerator_chain=("H100",), health_threshold=0.7)
    r = no_route(policy, Fleet([Node("h1", health=0.69), Node("h2", health=0.1)]))
    assert trace(r) == [("H100", 2, "health_score_below_threshold")]
    assert decision(policy, Fleet([Node("h1", health=0.7)])).node.id == "h1"


def test_circuit_open_uses_now() -> None:
    policy = Policy(accelerator_chain=("H100",))
    fleet = Fleet([Node("h1", open_until=NOW + 1)])
    r = no_route(policy, fleet)
    assert trace(r) == [("H100", 1, "circuit_open")]
    later = route(policy, MODEL, fleet, now=NOW + 1, rng=random.Random(0))
    assert isinstance(later, Decision)


def test_over_capacity_counts_the_node_queue() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    full = Node("h1", max_concurrency=4, max_queue=2, load=6)
    assert trace(no_route(policy, Fleet([full]))) == [("H100", 1, "all_nodes_over_capacity")]
    last_room = Node("h1", max_concurrency=4, max_queue=2, load=5)
    assert decision(policy, Fleet([last_room])).node is last_room
    no_queue = Node("h1", max_concurrency=4, max_queue=0, load=4)
    assert trace(no_route(policy, Fleet([no_queue])))[0][2] == "all_nodes_over_capacity"


def test_latency_target_exceeded() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=500, cost_priority="latency")
    r = no_route(policy, Fleet([Node("h1", ttft_ms=501.0)]))
    assert trace(r) == [("H100", 1, "latency_target_exceeded")]
    assert r.recommendation == "raise latency_target_ms or add capacity to the chain's families"
    assert decision(policy, Fleet([Node("h1", ttft_ms=500.0)])).predicted_ttft_ms == 500.0


def test_no_latency_target_means_no_limit() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None, cost_priority="latency")
    node = Node("h1", ttft_ms=90_000.0)
    assert decision(policy, Fleet([node])).node is node


def test_excluded_after_failure() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"))
    fleet = Fleet([Node("h1"), Node("h2"), Node("m1", "MI300X")])
    d = decision(policy, fleet, exclude={"h1", "h2"})
    assert d.node.id == "m1"
    assert trace(d) == [("H100", 2, "excluded_after_failure"), ("MI300X", 1, None)]
    r = no_route(policy, fleet, exclude=frozenset({"h1", "h2", "m1"}))
    assert [e.rejected_reason for e in r.evaluated] == ["excluded_after_failure"] * 2
    assert r.recommendation == "every candidate node failed for this request; see the attempts"


def test_checks_apply_in_documented_order() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=100)
    # excluded beats everything else
    bad: dict[str, typing.Any] = dict(open_until=NOW + 5, health=0.0, load=99, ttft_ms=9999.0)
    assert trace(no_route(policy, Fleet([Node("a", **bad)]), exclude={"a"}))[0][2] == (
        "excluded_after_failure"
    )
    assert trace(no_route(policy, Fleet([Node("a", **bad)])))[0][2] == "circuit_open"
    bad.pop("open_until")
    assert trace(no_route(policy, Fleet([Node("a", **bad)])))[0][2] == (
        "health_score_below_threshold"
    )
    bad.pop("health")
    assert trace(no_route(policy, Fleet([Node("a", **bad)])))[0][2] == "all_nodes_over_capacity"
    bad.pop("load")
    assert trace(no_route(policy, Fleet([Node("a", **bad)])))[0][2] == "latency_target_exceeded"


def test_family_reason_is_most_frequent_node_reason() -> None:
    policy = Policy(accelerator_chain=("H100",))
    nodes = [
        Node("a", health=0.1),
        Node("b", health=0.1),
        Node("c", open_until=NOW + 1),
        Node("d", load=8),
    ]
    r = no_route(policy, Fleet(nodes))
    assert trace(r) == [("H100", 4, "health_score_below_threshold")]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (["over", "latency"], "all_nodes_over_capacity"),
        (["latency", "circuit"], "latency_target_exceeded"),
        (["circuit", "health"], "circuit_open"),
        (["health", "excluded"], "health_score_below_threshold"),
        (["excluded", "health", "circuit", "latency", "over"], "all_nodes_over_capacity"),
        (["excluded", "excluded", "over"], "excluded_after_failure"),
    ],
)
def test_family_reason_ties_follow_documented_order(kinds: list[str], expected: str) -> None:
    make = {
        "over": lambda i: Node(i, load=8),
        "latency": lambda i: Node(i, ttft_ms=800.0),
        "circuit": lambda i: Node(i, open_until=NOW + 1),
        "health": lambda i: Node(i, health=0.0),
        "excluded": lambda i: Node(i),
    }
    nodes = [make[k](f"n{i}") for i, k in enumerate(kinds)]
    excluded = {n.id for n, k in zip(nodes, kinds, strict=True) if k == "excluded"}
    policy = Policy(accelerator_chain=("H100",), cost_priority="latency")
    r = no_route(policy, Fleet(nodes), exclude=excluded)
    assert trace(r) == [("H100", len(nodes), expected)]


# ---------------------------------------------------------------------------------------------
# predicted TTFT


def test_prediction_with_free_slot_is_the_ttft() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    assert decision(policy, Fleet([Node("a", load=3, ttft_ms=120.0)])).predicted_ttft_ms == 120.0


def test_prediction_adds_a_share_of_service_per_request_ahead() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    node = Node("a", max_concurrency=4, max_queue=8, load=6, ttft_ms=100.0, service_ms=1000.0)
    # ahead = 6 - 4 + 1 = 3 -> 100 + 3 * 1000 / 4
    assert decision(policy, Fleet([node])).predicted_ttft_ms == pytest.approx(850.0)


def test_priors_until_observed() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    fresh = Node("a", max_concurrency=2, max_queue=4, load=2, ttft_ms=None, service_ms=None)
    expected = PRIOR_TTFT_MS + 1 * PRIOR_SERVICE_MS / 2
    assert decision(policy, Fleet([fresh])).predicted_ttft_ms == pytest.approx(expected)
    observed_zero = Node("b", ttft_ms=0.0)
    assert decision(policy, Fleet([observed_zero])).predicted_ttft_ms == 0.0


def test_lowest_prediction_wins_within_family() -> None:
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    nodes = [
        Node("slow", ttft_ms=300.0),
        Node("queued", ttft_ms=50.0, load=4, service_ms=1000.0),  # 50 + 250
        Node("fast", ttft_ms=120.0, load=3),
    ]
    d = decision(policy, Fleet(nodes))
    assert d.node.id == "fast"
    assert d.predicted_ttft_ms == 120.0


# ---------------------------------------------------------------------------------------------
# cost_priority


CHAIN2 = ("H100", "MI300X")


def test_latency_leaves_family_at_high_water() -> None:
    policy = Policy(accelerator_chain=CHAIN2, cost_priority="latency")
    at_high_water = Fleet([*busy_family("H100", HIGH_WATER), Node("m1", "MI300X")])
    d = decision(policy, at_high_water)
    assert d.family == "MI300X"
    assert trace(d) == [("H100", 2, "above_high_water"), ("MI300X", 1, None)]
    below = Fleet([*busy_family("H100", 0.75), Node("m1", "MI300X")])
    assert decision(policy, below).family == "H100"


def test_latency_utilisation_ignores_rejected_nodes_but_counts_full_ones() -> None:
    policy = Policy(accelerator_chain=CHAIN2, cost_priority="latency", latency_target_ms=None)
    # passing nodes: 7 + 0 of 10 slots = 0.7 (the open and sick nodes do not count)
    nodes = [
        Node("h-busy", max_concurrency=5, max_queue=2, load=7),  # full (over capacity)
        Node("h-idle", max_concurrency=5, max_queue=0, load=0),
        Node("h-open", max_concurrency=5, load=0, open_until=NOW + 1),
        Node("h-sick", max_concurrency=5, load=0, health=0.1),
        Node("m1", "MI300X"),
    ]
    assert decision(policy, Fleet(nodes)).node.id == "h-idle"
    nodes[1].load = 1  # 8 / 10 = 0.8 -> leave
    assert decision(policy, Fleet(nodes)).family == "MI300X"


def test_latency_falls_back_to_first_soft_rejected_family() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X", "H100_PCIe"), cost_priority="latency")
    fleet = Fleet(
        [
            *busy_family("H100", 0.9),
            *busy_family("MI300X", 0.95),
            Node("p1", "H100_PCIe", health=0.0),
        ]
    )
    d = decision(policy, fleet)
    assert d.family == "H100"
    assert trace(d) == [
        ("H100", 2, None),
        ("MI300X", 2, "above_high_water"),
        ("H100_PCIe", 1, "health_score_below_threshold"),
    ]


def test_latency_fallback_keeps_earlier_hard_rejections() -> None:
    policy = Policy(accelerator_chain=("H100", "MI300X"), cost_priority="latency")
    fleet = Fleet([Node("h1", load=8), *busy_family("MI300X", 0.9)])
    d = decision(policy, fleet)
    assert d.family == "MI300X"
    assert trace(d) == [("H100", 1, "all_nodes_over_capacity"), ("MI300X", 2, None)]


def test_cost_holds_to_family_through_queue_room() -> None:
    policy = Policy(accelerator_chain=CHAIN2, cost_priority="cost", latency_target_ms=None)
    # every slot busy and most of the queue room used: U = 1.75
    nodes = [
        Node("h1", max_concurrency=4, max_queue=4, load=7),
        Node("h2", max_concurrency=4, max_queue=4, load=7),
        Node("m1", "MI300X"),
    ]
    d = decision(policy, Fleet(nodes))
    assert d.family == "H100"
    assert trace(d) == [("H100", 2, None)]  # the walk stopped there
    for n in nodes[:2]:
        n.load = 8
    assert decision(policy, Fleet(nodes)).family == "MI300X"


def test_cost_accepts_up_to_the_latency_margin() -> None:
    target = 500.0
    cost = Policy(accelerator_chain=CHAIN2, cost_priority="cost", latency_target_ms=target)
    latency = Policy(accelerator_chain=CHAIN2, cost_priority="latency", latency_target_ms=target)
    balanced = Policy(accelerator_chain=CHAIN2, cost_priority="balanced", latency_target_ms=target)
    fleet = Fleet([Node("h1", ttft_ms=1.2 * target), Node("m1", "MI300X", ttft_ms=100.0)])
    assert decision(cost, fleet).family == "H100"
    assert decision(cost, fleet).predicted_ttft_ms == pytest.approx(600.0)
    assert decision(latency, fleet).family == "MI300X"
    assert decision(balanced, fleet).family == "MI300X"
    at_margin = Fleet([Node("h1", ttft_ms=COST_LATENCY_MARGIN * target), Node("m1", "MI300X")])
    assert decision(cost, at_margin).family == "H100"
    over = Fleet([Node("h1", ttft_ms=1.3 * target), Node("m1", "MI300X")])
    d = decision(cost, over)
    assert trace(d) == [("H100", 1, "latency_target_exceeded"), ("MI300X", 1, None)]


def test_cost_ignores_high_water() -> None:
    policy = Policy(accelerator_chain=CHAIN2, cost_priority="cost")
    fleet = Fleet([*busy_family("H100", 0.99), Node("m1", "MI300X")])
    assert decision(policy, fleet).family == "H100"


@pytest.mark.parametrize(
    ("costs", "util", "stays"),
    [
        # s = (2 - 1) / 2 = 0.5 -> threshold 0.9
        ({"H100": 1.0, "MI300X": 2.0}, 0.85, True),
        ({"H100": 1.0, "MI300X": 2.0}, 0.9, False),
        # s = (4 - 1) / 4 = 0.75 -> threshold 0.95
        ({"H100": 1.0, "MI300X": 4.0}, 0.9, True),
        ({"H100": 1.0, "MI300X": 4.0}, 0.95, False),
        # staying is dearer: s clamped to 0 -> threshold 0.8 (like "latency")
        ({"H100": 3.0, "MI300X": 2.0}, 0.75, True),
        ({"H100": 3.0, "MI300X": 2.0}, 0.8, False),
        # this family is free: s = 1 -> threshold 1.0
        ({"H100": 0.0, "MI300X": 2.0}, 0.95, True),
        ({"H100": 0.0, "MI300X": 2.0}, 1.0, False),
        # the next family is free: s = 0
        ({"H100": 1.0, "MI300X": 0.0}, 0.8, False),
        # unknown cost -> s = 0.5 -> threshold 0.9
        ({}, 0.85, True),
        ({}, 0.9, False),
        ({"H100": 1.0}, 0.85, True),
        ({"MI300X": 1.0}, 0.9, False),
    ],
)
def test_balanced_threshold_weighs_cost_saving(
    costs: dict[str, float | None], util: float, stays: bool
) -> None:
    policy = Policy(accelerator_chain=CHAIN2, cost_priority="balanced", latency_target_ms=None)
    fleet = Fleet([*busy_family("H100", util, n=2, slots=10), Node("m1", "MI300X")], costs)
    d = decision(policy, fleet)
    assert d.family == ("H100" if stays else "MI300X")
    if not stays:
        assert trace(d)[0] == ("H100", 2, "above_high_water")


def test_balanced_last_family_uses_half_saving() -> None:
    policy = Policy(accelerator_chain=("MI300X", "H100"), cost_priority="balanced")
    costs = {"H100": 1.0, "MI300X": 10.0}
    # MI300X saturated -> walk on; H100 is the last family: threshold 0.9 whatever the costs
    for util, family in [(0.85, "H100"), (0.9, "MI300X")]:
        fleet = Fleet([*busy_family("MI300X", 0.99), *busy_family("H100", util)], costs)
        assert decision(policy, fleet).family == family


def test_balanced_next_family_is_the_chains_not_the_registrys() -> None:
    costs = {"H100": 1.0, "MI300X": 1.0, "H100_PCIe": 10.0}
    fleet = Fleet(
        [*busy_family("H100", 0.85), Node("m1", "MI300X"), Node("p1", "H100_PCIe")],
        costs,
        families=("H100", "MI300X", "H100_PCIe"),
    )
    # next in the chain is H100_PCIe: s = 0.9 -> threshold 0.98 -> stay
    policy = Policy(accelerator_chain=("H100", "H100_PCIe", "MI300X"))
    assert decision(policy, fleet).family == "H100"
    # next in the chain is MI300X: s = 0 -> threshold 0.8 -> leave
    policy = Policy(accelerator_chain=("H100", "MI300X", "H100_PCIe"))
    assert decision(policy, fleet).family == "MI300X"


def test_invalid_cost_priority_raises() -> None:
    policy = Policy(cost_priority="fastest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cost_priority"):
        go(policy, Fleet([Node("h1")]))


def test_duplicate_chain_entries_are_walked_once() -> None:
    policy = Policy(accelerator_chain=("H100", "H100", "MI300X"))
    r = no_route(policy, Fleet([Node("h1", health=0.0)]))
    assert [e.family for e in r.evaluated] == ["H100", "MI300X"]


# ---------------------------------------------------------------------------------------------
# ties and power of two choices


def tied_nodes() -> list[Node]:
    # identical prediction (free slot, same TTFT), different loads
    return [Node(f"t{i}", max_concurrency=8, load=i, ttft_ms=100.0) for i in range(6)]


def test_ties_are_broken_deterministically_per_seed() -> None:
    policy = Policy(accelerator_chain=("H100",))
    fleet = Fleet(tied_nodes())
    for seed in range(20):
        first = decision(policy, fleet, seed=seed).node.id
        assert all(decision(policy, fleet, seed=seed).node.id == first for _ in range(3))


def test_two_choices_never_picks_the_most_loaded_tie_and_spreads() -> None:
    policy = Policy(accelerator_chain=("H100",))
    fleet = Fleet(tied_nodes())
    chosen = [decision(policy, fleet, seed=seed).node.id for seed in range(300)]
    assert "t5" not in chosen  # it loses every pair it is sampled in
    assert chosen.count("t0") > chosen.count("t4")
    assert len(set(chosen)) >= 4  # not always the same node


def test_two_tied_nodes_pick_the_less_loaded() -> None:
    policy = Policy(accelerator_chain=("H100",))
    fleet = Fleet([Node("busy", load=3), Node("idle", load=1)])
    assert {decision(policy, fleet, seed=s).node.id for s in range(30)} == {"idle"}


def test_near_best_window_shares_load_but_excludes_clearly_slower_nodes() -> None:
    # Rule changed deliberately (no herding): the old exact-tie window (TIE_MS) became the
    # near-best window best * (1 + NEAR_BEST_SHARE) + NEAR_BEST_MS.
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    best = 100.0
    edge = best * (1 + NEAR_BEST_SHARE) + NEAR_BEST_MS
    nodes = [
        Node("best", ttft_ms=best),
        Node("inside", ttft_ms=edge),
        Node("outside", ttft_ms=edge + 1e-6),
    ]
    chosen = {decision(policy, Fleet(nodes), seed=s).node.id for s in range(40)}
    assert chosen == {"best", "inside"}


def test_sequential_requests_on_equal_loads_spread_over_the_near_best() -> None:
    # the herding case: one node observed a little faster than the others' prediction
    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    nodes = [Node("fast", ttft_ms=40.0), Node("b", ttft_ms=None), Node("c", ttft_ms=55.0)]
    fleet = Fleet(nodes)
    rng = random.Random(1)
    picks = [route(policy, MODEL, fleet, now=NOW, rng=rng).node.id  # type: ignore[union-attr]
             for _ in range(12)]
    assert set(picks) == {"fast", "c"}  # b's 200 ms prior is outside the window of 40 ms


@pytest.mark.parametrize("priority", ["cost", "latency", "balanced"])
def test_window_follows_the_true_minimum(
    priority: typing.Literal["cost", "latency", "balanced"],
) -> None:
    policy = Policy(accelerator_chain=("H100",), cost_priority=priority, latency_target_ms=None)
    # "a" is inside the window of "b" (seen first) but outside the window of "c"
    nodes = [
        Node("b", max_concurrency=8, load=5, ttft_ms=120.0),
        Node("a", max_concurrency=8, load=0, ttft_ms=140.0),
        Node("c", max_concurrency=8, load=6, ttft_ms=80.0),
    ]
    chosen = {decision(policy, Fleet(nodes), seed=s).node.id for s in range(40)}
    assert chosen == {"b"}  # window of c is 125: p2c over {b, c}, b is less loaded


def test_single_near_best_node_does_not_touch_rng() -> None:
    policy = Policy(accelerator_chain=("H100",))
    rng = random.Random(7)
    state = rng.getstate()
    route(policy, MODEL, Fleet([Node("a"), Node("b", ttft_ms=250.0)]), now=NOW, rng=rng)
    assert rng.getstate() == state


def test_prompt_size_adds_prefill_at_the_familys_throughput() -> None:
    class Priors(Fleet):
        def family_prior(self, family: str) -> tuple[float, float | None]:
            return 10.0, 20_000.0

    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    fleet = Priors([Node("a", ttft_ms=None)])
    tokens = routing.prompt_tokens_from_chars(48_000)
    assert tokens == 12_000
    long = decision(policy, fleet, prompt_tokens=tokens).predicted_ttft_ms
    short = decision(policy, fleet, prompt_tokens=200).predicted_ttft_ms
    assert long == pytest.approx(10.0 + 12_000 / 20.0)
    assert short == pytest.approx(10.0 + 200 / 20.0)
    assert routing.prompt_tokens_from_chars(0) == 0
    assert routing.prompt_tokens_from_chars(5) == 2


def test_prefill_ahead_counts_whether_or_not_the_slots_are_taken() -> None:
    class Priors(Fleet):
        def family_prior(self, family: str) -> tuple[float, float | None]:
            return 10.0, 1000.0

    @dataclass
    class Busy(Node):
        prefill_tokens: int = 0

    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    full = Busy("a", max_concurrency=2, max_queue=4, load=4, ttft_ms=None, service_ms=1000.0,
                prefill_tokens=4000)
    pred = decision(policy, Priors([full]), prompt_tokens=100).predicted_ttft_ms
    # 10 + 100 own tokens + 4000 tokens still to prefill + (4 - 2 + 1) * 1000 / 2 for the slots
    assert pred == pytest.approx(10.0 + 100.0 + 4000.0 + 1500.0)
    free = Busy("b", max_concurrency=8, max_queue=0, load=2, ttft_ms=30.0, prefill_tokens=600)
    got = decision(policy, Priors([free]), prompt_tokens=100)
    # a free slot, but the node's prefill lane still holds 600 tokens ahead of this request
    assert got.predicted_ttft_ms == pytest.approx(30.0 + 100.0 + 600.0)
    assert got.base_ttft_ms == 30.0


def test_a_node_prefilling_long_prompts_loses_to_an_idle_one() -> None:
    class Priors(Fleet):
        def family_prior(self, family: str) -> tuple[float, float | None]:
            return 10.0, 10_000.0

    @dataclass
    class Busy(Node):
        prefill_tokens: int = 0

    policy = Policy(accelerator_chain=("H100",), latency_target_ms=500)
    busy = Busy("busy", max_concurrency=32, load=1, ttft_ms=10.0, prefill_tokens=12_000)
    idle = Busy("idle", max_concurrency=32, load=0, ttft_ms=10.0)
    for seed in range(20):
        got = route(policy, MODEL, Priors([busy, idle]), now=NOW, rng=random.Random(seed),
                    prompt_tokens=200)
        assert isinstance(got, Decision) and got.node is idle


def test_an_unobserved_node_is_explored_with_an_optimistic_prior() -> None:
    class Priors(Fleet):
        def family_prior(self, family: str) -> tuple[float, float | None]:
            return 10.0, None

    policy = Policy(accelerator_chain=("H100",), latency_target_ms=None)
    fleet = Priors([Node("seen", ttft_ms=30.0), Node("new", ttft_ms=None)])
    chosen = {decision(policy, fleet, seed=s).node.id for s in range(20)}
    assert "new" in chosen


def test_without_a_policy_the_prediction_is_the_one_a_policy_makes(tmp_path: typing.Any) -> None:
    """The family's prior and the prompt's prefill, not the 200 ms test-double prior."""
    import zml

    path = tmp_path / "zml.toml"
    path.write_text('[accelerators.H100]\n[[nodes]]\nid = "n1"\nfamily = "H100"\n'
                    'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 2\n')
    with zml.Client(config=path, probe_interval_s=None) as client:
        for text in ("hi", "word " * 8000):
            messages = [{"role": "user", "content": text}]
            with_policy = client.explain("m", messages, policy={"name": "p", "accelerator_chain": ["H100"]})
            without = client.explain("m", messages)
            pinned = client.explain("m", messages, accelerator="H100")
            assert isinstance(with_policy, Decision) and isinstance(without, Decision)
            assert isinstance(pinned, Decision)
            assert without.predicted_ttft_ms == pytest.approx(with_policy.predicted_ttft_ms)
            assert pinned.predicted_ttft_ms == pytest.approx(with_policy.predicted_ttft_ms)
        assert without.predicted_ttft_ms > 100  # a 40,000-character prompt's prefill counts
