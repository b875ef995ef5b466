"""The virtual-clock driver: replay runs through the production dispatcher, fleet and flow."""

from __future__ import annotations

import pytest

from zml.config import registry_from_mapping
from zml.plugins.default.cost import default_cost
from zml.policy import validate_policy_tables
from zml.sim.model import NodeModel
from zml.sim.report import summarize
from zml.sim.traces import Arrival
from zml.sim.virtual import replay_policy

MODEL = "m"


def registry(*, slots: int = 1, max_queue: int = 0, queue_size: int = 0, nodes: int = 1,
             policy: dict | None = None):
    table: dict = {
        "accelerators": {"A100": {"cost_per_hour": 1.8}, "H100": {"cost_per_hour": 4.0}},
        "nodes": [
            {"id": f"{fam.lower()}-{i}", "family": fam, "url": f"http://10.0.0.{k}:8000",
             "models": [MODEL], "max_concurrency": slots, "max_queue": max_queue,
             "sim": {"queue_size": queue_size}}
            for k, (fam, i) in enumerate([(f, i) for f in ("A100", "H100") for i in range(nodes)])
        ],
        "policies": {"p": policy or {"accelerator_chain": ["A100", "H100"]}},
    }
    return registry_from_mapping(table)


def run(reg, arrivals, **kw):
    policies = validate_policy_tables(reg)
    return replay_policy(arrivals, reg, policies, policies["p"], name="p", default_model=MODEL,
                         **kw)


def test_successes_update_the_production_fleet_as_a_live_call_would():
    reg = registry()
    result = run(reg, [Arrival(i, i * 30.0, 500, 20) for i in range(4)])
    fleet = result.extra["fleet"]
    a100 = fleet.node("a100-0")
    assert [o.node for o in result.outcomes] == ["a100-0"] * 4  # first in the chain, idle
    assert a100.in_flight == 0 and a100.health == 1.0
    ttfts = [o.ttft_s for o in result.outcomes]
    observed = a100.observed_ttft_ms
    assert observed is not None and min(ttfts) * 1e3 <= observed <= max(ttfts) * 1e3
    # The base routing learns is the observed TTFT less the prefill it predicted: on an idle
    # node model that is the profile's fixed part, ttft_ms.
    prior_ttft, prefill_tps = fleet.family_prior("A100")
    assert prefill_tps is not None
    assert a100.ttft_ms == pytest.approx(observed - 500 / prefill_tps * 1e3)
    assert a100.ttft_ms == pytest.approx(prior_ttft, abs=1.0)


def test_the_cost_is_the_default_cost_plugins_attribution():
    reg = registry()
    result = run(reg, [Arrival(0, 0.0, 1000, 100)])
    out = result.outcomes[0]
    node = reg.nodes[0]
    expected = default_cost(reg.families[node.family], node,
                            {"prompt_tokens": 1000, "completion_tokens": 100}, out.e2e_s)
    assert expected is not None and out.cost_usd == pytest.approx(expected.amount)


def test_a_full_saturation_queue_drains_as_slots_free():
    # one slot, no node queue: without queueing, a burst of 5 gets 4 no_viable_node
    burst = [Arrival(i, 0.0, 200, 30) for i in range(5)]
    plain = summarize(run(registry(policy={"accelerator_chain": ["A100"]}), burst))
    assert plain["completed"] == 1 and plain["errors"] == {"no_viable_node": 4}
    queued = run(registry(policy={"accelerator_chain": ["A100"], "queue_on_saturation": True}),
                 burst)
    assert summarize(queued)["completed"] == 5
    starts = [o.ttft_s for o in queued.outcomes]
    assert starts == sorted(starts) and len(set(starts)) == 5  # served one after another, FIFO


def test_a_queue_timeout_is_the_flows_final_error():
    reg = registry(policy={"accelerator_chain": ["A100"], "queue_on_saturation": True,
                           "max_queue_ms": 100})
    row = summarize(run(reg, [Arrival(0, 0.0, 200, 400), Arrival(1, 0.0, 200, 30)]))
    assert row["completed"] == 1 and row["errors"] == {"queue_timeout": 1}


def test_a_503_from_the_node_model_fails_over_through_the_flow(monkeypatch):
    admit = NodeModel.admit
    refused: list[object] = []

    def overloaded_once(self, request, now):
        if not refused:  # the first admission anywhere answers 503 (queue full)
            refused.append(request.key)
            return "queue_full"
        return admit(self, request, now)

    monkeypatch.setattr(NodeModel, "admit", overloaded_once)
    result = run(registry(), [Arrival(0, 0.0, 200, 50)])
    assert result.outcomes[0].node == "h100-0" and result.outcomes[0].completed
    fleet = result.extra["fleet"]
    assert fleet.node("a100-0").health < 1.0  # the flow marked the node, as live
    assert fleet.node("a100-0").in_flight == 0 and fleet.node("h100-0").in_flight == 0


def test_a_request_over_the_kv_cache_is_one_clear_error_and_nothing_leaks():
    reg = registry()
    result = run(reg, [Arrival(0, 0.0, 50_000_000, 10), Arrival(1, 1.0, 100, 10)])
    row = summarize(result)
    assert row["errors"] == {"context_length_exceeded": 1} and row["completed"] == 1
    assert all(n.in_flight == 0 for n in result.extra["fleet"])


def test_a_row_naming_an_unknown_policy_is_policy_not_found():
    row = summarize(run(registry(), [Arrival(0, 0.0, 100, 10, policy="nope")]))
    assert row["errors"] == {"policy_not_found": 1}


def test_the_replay_is_deterministic():
    reg = registry(slots=2, max_queue=1, queue_size=1, nodes=2)
    arrivals = [Arrival(i, i * 0.05, 300 + 37 * i, 20 + i % 7) for i in range(200)]
    a, b = summarize(run(reg, arrivals)), summarize(run(reg, arrivals))
    assert a == b and a["completed"] + sum(a["errors"].values()) == 200
