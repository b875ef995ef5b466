"""Clients that are slow or endless before their request is even read, on real loopback sockets:
a request's head (request line and headers) must arrive within ``[gateway] head_timeout_s``
and hold at most 64 KiB, else the connection is closed (408, 431). uvicorn's default protocol
(httptools) had neither bound: a connection that sent nothing, or a header byte every 0.5 s,
stayed open for ever, and a 10 MB header was read whole.

The gateways here are served with the uvicorn options ``zml serve`` uses
(:func:`zml.gateway.server.connection_limits`); the last tests run ``zml serve`` itself. The
timeouts in the tests are hang guards, ten times the configured limit, not measurements.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import zml
from tests.conftest import MODEL, SimSetup
from zml.config import load_registry
from zml.gateway import create_app
from zml.gateway.settings import GatewaySettings, gateway_settings

from .conftest import _Thread
from .test_cli import env, free_port, start_serve, stop, wait_ready

ONE_NODE = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
PROD = {"prod": {"accelerator_chain": ["H100"]}}
GUARD_S = 10.0
"""How long a test waits for the gateway to close a connection (the limit is 1 s)."""
HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.fixture
def serve_limited(sim_fleet: Callable[..., SimSetup]) -> Iterator[Callable[[str], int]]:
    """Factory: a gateway with this ``[gateway]`` table, served as ``zml serve`` does; its port."""
    threads: list[_Thread] = []

    def make(gateway: str) -> int:
        setup = sim_fleet(ONE_NODE, PROD, time_scale=0.05)
        setup.path.write_text(setup.path.read_text() + "\n" + gateway + "\n")
        thread = _Thread(create_app(setup.path, environ={}, probe_interval_s=None))
        threads.append(thread)
        thread.start()
        return thread.port

    yield make
    for thread in threads:
        thread.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)


def read_until_closed(sock: socket.socket, guard: float = GUARD_S) -> bytes:
    """Everything the gateway sends until it closes the connection; fails after ``guard`` s."""
    data = b""
    deadline = time.monotonic() + guard
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"the connection is still open after {guard} s; got {data[:200]!r}")


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a Content-Length, leaving the connection open: (head, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, data
        body += chunk
    return head, body


class Trickle:
    """Sends one byte every ``every`` s on ``sock`` until the gateway closes it (or ``stop``)."""

    def __init__(self, sock: socket.socket, byte: bytes = b"a", every: float = 0.2) -> None:
        self.sock, self.byte, self.every = sock, byte, every
        self.stopped = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.sock.send(self.byte)
            except OSError:
                return
            self.sent += 1

    def __enter__(self) -> Trickle:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(GUARD_S)


def error_of(reply: bytes, status: int) -> dict[str, object]:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), reply[:300]
    assert b"connection: close" in head.lower()
    error: dict[str, object] = json.loads(body)["error"]
    return error


def test_a_connection_that_sends_nothing_is_closed_after_head_timeout(
        serve_limited: Callable[[str], int]) -> None:
    port = serve_limited("[gateway]\nhead_timeout_s = 1\n")
    with connect(port) as sock:
        assert read_until_closed(sock) == b""  # closed without a word: no request to answer


def test_a_head_sent_a_byte_at_a_time_gets_408_and_the_connection_is_closed(
        serve_limited: Callable[[str], int]) -> None:
    port = serve_limited("[gateway]\nhead_timeout_s = 1\n")
    with connect(port) as sock:
        sock.sendall(HEAD + b"X-Slow: ")
        with Trickle(sock) as trickle:
            reply = read_until_closed(sock)
        assert trickle.sent > 0  # the header was still growing when the gateway gave up
    error = error_of(reply, 408)
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert "head_timeout_s" in str(error["message"])


def test_the_limit_runs_again_after_each_response_on_a_kept_alive_connection(
        serve_limited: Callable[[str], int]) -> None:
    port = serve_limited("[gateway]\nhead_timeout_s = 1\n")
    with connect(port) as sock:
        for _ in range(2):  # whole heads are served, however long the connection lives
            sock.sendall(HEAD + b"\r\n")
            head, body = read_response(sock)
            assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body) == {"status": "ok"}
        sock.sendall(HEAD + b"X-Slow: ")
        with Trickle(sock):
            reply = read_until_closed(sock)
    assert error_of(reply, 408)["code"] == "request_timeout"


def test_a_body_the_gateway_did_not_read_cannot_hold_the_connection_after_the_response(
        serve_limited: Callable[[str], int]) -> None:
    """``/health`` answers without reading a body: the rest of it, trickled, was read for
    ever (uvicorn's keep-alive timer stops at every byte and starts again only after a
    response)."""
    port = serve_limited("[gateway]\nhead_timeout_s = 1\n")
    with connect(port) as sock:
        sock.sendall(HEAD + b"Content-Length: 100000\r\n\r\nxx")
        head, _ = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200 ")
        with Trickle(sock):
            assert read_until_closed(sock) == b""  # no 408: the request had its answer


def test_the_body_has_its_own_limit_and_a_slow_one_within_it_is_served(
        serve_limited: Callable[[str], int]) -> None:
    """The head timer stops when the head is in: a body slower than ``head_timeout_s`` (but
    within ``body_timeout_s``) is served."""
    port = serve_limited('[gateway]\nhead_timeout_s = 1\nbody_timeout_s = 20\n'
                         'default_policy = "prod"\n')
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    with connect(port) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), len(body) // 4 + 1):
            time.sleep(0.5)  # 2 s in all, twice the head limit
            sock.sendall(body[i:i + len(body) // 4 + 1])
        head, reply = read_response(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head + reply
    assert json.loads(reply)["object"] == "chat.completion"


def test_a_head_over_64_kib_gets_431_and_one_under_it_is_served(
        serve_limited: Callable[[str], int]) -> None:
    port = serve_limited("")  # the default limits
    with connect(port) as sock:
        sock.sendall(HEAD + b"X-Big: " + b"a" * (48 * 1024) + b"\r\nConnection: close\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200 ")  # over h11's default 16 KiB
    with connect(port) as sock:
        sock.sendall(HEAD + b"X-Big: " + b"a" * (80 * 1024) + b"\r\n\r\n")
        error = error_of(read_until_closed(sock), 431)
    assert error["code"] == "request_header_fields_too_large"


def test_an_endless_header_is_cut_at_the_limit(serve_limited: Callable[[str], int]) -> None:
    """10 MB of header and no end of it: the gateway answers 431 and closes the connection
    long before the client is done sending."""
    port = serve_limited("")
    total = 10 * 1024 * 1024
    sent = 0
    with connect(port) as sock:
        sock.sendall(HEAD + b"X-Endless: ")
        try:
            while sent < total:
                sent += sock.send(b"a" * 65536)
        except OSError:
            pass  # the gateway closed the connection
        assert sent < total
        error = error_of(read_until_closed(sock), 431)
    assert error["code"] == "request_header_fields_too_large"


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",  # no Host
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Name: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
    b"\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",  # a bad chunk size
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n",
])
def test_a_malformed_http_request_gets_an_openai_shaped_400(
    serve_limited: Callable[[str], int], request_bytes: bytes
) -> None:
    """uvicorn's own answer is a text/plain "Invalid HTTP request received."."""
    with connect(serve_limited("")) as sock:
        sock.sendall(request_bytes)
        reply = read_until_closed(sock)
    assert b"content-type: application/json" in reply.partition(b"\r\n\r\n")[0].lower()
    error = error_of(reply, 400)
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
    assert "well-formed" in str(error["message"])


def test_head_timeout_s_is_10_seconds_unless_set(tmp_path: Path) -> None:
    assert GatewaySettings().head_timeout_s == 10.0
    path = tmp_path / "zml.toml"
    path.write_text("[gateway]\nhead_timeout_s = 2\n")
    assert gateway_settings(load_registry(path)).head_timeout_s == 2.0


@pytest.mark.parametrize("key", ["head_timeout_s", "send_timeout_s", "shutdown_timeout_s"])
@pytest.mark.parametrize(("value", "shown"), [
    ("0", "0"), ("-1", "-1"), ("inf", "inf"), ("nan", "nan"), ("true", "True"), ('"10"', "'10'"),
])
def test_a_bad_head_or_send_timeout_s_names_the_key_and_the_value(
    tmp_path: Path, key: str, value: str, shown: str
) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(f"[gateway]\n{key} = {value}\n")
    with pytest.raises(zml.PolicyConfigError) as info:
        gateway_settings(load_registry(path))
    assert f"gateway.{key} = {shown}" in str(info.value)


def test_a_client_that_stops_reading_its_stream_is_dropped_and_its_slot_freed(
    sim_fleet: Callable[..., SimSetup],
) -> None:
    """A client that opens a stream and then reads nothing (the write buffer fills): after
    ``send_timeout_s`` the connection is aborted and the request cancelled, so the node's one
    slot serves the next request. Before, the request (and its slot) waited for ever, past
    its deadline: uvicorn's ``send`` waits on a full buffer without a bound."""
    setup = sim_fleet([{"id": "h100-1", "family": "H100", "max_concurrency": 1}], PROD,
                      time_scale=0.05)
    setup.path.write_text(setup.path.read_text() + "\n[gateway]\nsend_timeout_s = 1\n")
    app = create_app(setup.path, environ={}, probe_interval_s=None)
    thread = _Thread(app).start()
    gateway = app.state.gateway
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "stream": True, "max_tokens": 200_000, "ignore_eos": True}).encode()
    try:
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stalled.settimeout(GUARD_S)
        stalled.connect(("127.0.0.1", thread.port))
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                        % len(body) + body)
        assert stalled.recv(1024).startswith(b"HTTP/1.1 200 ")  # then it reads nothing more
        assert gateway.client.fleet.in_flight == 1
        # The connection is aborted: the request is cancelled and its slot is free again.
        deadline = time.monotonic() + GUARD_S * 3  # a hang guard: the buffer fills, then 1 s
        while gateway.client.fleet.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gateway.client.fleet.in_flight == 0
        with zml.Client(config=setup.path) as direct:  # the node itself took it back too
            assert direct.infer(MODEL, [{"role": "user", "content": "x"}], max_tokens=2)
        # The connection ends without [DONE]: the client can tell its stream is short.
        rest = read_until_closed(stalled)
        assert rest.count(b"data: ") > 10 and b"[DONE]" not in rest
        stalled.close()
    finally:
        thread.stop()


def test_send_and_shutdown_timeouts_are_60_and_30_seconds_unless_set(tmp_path: Path) -> None:
    assert GatewaySettings().send_timeout_s == 60.0
    assert GatewaySettings().shutdown_timeout_s == 30.0
    path = tmp_path / "zml.toml"
    path.write_text("[gateway]\nsend_timeout_s = 2.5\n")
    assert gateway_settings(load_registry(path)).send_timeout_s == 2.5


@pytest.mark.parametrize("workers", [1, 2])
def test_zml_serve_closes_idle_and_slow_connections(sim_fleet: Callable[..., SimSetup],
                                                    workers: int) -> None:
    """The command itself, with one process or several (whose protocol is pickled over)."""
    setup = sim_fleet(ONE_NODE, PROD, time_scale=0.05)
    setup.path.write_text(setup.path.read_text() + "\n[gateway]\nhead_timeout_s = 1\n")
    port = free_port()
    proc = start_serve(setup.path, port, "--workers", str(workers), environ=env())
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}")
        with connect(port) as idle, connect(port) as slow:
            slow.sendall(HEAD + b"X-Slow: ")
            with Trickle(slow):
                assert error_of(read_until_closed(slow), 408)["code"] == "request_timeout"
            assert read_until_closed(idle) == b""
        with connect(port) as big:
            big.sendall(HEAD + b"X-Big: " + b"a" * (80 * 1024) + b"\r\n\r\n")
            assert error_of(read_until_closed(big), 431)["code"] == \
                "request_header_fields_too_large"
    finally:
        stop(proc)
