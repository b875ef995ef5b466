"""Streams against a node that misbehaves on purpose, on real loopback sockets.

A small asyncio HTTP/1.1 server (in a daemon thread) answers every request with a scripted
behaviour: keep-alive comments forever, a body dripped a byte at a time, empty deltas only,
or a malformed event after a good one. Every script stops by itself after a few seconds (a
test of old code ends with a wrong outcome instead of hanging). No timing is asserted: a
deadline holds if the stream ends with ``ZMLTimeoutError`` while the node is still talking.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.conftest import MODEL

MSGS = [{"role": "user", "content": "hi"}]
RUN_S = 8.0  # how long a script keeps talking before it closes the connection


def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
    data = {"id": "chatcmpl-h", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(data).encode() + b"\n\n"


class HostileNode:
    """Serves ``script`` (a name) to every request; ``bad`` is the event of "malformed"."""

    def __init__(self) -> None:
        self.script = "keepalive"
        self.bad = b""
        self.keepalives = 0
        """Keep-alive comments sent so far (script "slow-keepalive")."""
        self.server: asyncio.Server | None = None
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def start() -> None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                await self._body(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _body(self, writer: asyncio.StreamWriter) -> None:
        def send(data: bytes) -> None:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

        loop = asyncio.get_running_loop()
        stop = loop.time() + RUN_S
        script = self.script
        if script in ("keepalive", "drip", "empty"):
            send(event({"role": "assistant", "content": ""}))
        if script in ("keepalive", "drip"):
            send(event({"content": "Hello"}))
        if script == "malformed":
            send(event({"role": "assistant", "content": ""}) + event({"content": "Hi"}))
            send(self.bad)
            await asyncio.sleep(0.2)
        if script == "slow-keepalive":
            send(event({"role": "assistant", "content": "Hello"}))
            await writer.drain()
        while loop.time() < stop and script != "malformed":
            if script == "slow-keepalive":
                await asyncio.sleep(2.0)
                send(b": keep-alive\n\n")
                await writer.drain()
                self.keepalives += 1
            elif script == "drip":
                for byte in event({"content": " world"}):
                    send(bytes([byte]))
                    await writer.drain()
                    await asyncio.sleep(0.2)
                    if loop.time() >= stop:
                        break
            else:
                send(b": keep-alive\n\n" if script != "empty" else event({"content": ""}))
                await writer.drain()
                await asyncio.sleep(0.2)
        writer.write(b"0\r\n\r\n")  # the end, without [DONE] or finish_reason
        await writer.drain()

    def stop(self) -> None:
        async def shutdown() -> None:
            if self.server is not None:
                self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def hostile(tmp_path: Path, sim_fleet: Any) -> Iterator[tuple[HostileNode, Path, Any]]:
    """A hostile node in family "EVIL", a well-behaved simulated node in family "H100"."""
    node = HostileNode()
    setup = sim_fleet([{"id": "good", "family": "H100", "max_concurrency": 4}],
                      time_scale=0.02)
    config = tmp_path / "hostile.toml"
    config.write_text(
        "[accelerators.EVIL]\n[accelerators.H100]\n"
        f'[[nodes]]\nid = "evil"\nfamily = "EVIL"\nurl = "http://127.0.0.1:{node.port}"\n'
        f'models = ["{MODEL}"]\nmax_concurrency = 8\n'
        f'[[nodes]]\nid = "good"\nfamily = "H100"\nurl = "{setup.fleet.url("good")}"\n'
        f'models = ["{MODEL}"]\nmax_concurrency = 4\n'
        '[policies.evil_first]\naccelerator_chain = ["EVIL", "H100"]\n'
    )
    yield node, config, setup
    node.stop()


class Outcomes:
    """Records how calls ended, as telemetry sees them."""

    def __init__(self) -> None:
        self.failed: list[zml.ZMLError] = []
        self.cancelled = 0

    @zml.hookimpl
    def zml_request_failed(self, error: zml.ZMLError, metadata: Any) -> None:
        self.failed.append(error)

    @zml.hookimpl
    def zml_request_cancelled(self, metadata: Any) -> None:
        self.cancelled += 1


def stream_until_timeout(config: Path, kind: str, timeout: float,
                         on_timeout: Any = None) -> Any:
    """Stream from the hostile node with a client of ``kind`` until ``ZMLTimeoutError``; call
    ``on_timeout()`` at once (before the node sends more), check the slot came back."""
    if kind == "sync":
        with zml.Client(config=config, probe_interval_s=None) as client:
            stream = client.infer_stream(MODEL, MSGS, accelerator="EVIL", timeout=timeout)
            with pytest.raises(zml.ZMLTimeoutError) as info:
                for _ in stream:
                    pass
            if on_timeout is not None:
                on_timeout()
            assert client.fleet.in_flight == 0
            return info.value

    async def main() -> Any:
        async with zml.AsyncClient(config=config, probe_interval_s=None) as client:
            with pytest.raises(zml.ZMLTimeoutError) as info:
                async for _ in client.infer_stream(MODEL, MSGS, accelerator="EVIL",
                                                   timeout=timeout):
                    pass
            if on_timeout is not None:
                on_timeout()
            assert client.fleet.in_flight == 0
            return info.value

    return asyncio.run(main())


@pytest.mark.parametrize("script", ["keepalive", "drip"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_node_that_keeps_talking_cannot_hold_a_stream_past_its_deadline(
        hostile: Any, script: str, kind: str) -> None:
    node, config, _ = hostile
    node.script = script
    error = stream_until_timeout(config, kind, 1.5)
    assert "deadline" in str(error) and error.text.startswith("Hello")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stream_ends_at_its_deadline_not_at_the_next_packet(hostile: Any, kind: str) -> None:
    """A keep-alive every 2 s and a 3 s deadline: the stream ends after the first keep-alive
    and before the second (at 3 s, not at the first read after it, 4 s)."""
    node, config, _ = hostile
    node.script = "slow-keepalive"
    sent: list[int] = []
    error = stream_until_timeout(config, kind, 3.0, lambda: sent.append(node.keepalives))
    assert sent == [1]
    assert "deadline" in str(error) and error.text == "Hello"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_comments_and_empty_deltas_are_no_first_token(hostile: Any, kind: str) -> None:
    """first_token expires on a node that sends only keep-alives and empty deltas: the stream
    fails over to the good node, and the hostile attempt is listed as a timeout."""
    node, config, _ = hostile
    node.script = "empty"
    timeouts = zml.Timeouts(total=30.0, first_token=1.0)
    if kind == "sync":
        with zml.Client(config=config, timeout=timeouts) as client:
            stream = client.infer_stream(MODEL, MSGS, policy="evil_first")
            chunks = list(stream)
    else:
        async def main() -> tuple[Any, list[Any]]:
            async with zml.AsyncClient(config=config, timeout=timeouts,
                                       probe_interval_s=None) as client:
                s = client.infer_stream(MODEL, MSGS, policy="evil_first")
                return s, [c async for c in s]

        stream, chunks = asyncio.run(main())
    assert stream.routing is not None and stream.routing.node_id == "good"
    assert [a.node_id for a in stream.routing.attempts] == ["evil"]
    assert stream.routing.attempts[0].error == "timeout"
    assert stream.finish_reason in ("stop", "length") and stream.text
    assert all(c.routing.node_id == "good" for c in chunks)


BAD_EVENTS = [b'{"choices": "abc"}', b"{}", b"[5]", b'{"choices": [{"delta": "x"}]}',
              b'{"choices": [{"delta": {"content": 5}}]}', b'{"choices": [], "usage": [1]}',
              b'{"choices": [{"delta": {"tool_calls": "zz"}}]}',
              b'{"choices": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"]


@pytest.mark.parametrize("bad", BAD_EVENTS, ids=lambda b: b[:30].decode())
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_hostile_events_raise_protocol_errors_that_telemetry_sees(
        hostile: Any, bad: bytes, kind: str) -> None:
    node, config, _ = hostile
    node.script = "malformed"
    node.bad = b"data: " + bad + b"\n\n"
    outcomes = Outcomes()
    got: list[str] = []
    if kind == "sync":
        with zml.Client(config=config) as client:
            client.plugins.register(outcomes)
            with pytest.raises(zml.NodeProtocolError) as info:
                for c in client.infer_stream(MODEL, MSGS, accelerator="EVIL"):
                    got.append(c.choices[0].delta.content or "")
            assert client.fleet.in_flight == 0
    else:
        async def main() -> Any:
            async with zml.AsyncClient(config=config, probe_interval_s=None) as client:
                client.plugins.register(outcomes)
                with pytest.raises(zml.NodeProtocolError) as info:
                    async for c in client.infer_stream(MODEL, MSGS, accelerator="EVIL"):
                        got.append(c.choices[0].delta.content or "")
                assert client.fleet.in_flight == 0
                return info

        info = asyncio.run(main())
    assert got == ["", "Hi"]  # the good chunks arrived, then the error
    err = info.value
    assert not isinstance(err, zml.IncompleteStreamError)
    assert err.node_id == "evil" and "'evil'" in str(err)
    assert outcomes.failed == [err] and outcomes.cancelled == 0
