"""Shared fleet state: leases across processes, expiry of a dead process's, health, global load."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zml_redis import RedisLedger
from zml_redis.settings import Settings

import zml
from tests.conftest import MODEL, LoadPeaks
from zml.fleet import CIRCUIT_FAILURES
from zml.sim import FaultSpec

from .conftest import REPLICA, RedisServer, replica_env

MSG = [{"role": "user", "content": "hi"}]


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.01) -> float:
    """Poll until ``predicate()``; return the seconds it took (fail after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(step)
    return time.monotonic() - start


def small_fleet(sim_fleet: Callable[..., Any], **sim: Any) -> Any:
    nodes = [{"id": f"h100-{i}", "family": "H100", "max_concurrency": 2,
              "sim": {"ttft_ms": 20, **sim}} for i in (1, 2)]
    return sim_fleet(nodes, {"p": {"accelerator_chain": ["H100"]}})


def test_without_url_the_plugin_does_nothing(sim_fleet: Callable[..., Any],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZML_REDIS_URL", raising=False)
    setup = small_fleet(sim_fleet)
    with zml.Client(config=setup.path) as client:
        assert client.plugins.has_plugin("redis")
        assert client.fleet.ledger is None
        assert not any(type(s).__name__ == "RedisPolicySource" for s in client.policies.sources)
        assert client.infer(model=MODEL, messages=MSG, policy="p").routing.node_id


def test_the_plugin_is_idle_until_a_client_has_a_redis_ledger(redis_env: Settings) -> None:
    # In a fresh interpreter: this test module imports the ledger itself.
    code = ("import zml_redis.plugin as p\nidle = p.zml_idle()\n"
            "import zml\nzml.Client(config=None).close()\nstill = p.zml_idle()\n"
            "from zml.plugins.manager import PluginManager\npm = PluginManager()\n"
            "pm.register(p, 'redis')\nwanted = pm.wanted('zml_request_completed')\n"
            "print(idle, still, wanted)\n")
    env = {k: v for k, v in os.environ.items() if k != "ZML_REDIS_URL"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "False"]
    env["ZML_REDIS_URL"] = redis_env.url
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False", "True"]  # a client with a Redis ledger


def test_leases_cap_a_node_across_ledgers_and_come_back_on_release(
    sim_fleet: Callable[..., Any], redis_env: Settings, redis_server: RedisServer
) -> None:
    setup = small_fleet(sim_fleet)
    with zml.Client(config=setup.path) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        node = client.fleet.node("h100-1")
        leases = [uuid.uuid4().hex for _ in range(3)]
        assert ledger.acquire(node, leases[0])
        assert node.reported_load == 1  # the global count is the node's load at once
        assert ledger.acquire(node, leases[1])
        assert not ledger.acquire(node, leases[2])  # max_concurrency 2 + max_queue 0
        r = redis_server.client()
        assert r.zcard(redis_env.lease_key("h100-1")) == 2
        ledger.release(node, leases[0])
        ledger.release(node, leases[0])  # twice: harmless
        wait_for(lambda: r.zcard(redis_env.lease_key("h100-1")) == 1, 2.0)
        assert ledger.acquire(node, leases[2])
        # Requests take and give back leases; none is left behind.
        for _ in range(3):
            assert client.infer(model=MODEL, messages=MSG, policy="p").routing.accelerator == "H100"
        ledger.release(node, leases[1])
        ledger.release(node, leases[2])
        wait_for(lambda: not r.keys(f"{redis_env.prefix}:lease:*"), 2.0)
        assert ledger.hub.held() == {}


def test_a_request_that_ends_while_a_lease_count_travels_is_taken_off_it(
    sim_fleet: Callable[..., Any], redis_env: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The count Redis gives with a new lease includes this process's other leases; one whose
    request ends before the count is applied no longer holds the node full (it did until the
    next sync)."""
    setup = small_fleet(sim_fleet)
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        fleet = client.fleet
        ledger = fleet.ledger
        assert isinstance(ledger, RedisLedger)
        node = fleet.node("h100-1")
        first = fleet.reserve(node, time.monotonic())
        assert ledger.acquire(node, "first")
        first.lease_id = "first"
        second = fleet.reserve(node, time.monotonic())
        real = ledger.hub._execute

        def execute(*commands: tuple[Any, ...], timeout: float | None = None) -> list[Any]:
            replies = real(*commands, timeout=timeout)
            if any("second" in command for command in commands):  # the second's ACQUIRE
                fleet.release(first)  # ... the first request ends while its reply travels
            return replies

        monkeypatch.setattr(ledger.hub, "_execute", execute)
        assert ledger.acquire(node, "second")  # Redis counted two leases
        assert (node.in_flight, node.reported_load, node.load) == (1, 1, 1)
        monkeypatch.undo()
        second.lease_id = "second"
        fleet.release(second)


async def test_async_clients_lease_too(sim_fleet: Callable[..., Any], redis_env: Settings,
                                       redis_server: RedisServer) -> None:
    setup = small_fleet(sim_fleet)
    async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        node = client.fleet.node("h100-2")
        assert await ledger.aacquire(node, "a")
        assert await ledger.aacquire(node, "b")
        assert not await ledger.aacquire(node, "c")
        ledger.release(node, "a")
        ledger.release(node, "b")
        await asyncio.to_thread(wait_for, lambda: node.load == 0, 2.0)  # the next sync
        answers = await asyncio.gather(*(client.infer(model=MODEL, messages=MSG, policy="p")
                                         for _ in range(4)))
        assert {a.routing.node_id for a in answers} == {"h100-1", "h100-2"}
    r = redis_server.client()
    await asyncio.to_thread(wait_for, lambda: not r.keys(f"{redis_env.prefix}:lease:*"), 2.0)


def test_global_load_reaches_routing(sim_fleet: Callable[..., Any], redis_env: Settings,
                                     redis_server: RedisServer) -> None:
    """Leases held elsewhere make a node full here, within one sync interval."""
    setup = small_fleet(sim_fleet)
    with zml.Client(config=setup.path) as client:
        node = client.fleet.node("h100-1")
        r = redis_server.client()
        expiry = int(r.time()[0]) * 1000 + 60_000
        r.zadd(redis_env.lease_key("h100-1"), {"other-1": expiry, "other-2": expiry})
        wait_for(lambda: node.reported_load == 2, 2.0)
        for _ in range(4):
            assert client.infer(model=MODEL, messages=MSG, policy="p").routing.node_id == "h100-2"
        r.delete(redis_env.lease_key("h100-1"))
        wait_for(lambda: node.load == 0, 2.0)


def test_health_and_circuit_breakers_are_shared(
    sim_fleet: Callable[..., Any], redis_env: Settings, redis_server: RedisServer
) -> None:
    setup = small_fleet(sim_fleet)
    r = redis_server.client()
    with zml.Client(config=setup.path, max_attempts=2) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        assert ledger.hub.subscribed.wait(5)
        node = client.fleet.node("h100-1")

        # Another replica's failures open this replica's circuit.
        def event(ok: bool) -> str:
            return json.dumps({"o": "another-replica", "n": "h100-1", "ok": ok})

        for _ in range(CIRCUIT_FAILURES):
            r.publish(redis_env.events_channel, event(False))
        wait_for(lambda: node.circuit_state == "open", 2.0)
        assert node.health < 0.5
        for _ in range(3):
            assert client.infer(model=MODEL, messages=MSG, policy="p").routing.node_id == "h100-2"
        r.publish(redis_env.events_channel, event(True))  # it recovered over there
        wait_for(lambda: node.circuit_state == "closed", 2.0)

        # This replica's own failures are published for the others.
        pubsub = r.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(redis_env.events_channel)
        setup.node("h100-2").set_faults(FaultSpec(error_rate=1.0, error_status=500))
        with pytest.raises(zml.RoutingError):  # h100-1's health is still recovering
            client.infer(model=MODEL, messages=MSG, policy="p")
        got = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and not got:
            message = pubsub.get_message(timeout=0.2)
            if message and "n" in json.loads(message["data"]):  # not a lease count
                got.append(json.loads(message["data"]))
        assert got and got[0]["n"] == "h100-2" and got[0]["ok"] is False
        assert got[0]["o"] == ledger.hub.origin
        pubsub.close()


# --- many processes ----------------------------------------------------------------------------

NODES = [{"id": f"h100-{i}", "family": "H100", "max_concurrency": 8,
          "sim": {"ttft_ms": 250, "tokens_per_s": 1000, "queue_size": 64}} for i in (1, 2, 3)]
POLICY = {"burst": {"accelerator_chain": ["H100"], "queue_on_saturation": True}}
PROCESSES = 4
PER_PROCESS = 50


def _spawn(config: Path, env: dict[str, str], count: int, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(REPLICA), str(config), "burst", str(count), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd=str(Path(__file__).parents[3]),
    )


def _ready(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"replica died: {proc.communicate(timeout=10)[1]}")
    ready: dict[str, Any] = json.loads(line)
    return ready


def _burst(setup: Any, env: dict[str, str]) -> tuple[dict[str, int], dict[str, int], list[str],
                                                      float]:
    procs = [_spawn(setup.path, env, PER_PROCESS, "burst") for _ in range(PROCESSES)]
    try:
        ledgers = {_ready(p)["ledger"] for p in procs}
        assert ledgers == ({"RedisLedger"} if "ZML_REDIS_URL" in env else {None})
        with LoadPeaks(dict(setup.fleet.nodes)) as peaks:
            started = time.monotonic()
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            results: list[str] = []
            for p in procs:
                out, err = p.communicate(timeout=60)
                assert p.returncode == 0, err
                assert "unreachable" not in err, err  # no replica fell back to local state
                results += json.loads(out.strip().splitlines()[-1])["results"]
            elapsed = time.monotonic() - started
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    running = {i: n.stats.running_peak for i, n in setup.fleet.nodes.items()}
    return peaks.peaks, running, results, elapsed


def test_replicas_never_oversubscribe_a_node_with_redis_and_do_without(
    sim_fleet: Callable[..., Any], redis_server: RedisServer, prefix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """4 processes x 50 concurrent requests on 3 nodes x 8 slots (24 < 200).

    Overflow policy: queue_on_saturation, so every request is answered in the end. With
    zml-redis no node ever holds more than its 8 slots (running + waiting, polled, and the
    node's running_peak); without it, each replica believes it has 24 slots to itself.
    """
    setup = sim_fleet(NODES, POLICY)
    shared_env = replica_env(ZML_REDIS_URL=redis_server.url, ZML_REDIS_PREFIX=prefix)
    shared, shared_running, shared_results, shared_s = _burst(setup, shared_env)
    alone, alone_running, alone_results, alone_s = _burst(setup, replica_env())
    with capsys.disabled():
        print(f"\n  zml-redis: node load peak (running+waiting) {shared}, running_peak "
              f"{shared_running}, {len(shared_results)} answered in {shared_s:.1f}s"
              f"\n  no Redis:  node load peak (running+waiting) {alone}, running_peak "
              f"{alone_running}, {len(alone_results)} answered in {alone_s:.1f}s")
    assert sorted(set(shared_results)) == ["h100-1", "h100-2", "h100-3"]  # no errors
    assert len(shared_results) == PROCESSES * PER_PROCESS
    assert all(peak <= 8 for peak in shared.values()), shared
    assert all(peak <= 8 for peak in shared_running.values()), shared_running
    assert max(alone.values()) > 8, alone  # the oversubscription the plugin prevents
    r = redis_server.client()  # every lease was given back (the last ones at process exit)
    assert not r.keys(f"{prefix}:lease:*")


def test_a_killed_process_gives_its_slots_back_within_the_lease_ttl(
    sim_fleet: Callable[..., Any], redis_server: RedisServer, prefix: str,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    ttl = 2.0
    setup = sim_fleet([{"id": "slow-1", "family": "H100", "max_concurrency": 3,
                        "sim": {"ttft_ms": 60_000}}], {"burst": {"accelerator_chain": ["H100"]}})
    env = replica_env(ZML_REDIS_URL=redis_server.url, ZML_REDIS_PREFIX=prefix,
                      ZML_REDIS_LEASE_TTL_S=str(ttl))
    proc = _spawn(setup.path, env, 3, "hold")
    r = redis_server.client()
    key = f"{prefix}:lease:slow-1"
    try:
        assert _ready(proc)["ledger"] == "RedisLedger"
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        wait_for(lambda: r.zcard(key) == 3, 10.0)
        time.sleep(ttl * 1.25)  # renewed in the background: still held past one TTL
        assert r.zcard(key) == 3
        assert setup.node("slow-1").stats.running == 3

        monkeypatch.setenv("ZML_REDIS_URL", redis_server.url)
        monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
        with zml.Client(config=setup.path) as client:
            ledger = client.fleet.ledger
            assert isinstance(ledger, RedisLedger)
            node = client.fleet.node("slow-1")
            assert not ledger.acquire(node, "probe-0")  # full: 3 leases of the live process
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            killed = time.monotonic()
            attempts = iter(range(1, 10_000))
            wait_for(lambda: ledger.acquire(node, f"probe-{next(attempts)}"), ttl + 1.0, 0.02)
            back_after = time.monotonic() - killed
            with capsys.disabled():
                print(f"\n  capacity back {back_after:.2f}s after kill -9 (lease TTL {ttl}s)")
            assert back_after <= ttl + 0.5  # the TTL, and this test's polling
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

