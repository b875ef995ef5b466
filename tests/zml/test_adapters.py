"""zml.LoopClients: one sync client, one AsyncClient per event loop, closed with its loop."""

from __future__ import annotations

import asyncio
import copy
import pickle
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import zml
from zml.client import AsyncClient

CONFIG = (
    '[accelerators.H100]\n[[nodes]]\nid = "h100-1"\nfamily = "H100"\n'
    'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 1\n'
)


@pytest.fixture
def options(tmp_path: Path) -> Callable[[], Mapping[str, Any]]:
    """Client options that read a config and send nothing; counts how often clients are built."""
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    calls: list[int] = []

    def make() -> Mapping[str, Any]:
        calls.append(1)
        return {"config": path, "max_attempts": 2}

    make.calls = calls  # type: ignore[attr-defined]
    return make


@pytest.fixture
def closed(monkeypatch: pytest.MonkeyPatch) -> list[AsyncClient]:
    """The async clients whose aclose() ran, in order."""
    seen: list[AsyncClient] = []
    original = AsyncClient.aclose

    async def aclose(self: AsyncClient) -> None:
        seen.append(self)
        await original(self)

    monkeypatch.setattr(AsyncClient, "aclose", aclose)
    return seen


def test_the_sync_client_is_built_once_under_concurrent_first_calls(options: Any) -> None:
    clients = zml.LoopClients()
    assert not clients.built
    got: list[zml.Client] = []
    barrier = threading.Barrier(8)

    def first_call() -> None:
        barrier.wait()
        got.append(clients.sync(options))

    threads = [threading.Thread(target=first_call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in got}) == 1
    assert len(options.calls) == 1
    assert clients.built
    clients.close()
    assert not clients.built
    assert clients.sync(options) is not got[0]  # a later call builds a new one
    clients.close()


def test_each_event_loop_gets_its_own_client_closed_when_the_loop_ends(
    options: Any, closed: list[AsyncClient]
) -> None:
    clients = zml.LoopClients()

    async def use() -> AsyncClient:
        first = clients.for_running_loop(options)
        assert clients.for_running_loop(options) is first  # same loop, same client
        await asyncio.sleep(0)
        return first

    a = asyncio.run(use())
    assert closed == [a]  # asyncio.run's shutdown closed it, while its loop could run
    assert clients.loop_count == 0 and not clients.built
    b = asyncio.run(use())
    assert b is not a
    assert closed == [a, b]
    assert len(options.calls) == 2


def test_threads_with_their_own_loops_get_distinct_clients(
    options: Any, closed: list[AsyncClient]
) -> None:
    clients = zml.LoopClients()
    barrier = threading.Barrier(4)
    got: dict[int, AsyncClient] = {}
    counts: list[int] = []

    async def use(i: int) -> None:
        got[i] = clients.for_running_loop(options)
        barrier.wait()  # every thread holds its client at once
        counts.append(clients.loop_count)
        barrier.wait()  # no loop ends before every thread has counted
        assert clients.for_running_loop(options) is got[i]

    threads = [threading.Thread(target=asyncio.run, args=(use(i),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(c) for c in got.values()}) == 4
    assert counts == [4, 4, 4, 4]
    assert sorted(map(id, closed)) == sorted(map(id, got.values()))
    assert clients.loop_count == 0


def test_aclose_closes_this_loops_client_once(options: Any, closed: list[AsyncClient]) -> None:
    clients = zml.LoopClients()

    async def use() -> tuple[AsyncClient, AsyncClient]:
        first = clients.for_running_loop(options)
        await clients.aclose()
        await clients.aclose()  # nothing left: no second close
        second = clients.for_running_loop(options)
        return first, second

    first, second = asyncio.run(use())
    assert first is not second
    assert closed == [first, second]  # the explicit close, then the loop's shutdown


def test_a_loop_closed_without_shutdown_is_dropped_on_next_use(
    options: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import gc

    clients = zml.LoopClients()
    loop = asyncio.new_event_loop()

    async def build() -> None:
        clients.for_running_loop(options)

    loop.run_until_complete(build())
    assert clients.loop_count == 1
    loop.close()  # no task cancellation: the client could not be closed on that loop
    assert clients.loop_count == 0

    async def use() -> None:
        clients.for_running_loop(options)
        assert len(clients._loops) == 1  # the closed loop's entry is gone

    asyncio.run(use())
    del loop
    gc.collect()
    # nothing of the closed loop was left pending: asyncio logs no destroyed task
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


def test_under_uvloop_each_loop_s_client_is_closed_at_shutdown(
    options: Any, closed: list[AsyncClient]
) -> None:
    uvloop = pytest.importorskip("uvloop")  # installed with zmlai[gateway]
    clients = zml.LoopClients()

    async def use() -> AsyncClient:
        return clients.for_running_loop(options)

    client = uvloop.run(use())
    assert closed == [client] and clients.loop_count == 0


def test_a_dropped_adapter_closes_its_client_while_the_loop_runs(
    options: Any, closed: list[AsyncClient]
) -> None:
    import gc

    async def use() -> AsyncClient:
        clients = zml.LoopClients()
        client = clients.for_running_loop(options)
        del clients
        gc.collect()  # the loop's finalizer hook schedules the closer's close
        for _ in range(5):
            await asyncio.sleep(0)
        assert closed == [client]
        return client

    asyncio.run(use())


def test_for_running_loop_needs_a_running_loop(options: Any) -> None:
    with pytest.raises(RuntimeError):
        zml.LoopClients().for_running_loop(options)


def test_copies_start_empty(options: Any) -> None:
    clients = zml.LoopClients()
    clients.sync(options)
    for clone in (copy.copy(clients), copy.deepcopy(clients), pickle.loads(pickle.dumps(clients))):
        assert isinstance(clone, zml.LoopClients)
        assert not clone.built
    assert repr(clients) == "LoopClients(sync=True, loops=0)"
    clients.close()


def test_a_collected_closer_never_takes_the_lock(options: Any, closed: list[AsyncClient]) -> None:
    """The closer coroutine of a loop closed without shutdown is finalized by the garbage
    collector, possibly while this thread holds the lock (a build allocates): it must do
    nothing then, not wait for the lock."""
    import gc

    clients = zml.LoopClients()
    loop = asyncio.new_event_loop()

    async def build() -> None:
        clients.for_running_loop(options)

    loop.run_until_complete(build())
    loop.close()
    collected = threading.Event()

    def collect_holding_the_lock() -> None:
        with clients._lock:
            clients._loops.clear()  # the closer's last references go
            gc.collect()
        collected.set()

    worker = threading.Thread(target=collect_holding_the_lock, daemon=True)
    worker.start()
    worker.join(timeout=30)  # a guard against a deadlock, not a speed check
    assert collected.is_set()
    assert closed == []  # nothing to await on a closed loop: dropped, not closed


def test_the_clients_of_one_adapter_share_one_fleet(options: Any) -> None:
    """Sync code and every event loop count the same slots: a node's capacity is never
    counted once per client of one integration object (and the zml.toml is read once)."""
    clients = zml.LoopClients()
    sync = clients.sync(options)

    async def in_a_loop() -> AsyncClient:
        return clients.for_running_loop(options)

    first = asyncio.run(in_a_loop())
    second = asyncio.run(in_a_loop())
    assert first is not second  # one client per event loop, as before
    assert sync.fleet is first.fleet is second.fleet
    assert second.registry is sync.registry
    clients.close()
    assert clients.sync(options).fleet is sync.fleet  # a new sync client: the same fleet
    clients.close()
