"""What real calls teach the fleet and how the saturation queue treats them, on loopback.

* A non-streamed answer arrives whole: its time is service time, never the node's time to
  first token (which a latency target routes on).
* The caller's own deadline expiring while a node answers is the caller's budget, not the
  node failing: health and circuit stay as they were.
* Only requests that freed capacity could serve wait in the saturation queue: one whose own
  prompt no idle node can serve within the target fails at once, and holds nobody up.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import fleet_fixture, run_client

MSGS = [{"role": "user", "content": "hi"}]
BIG = [{"role": "user", "content": "word " * 4000}]  # 5,000 tokens: ~190 ms of H100 prefill
LONG = {"max_tokens": 500, "extra_body": {"ignore_eos": True}}
NODES = [{"id": "n1", "family": "H100", "max_concurrency": 8},
         {"id": "n2", "family": "H100", "max_concurrency": 8}]
POLICIES = {
    "fast": {"accelerator_chain": ["H100"], "latency_target_ms": 500},
    "lenient": {"accelerator_chain": ["H100"], "health_threshold": 0.0},
    "tight": {"accelerator_chain": ["H100"], "latency_target_ms": 100,
              "queue_on_saturation": True, "max_queue_ms": 20000},
}

setup = fleet_fixture(NODES, POLICIES)


def test_a_long_whole_answer_does_not_shut_out_a_latency_target(setup: Any) -> None:
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        r = client.infer(MODEL, MSGS, policy="fast", max_tokens=200,
                         extra_body={"ignore_eos": True})  # well over 500 ms, whole
        node = client.fleet.node(r.routing.node_id)
        assert node.service_ms is not None and node.service_ms > 500
        assert node.ttft_ms is None and node.observed_ttft_ms is None
        for _ in range(3):  # both kinds still route under the 500 ms target
            assert client.infer(MODEL, MSGS, policy="fast", max_tokens=5).routing.node_id
            with client.infer_stream(MODEL, MSGS, policy="fast", max_tokens=5) as stream:
                assert list(stream)
        observed = [n.observed_ttft_ms for n in client.fleet if n.observed_ttft_ms is not None]
        assert observed and all(ms < 500 for ms in observed)  # learned from the streams


def test_a_tight_deadline_gives_an_answer_as_slow_as_usual_the_time_it_takes(setup: Any) -> None:
    """Two nodes whose whole answers take about S seconds, and a deadline of 2.4 S: shared
    among three attempts that would be 0.8 S each, every attempt would time out (and mark its
    node). An attempt gets at least twice the node's usual service time instead."""
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        for _ in range(12):  # until both nodes learned their service time (ties are random)
            client.infer(MODEL, MSGS, policy="lenient", **LONG)
            if all(n.service_ms is not None for n in client.fleet):
                break
        usual = [n.service_ms for n in client.fleet]
        assert all(ms is not None for ms in usual), usual
        budget = 2.4 * max(usual) / 1000  # type: ignore[type-var]
        r = client.infer(MODEL, MSGS, policy="lenient", timeout=budget, **LONG)
        assert r.routing.attempts == []
        assert all(n.health == 1.0 and n.consecutive_failures == 0 for n in client.fleet)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_callers_deadline_on_a_whole_answer_leaves_the_node_healthy(sim_fleet: Any,
                                                                          kind: str) -> None:
    """One node, so the attempt has all the time left (with other candidates it would get a
    share of it, and fail over when that share runs out)."""
    setup = sim_fleet([{"id": "solo", "family": "H100", "max_concurrency": 4}], POLICIES)

    def check(client: Any, errors: list[zml.ZMLTimeoutError]) -> None:
        assert len(errors) == 5
        for err in errors:
            assert "was answering" in str(err) and "failed attempt" not in str(err)
        assert all(n.health == 1.0 and n.circuit_at(0.0) == "closed" for n in client.fleet)
        assert all(n.consecutive_failures == 0 for n in client.fleet)

    def body_sync(client: zml.Client) -> None:
        errors = []
        for _ in range(5):
            with pytest.raises(zml.ZMLTimeoutError) as info:
                client.infer(MODEL, MSGS, policy="lenient", timeout=0.3, **LONG)
            errors.append(info.value)
        check(client, errors)
        assert client.infer(MODEL, MSGS, max_tokens=5).routing.attempts == []

    async def body_async(client: zml.AsyncClient) -> None:
        errors = []
        for _ in range(5):
            with pytest.raises(zml.ZMLTimeoutError) as info:
                await client.infer(MODEL, MSGS, policy="lenient", timeout=0.3, **LONG)
            errors.append(info.value)
        check(client, errors)
        assert (await client.infer(MODEL, MSGS, max_tokens=5)).routing.attempts == []

    run_client(kind, setup, body_sync if kind == "sync" else body_async)


def test_a_request_no_idle_node_can_serve_fails_at_once_and_blocks_nobody(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            big = asyncio.create_task(client.infer(MODEL, BIG, policy="tight", max_tokens=5))
            smalls = [asyncio.create_task(client.infer(MODEL, MSGS, policy="tight",
                                                       max_tokens=5)) for _ in range(3)]
            with pytest.raises(zml.RoutingError) as info:
                await asyncio.wait_for(big, 15)
            ctx = info.value.routing_context
            assert ctx["final_error"] == "no_viable_node"
            assert ctx["evaluated"][0]["rejected_reason"] == "latency_target_exceeded"
            for r in await asyncio.wait_for(asyncio.gather(*smalls), 15):
                assert r.routing.queued_ms == 0.0  # none of them waited behind it
            assert client._dispatcher.effects.queues.depth("tight") == 0
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    assert setup.node("n1").stats.requests_total + setup.node("n2").stats.requests_total == 3
