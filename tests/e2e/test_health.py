"""Node health: the circuit breaker, the health score, and active probing of /health and /metrics.

The breaker and the score are driven by real failures from simulated nodes (and, where the
contract is about time, by the fleet's clock directly: ``Fleet.record_*`` / ``refresh`` take
``now``). ``fleet.CIRCUIT_COOLDOWN_S`` / ``HEALTH_RECOVERY_S`` are module constants read at
use, monkeypatched small where a test waits for them. Probing runs against the nodes' real
``/metrics`` (vLLM, SGLang, TGI and llama.cpp names) while load is put on them by a plain
HTTP client the zml client knows nothing about.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest

import zml
import zml.fleet
from tests.conftest import MODEL
from tests.e2e.conftest import PROD, await_for, fleet_fixture, two_family_nodes, wait_for
from zml.dispatch import ResponseSummary
from zml.routing import Decision, NoRoute
from zml.sim import FaultSpec

MSGS = [{"role": "user", "content": "hello"}]
POLICIES = {
    # health_threshold 0: only the circuit breaker keeps a failing node out
    "breaker": {"accelerator_chain": ["H100", "MI300X"], "cost_priority": "cost",
                "health_threshold": 0.0},
    "prod": PROD,
}
setup = fleet_fixture(two_family_nodes(), POLICIES, 0.05)


def first_reason(decision: Decision | NoRoute) -> Any:
    return decision.evaluated[0].as_dict()["rejected_reason"]


# --- circuit breaker ---------------------------------------------------------------------------


def test_circuit_opens_half_opens_admits_one_trial_and_closes(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zml.fleet, "CIRCUIT_COOLDOWN_S", 0.3)
    bad = setup.node("h100-a")
    bad.set_faults(FaultSpec(error_rate=1.0, error_status=503))
    with zml.Client(config=setup.path) as client:
        node = client.fleet.node("h100-a")
        policy = client.policy("breaker")
        for i in range(zml.fleet.CIRCUIT_FAILURES):
            assert node.circuit_state == "closed"
            r = client.infer(MODEL, MSGS, policy="breaker")
            assert r.routing.node_id == "mi-a"
            assert [a.node_id for a in r.routing.attempts] == ["h100-a"]
            assert node.consecutive_failures == i + 1
        assert node.circuit_state == "open"
        assert bad.stats.requests_total == zml.fleet.CIRCUIT_FAILURES

        # open: skipped without being tried, visible in the trace and in a dry run
        decision = client.explain(MODEL, policy=policy)
        assert isinstance(decision, Decision) and decision.node.id == "mi-a"
        assert first_reason(decision) == "circuit_open"
        r = client.infer(MODEL, MSGS, policy="breaker")
        assert r.routing.attempts == []
        assert r.routing.evaluated[0] == {"family": "H100", "nodes_checked": 1,
                                          "rejected_reason": "circuit_open"}
        assert bad.stats.requests_total == zml.fleet.CIRCUIT_FAILURES
        assert {s["id"]: s["circuit"] for s in client.fleet.status()}["h100-a"] == "open"

        # after the cool-down the node is admitted again, for one trial at a time
        wait_for(lambda: client.explain(MODEL, policy=policy).node.id == "h100-a",
                 "the cool-down to pass")
        bad.set_faults(FaultSpec())
        with client.infer_stream(MODEL, MSGS, policy="breaker") as trial:
            assert trial.routing is not None and trial.routing.node_id == "h100-a"
            assert node.circuit_state == "half_open"
            decision = client.explain(MODEL, policy=policy)
            assert first_reason(decision) == "circuit_open"  # no second trial meanwhile
            other = client.infer(MODEL, MSGS, policy="breaker")
            assert other.routing.node_id == "mi-a"
            assert other.routing.evaluated[0]["rejected_reason"] == "circuit_open"
            assert trial.text == "" and list(trial) and trial.finish_reason
        assert node.circuit_state == "closed" and node.consecutive_failures == 0
        r = client.infer(MODEL, MSGS, policy="breaker")
        assert r.routing.node_id == "h100-a" and r.routing.attempts == []
        assert client.fleet.in_flight == 0


def test_a_failed_trial_opens_the_circuit_again(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zml.fleet, "CIRCUIT_COOLDOWN_S", 0.2)
    bad = setup.node("h100-a")
    bad.set_faults(FaultSpec(error_rate=1.0, error_status=500))

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            node = client.fleet.node("h100-a")
            policy = client.policy("breaker")
            for _ in range(zml.fleet.CIRCUIT_FAILURES):
                await client.infer(MODEL, MSGS, policy="breaker")
            assert node.circuit_state == "open"
            await await_for(
                lambda: client.explain(MODEL, policy=policy).node.id == "h100-a",
                "the cool-down to pass")
            r = await client.infer(MODEL, MSGS, policy="breaker")  # the trial fails over
            assert r.routing.node_id == "mi-a"
            assert [(a.node_id, a.error) for a in r.routing.attempts] == [
                ("h100-a", "server_error")]
            assert node.circuit_state == "open"
            assert first_reason(client.explain(MODEL, policy=policy)) == "circuit_open"
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    assert bad.stats.requests_total == zml.fleet.CIRCUIT_FAILURES + 1


def test_circuit_breaker_on_the_fleet_clock(setup: Any) -> None:
    """The same life cycle, on explicit times (no waiting at all)."""
    client = zml.Client(config=setup.path)
    fleet = client.fleet
    node = fleet.node("h100-a")
    cool = zml.fleet.CIRCUIT_COOLDOWN_S
    t = 1000.0
    for _ in range(zml.fleet.CIRCUIT_FAILURES - 1):
        fleet.record_failure(node, t)
    assert node.circuit_state == "closed" and node.circuit_allows(t)
    fleet.record_failure(node, t)
    assert node.circuit_state == "open"
    assert not node.circuit_allows(t + cool - 0.001)
    assert node.circuit_allows(t + cool)
    trial = fleet.reserve(node, t + cool)
    assert trial.trial and node.circuit_state == "half_open"
    assert not node.circuit_allows(t + cool + 1)  # one trial at a time
    fleet.release(trial)
    fleet.record_failure(node, t + cool + 1)  # the trial failed: open for another cool-down
    assert node.circuit_state == "open"
    assert not node.circuit_allows(t + 2 * cool)
    assert node.circuit_allows(t + 2 * cool + 1)
    trial = fleet.reserve(node, t + 2 * cool + 1)
    assert trial.trial
    fleet.release(trial)
    fleet.record_success(node, t + 2 * cool + 2, 0.05, 0.2)
    assert node.circuit_state == "closed" and node.circuit_allows(t + 2 * cool + 2)
    plain = fleet.reserve(node, t + 2 * cool + 3)
    assert not plain.trial
    fleet.release(plain)
    assert fleet.in_flight == 0
    client.close()


# --- health score --------------------------------------------------------------------------------


def test_health_drops_with_failures_skips_the_node_and_recovers(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = setup.node("h100-a")
    bad.set_faults(FaultSpec(error_rate=1.0, error_status=503))
    with zml.Client(config=setup.path) as client:
        node = client.fleet.node("h100-a")
        policy = client.policy("prod")
        healths = [node.health]
        while True:
            r = client.infer(MODEL, MSGS, policy="prod")
            assert r.routing.node_id == "mi-a"
            if not r.routing.attempts:
                break
            healths.append(node.health)
            assert len(healths) < 10
        assert healths == sorted(healths, reverse=True) and healths[-1] < 0.5
        failures = len(healths) - 1
        assert bad.stats.requests_total == failures  # skipped, not tried, from then on
        assert r.routing.evaluated[0] == {"family": "H100", "nodes_checked": 1,
                                          "rejected_reason": "health_score_below_threshold"}
        assert node.circuit_state == "closed"  # too few failures for the breaker
        # a policy with a lower threshold still takes it
        lenient = client.policy({"name": "lenient", "accelerator_chain": ["H100", "MI300X"],
                                 "health_threshold": 0.01})
        decision = client.explain(MODEL, policy=lenient)
        assert isinstance(decision, Decision) and decision.node.id == "h100-a"

        bad.set_faults(FaultSpec())
        monkeypatch.setattr(zml.fleet, "HEALTH_RECOVERY_S", 1.0)
        wait_for(lambda: client.explain(MODEL, policy=policy).node.id == "h100-a",
                 "the health score to recover")
        before = node.health
        r = client.infer(MODEL, MSGS, policy="prod")
        assert r.routing.node_id == "h100-a" and r.routing.attempts == []
        assert node.health > before
        assert bad.stats.requests_total == failures + 1


@pytest.mark.parametrize("step_s", [30.0, 1.0, 0.01])
def test_health_recovers_linearly_whatever_the_refresh_rate(setup: Any, step_s: float) -> None:
    """After failures the score returns to 1 within HEALTH_RECOVERY_S without traffic, whether
    routing refreshes the fleet once or every few milliseconds."""
    client = zml.Client(config=setup.path)
    fleet = client.fleet
    node = fleet.node("h100-a")
    t0 = 500.0
    fleet.record_failure(node, t0)
    fleet.record_failure(node, t0)
    low = node.health
    assert low < 0.5
    recovery = zml.fleet.HEALTH_RECOVERY_S
    t = t0
    samples = []
    while t < t0 + recovery:
        t = min(t0 + recovery, t + step_s)
        fleet.refresh(t)
        samples.append(node.health)
    assert samples == sorted(samples)
    assert node.health == 1.0, f"health {node.health:.3f} after {recovery}s (steps of {step_s}s)"
    client.close()


def test_probe_marks_a_dead_node_unhealthy_and_a_restarted_one_healthy(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=0.05, timeout=30) as client:
            policy = client.policy("prod")
            r = await client.infer(MODEL, MSGS, policy="prod")  # starts the prober
            assert r.routing.node_id == "h100-a"
            await asyncio.to_thread(setup.fleet.kill, "h100-a")
            node = client.fleet.node("h100-a")
            await await_for(lambda: node.health == 0.0, "a probe to find the node down")
            decision = client.explain(MODEL, policy=policy)
            assert first_reason(decision) == "health_score_below_threshold"
            r = await client.infer(MODEL, MSGS, policy="prod")
            assert r.routing.node_id == "mi-a" and r.routing.attempts == []  # not even tried
            await asyncio.to_thread(setup.fleet.restart, "h100-a")
            await await_for(
                lambda: client.explain(MODEL, policy=policy).node.id == "h100-a",
                "probes to find the node back")
            r = await client.infer(MODEL, MSGS, policy="prod")
            assert r.routing.node_id == "h100-a"

    asyncio.run(main())


# --- active probing: node-reported load ------------------------------------------------------------


class ExternalLoad:
    """Requests held open on nodes by a plain HTTP client in its own thread and event loop:
    load the zml client can only learn about from the nodes' /metrics."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.http = httpx2.AsyncClient(timeout=None, limits=httpx2.Limits(max_connections=None))
        self.tasks: list[Any] = []

    def hold(self, url: str, count: int) -> None:
        async def one() -> None:
            # a minute of tokens at the nodes' 50 per second: longer than any test holds it
            body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 3000,
                    "ignore_eos": True}
            async with self.http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass

        for _ in range(count):
            self.tasks.append(asyncio.run_coroutine_threadsafe(one(), self.loop))

    def release(self) -> None:
        for task in self.tasks:
            task.cancel()
        self.tasks.clear()

    def close(self) -> None:
        self.release()
        asyncio.run_coroutine_threadsafe(self.http.aclose(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def external() -> Iterator[ExternalLoad]:
    load = ExternalLoad()
    yield load
    load.close()


KIND_NODES = [
    # a token every 20 ms: held streams never run the simulated node behind its schedule
    {"id": f"{kind}-1", "family": "H100", "max_concurrency": 1, "max_queue": 8, "kind": kind,
     "sim": {"ttft_ms": 5.0, "tokens_per_s": 50.0}}
    for kind in ("vllm", "sglang", "tgi", "llamacpp", "openai")
]


def status_of(client: Any) -> dict[str, dict[str, Any]]:
    return {s["id"]: s for s in client.fleet.status()}


def test_async_client_probes_by_default_and_merges_reported_load(
    sim_fleet: Any, external: ExternalLoad, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="zml")
    setup = sim_fleet(KIND_NODES, {"any": {"accelerator_chain": ["H100"]}})
    reporting = ["vllm-1", "sglang-1", "tgi-1", "llamacpp-1"]

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=0.05,
                                   timeout=30) as client:
            assert client._prober is not None and client._prober.interval_s == 0.05
            await client.infer(MODEL, MSGS, accelerator="H100", max_tokens=2)
            await await_for(lambda: all(status_of(client)[n]["reported_load"] == 0
                                        for n in reporting), "the first probes")
            for node_id in [*reporting, "openai-1"]:
                external.hold(setup.fleet.url(node_id), 3)  # 1 running, 2 waiting
            await await_for(lambda: all(setup.node(n).stats.waiting == 2
                                        for n in [*reporting, "openai-1"]), "external load")
            await await_for(lambda: all(status_of(client)[n]["reported_load"] == 3
                                        for n in reporting), "probes to report the load")
            status = status_of(client)
            for node_id in reporting:
                assert status[node_id]["in_flight"] == 0
                assert status[node_id]["load"] == 3, status[node_id]
            # an "openai" node has no /metrics: client-side accounting only
            assert status["openai-1"]["reported_load"] is None
            assert status["openai-1"]["load"] == 0
            # routing sees the reported load: only the node that reports none looks idle
            decision = client.explain(MODEL, policy=None, accelerator="H100")
            assert isinstance(decision, Decision) and decision.node.id == "openai-1"
            external.release()
            await await_for(lambda: all(status_of(client)[n]["reported_load"] == 0
                                        for n in reporting), "probes to see the load go")

    asyncio.run(main())
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage() for r in noisy]


def test_node_reported_load_steers_routing(
    sim_fleet: Any, external: ExternalLoad
) -> None:
    slow = {"ttft_ms": 5.0, "tokens_per_s": 50.0}
    nodes = [
        {"id": "h100-a", "family": "H100", "max_concurrency": 2, "sim": slow},
        {"id": "mi-a", "family": "MI300X", "max_concurrency": 2, "sim": slow},
    ]
    setup = sim_fleet(nodes, POLICIES)

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=0.05, timeout=30) as client:
            r = await client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
            assert r.routing.node_id == "h100-a"
            external.hold(setup.fleet.url("h100-a"), 2)  # another client fills the node
            await await_for(lambda: client.fleet.node("h100-a").load == 2, "a probe")
            assert client.fleet.in_flight == 0
            r = await client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
            assert r.routing.node_id == "mi-a"
            assert r.routing.evaluated[0]["rejected_reason"] == "all_nodes_over_capacity"
            assert setup.node("h100-a").stats.requests_total == 3  # 1 of ours + 2 external

    asyncio.run(main())


def test_sync_client_probes_after_start_probing(
    sim_fleet: Any, external: ExternalLoad, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="zml")
    setup = sim_fleet(KIND_NODES, {"any": {"accelerator_chain": ["H100"]}})
    with zml.Client(config=setup.path, timeout=30) as client:
        assert all(s["reported_load"] is None for s in client.fleet.status())  # not by default
        client.start_probing(0.05)
        client.start_probing(0.05)  # idempotent
        external.hold(setup.fleet.url("tgi-1"), 2)
        wait_for(lambda: status_of(client)["tgi-1"]["reported_load"] == 2, "a probe")
        status = status_of(client)
        assert status["tgi-1"]["load"] == 2 and status["tgi-1"]["in_flight"] == 0
        assert status["vllm-1"]["reported_load"] == 0
        assert status["openai-1"]["reported_load"] is None
        r = client.infer(MODEL, MSGS, accelerator="H100", max_tokens=2)
        assert r.routing.node_id != "tgi-1"  # the least loaded node, by the reports
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert noisy == [], [r.getMessage() for r in noisy]


def test_release_corrects_a_stale_report(setup: Any) -> None:
    """The node's last report counted this client's request; once it ends, load drops at once
    instead of waiting for the next probe."""
    client = zml.Client(config=setup.path)
    fleet = client.fleet
    node = fleet.node("h100-a")
    call = client._dispatcher.start(model=MODEL, messages=MSGS, policy=client.policy("prod"),
                                    accelerator=None, params={}, stream=False, metadata=None,
                                    timeouts=client._dispatcher.timeouts)
    op, _ = call.advance(call.flow(), None)
    assert isinstance(op, zml.dispatch.Send) and op.step.node is node
    step = op.step
    fleet.record_probe(node, client._dispatcher.clock(), healthy=True, reported_load=3)
    assert node.load == 3
    call.succeeded(step, None, ResponseSummary(None, None, "stop"))
    assert node.in_flight == 0 and node.load == 2
    client.close()


def test_probing_defaults(setup: Any) -> None:
    """Both clients probe every 2 s from their first request until they are closed, unless
    built with probe_interval_s=None."""
    async def main() -> None:
        client = zml.AsyncClient(config=setup.path)
        prober = client._prober
        assert prober is not None and prober.interval_s == 2.0
        assert not prober.running  # nothing runs before the first request
        await client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
        assert prober.running  # a round, or the timer of the next one
        await await_for(lambda: client.fleet.node("h100-a").reported_load is not None,
                        "the first probe")
        await client.aclose()
        assert not prober.running
        off = zml.AsyncClient(config=setup.path, probe_interval_s=None)
        assert off._prober is None
        await off.aclose()

    asyncio.run(main())
    with zml.Client(config=setup.path) as client:
        assert not client._probing  # nothing runs before the first request
        client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
        stop = client._probe_stop
        assert client._probing and not stop.is_set()
        wait_for(lambda: client.fleet.node("h100-a").reported_load is not None, "the first probe")
    assert stop.is_set()  # close() stopped it
    with zml.Client(config=setup.path, probe_interval_s=None) as off:
        off.infer(MODEL, MSGS, policy="prod", max_tokens=2)
        assert not off._probing
        assert all(s["reported_load"] is None for s in off.fleet.status())
    with pytest.raises(zml.InvalidRequestError, match="probe_interval_s"):
        zml.Client(config=setup.path, probe_interval_s=0)
