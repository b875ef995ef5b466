"""The baseline strategies: what each picks, from its public description."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest

from zml.strategies import (
    STRATEGIES,
    StrategyState,
    latency_based,
    least_busy,
    random_choice,
    round_robin,
)


@dataclass
class Node:
    id: str
    in_flight: int = 0
    latency_ms: float | None = None


def test_the_table_names_every_strategy():
    assert set(STRATEGIES) == {"round_robin", "random", "least_busy", "latency_based"}


def test_round_robin_takes_each_candidate_in_turn():
    nodes = [Node("a", 9), Node("b"), Node("c")]
    state = StrategyState()
    picks = [nodes[round_robin(nodes, state, random.Random(0))].id for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_random_is_uniform_and_seeded():
    nodes = [Node(str(i)) for i in range(4)]
    counts = Counter(random_choice(nodes, StrategyState(), rng) for rng in [random.Random(1)] for _ in range(4000))
    assert set(counts) == {0, 1, 2, 3} and min(counts.values()) > 800
    a = [random_choice(nodes, StrategyState(), random.Random(5)) for _ in range(3)]
    b = [random_choice(nodes, StrategyState(), random.Random(5)) for _ in range(3)]
    assert a == b


def test_least_busy_takes_the_fewest_in_flight_ties_at_random():
    nodes = [Node("a", 3), Node("b", 1), Node("c", 2)]
    assert least_busy(nodes, StrategyState(), random.Random(0)) == 1
    tied = [Node("a", 1), Node("b", 0), Node("c", 0)]
    assert {least_busy(tied, StrategyState(), random.Random(s)) for s in range(50)} == {1, 2}


def test_latency_based_prefers_unobserved_then_the_lowest_average():
    nodes = [Node("a", latency_ms=80.0), Node("b", latency_ms=None), Node("c", latency_ms=50.0)]
    assert latency_based(nodes, StrategyState(), random.Random(0)) == 1
    nodes[1].latency_ms = 120.0
    assert latency_based(nodes, StrategyState(), random.Random(0)) == 2
    # it ignores load entirely (the peers' behaviour): a busy fast node still wins
    nodes[2].in_flight = 100
    assert latency_based(nodes, StrategyState(), random.Random(0)) == 2


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_no_candidate_is_a_programming_error(name):
    with pytest.raises(ValueError):
        STRATEGIES[name]([], StrategyState(), random.Random(0))
