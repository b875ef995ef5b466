"""Redis goes away mid-run: requests go on with local state and one warning; then it is back."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import pytest
from zml_redis import RedisLedger
from zml_redis.policies import PolicyStore, RedisPolicySource
from zml_redis.settings import Settings

import zml
from tests.conftest import MODEL

from .conftest import RedisServer
from .test_shared_state import wait_for

MSG = [{"role": "user", "content": "hi"}]
NODES = [
    {"id": "h100-1", "family": "H100", "max_concurrency": 2,
     "sim": {"ttft_ms": 10, "tokens_per_s": 5000}},
    {"id": "h100-2", "family": "H100", "max_concurrency": 2,
     "sim": {"ttft_ms": 10, "tokens_per_s": 5000}},
    {"id": "slow-1", "family": "SLOW", "max_concurrency": 1, "sim": {"ttft_ms": 2500}},
]
POLICIES = {"p": {"accelerator_chain": ["H100"], "queue_on_saturation": True},
            "slow": {"accelerator_chain": ["SLOW"]}}


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "zml.redis" and r.levelno >= logging.WARNING]


def outage_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in warnings_of(caplog) if "unreachable" in m]


async def burst(client: zml.AsyncClient, n: int = 8) -> list[str]:
    answers = await asyncio.gather(*(client.infer(model=MODEL, messages=MSG, policy="p",
                                                  max_tokens=2) for _ in range(n)))
    return [a.routing.node_id for a in answers]


async def test_redis_stopped_mid_run_then_restarted(
    sim_fleet: Callable[..., Any], own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, prefix: str,
) -> None:
    caplog.set_level(logging.INFO, logger="zml.redis")
    monkeypatch.setenv("ZML_REDIS_URL", own_redis.url)
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    monkeypatch.setenv("ZML_REDIS_LEASE_TTL_S", "3")
    setup = sim_fleet(NODES, POLICIES, {"H100": {}, "SLOW": {}})
    async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        hub = ledger.hub
        source = next(s for s in client.policies.sources if isinstance(s, RedisPolicySource))
        with PolicyStore(own_redis.url, prefix) as store:
            store.push({"kept": {"accelerator_chain": ["H100"]}})
        await asyncio.to_thread(wait_for, lambda: "kept" in source.list(), 2.0)
        assert len(await burst(client)) == 8
        r = own_redis.client()

        # A long request holds a lease while Redis goes away (and comes back empty).
        slow = asyncio.create_task(client.infer(model=MODEL, messages=MSG, policy="slow"))
        await asyncio.to_thread(wait_for, lambda: r.zcard(f"{prefix}:lease:slow-1") == 1)

        own_redis.stop()
        started = time.monotonic()
        for _ in range(3):  # every request succeeds, on this process's own accounting
            assert len(await burst(client)) == 8
        assert time.monotonic() - started < 5
        assert not hub.connected
        assert len(outage_warnings(caplog)) == 1, warnings_of(caplog)
        down_latency = []
        for _ in range(20):  # no round trip is attempted while down
            t0 = time.perf_counter()
            assert await ledger.aacquire(client.fleet.node("h100-1"), f"down-{_}")
            down_latency.append(time.perf_counter() - t0)
            ledger.release(client.fleet.node("h100-1"), f"down-{_}")
        assert max(down_latency) < 0.05
        assert source.list() == ["kept"]  # the policies mirrored before the outage stay
        assert (await client.infer(model=MODEL, messages=MSG, policy="kept")).routing.node_id

        own_redis.start()  # same port, empty
        await asyncio.to_thread(wait_for, lambda: any(
            "resumed" in r.getMessage() for r in caplog.records if r.name == "zml.redis"), 5.0)
        assert hub.connected
        # Redis came back empty: the policies read before are kept (one warning says why).
        await asyncio.to_thread(wait_for, lambda: any("lost its data" in m
                                                      for m in warnings_of(caplog)), 2.0)
        assert (await client.infer(model=MODEL, messages=MSG, policy="kept")).routing.node_id
        # The lease of the request still running is written back...
        assert r.zcard(f"{prefix}:lease:slow-1") == 1
        # ...new requests take leases again...
        node = client.fleet.node("h100-1")
        await asyncio.to_thread(wait_for, lambda: r.zcard(f"{prefix}:lease:h100-1") == 0)
        assert await ledger.aacquire(node, "x1") and await ledger.aacquire(node, "x2")
        assert not await ledger.aacquire(node, "x3")  # shared capacity enforced again
        ledger.release(node, "x1")
        ledger.release(node, "x2")
        await asyncio.to_thread(wait_for, lambda: node.load == 0, 2.0)
        assert len(await burst(client)) == 8
        # ...and the policy store is live again.
        with PolicyStore(own_redis.url, prefix) as store:
            store.push({"p": {"accelerator_chain": ["H100"], "max_queue_ms": 5000}})
        await asyncio.to_thread(wait_for, lambda: "p" in source.list(), 2.0)
        assert client.policies["p"].max_queue_ms == 5000
        assert "kept" not in source.list()  # the store now is what was pushed since
        assert (await slow).routing.node_id == "slow-1"
        await asyncio.to_thread(wait_for, lambda: r.zcard(f"{prefix}:lease:slow-1") == 0, 2.0)
    assert len(outage_warnings(caplog)) == 1


def test_a_hung_redis_costs_a_short_timeout_then_nothing(
    sim_fleet: Callable[..., Any], own_redis: RedisServer, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, prefix: str,
) -> None:
    monkeypatch.setenv("ZML_REDIS_URL", own_redis.url)
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    setup = sim_fleet(NODES[:2], POLICIES, {"H100": {}, "SLOW": {}})
    with zml.Client(config=setup.path) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        node = client.fleet.node("h100-1")
        assert ledger.acquire(node, "warm")  # a pooled connection exists
        ledger.release(node, "warm")
        own_redis.pause()
        try:
            times = []
            for i in range(5):
                t0 = time.perf_counter()
                assert ledger.acquire(node, f"hung-{i}")  # True: go on with local state
                times.append(time.perf_counter() - t0)
            assert not ledger.hub.connected
            assert all(t < 0.5 for t in times[:3]), times  # the 100 ms socket timeout
            assert all(t < 0.05 for t in times[3:]), times  # then no I/O at all
            assert client.infer(model=MODEL, messages=MSG, policy="p").routing.accelerator
            assert len(warnings_of(caplog)) == 1
        finally:
            own_redis.resume()
        wait_for(lambda: ledger.hub.connected, 5.0)


def test_a_lease_key_of_the_wrong_type_is_named_and_is_no_outage(
    sim_fleet: Callable[..., Any], redis_env: Settings, redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture, prefix: str,
) -> None:
    r = redis_server.client()
    r.set(f"{prefix}:lease:h100-1", "edited by hand")
    setup = sim_fleet(NODES[:2], POLICIES, {"H100": {}, "SLOW": {}})
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        bad, good = client.fleet.node("h100-1"), client.fleet.node("h100-2")
        assert ledger.acquire(bad, "b1")  # counted by this process alone
        assert ledger.acquire(good, "g1") and ledger.acquire(good, "g2")
        assert not ledger.acquire(good, "g3")  # the other node's leases are still shared
        assert r.zcard(f"{prefix}:lease:h100-2") == 2
        for lease, node in (("b1", bad), ("g1", good), ("g2", good)):
            ledger.release(node, lease)
        wait_for(lambda: r.zcard(f"{prefix}:lease:h100-2") == 0, 5.0)
        for _ in range(3):
            assert client.infer(model=MODEL, messages=MSG, policy="p",
                                max_tokens=2).routing.node_id
        assert ledger.hub.connected
    named = [m for m in warnings_of(caplog) if f"'{prefix}:lease:h100-1'" in m]
    assert len(named) == 1 and "wrong type" in named[0], warnings_of(caplog)
    assert warnings_of(caplog) == named  # releases and load reads skip the key: no outage
