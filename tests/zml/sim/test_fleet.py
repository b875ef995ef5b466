"""SimFleet on real loopback sockets: real concurrency, clients closing connections, node kills
and restarts, dropped connections, serving in the caller's loop."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx2
import pytest
from prometheus_client.parser import text_string_to_metric_families

from zml.sim import FaultSpec, SimFleet

PACED = {"ttft_ms": 30, "tokens_per_s": 100}


def _chat_body(tk, **extra):
    return {"model": "m1", "messages": tk.user("hello"), **extra}


async def _stream_all(client, url, body):
    async with client.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [event.data async for event in httpx2.EventSource(r)]


@pytest.fixture
async def http():
    async with httpx2.AsyncClient(timeout=10) as client:
        yield client


async def test_real_concurrency_is_capped_by_slots(tk, http):
    specs = [tk.spec(id="a", max_concurrency=2, **PACED), tk.spec(id="b", family="MI300X")]
    with SimFleet(specs, time_scale=1.0) as fleet:
        node = fleet.nodes["a"]
        seen_waiting = []
        body = _chat_body(tk, max_tokens=30, stream_options={"include_usage": True})
        requests = [asyncio.ensure_future(_stream_all(http, fleet.url("a"), body)) for _ in range(5)]
        while not all(r.done() for r in requests):
            stats = node.stats
            assert stats.running <= 2
            seen_waiting.append(stats.waiting)
            await asyncio.sleep(0.005)
        results = [r.result() for r in requests]
        assert all(events[-1] == "[DONE]" for events in results)
        assert all(0 < json.loads(events[-2])["usage"]["completion_tokens"] <= 30 for events in results)
        assert max(seen_waiting) >= 2
        stats = node.stats
        assert stats.running_peak == 2
        assert (stats.running, stats.waiting, stats.completed_total) == (0, 0, 5)
        assert fleet.nodes["b"].stats.requests_total == 0


async def test_client_disconnect_mid_stream_aborts(tk, http):
    with SimFleet([tk.spec(id="a", max_concurrency=1, ttft_ms=10, tokens_per_s=50)], time_scale=1.0) as fleet:
        node = fleet.nodes["a"]
        url = fleet.url("a")
        body = _chat_body(tk, max_tokens=500, stream=True)
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            received = 0
            async for _event in httpx2.EventSource(r):
                received += 1
                if received == 3:
                    assert node.stats.running == 1
                    break
        await tk.wait_for(lambda: node.stats.aborted_total == 1, timeout=3)
        assert node.stats.running == 0 and node.stats.waiting == 0
        # the slot is free again
        r = await http.post(f"{url}/v1/chat/completions", json=_chat_body(tk, max_tokens=2))
        assert r.status_code == 200


async def test_client_disconnect_while_queued_aborts(tk, http):
    with SimFleet([tk.spec(id="a", max_concurrency=1, ttft_ms=10, tokens_per_s=50)], time_scale=1.0) as fleet:
        node = fleet.nodes["a"]
        url = fleet.url("a")
        hog = asyncio.ensure_future(
            http.post(f"{url}/v1/chat/completions", json=_chat_body(tk, max_tokens=500))
        )
        await tk.wait_for(lambda: node.stats.running == 1)
        queued = asyncio.ensure_future(_stream_all(http, url, _chat_body(tk)))
        await tk.wait_for(lambda: node.stats.waiting == 1)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        await tk.wait_for(lambda: node.stats.aborted_total == 1, timeout=3)
        assert node.stats.waiting == 0 and node.stats.running == 1
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        await tk.wait_for(lambda: node.stats.running == 0, timeout=3)
        assert node.stats.aborted_total == 2
        stats = (await http.get(f"{url}/_sim/stats")).json()
        assert stats["aborted_total"] == 2 and stats["running"] == 0


async def test_kill_refuses_connections_and_restart_serves_again(tk, http):
    with SimFleet([tk.spec(id="a"), tk.spec(id="b")], time_scale=0.01) as fleet:
        url = fleet.url("a")
        assert (await http.get(f"{url}/health")).status_code == 200
        fleet.kill("a")
        with pytest.raises(httpx2.ConnectError):
            await http.get(f"{url}/health")
        with pytest.raises(httpx2.ConnectError):
            await http.post(f"{url}/v1/chat/completions", json=_chat_body(tk))
        assert (await http.get(f"{fleet.url('b')}/health")).status_code == 200
        fleet.restart("a")
        assert fleet.url("a") == url
        r = await http.post(f"{url}/v1/chat/completions", json=_chat_body(tk))
        assert r.status_code == 200 and r.json()["choices"]


async def test_kill_cuts_open_streams(tk, http):
    with SimFleet([tk.spec(id="a", ttft_ms=10, tokens_per_s=50)], time_scale=1.0) as fleet:
        node = fleet.nodes["a"]
        events = []
        with pytest.raises(httpx2.TransportError):
            async with http.stream(
                "POST", f"{fleet.url('a')}/v1/chat/completions", json=_chat_body(tk, stream=True, max_tokens=500)
            ) as r:
                async for event in httpx2.EventSource(r):
                    events.append(event.data)
                    if len(events) == 2:
                        await asyncio.to_thread(fleet.kill, "a")
        assert "[DONE]" not in events
        await tk.wait_for(lambda: node.stats.running == 0, timeout=3)


async def test_drop_rate_one_cuts_streams_before_done(tk, http):
    with SimFleet([tk.spec(id="a", faults=FaultSpec(drop_rate=1.0))], time_scale=0.01) as fleet:
        url = fleet.url("a")
        events = []
        with pytest.raises(httpx2.RemoteProtocolError):
            async with http.stream("POST", f"{url}/v1/chat/completions", json=_chat_body(tk, stream=True)) as r:
                assert r.status_code == 200
                async for event in httpx2.EventSource(r):
                    events.append(event.data)
        assert events and "[DONE]" not in events
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        with pytest.raises(httpx2.RemoteProtocolError):
            await http.post(f"{url}/v1/chat/completions", json=_chat_body(tk))
        node = fleet.nodes["a"]
        await tk.wait_for(lambda: node.stats.dropped_total == 2)
        assert node.stats.running == 0
        # faults change at runtime, through the admin endpoint
        assert (await http.post(f"{url}/_sim/faults", json={})).status_code == 200
        assert (await _stream_all(http, url, _chat_body(tk)))[-1] == "[DONE]"


async def test_fixed_ports_and_metrics_over_http(tk, http):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    fleet = SimFleet([tk.spec(id="a"), tk.spec(id="b", kind="sglang")], ports={"b": port}, time_scale=0.01)
    assert fleet.url("b") == f"http://127.0.0.1:{port}"
    with fleet:
        r = await http.get(f"{fleet.url('b')}/metrics")
        names = {f.name for f in text_string_to_metric_families(r.text)}
        assert {"sglang:num_running_reqs", "sglang:num_queue_reqs"} <= names
        assert fleet.urls == {"a": fleet.url("a"), "b": fleet.url("b")}
    with pytest.raises(httpx2.ConnectError):
        await http.get(f"{fleet.url('b')}/health")
    fleet.stop()  # idempotent


async def test_serve_in_the_current_loop(tk, http):
    fleet = SimFleet([tk.spec(id="a")], time_scale=0.01)
    server = asyncio.ensure_future(fleet.serve())
    url = fleet.url("a")

    async def healthy():
        try:
            return (await http.get(f"{url}/health")).status_code == 200
        except httpx2.TransportError:  # refused, or a pooled connection cut by the kill
            return False

    for _ in range(200):
        if await healthy():
            break
        await asyncio.sleep(0.01)
    assert await healthy()
    fleet.kill("a")
    assert not await healthy()
    fleet.restart("a")
    assert (await http.post(f"{url}/v1/chat/completions", json=_chat_body(tk))).status_code == 200
    server.cancel()
    await asyncio.gather(server, return_exceptions=True)
    assert not await healthy()


def test_fleet_argument_checks(tk):
    with pytest.raises(ValueError, match="duplicate"):
        SimFleet([tk.spec(id="a"), tk.spec(id="a")])
    with pytest.raises(ValueError, match="unknown"):
        SimFleet([tk.spec(id="a")], ports={"zz": 1234})
    with SimFleet([tk.spec(id="a")]) as fleet, pytest.raises(KeyError):
        fleet.url("zz")


def test_kill_requires_a_serving_fleet(tk):
    fleet = SimFleet([tk.spec(id="a")])
    try:
        with pytest.raises(RuntimeError):
            fleet.kill("a")
    finally:
        fleet.stop()
