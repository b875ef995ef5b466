"""A client that walks away from the gateway closes the node request.

Whether the request was generating, waiting in the node's queue or waiting in the gateway's
own saturation queue, the gateway cancels it when its client disconnects: the node counts the
abort (``aborted_total``) and drops the request from its gauges, and the gateway gives its slot
back. Node counters are polled until they settle; the timeouts are safety nets only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from tests.conftest import MODEL

from .conftest import GatewayServer, wait_for

MSGS = [{"role": "user", "content": "Write a very long essay"}]
LONG = {"model": MODEL, "messages": MSGS, "max_tokens": 4000, "ignore_eos": True}
Make = Callable[..., GatewayServer]


async def until(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def cancelled_count(gw: GatewayServer) -> float:
    return sum(s.value for s in gw.gateway.metrics.requests.collect()[0].samples
               if s.name.endswith("_total") and s.labels["outcome"] == "cancelled")


def cancelled_nodes(gw: GatewayServer) -> dict[str, float]:
    """The ``cancelled`` count of each ``node`` label ("" for none)."""
    out: dict[str, float] = {}
    for s in gw.gateway.metrics.requests.collect()[0].samples:
        if s.name.endswith("_total") and s.labels["outcome"] == "cancelled":
            out[s.labels["node"]] = out.get(s.labels["node"], 0) + s.value
    return out


def settled(node: Any, aborted: int) -> Callable[[], bool]:
    def check() -> bool:
        s = node.stats
        return s.aborted_total == aborted and s.running == 0 and s.waiting == 0

    return check


def test_leaving_a_stream_mid_way_aborts_the_node_request(serve_gateway: Make) -> None:
    gw = serve_gateway([{"id": "gpu", "family": "H100", "max_concurrency": 2}], time_scale=0.2)
    node = gw.node("gpu")
    with httpx2.stream("POST", f"{gw.base_url}/chat/completions",
                       json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [line for _, line in zip(range(6), lines, strict=False)]
        assert any(line.startswith("data: {") for line in got)
        assert node.stats.running == 1
    wait_for(settled(node, 1), "the node to abort the stream")
    wait_for(lambda: gw.gateway.client.fleet.in_flight == 0, "the gateway to free its slot")
    wait_for(lambda: cancelled_count(gw) == 1, "the cancelled outcome")
    assert node.stats.completed_total == 0
    assert cancelled_nodes(gw) == {"gpu": 1}


async def test_leaving_a_json_request_while_it_generates_aborts_it(serve_gateway: Make) -> None:
    gw = serve_gateway([{"id": "gpu", "family": "H100", "max_concurrency": 2}], time_scale=0.2)
    node = gw.node("gpu")
    async with httpx2.AsyncClient(timeout=30) as http:
        task = asyncio.create_task(http.post(f"{gw.base_url}/chat/completions", json=LONG))
        await until(lambda: node.stats.running == 1, "the node to start generating")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await until(settled(node, 1), "the node to abort the request")
    await until(lambda: gw.gateway.client.fleet.in_flight == 0, "the gateway's slot")
    assert node.stats.completed_total == 0
    # counted under the node that had it, although no answer had started
    await until(lambda: cancelled_count(gw) == 1, "the cancelled outcome")
    assert cancelled_nodes(gw) == {"gpu": 1}


async def test_leaving_while_queued_on_the_node_aborts_the_queued_request(
        serve_gateway: Make) -> None:
    """The node has one slot and zml may queue one more request on it (max_queue = 1)."""
    gw = serve_gateway([{"id": "gpu", "family": "H100", "max_concurrency": 1, "max_queue": 1}],
                       {"p": {"accelerator_chain": ["H100"], "cost_priority": "cost"}},
                       gateway='[gateway]\ndefault_policy = "p"\n', time_scale=0.2)
    node = gw.node("gpu")
    async with httpx2.AsyncClient(timeout=30) as http:
        url = f"{gw.base_url}/chat/completions"
        async with http.stream("POST", url, json={**LONG, "stream": True}) as holder:
            assert holder.status_code == 200
            queued = asyncio.create_task(http.post(url, json={**LONG, "max_tokens": 3}))
            await until(lambda: node.stats.waiting == 1, "the request to queue on the node")
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await until(lambda: node.stats.aborted_total == 1 and node.stats.waiting == 0,
                        "the node to drop the queued request")
            assert node.stats.running == 1  # the holder is untouched
    await until(settled(node, 2), "the holder's abort too")
    await until(lambda: gw.gateway.client.fleet.in_flight == 0, "the gateway's slots")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_leaving_while_queued_in_the_gateway_never_reaches_the_node(
        serve_gateway: Make, stream: bool) -> None:
    """queue_on_saturation: the request waits in the gateway's client for a slot."""
    policy = {"accelerator_chain": ["H100"], "queue_on_saturation": True,
              "max_queue_ms": 60_000}
    gw = serve_gateway([{"id": "gpu", "family": "H100", "max_concurrency": 1}], {"q": policy},
                       gateway='[gateway]\ndefault_policy = "q"\n', time_scale=0.2)
    node = gw.node("gpu")
    async with httpx2.AsyncClient(timeout=30) as http:
        url = f"{gw.base_url}/chat/completions"
        async with http.stream("POST", url, json={**LONG, "stream": True}) as holder:
            assert holder.status_code == 200
            queued = asyncio.create_task(http.post(url, json={**LONG, "max_tokens": 3,
                                                              "stream": stream}))
            await until(lambda: gw.gateway.metrics.registry.get_sample_value(
                "zml_gateway_requests_in_flight") == 2,
                        "the second request to reach the gateway")
            await asyncio.sleep(0.2)  # give it time to (wrongly) reach the node
            assert node.stats.requests_total == 1
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await until(lambda: cancelled_count(gw) == 1, "the gateway to cancel it")
        await until(settled(node, 1), "the holder's abort")
        assert node.stats.requests_total == 1  # the queued request never reached the node
        await until(lambda: gw.gateway.client.fleet.in_flight == 0, "the gateway's slots")
        # Nothing is left queued: the next request is served at once.
        r = await http.post(url, json={**LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
