"""Prefix affinity, the baseline strategies as a policy field, and the fleet's priors.

Affinity's rules (zml.routing module docs): rendezvous hashing of the first prefix block over
the family's viable nodes within the bounded-load cap; never a node the bound excludes; the
usual rules (viability, chain order) untouched.
"""

from __future__ import annotations

import random
import typing
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings, strategies as st

from tests.zml import routing_world as world
from tests.zml.random_fleets import NOW, Fleet, Policy, fleets, policies
from zml import routing, routing_families
from zml.config import load_registry
from zml.fleet import FAMILY_PRIORS, Fleet as ZmlFleet
from zml.routing import Decision, affinity_bound, route
from zml.strategies import StrategyState, route_by_strategy


@dataclass(frozen=True)
class AffinityPolicy(Policy):
    affinity: str | None = "prefix"


def _as_affinity(p: Policy) -> AffinityPolicy:
    return AffinityPolicy(p.name, p.accelerator_chain, p.latency_target_ms, p.cost_priority,
                          p.health_threshold)


def _viable_of_family(fleet: Fleet, policy: Policy, family: str) -> list[typing.Any]:
    limit = float("inf")
    if policy.latency_target_ms is not None:
        limit = policy.latency_target_ms * (1.25 if policy.cost_priority == "cost" else 1.0)
    out = []
    for n in fleet.nodes_for("m", family):
        if n.circuit_is_open or n.health < policy.health_threshold:
            continue
        if n.load >= n.max_concurrency + n.max_queue:
            continue
        pred = routing_families._node_prediction(n, routing.PRIOR_TTFT_MS, 0.0, 0.0)
        if pred > limit:
            continue
        out.append(n)
    return out


@settings(max_examples=200, deadline=None)
@given(fleets(), policies, st.integers(0, 50), st.integers(0, 2**32 - 1))
def test_affinity_never_picks_a_node_the_load_bound_excludes(
    fleet: Fleet, policy: Policy, block: int, seed: int
) -> None:
    aff = _as_affinity(policy)
    with_affinity = route(aff, "m", fleet, now=NOW, rng=random.Random(seed),
                          prefix_blocks=(block,))
    plain = route(policy, "m", fleet, now=NOW, rng=random.Random(seed))
    # affinity changes the node only, never the family walk or its trace
    assert type(with_affinity) is type(plain)
    assert with_affinity.evaluated == plain.evaluated
    if not isinstance(with_affinity, Decision):
        return
    node = with_affinity.node
    assert node.load < node.max_concurrency + node.max_queue  # no node over capacity
    viable = _viable_of_family(fleet, policy, with_affinity.family)
    assert node in viable
    load = sum(n.load for n in viable)
    cap = sum(n.max_concurrency for n in viable)
    within = [n for n in viable if n.load + 1 <= affinity_bound(load, cap, n.max_concurrency)]
    if within:
        assert node in within  # the bound is respected...
        top = max(within, key=lambda n: routing_families._affinity_score(str(block), n.id))
        assert node is top  # ...and the home node is the rendezvous winner


def test_one_hot_prefix_cannot_overload_a_node() -> None:
    nodes = [world.Node(f"n{i}", max_queue=0, ttft_ms=50.0, service_ms=500.0, models=("m",))
             for i in range(4)]
    fleet = world.Fleet(nodes)
    policy = AffinityPolicy("p", ("H100",), None, "latency", 0.0)
    rng = random.Random(0)
    for _ in range(12):  # 12 requests with the same leading block, none finishing
        total = sum(n.load for n in nodes)
        d = route(policy, "m", fleet, now=NOW, rng=rng, prefix_blocks=("system-prompt",))
        assert isinstance(d, Decision)
        assert d.node.load + 1 <= affinity_bound(total, 16, 4)
        d.node.load += 1
    loads = sorted(n.load for n in nodes)
    assert loads[-1] <= 4  # the home node stopped at its bound...
    assert sum(1 for n in nodes if n.load) >= 3  # ...and the hot prefix spilled over
    # while the home node is within its bound, the same prefix keeps going there
    for n in nodes:
        n.load = 0
    homes = Counter(
        route(policy, "m", fleet, now=NOW, rng=random.Random(s), prefix_blocks=("x",)).node.id  # type: ignore[union-attr]
        for s in range(10)
    )
    assert len(homes) == 1


def test_fleet_priors_equal_the_simulated_profiles() -> None:
    from zml.sim.profiles import PROFILES

    assert set(FAMILY_PRIORS) == set(PROFILES)
    for name, profile in PROFILES.items():
        assert FAMILY_PRIORS[name] == (profile.ttft_ms, float(profile.prefill_tokens_per_s))


def _fleet(tmp_path: typing.Any, text: str) -> ZmlFleet:
    path = tmp_path / "zml.toml"
    path.write_text(text)
    return ZmlFleet(load_registry(path))


NODES = """
[accelerators.H100]
[accelerators.gpu-pool]
[accelerators.L4.sim]
ttft_ms = 40.0
prefill_tokens_per_s = 1000.0

[[nodes]]
id = "h1"
family = "H100"
url = "http://127.0.0.1:1"
models = ["m"]
max_concurrency = 2
[[nodes]]
id = "h2"
family = "H100"
url = "http://127.0.0.1:2"
models = ["m"]
max_concurrency = 2
[[nodes]]
id = "l1"
family = "L4"
url = "http://127.0.0.1:3"
models = ["m"]
max_concurrency = 2
"""


def test_fleet_family_prior_uses_the_profile_then_the_sim_table(tmp_path: typing.Any) -> None:
    fleet = _fleet(tmp_path, NODES)
    assert fleet.family_prior("H100") == FAMILY_PRIORS["H100"]
    assert fleet.family_prior("L4") == (40.0, 1000.0)
    assert fleet.family_prior("gpu-pool") == FAMILY_PRIORS["A100"]


def test_fleet_counts_prompt_tokens_in_flight(tmp_path: typing.Any) -> None:
    fleet = _fleet(tmp_path, NODES)
    node = fleet.node("h1")
    with fleet.lock:
        a = fleet.reserve(node, 0.0, 300)
        b = fleet.reserve(node, 0.0, 200)
    assert node.tokens_in_flight == 500
    fleet.release(a)
    fleet.release(a)  # a double release gives nothing back twice
    assert node.tokens_in_flight == 200
    fleet.release(b)
    assert node.tokens_in_flight == 0


def test_prefill_tokens_count_until_the_first_token(tmp_path: typing.Any) -> None:
    fleet = _fleet(tmp_path, NODES)
    node = fleet.node("h1")
    with fleet.lock:
        a = fleet.reserve(node, 0.0, 300)
        b = fleet.reserve(node, 0.0, 200)
        c = fleet.reserve(node, 0.0, 0)
    assert node.prefill_tokens == 500
    fleet.first_token(a)
    fleet.first_token(a)  # once only
    fleet.first_token(c)  # no prompt size: nothing to take back
    assert node.prefill_tokens == 200 and node.tokens_in_flight == 500
    fleet.release(a)  # after its first token: only tokens_in_flight goes down
    assert node.prefill_tokens == 200 and node.tokens_in_flight == 200
    fleet.release(b)  # failed before its first token
    fleet.release(c)
    assert node.prefill_tokens == 0 and node.tokens_in_flight == 0


def test_a_whole_answers_prompt_counts_as_prefilled_once_its_predicted_ttft_passed(
    tmp_path: typing.Any,
) -> None:
    fleet = _fleet(tmp_path, NODES)
    node = fleet.node("h1")
    with fleet.lock:
        whole = fleet.reserve(node, 10.0, 300, prefill_by=10.5)  # not streamed: no first token
        streamed = fleet.reserve(node, 10.0, 200)
        fleet.refresh(10.4)
    assert node.prefill_tokens == 500
    with fleet.lock:
        fleet.refresh(10.5)  # the whole answer's predicted first token has passed
    assert node.prefill_tokens == 200 and node.tokens_in_flight == 500
    with fleet.lock:
        fleet.refresh(99.0)  # a streamed prompt counts until its first token, however long
    assert node.prefill_tokens == 200
    fleet.release(whole)
    fleet.release(streamed)
    assert node.prefill_tokens == 0 and node.tokens_in_flight == 0


def test_the_learned_base_is_the_observed_ttft_less_what_routing_explained(
    tmp_path: typing.Any,
) -> None:
    fleet = _fleet(tmp_path, NODES)
    node = fleet.node("h1")
    fleet.record_success(node, 0.0, 0.300, 1.0, explained_ms=250.0)
    assert node.observed_ttft_ms == pytest.approx(300.0)
    assert node.ttft_ms == pytest.approx(50.0)
    assert node.latency_ms == pytest.approx(300.0)  # what latency_based reads: as observed
    fleet.record_success(node, 1.0, 0.100, 1.0, explained_ms=400.0)  # faster than predicted
    assert node.ttft_ms == pytest.approx(50.0 * 0.8)  # never below zero: the sample is 0
    assert {n["id"]: n for n in fleet.status(1.0)}["h1"]["base_ttft_ms"] == pytest.approx(40.0)


@pytest.mark.parametrize("name", ["round_robin", "random", "least_busy", "latency_based"])
def test_strategy_as_a_policy_field_ignores_the_chain(tmp_path: typing.Any, name: str) -> None:
    fleet = _fleet(tmp_path, NODES)
    state = StrategyState()
    rng = random.Random(0)
    picked = Counter()
    for _ in range(30):
        d = route_by_strategy(name, "m", fleet, state, rng)
        assert isinstance(d, Decision)
        assert [e.rejected_reason for e in d.evaluated] == [None]
        picked[d.node.id] += 1
    if name in ("round_robin", "random"):
        assert set(picked) == {"h1", "h2", "l1"}  # the L4 node too: no chain order
    if name == "round_robin":
        assert picked == Counter({"h1": 10, "h2": 10, "l1": 10})
    d = route_by_strategy(name, "m", fleet, state, rng, exclude=frozenset({"h1", "h2", "l1"}))
    assert not isinstance(d, Decision)
    assert d.final_error == "no_viable_node"
    d = route_by_strategy(name, "m", fleet, state, rng, pinned_family="L4")
    assert isinstance(d, Decision) and d.node.id == "l1"


def test_policy_fields_strategy_and_affinity_are_validated(tmp_path: typing.Any) -> None:
    from zml.errors import PolicyConfigError
    from zml.policy import policy_from_mapping

    reg = _fleet(tmp_path, NODES).registry
    p = policy_from_mapping({"name": "x", "accelerator_chain": ["H100"],
                             "strategy": "least_busy", "affinity": "prefix"}, reg)
    assert (p.strategy, p.affinity) == ("least_busy", "prefix")
    assert policy_from_mapping({"name": "y", "accelerator_chain": ["H100"]}, reg).strategy is None
    with pytest.raises(PolicyConfigError, match="least_busy"):
        policy_from_mapping({"name": "z", "accelerator_chain": ["H100"],
                             "strategy": "least-busy"}, reg)
    with pytest.raises(PolicyConfigError, match="affinity"):
        policy_from_mapping({"name": "z", "accelerator_chain": ["H100"], "affinity": "cache"}, reg)
