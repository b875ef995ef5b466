"""Calls against a node that misbehaves *before* its answer starts, on real loopback sockets.

The node of :mod:`tests.e2e.hostile` plays a few more scripts here: response headers dripped a
byte at a time, ``102 Processing`` interim responses, an error body dripped or endless, and an
SSE body that stays open after ``[DONE]``. Every script stops by itself after a few seconds,
and the node records whether the client left while it was still talking (``closed_by_client``):
a bound holds if the call ended with the expected error *and* the client hung up first. No
timing is asserted; every wait has a generous safety timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.e2e import hostile as hostile_module
from tests.e2e.conftest import wait_for
from tests.e2e.hostile import MODEL, HostileNode, Request, chunk, write_config
from zml.transport import MAX_ERROR_BODY_BYTES

MSGS = [{"role": "user", "content": "hi"}]
TALK_S = 4.0  # how long a script keeps talking before it gives up by itself
TICK_S = 0.1
SAFETY = 30.0
VERDICT_S = 10.0  # how long the node may take to notice the client left (a safety net)
ERROR_BODY = 32 * 2**20  # an endless error body, as far as zml is concerned


async def _talk(conn: Any, req: Request, first: bytes, again: bytes) -> None:
    """Write ``first``, then ``again`` every tick for TALK_S; a client that left is noticed
    (the hostile node's handler records it) at the next write."""
    conn.writer.write(first)
    await conn.writer.drain()
    for _ in range(int(TALK_S / TICK_S)):
        await asyncio.sleep(TICK_S)
        conn.writer.write(again)
        await conn.writer.drain()
        req.sent += len(again)


async def _drip_head(conn: Any, req: Request, arg: str) -> None:
    await _talk(conn, req, b"HTTP/1.1 200 OK\r\nx-pad: ", b"a")


async def _processing(conn: Any, req: Request, arg: str) -> None:
    await _talk(conn, req, b"HTTP/1.1 102 Processing\r\n\r\n", b"HTTP/1.1 102 Processing\r\n\r\n")


async def _drip_error(conn: Any, req: Request, arg: str) -> None:
    await conn.head(400, {"content-type": "application/json", "content-length": "100000"})
    await _talk(conn, req, b'{"error": {"message": "', b"x")


async def _endless_error(conn: Any, req: Request, arg: str) -> None:
    await conn.head(400, {"content-type": "application/json"})  # ends when the node closes
    await conn.body(req, b'{"error": {"message": "')
    block = b"x" * 65536
    for _ in range(ERROR_BODY // len(block)):
        await conn.body(req, block)


async def _open_after_done(conn: Any, req: Request, arg: str) -> None:
    """An SSE answer whose (chunked) body stays open after [DONE], until the client leaves or
    TALK_S passed; then it ends the body properly."""
    conn.writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                      b"transfer-encoding: chunked\r\n\r\n")
    for data in (chunk("hel"), chunk("lo", "stop"), "[DONE]"):
        event = data if isinstance(data, str) else json.dumps(data)
        payload = f"data: {event}\n\n".encode()
        conn.writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
    await conn.writer.drain()
    with contextlib.suppress(asyncio.TimeoutError):
        if await asyncio.wait_for(conn.reader.read(1), TALK_S) == b"":
            req.closed_by_client = True
            return
    conn.writer.write(b"0\r\n\r\n")
    await conn.writer.drain()


@pytest.fixture(autouse=True)
def scripts(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, handler in {"drip-head": _drip_head, "processing": _processing,
                          "drip-error": _drip_error, "endless-error": _endless_error,
                          "open-after-done": _open_after_done}.items():
        monkeypatch.setitem(hostile_module.BEHAVIOURS, name, handler)


def _call(kind: str, path: Path, streamed: bool, timeout: Any, **client: Any) -> Any:
    """One call on either client (``policy="hostile"``); the stream's text, or the answer."""
    if kind == "sync":
        with zml.Client(config=path, probe_interval_s=None, timeout=timeout, **client) as c:
            try:
                if streamed:
                    with c.infer_stream(MODEL, MSGS, policy="hostile") as s:
                        return "".join(ch.choices[0].delta.content or "" for ch in s
                                       if ch.choices), s.routing
                return c.infer(MODEL, MSGS, policy="hostile")
            finally:
                assert c.fleet.in_flight == 0

    async def main() -> Any:
        async with zml.AsyncClient(config=path, probe_interval_s=None, timeout=timeout,
                                   **client) as c:
            try:
                if streamed:
                    async with c.infer_stream(MODEL, MSGS, policy="hostile") as s:
                        text = "".join([ch.choices[0].delta.content or "" async for ch in s
                                        if ch.choices])
                        return text, s.routing
                return await c.infer(MODEL, MSGS, policy="hostile")
            finally:
                assert c.fleet.in_flight == 0

    return asyncio.run(main())


def _left_early(node: HostileNode, behaviour: str) -> bool:
    """Whether the client hung up on the node playing ``behaviour`` while it still talked."""
    return any(req.closed_by_client for req in node.requests_for(behaviour))


KINDS = [("sync", True), ("sync", False), ("async", True), ("async", False)]
IDS = ["sync-stream", "sync-infer", "async-stream", "async-infer"]


@pytest.mark.parametrize("behaviour", ["drip-head", "processing"])
@pytest.mark.parametrize(("kind", "streamed"), KINDS, ids=IDS)
def test_the_deadline_holds_while_the_node_drips_or_delays_its_headers(
        hostile: HostileNode, tmp_path: Path, kind: str, streamed: bool, behaviour: str) -> None:
    path = write_config(tmp_path / "zml.toml", hostile, {"slow": behaviour})
    with pytest.raises(zml.ZMLTimeoutError):
        _call(kind, path, streamed, 0.5)
    wait_for(lambda: _left_early(hostile, behaviour), "the client to hang up", VERDICT_S)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_first_token_holds_while_the_node_drips_its_headers(
        hostile: HostileNode, tmp_path: Path, kind: str) -> None:
    path = write_config(tmp_path / "zml.toml", hostile, {"slow": "drip-head", "good": "ok"})
    text, routing = _call(kind, path, True, zml.Timeouts(total=SAFETY, first_token=0.5))
    assert text == "hello" and routing.node_id == "good"
    assert [(a.node_id, a.error) for a in routing.attempts] == [("slow", "timeout")]
    assert "first_token=0.5s" in routing.attempts[0].message
    wait_for(lambda: _left_early(hostile, "drip-head"), "the client to hang up", VERDICT_S)


@pytest.mark.parametrize(("kind", "streamed"), KINDS, ids=IDS)
def test_the_deadline_holds_while_the_node_drips_an_error_body(
        hostile: HostileNode, tmp_path: Path, kind: str, streamed: bool) -> None:
    path = write_config(tmp_path / "zml.toml", hostile, {"slow": "drip-error"})
    with pytest.raises(zml.ZMLTimeoutError):
        _call(kind, path, streamed, 0.5)
    wait_for(lambda: _left_early(hostile, "drip-error"), "the client to hang up", VERDICT_S)


@pytest.mark.parametrize(("kind", "streamed"), KINDS, ids=IDS)
def test_an_endless_error_body_is_read_only_as_far_as_it_is_kept(
        hostile: HostileNode, tmp_path: Path, kind: str, streamed: bool) -> None:
    path = write_config(tmp_path / "zml.toml", hostile, {"big": "endless-error"})
    with pytest.raises(zml.BadRequestError) as info:
        _call(kind, path, streamed, SAFETY)
    assert isinstance(info.value.body, str) and len(info.value.body) <= MAX_ERROR_BODY_BYTES
    # the client stopped reading and hung up long before the node had sent it all
    wait_for(lambda: _left_early(hostile, "endless-error"), "the client to hang up", VERDICT_S)
    (req,) = hostile.requests_for("endless-error")
    assert req.sent < ERROR_BODY


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stream_ends_soon_after_done_whatever_the_node_does_next(
        hostile: HostileNode, tmp_path: Path, kind: str) -> None:
    """After [DONE] the stream reads the end of the response for at most DRAIN_S, then hangs
    up: a node keeping the body open holds neither the caller nor the slot (idle is long)."""
    path = write_config(tmp_path / "zml.toml", hostile, {"lazy": "open-after-done"})
    text, routing = _call(kind, path, True, zml.Timeouts(total=SAFETY, idle=SAFETY))
    assert text == "hello" and routing.node_id == "lazy"
    wait_for(lambda: _left_early(hostile, "open-after-done"), "the client to hang up", VERDICT_S)


class _KeepAliveNode:
    """Answers the first request on a connection well (kept alive), then drips the headers of
    every later one: the deadline must hold on a reused connection too."""

    def __init__(self) -> None:
        self.connections = 0
        self.hung_up: list[bool] = []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = self.server.sockets[0].getsockname()[1]
            ready.set()
            try:
                self.loop.run_forever()
            finally:
                self.server.close()
                tasks = asyncio.all_tasks(self.loop)
                for task in tasks:
                    task.cancel()
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
                self.loop.close()

        self.thread = threading.Thread(target=run, name="keepalive-node", daemon=True)
        self.thread.start()
        ready.wait(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for n in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                await reader.readexactly(length)
                if n == 0:
                    body = json.dumps(hostile_module.completion()).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n" % len(body) + body)
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nx-pad: ")
                try:
                    for _ in range(int(TALK_S / TICK_S)):
                        await asyncio.sleep(TICK_S)
                        writer.write(b"a")
                        await writer.drain()
                except ConnectionError:
                    self.hung_up.append(True)
                    return
                self.hung_up.append(False)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.mark.parametrize(("kind", "streamed"), KINDS, ids=IDS)
def test_the_deadline_holds_on_a_reused_connection(tmp_path: Path, kind: str,
                                                   streamed: bool) -> None:
    node = _KeepAliveNode()
    try:
        path = tmp_path / "zml.toml"
        path.write_text('[accelerators.F]\n[[nodes]]\nid = "n"\nfamily = "F"\n'
                        f'url = "http://127.0.0.1:{node.port}"\nmodels = ["{MODEL}"]\n'
                        'max_concurrency = 4\n'
                        '[policies.hostile]\naccelerator_chain = ["F"]\n')

        def call_twice_sync() -> None:
            with zml.Client(config=path, probe_interval_s=None) as c:
                c.infer(MODEL, MSGS, policy="hostile")
                with pytest.raises(zml.ZMLTimeoutError):
                    if streamed:
                        for _ in c.infer_stream(MODEL, MSGS, policy="hostile", timeout=0.5):
                            pass
                    else:
                        c.infer(MODEL, MSGS, policy="hostile", timeout=0.5)
                assert c.fleet.in_flight == 0

        async def call_twice_async() -> None:
            async with zml.AsyncClient(config=path, probe_interval_s=None) as c:
                await c.infer(MODEL, MSGS, policy="hostile")
                with pytest.raises(zml.ZMLTimeoutError):
                    if streamed:
                        async for _ in c.infer_stream(MODEL, MSGS, policy="hostile",
                                                      timeout=0.5):
                            pass
                    else:
                        await c.infer(MODEL, MSGS, policy="hostile", timeout=0.5)
                assert c.fleet.in_flight == 0

        if kind == "sync":
            call_twice_sync()
        else:
            asyncio.run(call_twice_async())
        wait_for(lambda: bool(node.hung_up), "the node's verdict", VERDICT_S)
        assert node.connections == 1 and node.hung_up == [True]
    finally:
        node.stop()
