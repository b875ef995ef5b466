"""A hostile node: a small HTTP server on loopback that misbehaves on purpose.

It is written on raw asyncio streams (not on the simulated node's framework) so that it can
do what a well-behaved server library would refuse to: drip a body byte by byte, send SSE
comments forever, reset the connection mid-stream, stall before the headers, announce one
length and send another.

One server plays many nodes: the first path segment of a request picks the behaviour, so a
node whose ``url`` is ``http://127.0.0.1:PORT/keepalive`` gets SSE comments, and one at
``.../retry-after=inf`` gets ``429 Retry-After: inf``. :meth:`HostileNode.url` builds them,
:func:`write_config` writes a ``zml.toml`` with one node per behaviour. Every request is
recorded (path, headers, bytes sent back) in :attr:`HostileNode.requests`.

Behaviours (``NAME`` or ``NAME=ARG``):

``ok``                    a valid chat completion (SSE when the request asks to stream)
``keepalive``             200 ``text/event-stream``, then ``: keep-alive`` every 0.2 s, forever
``drip``                  200 JSON completion, one byte every ARG s (default 0.2)
``empty-deltas``          SSE chunks with an empty delta every 0.2 s, forever
``reset-after-first-token``  one SSE token, then a TCP reset
``shape=NAME``            a completion body (or stream event) of a malformed shape (SHAPES)
``huge``                  200 JSON of ARG MiB (default 20), written as fast as it is read
``deep``                  200 JSON nested ARG levels deep (default 100000)
``status=CODE``           that status with an OpenAI error body
``echo-key=CODE``         that status, the error quoting the request's key (``api-key`` header, else
                          the Bearer one), as some servers do
``echo-key-on=WHERE``     the key quoted without an error status: stream, first-event, body,
                          body-cut, redirect; or in a successful answer's metadata (JSON or SSE):
                          id, model, fingerprint (``system_fingerprint``)
``retry-after=VALUE``     429 with ``Retry-After: VALUE`` (``http-date``: a date 1 h ahead)
``retry-after-ms=VALUE``  429 with ``retry-after-ms: VALUE``
``redirect=CODE``         that 3xx status, Location with credentials in it
``redirect-sse=CODE``     the same, with an event-stream body that would pass for an answer
``stall``                 read the request, then send nothing, ever
``stall-body``            send the headers of a JSON answer, then nothing
``done-then-hold``        a whole SSE answer and ``[DONE]``, then the response is never ended
``drip-head``             the response's headers one byte every ARG s (default 0.2), never ended
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from pathlib import Path
from typing import Any

MODEL = "meta-llama/llama-3-8b-instruct"
REDIRECT_TARGET = "http://alice:REDIRECT-PW@127.0.0.1:9/elsewhere"

SHAPES: dict[str, object] = {
    "choices-abc": {"choices": "abc"},
    "empty-object": {},
    "list": [5],
    "delta-str": {"choices": [{"index": 0, "delta": "x", "message": "x"}]},
    "content-int": {"choices": [{"index": 0, "delta": {"content": 5},
                                 "message": {"role": "assistant", "content": 5}}]},
    "usage-list": {"choices": [], "usage": [1]},
    "tool-calls-str": {"choices": [{"index": 0, "delta": {"tool_calls": "zz"},
                                    "message": {"role": "assistant", "tool_calls": "zz"}}]},
    "choice-null": {"choices": [None]},
    "string": "just a string",
}
"""Malformed bodies by name: each is a non-streamed body and, for ``stream``, one event."""


def completion(model: str = MODEL, content: str = "hello") -> dict[str, Any]:
    """A valid chat completion object."""
    return {
        "id": "chatcmpl-hostile", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def chunk(content: str | None, finish: str | None = None) -> dict[str, Any]:
    """One chat.completion.chunk."""
    delta = {} if content is None else {"content": content}
    return {"id": "chatcmpl-hostile", "object": "chat.completion.chunk", "created": 1,
            "model": MODEL, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


@dataclass
class Request:
    """One request the hostile node received."""

    behaviour: str
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    sent: int = 0
    """Bytes of response body written so far."""
    closed_by_client: bool = False

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


Handler = Callable[["_Conn", Request, str], Awaitable[None]]


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def head(self, status: int, headers: Mapping[str, str]) -> None:
        reason = {200: "OK", 429: "Too Many Requests"}.get(status, "Status")
        lines = [f"HTTP/1.1 {status} {reason}", "connection: close",
                 *(f"{k}: {v}" for k, v in headers.items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await self.writer.drain()

    async def body(self, request: Request, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()
        request.sent += len(data)

    async def json(self, request: Request, status: int, value: object,
                   headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(value).encode()
        await self.head(status, {"content-type": "application/json",
                                 "content-length": str(len(data)), **(headers or {})})
        await self.body(request, data)

    async def sse_head(self) -> None:
        await self.head(200, {"content-type": "text/event-stream", "cache-control": "no-cache"})

    async def event(self, request: Request, value: object) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        await self.body(request, f"data: {text}\n\n".encode())


# --- behaviours -------------------------------------------------------------------------------


async def _ok(conn: _Conn, req: Request, arg: str) -> None:
    body = req.json or {}
    if body.get("stream"):
        await conn.sse_head()
        for piece in ("hel", "lo"):
            await conn.event(req, chunk(piece))
        await conn.event(req, chunk(None, "stop"))
        await conn.event(req, "[DONE]")
    else:
        await conn.json(req, 200, completion(body.get("model", MODEL)))


async def _keepalive(conn: _Conn, req: Request, arg: str) -> None:
    await conn.sse_head()
    while True:
        await conn.body(req, b": keep-alive\n\n")
        await asyncio.sleep(float(arg or 0.2))


async def _drip(conn: _Conn, req: Request, arg: str) -> None:
    data = json.dumps(completion()).encode()
    await conn.head(200, {"content-type": "application/json", "content-length": str(len(data))})
    for i in range(len(data)):
        await conn.body(req, data[i : i + 1])
        await asyncio.sleep(float(arg or 0.2))


async def _empty_deltas(conn: _Conn, req: Request, arg: str) -> None:
    await conn.sse_head()
    while True:
        await conn.event(req, chunk(""))
        await asyncio.sleep(float(arg or 0.2))


async def _reset_after_first_token(conn: _Conn, req: Request, arg: str) -> None:
    await conn.sse_head()
    await conn.event(req, chunk("hel"))
    await asyncio.sleep(0.05)
    sock = conn.writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    conn.writer.transport.abort()


async def _shape(conn: _Conn, req: Request, arg: str) -> None:
    shape = SHAPES[arg]
    if (req.json or {}).get("stream"):
        await conn.sse_head()
        await conn.event(req, shape)
        await conn.event(req, "[DONE]")
    else:
        await conn.json(req, 200, shape)


async def _huge(conn: _Conn, req: Request, arg: str) -> None:
    mib = int(arg or 20)
    prefix, suffix = b'{"choices": [], "padding": "', b'"}'
    block = b"x" * 65536
    total = len(prefix) + mib * 16 * len(block) + len(suffix)
    await conn.head(200, {"content-type": "application/json", "content-length": str(total)})
    await conn.body(req, prefix)
    for _ in range(mib * 16):
        await conn.body(req, block)
    await conn.body(req, suffix)


async def _huge_unannounced(conn: _Conn, req: Request, arg: str) -> None:
    """Like ``huge``, without a content-length (read until the connection closes)."""
    mib = int(arg or 20)
    await conn.head(200, {"content-type": "application/json"})
    await conn.body(req, b'{"choices": [], "padding": "')
    for _ in range(mib * 16):
        await conn.body(req, b"x" * 65536)
    await conn.body(req, b'"}')


async def _deep(conn: _Conn, req: Request, arg: str) -> None:
    depth = int(arg or 100_000)
    data = b"[" * depth + b"]" * depth
    await conn.head(200, {"content-type": "application/json", "content-length": str(len(data))})
    await conn.body(req, data)


async def _status(conn: _Conn, req: Request, arg: str) -> None:
    await conn.json(req, int(arg), {"error": {"message": f"hostile status {arg}"}})


def _sent_key(req: Request) -> str:
    """The key the request carries: an ``api-key`` header (Azure's style) or the Bearer one."""
    return req.headers.get("api-key") or req.headers.get("authorization", "").partition(" ")[2]


async def _echo_key(conn: _Conn, req: Request, arg: str) -> None:
    key = _sent_key(req)
    await conn.json(req, int(arg), {"error": {
        "message": f"Incorrect API key provided: {key}. Received API Key = {key}",
        "param": f"key={key}", "code": "invalid_api_key"}})


ECHOED_FIELDS = {"id": "id", "model": "model", "fingerprint": "system_fingerprint"}
"""``echo-key-on=WHERE`` -> the answer's field that quotes the key (as ``FIELD-KEY-end``)."""


async def _echo_key_on(conn: _Conn, req: Request, arg: str) -> None:
    """The request's key quoted where no error status is: ``stream`` (an error event after a
    token), ``first-event`` (an error event first), ``body`` (a 200 body that is not JSON),
    ``body-cut`` (the same, the key where zml cuts the body it quotes) or ``redirect`` (a
    Location holding it); or ``id``, ``model``, ``fingerprint``: a valid answer (a completion,
    or a stream: then in every chunk) quoting it in that field (``system_fingerprint``)."""
    key = _sent_key(req)
    if arg in ECHOED_FIELDS:
        field = ECHOED_FIELDS[arg]
        quoted = {field: f"{field}-{key}-end"}
        if (req.json or {}).get("stream"):
            await conn.sse_head()
            await conn.event(req, {**chunk("hel"), **quoted})
            await asyncio.sleep(0.05)  # the first chunk opens the stream; the others come later
            for piece, finish in (("lo", None), (None, "stop")):
                await conn.event(req, {**chunk(piece, finish), **quoted})
            await conn.event(req, "[DONE]")
        else:
            await conn.json(req, 200, {**completion(), **quoted})
    elif arg in ("stream", "first-event"):
        await conn.sse_head()
        if arg == "stream":
            await conn.event(req, chunk("hel"))
        await conn.event(req, {"error": {"message": f"key {key} revoked"}})
    elif arg in ("body", "body-cut"):
        # body-cut: the key straddles the 200 bytes of a body that zml quotes in its error
        pad = "x" * (159 if arg == "body-cut" else 0)
        data = f"<html>{pad}proxy error for key {key}</html>".encode()
        await conn.head(200, {"content-type": "text/html", "content-length": str(len(data))})
        await conn.body(req, data)
    else:
        await conn.head(302, {"location": f"http://127.0.0.1:9/{key}/v1", "content-length": "0"})


def _retry_value(arg: str) -> str:
    return formatdate(time.time() + 3600, usegmt=True) if arg == "http-date" else arg


async def _retry_after(conn: _Conn, req: Request, arg: str) -> None:
    await conn.json(req, 429, {"error": {"message": "slow down"}},
                    {"retry-after": _retry_value(arg)})


async def _retry_after_ms(conn: _Conn, req: Request, arg: str) -> None:
    await conn.json(req, 429, {"error": {"message": "slow down"}}, {"retry-after-ms": arg})


async def _redirect(conn: _Conn, req: Request, arg: str) -> None:
    await conn.head(int(arg or 302), {"location": REDIRECT_TARGET, "content-length": "0"})


async def _redirect_sse(conn: _Conn, req: Request, arg: str) -> None:
    """A redirect whose body is an event stream, as a misconfigured proxy may send."""
    await conn.head(int(arg or 302), {"location": REDIRECT_TARGET,
                                      "content-type": "text/event-stream"})
    await conn.event(req, chunk("hello", "stop"))
    await conn.event(req, "[DONE]")


async def _stall(conn: _Conn, req: Request, arg: str) -> None:
    await asyncio.Event().wait()


async def _stall_body(conn: _Conn, req: Request, arg: str) -> None:
    await conn.head(200, {"content-type": "application/json", "content-length": "500"})
    await asyncio.Event().wait()


async def _done_then_hold(conn: _Conn, req: Request, arg: str) -> None:
    await conn.sse_head()
    await conn.event(req, chunk("hi", "stop"))
    await conn.event(req, "[DONE]")
    await asyncio.Event().wait()


async def _drip_head(conn: _Conn, req: Request, arg: str) -> None:
    for byte in b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-pad: " + b"a" * 10_000:
        conn.writer.write(bytes([byte]))
        await conn.writer.drain()
        await asyncio.sleep(float(arg or 0.2))


BEHAVIOURS: dict[str, Handler] = {
    "ok": _ok,
    "keepalive": _keepalive,
    "drip": _drip,
    "empty-deltas": _empty_deltas,
    "reset-after-first-token": _reset_after_first_token,
    "shape": _shape,
    "huge": _huge,
    "huge-unannounced": _huge_unannounced,
    "deep": _deep,
    "status": _status,
    "echo-key": _echo_key,
    "echo-key-on": _echo_key_on,
    "redirect-sse": _redirect_sse,
    "retry-after": _retry_after,
    "retry-after-ms": _retry_after_ms,
    "redirect": _redirect,
    "stall": _stall,
    "stall-body": _stall_body,
    "done-then-hold": _done_then_hold,
    "drip-head": _drip_head,
}


# --- the server -------------------------------------------------------------------------------


@dataclass
class HostileNode:
    """The server: ``start()`` serves on a free loopback port from a thread, ``stop()`` ends it."""

    requests: list[Request] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def url(self, behaviour: str) -> str:
        """The base URL of a node that behaves as ``behaviour`` (``"retry-after=inf"``...)."""
        return f"http://127.0.0.1:{self.port}/{behaviour}"

    def requests_for(self, behaviour: str) -> list[Request]:
        """The requests received by the node playing ``behaviour``."""
        return [r for r in self.requests if r.behaviour == behaviour]

    def start(self) -> HostileNode:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            server = loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0, limit=2**20))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            try:
                loop.run_forever()
            finally:
                server.close()
                loop.run_until_complete(self._drain(server))
                loop.close()

        self._thread = threading.Thread(target=run, name="hostile-node", daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    async def _drain(self, server: asyncio.Server) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        conn = _Conn(reader, writer)
        req: Request | None = None
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                if ":" in line:
                    k, v = line.split(":", 1)
                    headers[k.strip().lower()] = v.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            segment = path.lstrip("/").split("/", 1)[0]
            name, _, arg = segment.partition("=")
            req = Request(segment, method, path, headers, body)
            self.requests.append(req)
            handler = BEHAVIOURS.get(name)
            if handler is None or not path.endswith("/v1/chat/completions"):
                await conn.json(req, 404, {"error": {"message": f"no route {path}"}})
            else:
                await handler(conn, req, arg)
        except (ConnectionError, asyncio.IncompleteReadError):
            if req is not None:
                req.closed_by_client = True
        except asyncio.CancelledError:
            pass  # the server is stopping: end quietly (asyncio logs a cancelled handler task)
        finally:
            with contextlib.suppress(Exception):
                writer.close()
            self._tasks.discard(task)  # type: ignore[arg-type]


@contextlib.contextmanager
def serving() -> Iterator[HostileNode]:
    """A started :class:`HostileNode`, stopped on exit."""
    node = HostileNode().start()
    try:
        yield node
    finally:
        node.stop()


def write_config(path: Path, node: HostileNode, behaviours: Mapping[str, str],
                 *, policy_chain: list[str] | None = None, extra: str = "") -> Path:
    """A zml.toml with one node per ``{node_id: behaviour}``, each in its own family.

    Families are named after the node ids (``F_<id>``), and a policy ``hostile`` lists them in
    the given order (or ``policy_chain``), so a test decides which node is tried first.
    """
    lines: list[str] = []
    families = [f"F_{nid.replace('-', '_')}" for nid in behaviours]
    for fam in families:
        lines.append(f"[accelerators.{fam}]")
    for (nid, behaviour), fam in zip(behaviours.items(), families, strict=True):
        lines += ["[[nodes]]", f'id = "{nid}"', f'family = "{fam}"',
                  f'url = "{node.url(behaviour)}"', f'models = ["{MODEL}"]',
                  "max_concurrency = 4"]
    lines += ["[policies.hostile]",
              "accelerator_chain = [" + ", ".join(f'"{f}"' for f in policy_chain or families)
              + "]"]
    path.write_text("\n".join(lines) + "\n" + extra)
    return path
