"""Fault injection in-process: injected errors, malformed events, drops, stalls, runtime changes
through the admin endpoints."""

from __future__ import annotations

import json
import time

import httpx2
import pytest

from zml.sim import FaultSpec, SimulatedDrop


async def test_error_rate_one_answers_error_status_with_retry_after(make_node, client_for, chat):
    node = make_node(faults=FaultSpec(error_rate=1.0, error_status=503, retry_after_s=0.5))
    client = client_for(node)
    r = await chat(client)
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    assert r.headers["retry-after-ms"] == "500"
    error = r.json()["error"]
    assert error["type"] == "server_error" and error["message"]
    assert node.stats.rejected_total == 1 and node.stats.completed_total == 0


async def test_injected_429_and_500(make_node, client_for, chat):
    client = client_for(make_node(faults=FaultSpec(error_rate=1.0, error_status=429, retry_after_s=2)))
    r = await chat(client)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error"
    client = client_for(make_node(faults=FaultSpec(error_rate=1.0, error_status=500, retry_after_s=2)))
    r = await chat(client)
    assert r.status_code == 500 and "retry-after" not in r.headers


async def test_partial_error_rate_is_seeded(make_node, client_for, chat):
    async def statuses(seed):
        client = client_for(make_node(faults=FaultSpec(error_rate=0.5, seed=seed)))
        return [(await chat(client)).status_code for _ in range(40)]

    first = await statuses(1)
    assert first == await statuses(1)
    assert 5 < first.count(503) < 35
    assert set(first) == {200, 503}
    assert first != await statuses(2)


async def test_malformed_rate_one_emits_one_bad_event(make_node, client_for, stream):
    client = client_for(make_node(faults=FaultSpec(malformed_rate=1.0)))
    events = await stream(client)
    assert events[-1] == "[DONE]"
    bad = []
    for data in events[:-1]:
        try:
            json.loads(data)
        except ValueError:
            bad.append(data)
    assert len(bad) == 1


async def test_malformed_does_not_touch_non_streamed(make_node, client_for, chat):
    client = client_for(make_node(faults=FaultSpec(malformed_rate=1.0)))
    r = await chat(client)
    assert r.status_code == 200 and r.json()["choices"]


async def test_drop_in_process_raises_a_remote_protocol_error(make_node, client_for, chat, stream):
    node = make_node(faults=FaultSpec(drop_rate=1.0))
    client = client_for(node)
    with pytest.raises(httpx2.RemoteProtocolError):
        await chat(client)
    with pytest.raises(SimulatedDrop):
        await stream(client)
    stats = node.stats
    assert stats.dropped_total == 2 and stats.completed_total == 0
    assert stats.running == 0 and stats.waiting == 0


async def test_stall_delays_the_first_byte(make_node, client_for, chat):
    client = client_for(make_node(time_scale=1.0, ttft_ms=0, tokens_per_s=1e6, faults=FaultSpec(stall_s=0.15)))
    started = time.perf_counter()
    assert (await chat(client)).status_code == 200
    assert time.perf_counter() - started >= 0.15


async def test_admin_faults_stats_and_reset_peak(make_node, client_for, chat):
    node = make_node()
    client = client_for(node)
    r = await client.post("/_sim/faults", json={"error_rate": 1.0, "error_status": 429})
    assert r.status_code == 200 and r.json()["error_status"] == 429
    assert node.faults == FaultSpec(error_rate=1.0, error_status=429)
    assert (await chat(client)).status_code == 429
    assert (await client.post("/_sim/faults", json={"bogus": 1})).status_code == 400
    assert (await client.post("/_sim/faults", json={"error_rate": 2})).status_code == 400
    assert (await client.post("/_sim/faults", json=[1])).status_code == 400
    assert (await client.post("/_sim/faults", json={})).status_code == 200
    assert (await chat(client)).status_code == 200
    stats = (await client.get("/_sim/stats")).json()
    assert stats["requests_total"] == 2 and stats["completed_total"] == 1 and stats["rejected_total"] == 1
    assert stats["running_peak"] == 1
    r = await client.post("/_sim/reset_peak")
    assert r.status_code == 200 and r.json()["running_peak"] == 0
    assert node.stats.running_peak == 0


def test_set_faults_restarts_the_fault_generator(make_node):
    node = make_node()
    node.set_faults(FaultSpec(drop_rate=0.3, seed=9))
    assert node.faults.drop_rate == 0.3


@pytest.mark.parametrize(
    "kwargs",
    [{"error_rate": -0.1}, {"drop_rate": 1.5}, {"malformed_rate": 2}, {"error_status": 200}, {"stall_s": -1}],
)
def test_fault_spec_validation(kwargs):
    with pytest.raises(ValueError):
        FaultSpec(**kwargs)
