"""``zml.Client`` and ``zml.AsyncClient``: thin drivers over :mod:`zml.dispatch`.

Everything both clients do alike (finding the configuration, validating policies and
arguments, routing, failover decisions) happens once, in :mod:`zml.client_base` and the
dispatcher. What is left here is what differs between sync and async: sending, waiting and
sleeping.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx2

from .client_base import (
    DEFAULT_TIMEOUT,
    NOT_GIVEN,
    BaseClient,
    NotGiven,
    answer_deadline,
    check_http_client,
    check_probe_interval,
    finish,
    read_failure,
)
from .config import Registry
from .connections import async_http_client, sync_http_client
from .dispatch import MAX_ATTEMPTS, Call, Step, Timeouts, Wait, adrive, drive
from .errors import NodeError
from .fleet import Fleet
from .policy import PolicyRef
from .transport import (
    PostRequests,
    aread_body,
    aread_error_body,
    check_status,
    decode_completion,
    read_body,
    read_error_body,
    still_sending,
)
from .types import ChatCompletion
from .watchdog import LoopWatchdog, Watch, Watchdog

if TYPE_CHECKING:
    import asyncio
    from types import TracebackType

    from .streaming import AsyncStream, Stream

__all__ = ["AsyncClient", "Client"]

# An idle connection is dropped after 4 s. The servers in front of inference engines (uvicorn
# for vLLM and SGLang, llama.cpp's own) close it after 5 s, httpx2's default expiry: a request
# sent on a connection at the moment the node closes it fails, a spurious failover that also
# lowers the node's health.
_LIMITS = httpx2.Limits(max_connections=None, max_keepalive_connections=256,
                        keepalive_expiry=4.0)


def _release_sync(stop: threading.Event, watchdog: Watchdog, http: httpx2.Client | None) -> None:
    # What a sync client lets go of at close(), or when it is garbage-collected unclosed.
    stop.set()
    watchdog.close()
    if http is not None:
        http.close()


class Client(BaseClient):
    """The synchronous zml client.

    Args:
        api_key: sent to nodes as a Bearer token (default: ``$ZML_API_KEY``); never shown in
            reprs, logs, errors or routing metadata.
        config: a ``zml.toml`` path (default: ``$ZML_CONFIG``, else ``./zml.toml``) or a Registry.
        timeout: the overall deadline per request in seconds, or a :class:`zml.Timeouts`.
        max_attempts: dispatches per request at most, counting failovers.
        http_client: an ``httpx2.Client`` to send with (its transport, proxies, TLS settings).
        fleet: another client's ``.fleet``, to share its registry and capacity accounting on
            purpose (then pass no ``config``).
        probe_interval_s: from the first request on, probe every node's ``/health`` and
            ``/metrics`` this often from a daemon thread, so that load reported by the nodes
            (from every client) and liveness feed routing. None: no probing.

    Raises:
        PolicyConfigError: the configuration or one of its policies is invalid.
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        config: str | os.PathLike[str] | Registry | None = None,
        timeout: float | Timeouts | None = DEFAULT_TIMEOUT,
        max_attempts: int = MAX_ATTEMPTS,
        http_client: httpx2.Client | None = None,
        fleet: Fleet | None = None,
        probe_interval_s: float | None = 2.0,
    ) -> None:
        check_http_client(http_client, httpx2.Client, "Client")
        super().__init__(api_key, config, timeout, max_attempts, fleet)
        if probe_interval_s is not None:
            check_probe_interval(probe_interval_s)
        self._own_http = http_client is None
        self._http = http_client or sync_http_client(_LIMITS)
        self._posts = PostRequests(self._http)
        self._probing = False
        self._probe_stop = threading.Event()
        self._probe_interval_s = probe_interval_s
        self._watchdog = Watchdog(self._dispatcher.clock)
        self._closing = threading.Event()
        """Set by close(): ends the Retry-After waits of calls in flight."""
        # A client dropped without close() must leave neither its threads nor its open
        # connections behind (these would otherwise be freed, unclosed, whenever the prober
        # thread lets go of them).
        self._release = weakref.finalize(self, _release_sync, self._probe_stop, self._watchdog,
                                         self._http if self._own_http else None)

    def start_probing(self, interval_s: float = 2.0) -> None:
        """Probe every node's ``/health`` and ``/metrics`` every ``interval_s`` seconds (the
        first time ``interval_s`` from now) from a daemon thread, with this client's HTTP
        client, so node-reported load and liveness feed routing. The client does this
        from its first request unless built with ``probe_interval_s=None``; call it to start
        earlier. Stopped by ``close()`` (or when the client is garbage-collected)."""
        check_probe_interval(interval_s)
        if self._probing or not self._release.alive:
            return
        self._probing = True
        stop = self._probe_stop
        fleet = weakref.ref(self.fleet)
        http = self._http  # the client's own transport, proxies and TLS settings

        def run() -> None:
            while not stop.wait(interval_s):
                live = fleet()
                if live is None:  # the client (and its fleet) are gone
                    return
                try:
                    # Imported at the first probe, not on the first request's path (the
                    # module brings asyncio, which the sync client does not need otherwise).
                    from .probe import Prober

                    Prober(live, interval_s).probe_all(http)
                except Exception as exc:  # one bad answer must not end the probing
                    if not stop.is_set():  # (a probe cut short by close() is no news)
                        logging.getLogger("zml.probe").warning("zml prober: %s", exc)
                del live

        threading.Thread(target=run, name="zml-prober", daemon=True).start()

    def _probe_on_first_use(self) -> None:
        if not self._probing and self._probe_interval_s is not None:
            self.start_probing(self._probe_interval_s)

    def infer(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        policy: PolicyRef | None = None,
        accelerator: str | None = None,
        timeout: float | Timeouts | NotGiven | None = NOT_GIVEN,
        metadata: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> ChatCompletion:
        """Send a chat completion to the node the policy picks; return its answer.

        Args:
            model: the model name, as the nodes serve it.
            messages: the chat, as a list of ``{"role": ..., "content": ...}`` mappings.
            policy: a :class:`Policy`, the name of a configured policy, or a dict of Policy
                fields. None: any healthy node serving the model (the 0.2 behaviour).
            accelerator: pin one family, without a policy (the 0.2 style).
            timeout: this request's deadline, overriding the client's.
            metadata: free-form labels (team, service) passed to every plugin hook.
            **params: OpenAI chat parameters passed through (temperature, max_tokens, stop,
                tools, tool_choice, response_format, seed, ...; others in ``extra_body``).

        Returns:
            The completion; ``response.routing`` says where it went and why.

        Raises:
            RoutingError: no node could take it. PolicyConfigError: the policy is invalid.
            InvalidRequestError: a bad argument. NodeError subclasses: the node failed.
        """
        call = self._call(model, messages, policy, accelerator, params, False, metadata, timeout)
        self._probe_on_first_use()
        step, data = drive(call, self._wait, lambda step: self._post(call, step))
        return finish(call, step, data)

    def infer_stream(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        policy: PolicyRef | None = None,
        accelerator: str | None = None,
        timeout: float | Timeouts | NotGiven | None = NOT_GIVEN,
        metadata: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> Stream:
        """Like :meth:`infer`, streamed: returns a :class:`Stream` of chunks, already dispatched.

        Failover happens only before the first chunk; ``stream.routing`` is set on return.
        Leaving the loop early or calling ``close()`` cancels the request on the node.
        """
        call = self._call(model, messages, policy, accelerator, params, True, metadata, timeout)
        self._probe_on_first_use()
        from .streaming import Stream

        return Stream(call, self._http, self._wait, self._watchdog, self._request)

    def _post(self, call: Call, step: Step) -> dict[str, Any]:
        node_id = step.node.id
        deadline = answer_deadline(call, step)
        watch: Watch | None = None
        r: httpx2.Response | None = None
        try:
            request = self._request(call, step)
            step.sent_headers = request.headers
            # Neither the headers nor a dripped body outlast the attempt's limit or the
            # request's deadline, and close() can cut the call short (an endless watch when
            # there is neither).
            watch = self._watchdog.watch(math.inf if deadline is None else deadline, request)
            r = self._http.send(request, stream=True)
            if watch is not None and not watch.follow(r):
                raise still_sending(node_id)
            content = read_error_body(r) if r.status_code >= 400 else \
                read_body(r, node_id, deadline=deadline, clock=call.d.clock)
            if watch is not None and watch.fired:  # what came was cut short at the deadline
                raise still_sending(node_id)
        except (httpx2.HTTPError, NodeError) as exc:
            err = read_failure(exc, watch, node_id)
            if err is exc:
                raise
            raise err from exc
        finally:
            if watch is not None:
                watch.end()
            if r is not None:
                r.close()
        check_status(r.status_code, r.headers, content, node_id, r.request.headers)
        call.first_token(step)
        return decode_completion(content, node_id)

    def _wait(self, wait: Wait) -> None:
        delay = max(0.0, wait.until - self._dispatcher.clock())
        timeout = None if math.isinf(delay) else delay
        ticket = wait.ticket
        if ticket is None:  # a Retry-After wait: close() ends it
            if timeout is not None:
                self._closing.wait(timeout)
            return
        event = threading.Event()
        ticket.arm(event.set)
        try:
            event.wait(timeout)
        finally:
            ticket.disarm()

    def close(self) -> None:
        """Close the connections this client opened (not those of a passed ``http_client``),
        stop probing and stop the deadline thread (:mod:`zml.watchdog`). Calls still in
        flight, in other threads, end at once with a :class:`~zml.ClientConfigError` (no
        failover, no node blamed); a call made after it raises one too."""
        self._closed = True
        self._dispatcher.close(type(self).__name__)  # first: calls it cuts short say why
        self._closing.set()
        self._release()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncClient(BaseClient):
    """The asyncio zml client: the same interface as :class:`Client`, with ``await``.

    Use it as ``async with zml.AsyncClient(...) as client`` so its connections are closed.
    Cancelling a task that awaits ``infer`` (or iterates ``infer_stream``) closes the
    connection, and the node drops the request. Use it from one event loop at a time: a later
    ``asyncio.run()`` is fine (the connections of the finished loop are let go of, and new ones
    opened), two loops in two threads at once are not. Arguments as for :class:`Client`, with
    an ``httpx2.AsyncClient`` for ``http_client`` (one of your own is bound to its first loop,
    as httpx2's clients are: build it, and the zml client, inside the loop), and:

    Args:
        probe_interval_s: from the first request on, probe every node's ``/health`` and
            ``/metrics`` this often, so that load reported by the nodes (from every client)
            and liveness feed routing. None: no probing (client-side accounting only).
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        config: str | os.PathLike[str] | Registry | None = None,
        timeout: float | Timeouts | None = DEFAULT_TIMEOUT,
        max_attempts: int = MAX_ATTEMPTS,
        http_client: httpx2.AsyncClient | None = None,
        probe_interval_s: float | None = 2.0,
        fleet: Fleet | None = None,
    ) -> None:
        check_http_client(http_client, httpx2.AsyncClient, "AsyncClient")
        if probe_interval_s is not None:
            check_probe_interval(probe_interval_s)
        super().__init__(api_key, config, timeout, max_attempts, fleet)
        self._own_http = http_client is None
        self._http = http_client or async_http_client(_LIMITS)
        self._posts = PostRequests(self._http)
        # Imported here, not with the module: the sync client needs neither (nor asyncio).
        from .probe import Prober
        from .streaming import AsyncStream

        self._stream_type = AsyncStream
        self._deadlines = LoopWatchdog(self._dispatcher.clock)
        self._waits: set[asyncio.Event] = set()
        """The events of the waits in progress (queue places, Retry-After): aclose() sets them."""
        self._prober = None if probe_interval_s is None else Prober(self.fleet, probe_interval_s)

    def _start_probing(self) -> None:
        if self._prober is not None:
            self._prober.start(self._http)

    async def infer(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        policy: PolicyRef | None = None,
        accelerator: str | None = None,
        timeout: float | Timeouts | NotGiven | None = NOT_GIVEN,
        metadata: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> ChatCompletion:
        """Send a chat completion to the node the policy picks; see :meth:`Client.infer`."""
        call = self._call(model, messages, policy, accelerator, params, False, metadata, timeout)
        self._start_probing()
        step, data = await adrive(call, self._wait, lambda step: self._post(call, step))
        return finish(call, step, data)

    def infer_stream(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        policy: PolicyRef | None = None,
        accelerator: str | None = None,
        timeout: float | Timeouts | NotGiven | None = NOT_GIVEN,
        metadata: Mapping[str, Any] | None = None,
        **params: Any,
    ) -> AsyncStream:
        """Stream a chat completion: ``async for chunk in client.infer_stream(...)``.

        Arguments are validated at once; the request is dispatched on first iteration (or
        ``async with``). See :meth:`Client.infer_stream`.
        """
        call = self._call(model, messages, policy, accelerator, params, True, metadata, timeout)
        return self._stream_type(call, self._http, self._wait, self._deadlines, self._request,
                                 self._start_probing)

    async def _post(self, call: Call, step: Step) -> dict[str, Any]:
        node_id = step.node.id
        deadline = answer_deadline(call, step)
        watch: Watch | None = None
        r: httpx2.Response | None = None
        try:
            request = self._request(call, step)
            step.sent_headers = request.headers
            # Neither the headers nor a dripped body outlast the attempt's limit or the
            # request's deadline, and close() can cut the call short (an endless watch when
            # there is neither).
            watch = self._deadlines.watch(math.inf if deadline is None else deadline, request)
            r = await self._http.send(request, stream=True)
            if watch is not None and not watch.follow(r):
                raise still_sending(node_id)
            content = await aread_error_body(r) if r.status_code >= 400 else \
                await aread_body(r, node_id, deadline=deadline, clock=call.d.clock)
            if watch is not None and watch.fired:  # what came was cut short at the deadline
                raise still_sending(node_id)
        except (httpx2.HTTPError, NodeError) as exc:
            err = read_failure(exc, watch, node_id)
            if err is exc:
                raise
            raise err from exc
        finally:
            if watch is not None:
                watch.end()
            if r is not None:
                await r.aclose()
        check_status(r.status_code, r.headers, content, node_id, r.request.headers)
        call.first_token(step)
        return decode_completion(content, node_id)

    async def _wait(self, wait: Wait) -> None:
        import asyncio

        delay = max(0.0, wait.until - self._dispatcher.clock())
        ticket = wait.ticket
        loop = asyncio.get_running_loop()
        event = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                loop.call_soon_threadsafe(event.set)

        # A timer rather than asyncio.wait_for: before Python 3.12, wait_for swallows a
        # cancellation that arrives just as the event is set, and the request would stay queued.
        timer = None if math.isinf(delay) else loop.call_later(delay, event.set)
        if ticket is not None:  # a place in a saturation queue: freed capacity ends the wait
            ticket.arm(wake)
        self._waits.add(event)  # aclose() ends it
        try:
            await event.wait()
        finally:
            self._waits.discard(event)
            if timer is not None:
                timer.cancel()
            if ticket is not None:
                ticket.disarm()

    async def aclose(self) -> None:
        """Stop probing; close the connections this client opened (not a passed
        ``http_client``'s). Calls still in flight end at once with a
        :class:`~zml.ClientConfigError` (no failover, no node blamed); a call made after it
        raises one too."""
        self._closed = True
        self._dispatcher.close(type(self).__name__)  # first: calls it cuts short say why
        for event in list(self._waits):
            event.set()
        self._deadlines.close()
        if self._prober is not None:
            await self._prober.stop()
        if self._own_http:
            await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
