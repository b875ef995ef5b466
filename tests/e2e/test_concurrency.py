"""Slots are reserved at decision time: concurrent tasks never oversubscribe a node.

Real sockets, simulated nodes: the requests overlap on the nodes, so the node's own peak gauge
confirms what the client decided.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import zml
from tests.conftest import MODEL

NODES = [
    {"id": "h100-solo", "family": "H100", "max_concurrency": 1},
    {"id": "mi-1", "family": "MI300X", "max_concurrency": 4},
    {"id": "mi-2", "family": "MI300X", "max_concurrency": 4},
]
POLICIES = {
    "two-families": {"accelerator_chain": ["H100", "MI300X"], "cost_priority": "cost"},
    "h100-only": {"accelerator_chain": ["H100"]},
}


async def _six(config: Any, policy: str) -> list[Any]:
    async with zml.AsyncClient(config=config) as client:
        results = await asyncio.gather(
            *(client.infer(MODEL, [{"role": "user", "content": f"q{i}"}], policy=policy)
              for i in range(6)),
            return_exceptions=True,
        )
        assert client.fleet.in_flight == 0
        return results


def test_six_concurrent_requests_one_slot_then_next_family(sim_fleet: Any) -> None:
    setup = sim_fleet(NODES, POLICIES)
    results = asyncio.run(_six(setup.path, "two-families"))
    assert all(isinstance(r, zml.ChatCompletion) for r in results), results
    nodes = [r.routing.node_id for r in results]
    assert nodes.count("h100-solo") == 1
    assert {r.routing.accelerator for r in results if r.routing.node_id != "h100-solo"} == {
        "MI300X"
    }
    fallbacks = [r for r in results if r.routing.accelerator == "MI300X"]
    assert all(r.routing.evaluated[0]["rejected_reason"] == "all_nodes_over_capacity"
               for r in fallbacks)
    assert setup.node("h100-solo").stats.running_peak == 1


def test_one_family_policy_gives_routing_errors_for_the_rest(sim_fleet: Any) -> None:
    setup = sim_fleet(NODES, POLICIES)
    results = asyncio.run(_six(setup.path, "h100-only"))
    ok = [r for r in results if isinstance(r, zml.ChatCompletion)]
    errors = [r for r in results if isinstance(r, zml.RoutingError)]
    assert len(ok) == 1 and len(errors) == 5
    for err in errors:
        assert err.routing_context["evaluated"] == [
            {"family": "H100", "nodes_checked": 1, "rejected_reason": "all_nodes_over_capacity"}
        ]
    assert setup.node("h100-solo").stats.running_peak == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_0_2_fallback_pattern_with_accelerator_pin(sim_fleet: Any, kind: str) -> None:
    """The 0.2 style: try one family, catch ZMLRoutingError, try the next."""
    setup = sim_fleet(NODES, POLICIES)

    async def main() -> list[str]:
        async with zml.AsyncClient(config=setup.path) as aclient:
            held = aclient.infer_stream(MODEL, [{"role": "user", "content": "hold"}],
                                        accelerator="H100")
            it = held.__aiter__()
            await it.__anext__()  # the H100 slot is now taken
            try:
                used = []
                for _ in range(2):
                    if kind == "sync":
                        client = zml.Client(fleet=aclient.fleet)  # shared on purpose
                        try:
                            r = client.infer(MODEL, [{"role": "user", "content": "x"}],
                                             accelerator="H100")
                        except zml.ZMLRoutingError:
                            r = client.infer(MODEL, [{"role": "user", "content": "x"}],
                                             accelerator="MI300X")
                    else:
                        try:
                            r = await aclient.infer(MODEL, [{"role": "user", "content": "x"}],
                                                    accelerator="H100")
                        except zml.ZMLRoutingError:
                            r = await aclient.infer(MODEL, [{"role": "user", "content": "x"}],
                                                    accelerator="MI300X")
                    used.append(r.routing.accelerator)
                return used
            finally:
                await it.aclose()

    assert asyncio.run(main()) == ["MI300X", "MI300X"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_routing_is_set_on_every_response_with_queue_depth(sim_fleet: Any, kind: str) -> None:
    nodes = [{"id": "q-1", "family": "H100", "max_concurrency": 1, "max_queue": 3}]
    setup = sim_fleet(nodes, {"queueing": {"accelerator_chain": ["H100"],
                                           "cost_priority": "cost"}})

    async def burst() -> list[Any]:
        async with zml.AsyncClient(config=setup.path) as client:
            return list(await asyncio.gather(
                *(client.infer(MODEL, [{"role": "user", "content": f"{i}"}], policy="queueing")
                  for i in range(4))))

    if kind == "async":
        results = asyncio.run(burst())
        assert sorted(r.routing.queue_depth for r in results) == [0, 0, 1, 2]
        assert sorted(r.routing.node_load for r in results) == [0, 1, 2, 3]
    else:
        with zml.Client(config=setup.path) as client:
            results = [client.infer(MODEL, [{"role": "user", "content": "x"}],
                                    policy="queueing") for _ in range(3)]
        assert [r.routing.queue_depth for r in results] == [0, 0, 0]
    for r in results:
        assert r.routing.node_id == "q-1" and r.routing.policy == "queueing"
