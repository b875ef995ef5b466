"""The deadline watchdogs (thread and event loop) on real sockets: a blocked read returns when
its deadline passes."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from zml.watchdog import LoopWatchdog, Watchdog


class _Stream:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def get_extra_info(self, name: str) -> Any:
        return self.sock if name == "socket" else None


class _Response:
    """What the watchdog reads of an httpx2 response: its network stream's socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.extensions = {"network_stream": _Stream(sock)}


def test_a_blocked_read_returns_when_the_deadline_passes() -> None:
    a, b = socket.socketpair()
    dog = Watchdog()
    try:
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(a.recv(10)))
        reader.start()
        watch = dog.watch(time.monotonic() + 0.2, _Response(a))
        reader.join(10)
        assert not reader.is_alive() and got == [b""]  # the read ended: end of stream
        assert watch.fired and watch.response is None
        watch.end()  # ending after it fired is harmless
    finally:
        dog.close()
        a.close()
        b.close()


def test_an_ended_watch_never_fires() -> None:
    a, b = socket.socketpair()
    dog = Watchdog()
    try:
        watch = dog.watch(time.monotonic() + 0.05, _Response(a))
        watch.end()
        watch.end()
        # a later watch fires: the thread went past the ended one without touching its socket
        other_a, other_b = socket.socketpair()
        later = dog.watch(time.monotonic() + 0.1, _Response(other_a))
        assert other_a.recv(10) == b""
        assert later.fired and not watch.fired
        b.sendall(b"x")
        assert a.recv(10) == b"x"  # the first socket is still open
        other_a.close()
        other_b.close()
    finally:
        dog.close()
        a.close()
        b.close()


def test_an_earlier_deadline_wakes_the_thread() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    dog = Watchdog()
    try:
        far = dog.watch(time.monotonic() + 3600, _Response(a))  # the thread sleeps for an hour
        near = dog.watch(time.monotonic() + 0.05, _Response(c))
        assert c.recv(10) == b""  # ... and still woke for the nearer deadline
        assert near.fired and not far.fired
    finally:
        dog.close()
        for s in (a, b, c, d):
            s.close()


def test_ended_entries_do_not_pile_up() -> None:
    dog = Watchdog()
    try:
        for _ in range(1000):
            dog.watch(time.monotonic() + 3600, object()).end()
        live = dog.watch(time.monotonic() + 3600, object())
        assert len(dog._heap.entries) <= 2 * 1 + 64  # compacted as it grew
        live.end()
    finally:
        dog.close()


def test_a_dropped_client_stops_its_deadline_thread(tmp_path: Any) -> None:
    import gc

    import zml

    config = tmp_path / "zml.toml"
    config.write_text('[accelerators.H100]\n[[nodes]]\nid = "n"\nfamily = "H100"\n'
                      'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 1\n')
    client = zml.Client(config=config, probe_interval_s=None)
    client._watchdog.watch(time.monotonic() + 3600, object()).end()  # as a call would
    thread = client._watchdog._thread
    assert thread is not None and thread.is_alive()
    del client
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


# --- the event loop's watchdog ------------------------------------------------------------


def test_the_loop_watchdog_ends_a_blocked_read_at_its_deadline() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)

    async def main() -> tuple[bytes, bool]:
        dog = LoopWatchdog()
        watch = dog.watch(time.monotonic() + 0.1, _Response(a))
        got = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(a, 10), 10)
        return got, watch.fired

    try:
        assert asyncio.run(main()) == (b"", True)
    finally:
        a.close()
        b.close()


def test_the_loop_watchdog_skips_ended_watches_and_wakes_for_an_earlier_deadline() -> None:
    pairs = [socket.socketpair() for _ in range(3)]
    for a, _ in pairs:
        a.setblocking(False)
    (a1, b1), (a2, _), (a3, _) = pairs

    async def main() -> None:
        dog = LoopWatchdog()
        far = dog.watch(time.monotonic() + 3600, _Response(a1))  # the timer is an hour away
        ended = dog.watch(time.monotonic() + 0.05, _Response(a2))  # ... moved to this one
        ended.end()
        near = dog.watch(time.monotonic() + 0.1, _Response(a3))
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.sock_recv(a3, 10), 10) == b""
        assert near.fired and not ended.fired and not far.fired
        b1.sendall(b"x")
        assert await loop.sock_recv(a1, 10) == b"x"  # the far one's socket is still open
        far.end()
        dog.close()

    try:
        asyncio.run(main())
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def test_the_loop_watchdog_follows_its_client_to_a_new_event_loop() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    dog = LoopWatchdog()

    async def first() -> None:
        dog.watch(time.monotonic() + 0.05, object()).end()  # arms a timer on this loop

    async def second() -> bool:
        watch = dog.watch(time.monotonic() + 3600, _Response(a))
        watch.end()
        watch = dog.watch(time.monotonic() + 0.1, _Response(a))  # later than the first's
        await asyncio.wait_for(asyncio.get_running_loop().sock_recv(a, 10), 10)
        return watch.fired

    try:
        asyncio.run(first())
        assert asyncio.run(second())
    finally:
        a.close()
        b.close()


def test_the_loop_watchdogs_ended_entries_do_not_pile_up() -> None:
    async def main() -> int:
        dog = LoopWatchdog()
        for _ in range(1000):
            dog.watch(time.monotonic() + 3600, object()).end()
        live = dog.watch(time.monotonic() + 3600, object())
        size = len(dog._heap.entries)
        live.end()
        dog.close()
        return size

    assert asyncio.run(main()) <= 2 * 1 + 64


class _Request:
    """What the watchdog reads of a request: no network stream until it goes out on one."""

    def __init__(self) -> None:
        self.extensions: dict[str, Any] = {}


def test_a_watched_request_is_shut_down_on_its_connection_then_follows_its_response() -> None:
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    for s in (a, c):
        s.settimeout(10)  # a safety net: the watchdog ends the reads long before
    dog = Watchdog()
    try:
        request = _Request()
        watch = dog.watch(time.monotonic() + 0.2, request)
        request.extensions["network_stream"] = _Stream(a)  # what zml's transports record
        assert a.recv(10) == b""  # the wait for the headers ended at the deadline
        assert watch.fired and not watch.follow(_Response(c))  # too late to follow
        watch = dog.watch(time.monotonic() + 0.2, _Request())  # a transport that records none
        assert watch.follow(_Response(c))
        assert c.recv(10) == b""  # the response's socket, once the headers are in
        assert watch.fired
    finally:
        dog.close()
        for s in (a, b, c, d):
            s.close()


def test_the_loop_watchdog_follows_a_request_to_its_response() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        dog = LoopWatchdog(loop.time)
        try:
            watch = dog.watch(loop.time() + 0.1, _Request())
            assert watch.follow(_Response(a))
            assert await asyncio.wait_for(loop.sock_recv(a, 10), 10) == b""
            assert watch.fired and not watch.follow(_Response(a))
        finally:
            dog.close()
            a.close()
            b.close()

    asyncio.run(main())


def test_a_deadline_far_beyond_the_platform_s_wait_limit_does_not_stop_the_thread() -> None:
    """The thread waits at most threading.TIMEOUT_MAX at a time (a longer wait raises), and
    goes on serving the deadlines that come after."""
    dog = Watchdog()
    far = dog.watch(time.monotonic() + threading.TIMEOUT_MAX * 4, object())
    time.sleep(0.05)  # the thread now waits for that deadline
    a, b = socket.socketpair()
    try:
        response = _Response(a)
        near = dog.watch(time.monotonic() + 0.05, response)
        deadline = time.monotonic() + 10  # a safety net
        while not near.fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert near.fired and dog._thread is not None and dog._thread.is_alive()
    finally:
        far.end()
        dog.close()
        a.close()
        b.close()


def test_on_fire_runs_after_the_shutdown_outside_the_lock_and_never_at_close() -> None:
    """A watch's ``on_fire`` (an open stream frees its slot there) runs once its socket was
    shut down at the deadline, on the thread, free to call the watchdog again; closing the
    client shuts sockets down without calling it."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    dog = Watchdog()
    calls: list[str] = []
    done = threading.Event()
    try:
        watch = dog.watch(time.monotonic() + 0.1, _Response(a))

        def on_fire() -> None:
            calls.append(threading.current_thread().name)
            dog.watch(time.monotonic() + 60, _Response(c)).end()  # would deadlock under lock
            done.set()

        watch.on_fire = on_fire
        assert done.wait(10)
        assert calls == ["zml-deadlines"] and watch.fired
        assert a.recv(10) == b""  # shut down before the callback ran
        closing = dog.watch(time.monotonic() + 60, _Response(c))
        closing.on_fire = lambda: calls.append("at close")
        dog.close()
        assert calls == ["zml-deadlines"] and not closing.fired
    finally:
        dog.close()
        for s in (a, b, c, d):
            s.close()


def test_the_loop_watchdog_runs_on_fire_on_the_loop() -> None:
    a, b = socket.socketpair()

    async def main() -> list[bool]:
        dog = LoopWatchdog()
        loop = asyncio.get_running_loop()
        seen: list[bool] = []
        fired = asyncio.Event()
        watch = dog.watch(time.monotonic() + 0.1, _Response(a))
        watch.on_fire = lambda: (seen.append(asyncio.get_running_loop() is loop), fired.set())
        await asyncio.wait_for(fired.wait(), 10)
        dog.close()
        return seen

    try:
        assert asyncio.run(main()) == [True]
    finally:
        a.close()
        b.close()
