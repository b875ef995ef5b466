"""What building a client reads, and when: the environment once per client, and the policy
store once, within a short bound even when Redis hangs."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from zml_redis import RedisLedger
from zml_redis.policies import PolicyStore, RedisPolicySource

import zml
from tests.conftest import MODEL

from .conftest import RedisServer

MSG = [{"role": "user", "content": "hi"}]
FAMILIES: dict[str, dict[str, Any]] = {"H100": {}, "MI300X": {}}
NODES = [
    {"id": "h100-1", "family": "H100", "max_concurrency": 4,
     "sim": {"ttft_ms": 5, "tokens_per_s": 5000}},
    {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 4,
     "sim": {"ttft_ms": 5, "tokens_per_s": 5000}},
]
LOCAL = {"local": {"accelerator_chain": ["H100"]}}
"""A zml.toml policy: served whatever Redis does."""
HANG_GUARD_S = 10.0
"""Not a timing assertion: only so that a build that hangs fails the test instead of it."""


def redis_source(client: zml.Client | zml.AsyncClient) -> RedisPolicySource | None:
    return next((s for s in client.policies.sources if isinstance(s, RedisPolicySource)), None)


def route(client: zml.Client, policy: str = "p") -> str:
    return client.infer(model=MODEL, messages=MSG, policy=policy,
                        max_tokens=2).routing.accelerator


class Telemetry:
    """An unrelated plugin: registering it makes zml collect the policy sources again."""

    @zml.hookimpl
    def zml_request_completed(self, routing: Any) -> None:
        pass


def test_a_client_keeps_the_redis_it_was_built_with(
    sim_fleet: Callable[..., Any], redis_server: RedisServer, own_redis: RedisServer,
    prefix: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    setup = sim_fleet(NODES, LOCAL, FAMILIES)
    for server, family in ((redis_server, "H100"), (own_redis, "MI300X")):
        with PolicyStore(server.url, prefix) as store:
            store.push({"p": {"accelerator_chain": [family]}})
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    monkeypatch.setenv("ZML_REDIS_URL", redis_server.url)
    a = zml.Client(config=setup.path, probe_interval_s=None)
    monkeypatch.setenv("ZML_REDIS_URL", own_redis.url)
    b = zml.Client(config=setup.path, probe_interval_s=None)
    monkeypatch.delenv("ZML_REDIS_URL")
    plain = zml.Client(config=setup.path, probe_interval_s=None)
    with a, b, plain:
        source_a, source_b = redis_source(a), redis_source(b)
        assert source_a is not None and source_b is not None
        assert redis_server.url in source_a.name and own_redis.url in source_b.name
        assert (route(a), route(b)) == ("H100", "MI300X")
        assert redis_source(plain) is None and plain.fleet.ledger is None

        # Another Redis in the environment by now; then a plugin registered on each client
        # makes zml ask the plugin for its policy sources again: each keeps its own.
        monkeypatch.setenv("ZML_REDIS_URL", own_redis.url)
        for client in (a, b, plain):
            client.plugins.register(Telemetry(), name="telemetry")
        assert redis_source(a) is source_a and redis_source(b) is source_b
        assert (route(a), route(b)) == ("H100", "MI300X")
        assert redis_source(plain) is None  # built without Redis: stays without it
        ledger = a.fleet.ledger
        assert isinstance(ledger, RedisLedger) and ledger.hub is source_a.hub

        # Nor does an environment that would not even be valid any more matter to them.
        monkeypatch.setenv("ZML_REDIS_URL", "redis://127.0.0.1:0/0")
        monkeypatch.setenv("ZML_REDIS_LEDGER", "flase")
        for client in (a, b, plain):
            client.plugins.unregister(name="telemetry")
        assert redis_source(a) is source_a and redis_source(b) is source_b
        assert (route(a), route(b), route(plain, "local")) == ("H100", "MI300X", "H100")
        with pytest.raises(zml.PolicyConfigError):  # only a new client reads the environment
            zml.Client(config=setup.path)
    assert not [r for r in caplog.records if r.name == "zml.redis"
                and r.levelno >= logging.WARNING]


@pytest.fixture
def mute_redis() -> Iterator[socket.socket]:
    """A loopback port where connections are made (the kernel completes them) and nothing
    ever answers: a Redis that hangs. Connections are left in the backlog until drained."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    yield listener
    listener.close()


def drain(listener: socket.socket) -> int:
    """Accept (and close) the connections made so far; return how many there were."""
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


class OnFirstWarning(logging.Handler):
    """Counts the connections made to ``listener`` when zml-redis logs its first warning (on
    the building thread, before the hub's own threads start)."""

    def __init__(self, listener: socket.socket) -> None:
        super().__init__(logging.WARNING)
        self.listener = listener
        self.connections: int | None = None
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        if self.connections is None:
            self.connections = drain(self.listener)


@pytest.fixture
def first_warning(mute_redis: socket.socket) -> Iterator[OnFirstWarning]:
    handler = OnFirstWarning(mute_redis)
    logger = logging.getLogger("zml.redis")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_a_redis_that_never_answers_costs_a_build_one_short_try(
    sim_fleet: Callable[..., Any], mute_redis: socket.socket, first_warning: OnFirstWarning,
    prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = sim_fleet(NODES, LOCAL, FAMILIES)
    port = mute_redis.getsockname()[1]
    monkeypatch.setenv("ZML_REDIS_URL", f"redis://127.0.0.1:{port}/0?socket_timeout=30")
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    started = time.monotonic()
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        built = time.monotonic() - started
        assert built < HANG_GUARD_S, built
        # The build read the store once, with one connection (no retry), gave up (the URL's
        # 30 s socket timeout does not apply to it), and said so once:
        assert first_warning.connections == 1, first_warning.messages
        assert len(first_warning.messages) == 1, first_warning.messages
        assert "unreachable" in first_warning.messages[0]
        assert "TimeoutError" in first_warning.messages[0]
        # ...and the client starts as while Redis is down: no store policies, no I/O.
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger) and not ledger.hub.connected
        source = redis_source(client)
        assert source is not None and source.list() == [] and source.version == 0
        node = client.fleet.node("h100-1")
        assert ledger.acquire(node, "while-mute")  # answered without a round trip
        ledger.release(node, "while-mute")
        assert route(client, "local") == "H100"


def test_the_build_timeout_is_short_and_documented() -> None:
    from zml_redis.settings import BUILD_TIMEOUT_MAX_S, BUILD_TIMEOUT_S, Settings

    assert BUILD_TIMEOUT_S < 1.0 and BUILD_TIMEOUT_MAX_S <= 1.0
    assert Settings(url="redis://h:1/0").build_timeout_s == BUILD_TIMEOUT_S
    assert Settings(url="redis://h:1/0", timeout_s=0.6).build_timeout_s == 0.6
    assert Settings(url="redis://h:1/0", timeout_s=2.0).build_timeout_s == BUILD_TIMEOUT_MAX_S


async def test_an_async_client_built_while_redis_is_paused_degrades(
    sim_fleet: Callable[..., Any], own_redis: RedisServer, prefix: str,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    setup = sim_fleet(NODES, LOCAL, FAMILIES)
    with PolicyStore(own_redis.url, prefix) as store:
        store.push({"p": {"accelerator_chain": ["MI300X"]}})
    monkeypatch.setenv("ZML_REDIS_URL", own_redis.url)
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    own_redis.pause()
    try:
        started = time.monotonic()
        client = zml.AsyncClient(config=setup.path, probe_interval_s=None)
        assert time.monotonic() - started < HANG_GUARD_S
        try:
            warnings = [r.getMessage() for r in caplog.records
                        if r.name == "zml.redis" and r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "unreachable" in warnings[0], warnings
            ledger = client.fleet.ledger
            assert isinstance(ledger, RedisLedger) and not ledger.hub.connected
            answer = await client.infer(model=MODEL, messages=MSG, policy="local",
                                        max_tokens=2)
            assert answer.routing.accelerator == "H100"
            source = redis_source(client)
            assert source is not None and source.list() == []
            own_redis.resume()
            # Redis answers again: the store is read (no restart, no new client).
            deadline = time.monotonic() + HANG_GUARD_S
            while "p" not in source.list():
                assert time.monotonic() < deadline, "the store was not read again"
                await asyncio.sleep(0.02)
            answer = await client.infer(model=MODEL, messages=MSG, policy="p", max_tokens=2)
            assert answer.routing.accelerator == "MI300X"
        finally:
            await client.aclose()
    finally:
        own_redis.resume()


def test_closing_a_hub_while_redis_hangs_leaves_its_threads_to_stop_by_themselves(
    sim_fleet: Callable[..., Any], mute_redis: socket.socket, first_warning: OnFirstWarning,
    prefix: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    setup = sim_fleet(NODES, LOCAL, FAMILIES)
    monkeypatch.setenv("ZML_REDIS_URL", f"redis://127.0.0.1:{mute_redis.getsockname()[1]}/0")
    monkeypatch.setenv("ZML_REDIS_PREFIX", prefix)
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger)
        hub = ledger.hub
        assert not hub.connected
        # The worker (retrying) and the listener (subscribing) wait on the mute Redis.
        deadline = time.monotonic() + HANG_GUARD_S
        while drain(mute_redis) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    threads = list(hub._threads)
    assert len(threads) == 2
    hub.close(timeout=HANG_GUARD_S)  # what runs at exit (while down: no wait for threads)
    for thread in threads:  # daemons, which never hold the exit, and stop by themselves
        thread.join(HANG_GUARD_S)
        assert thread.daemon and not thread.is_alive()
