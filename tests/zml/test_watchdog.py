"""The sync deadline watchdog on real sockets: a blocked read returns when its deadline passes."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from zml.watchdog import Watchdog


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
        assert len(dog._heap) <= 2 * 1 + 64  # compacted as it grew
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
