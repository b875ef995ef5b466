"""One simulated inference node as a raw ASGI app: a real bounded queue in front of real
slots, paced token streaming, fault injection and abort on client disconnect.

The point of the simulation is that the client's routing, retry and cancellation logic meet
the same behaviour as against vLLM: requests really wait for a slot (FIFO, bounded, 503 when
full), really hold it while generating, and really let go of it the moment the client closes
its connection. Raw ASGI (no framework) keeps the per-request cost low, since the node also
serves the benchmarks.

Timing comes from the node performance model (`zml.sim.model.NodeModel`, the same model trace
replay uses), run on the event loop's clock: a timer fires at the model's next event (a request
reaching a slot, a first token, a finish), so the time to first token is the queue wait plus
the prefill of the prompt's uncached tokens, and tokens are paced by the decode step of the
current batch (slower as the node fills). The prompt's size is the node's prompt token count
(the `usage.prompt_tokens` it reports); its prefix blocks are `zml.sim.model.prompt_blocks`.
A prompt too large for the node's KV cache is answered 400 (`context_length_exceeded`).

Disconnects are watched by a small task reading `receive()` alongside the request; when it
sees `http.disconnect` it cancels the request's task wherever it is (queued or generating).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, MutableMapping, Sequence
from typing import Any

import httpx2

from zml.sim.metrics import CONTENT_TYPE, LoadSnapshot, MetricsExporter
from zml.sim.model import ModelRequest, NodeEvent, NodeModel, prompt_blocks
from zml.sim.planning import plan_reply
from zml.sim.protocol import (
    ApiError,
    ChatRequest,
    ChunkEncoder,
    Plan,
    completion_body,
    parse_request,
    reply_units,
)
from zml.sim.spec import FaultSpec, SimNodeSpec
from zml.validation import check_scale

__all__ = ["SimNode", "SimStats", "SimulatedDrop"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

Headers = Sequence[tuple[bytes, bytes]]

PLAN_INLINE_UNITS = 20_000
"""Replies larger than this (:func:`zml.sim.protocol.reply_units`; about 20 ms of planning)
are planned in a worker thread rather than on the event loop."""

_JSON: Headers = ((b"content-type", b"application/json"),)
_SSE: Headers = ((b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"))


class SimulatedDrop(httpx2.RemoteProtocolError):
    """Raised by a node to drop a connection on purpose (the `drop_rate` fault).

    Under a real server the connection is closed mid-response; in-process (through
    `httpx2.ASGITransport`) the client sees this exception, which is an
    `httpx2.RemoteProtocolError` like the one a real cut connection produces.
    """


@dataclasses.dataclass(frozen=True)
class SimStats:
    """A snapshot of a node's counters and load."""

    requests_total: int
    """Chat requests received."""
    completed_total: int
    """Requests answered in full."""
    aborted_total: int
    """Requests given up because the client disconnected (queued or generating)."""
    rejected_total: int
    """Requests answered with an error status (validation, auth, queue full, injected)."""
    dropped_total: int
    """Requests whose connection the node dropped on purpose (faults)."""
    running: int
    """Requests generating now."""
    waiting: int
    """Requests waiting for a slot now."""
    running_peak: int
    """Most requests generating at once since start or `reset_peak()`."""

    def as_dict(self) -> dict[str, int]:
        """The snapshot as a JSON-ready dict."""
        return dataclasses.asdict(self)


class _Live:
    """A request in the node model, as the ASGI side waits on it."""

    __slots__ = ("done", "first", "model", "started")

    def __init__(self, model: str, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self.started = False
        self.first: asyncio.Future[float] = loop.create_future()
        self.done: asyncio.Future[float] = loop.create_future()


class _Guard:
    """Shared between a request and its disconnect watcher."""

    __slots__ = ("active", "fired")

    def __init__(self) -> None:
        self.active = True
        self.fired = False


def _hit(rng: random.Random, rate: float) -> bool:
    return rate >= 1.0 or (rate > 0.0 and rng.random() < rate)


async def _read_body(receive: Receive) -> bytes | None:
    """The request body, or None when the client went away first."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _watch(receive: Receive, task: asyncio.Task[Any], guard: _Guard) -> None:
    while True:
        try:
            message = await receive()
        except Exception:  # a server that fails receive() has lost the connection
            message = {"type": "http.disconnect"}
        if message["type"] == "http.disconnect":
            if guard.active:
                guard.fired = True
                task.cancel()
            return


async def _send_bytes(send: Send, status: int, body: bytes, headers: Headers = _JSON) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    await _send_bytes(send, status, json.dumps(payload).encode())


async def _send_error(send: Send, error: ApiError, headers: Headers = _JSON) -> None:
    await _send_bytes(send, error.status, error.body(), headers)


class SimNode:
    """One simulated node: its state and its ASGI app (the instance itself is the app).

    `time_scale` multiplies every delay (time to first token, token pacing, stalls): tests use
    e.g. 0.01, benchmarks may use 0 for no pacing at all. Counters may be read from any
    thread; requests are served on one event loop.
    """

    def __init__(self, spec: SimNodeSpec, *, time_scale: float = 1.0) -> None:
        time_scale = check_scale(time_scale, "time_scale")
        self.spec = spec
        self.time_scale = time_scale
        self.model: NodeModel = NodeModel(spec.performance, spec.max_concurrency,
                               queue_size=spec.queue_size, time_scale=time_scale)
        """The performance model pacing this node (its clock is the event loop's)."""
        self._live: dict[Hashable, _Live] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._next_key = 0
        self._faults = spec.faults
        self._fault_rng = random.Random(spec.faults.seed)
        self._running_by_model = dict.fromkeys(spec.models, 0)
        self._waiting_by_model = dict.fromkeys(spec.models, 0)
        self._running = 0
        self._waiting = 0
        self._peak = 0
        self._requests_total = 0
        self._completed_total = 0
        self._aborted_total = 0
        self._rejected_total = 0
        self._dropped_total = 0
        self._auth = None if spec.api_key is None else f"Bearer {spec.api_key}".encode()
        self._exporter = None if spec.kind == "openai" else MetricsExporter(spec.kind, self._load)
        self._models_body = json.dumps(
            {
                "object": "list",
                "data": [
                    {"id": m, "object": "model", "created": 0, "owned_by": "zml-sim"} for m in spec.models
                ],
            }
        ).encode()
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("POST", "/v1/chat/completions"): self._chat,
            ("GET", "/health"): self._health,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/_sim/stats"): self._stats,
            ("POST", "/_sim/faults"): self._set_faults,
            ("POST", "/_sim/reset_peak"): self._reset_peak,
        }
        self._paths = {path for _, path in self._routes}

    # -- public state -------------------------------------------------------------------

    @property
    def faults(self) -> FaultSpec:
        """The faults in force."""
        return self._faults

    def set_faults(self, faults: FaultSpec) -> None:
        """Replace the injected faults (and restart their generator from `faults.seed`)."""
        self._fault_rng = random.Random(faults.seed)
        self._faults = faults

    @property
    def stats(self) -> SimStats:
        """A snapshot of the counters and the current load."""
        return SimStats(
            requests_total=self._requests_total,
            completed_total=self._completed_total,
            aborted_total=self._aborted_total,
            rejected_total=self._rejected_total,
            dropped_total=self._dropped_total,
            running=self._running,
            waiting=self._waiting,
            running_peak=self._peak,
        )

    def reset_peak(self) -> None:
        """Restart `running_peak` from the number running now."""
        self._peak = self._running

    def _load(self) -> LoadSnapshot:
        return LoadSnapshot(
            running=dict(self._running_by_model),
            waiting=dict(self._waiting_by_model),
            requests_total=self._requests_total,
            aborted_total=self._aborted_total,
            running_peak=self._peak,
        )

    # -- ASGI -----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI entry point (http and lifespan scopes)."""
        kind = scope["type"]
        if kind == "http":
            handler = self._routes.get((scope["method"], scope["path"]))
            if handler is not None:
                await handler(scope, receive, send)
            elif scope["path"] in self._paths:
                await _send_error(send, ApiError(405, "Method Not Allowed", code="method_not_allowed"))
            else:
                await _send_error(send, ApiError(404, f"Not found: {scope['path']}", type="NotFoundError"))
        elif kind == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_bytes(send, 200, b'{"status":"ok"}')

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_bytes(send, 200, self._models_body)

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._exporter is None:
            await _send_error(send, ApiError(404, "Not found: /metrics", type="NotFoundError"))
            return
        await _send_bytes(send, 200, self._exporter.render(), ((b"content-type", CONTENT_TYPE.encode()),))

    async def _stats(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_json(send, 200, self.stats.as_dict())

    async def _reset_peak(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reset_peak()
        await _send_json(send, 200, self.stats.as_dict())

    async def _set_faults(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return
        try:
            fields = json.loads(body or b"{}")
            if not isinstance(fields, dict):
                raise TypeError("faults must be a JSON object")
            faults = FaultSpec(**fields)
        except (ValueError, TypeError) as exc:
            await _send_error(send, ApiError(400, f"bad faults: {exc}"))
            return
        self.set_faults(faults)
        await _send_json(send, 200, dataclasses.asdict(faults))

    # -- chat completions ---------------------------------------------------------------

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._requests_total += 1
        body = await _read_body(receive)
        if body is None:
            self._aborted_total += 1
            return
        if self._auth is not None and not self._authorized(scope):
            self._rejected_total += 1
            await _send_error(
                send, ApiError(401, "Invalid or missing API key.", type="authentication_error", code="invalid_api_key")
            )
            return
        try:
            request = parse_request(body, self.spec.models)
        except ApiError as error:
            self._rejected_total += 1
            await _send_error(send, error)
            return
        faults, rng = self._faults, self._fault_rng
        if _hit(rng, faults.error_rate):
            self._rejected_total += 1
            await self._send_injected_error(send, faults)
            return
        drop = _hit(rng, faults.drop_rate)
        malformed = request.stream and _hit(rng, faults.malformed_rate)
        if reply_units(request) > PLAN_INLINE_UNITS:
            # a long reply is planned off the event loop, which every simulated node of the
            # process shares: their /health and other requests are answered meanwhile
            plan = await asyncio.to_thread(plan_reply, request)
        else:
            plan = plan_reply(request)
        loop = asyncio.get_running_loop()
        self._next_key += 1
        key = self._next_key
        admission = self.model.admit(
            ModelRequest(key, max(1, plan.prompt_tokens), max(1, plan.completion_tokens),
                         prompt_blocks(request.messages)),
            loop.time(),
        )
        if admission == "queue_full":
            self._rejected_total += 1
            await _send_error(
                send,
                ApiError(
                    503,
                    f"Server is overloaded: {self.spec.queue_size} requests already waiting.",
                    type="ServiceUnavailableError",
                    code="queue_full",
                ),
            )
            return
        if admission == "exceeds_kv_cache":
            self._rejected_total += 1
            limit = self.model.profile.kv_cache_tokens
            await _send_error(
                send,
                ApiError(
                    400,
                    f"This request needs {plan.prompt_tokens + plan.completion_tokens} tokens of "
                    f"KV cache; the node holds {limit}. Shorten the prompt or max_tokens.",
                    code="context_length_exceeded",
                ),
            )
            return
        live = _Live(request.model, loop)
        self._live[key] = live
        self._waiting += 1
        self._waiting_by_model[request.model] += 1
        self._pump(loop)
        await self._serve(request, plan, key, live, receive, send, drop, malformed)

    # -- the model's clock ----------------------------------------------------------------

    def _pump(self, loop: asyncio.AbstractEventLoop, at: float = 0.0) -> None:
        """Apply the model's events up to now and set the timer for its next one."""
        now = max(loop.time(), at)
        for event in self.model.advance(now):
            self._apply(event)
        when = self.model.next_event_time()
        if when != self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._timer_at = when
            if when < math.inf:
                self._timer = loop.call_at(when, self._on_timer, loop, when)

    def _on_timer(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._pump(loop, when)

    def _apply(self, event: NodeEvent) -> None:
        live = self._live.get(event.key)
        if live is None:
            return
        if event.kind == "started":
            live.started = True
            self._waiting -= 1
            self._waiting_by_model[live.model] -= 1
            self._running += 1
            self._running_by_model[live.model] += 1
            if self._running > self._peak:
                self._peak = self._running
        elif event.kind == "first_token":
            if not live.first.done():
                live.first.set_result(event.time)
        else:
            self._leave(event.key, live)
            if not live.first.done():
                live.first.set_result(event.time)
            if not live.done.done():
                live.done.set_result(event.time)

    def _leave(self, key: Hashable, live: _Live) -> None:
        """Forget a request (finished or aborted) and update the load counters."""
        del self._live[key]
        if live.started:
            self._running -= 1
            self._running_by_model[live.model] -= 1
        else:
            self._waiting -= 1
            self._waiting_by_model[live.model] -= 1

    async def _until_token(self, key: Hashable, live: _Live, index: int) -> None:
        """Wait until token ``index`` of the request is generated (always yields once)."""
        loop = asyncio.get_running_loop()
        model = self.model
        await asyncio.sleep(0)
        while not live.done.done():
            now = loop.time()
            if model.tokens_out(key, now) > index:
                return
            due = model.token_time(key, index)
            if due is None:
                await asyncio.wait((live.done,))
                return
            await asyncio.sleep(max(0.0, due - now))

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bool(value == self._auth)
        return False

    async def _send_injected_error(self, send: Send, faults: FaultSpec) -> None:
        status = faults.error_status
        headers = list(_JSON)
        if faults.retry_after_s is not None and status in (429, 503):
            headers.append((b"retry-after", str(math.ceil(faults.retry_after_s)).encode()))
            headers.append((b"retry-after-ms", str(round(faults.retry_after_s * 1000)).encode()))
        kind = "rate_limit_error" if status == 429 else "server_error" if status >= 500 else "invalid_request_error"
        error = ApiError(status, f"Injected fault: HTTP {status}.", type=kind, code="sim_injected_fault")
        await _send_error(send, error, headers)

    async def _serve(
        self, request: ChatRequest, plan: Plan, key: Hashable, live: _Live, receive: Receive,
        send: Send, drop: bool, malformed: bool
    ) -> None:
        """Wait for the model's first token and pace the answer, aborting on disconnect."""
        task = asyncio.current_task()
        assert task is not None
        guard = _Guard()
        watcher = asyncio.ensure_future(_watch(receive, task, guard))
        try:
            await asyncio.wait((live.first,))
            stall = self._faults.stall_s * self.time_scale
            if stall:
                await asyncio.sleep(stall)
            if request.stream:
                await self._stream(request, plan, key, live, send, drop, malformed)
            else:
                await self._respond(plan, live, send, drop)
            guard.active = False
            self._completed_total += 1
        except asyncio.CancelledError:
            if not guard.fired:
                raise
            if sys.version_info >= (3, 11):
                task.uncancel()
            self._aborted_total += 1
        except OSError:
            self._aborted_total += 1
        except SimulatedDrop:
            self._dropped_total += 1
            raise
        finally:
            guard.active = False
            watcher.cancel()
            if key in self._live:
                loop = asyncio.get_running_loop()
                self.model.cancel(key, loop.time())
                self._leave(key, live)
                self._pump(loop)

    async def _respond(self, plan: Plan, live: _Live, send: Send, drop: bool) -> None:
        await asyncio.wait((live.done,))
        body = completion_body(plan, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        headers = [*_JSON, (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if drop:
            raise SimulatedDrop("simulated node dropped the connection before the body")
        await send({"type": "http.response.body", "body": body})

    async def _stream(
        self, request: ChatRequest, plan: Plan, key: Hashable, live: _Live, send: Send,
        drop: bool, malformed: bool
    ) -> None:
        encoder = ChunkEncoder(plan, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()))
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        for i in range(encoder.steps):
            if i:
                await self._until_token(key, live, i)
            if drop and i == 3:
                break
            chunk = encoder.step(i)
            if malformed and i == 0:
                chunk += encoder.malformed()
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if drop:
            raise SimulatedDrop("simulated node dropped the connection mid-stream")
        await asyncio.wait((live.done,))
        await send({"type": "http.response.body", "body": encoder.tail(request.include_usage)})
