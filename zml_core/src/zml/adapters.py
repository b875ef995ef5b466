"""The toolkit of framework adapters: the zml clients an integration object builds lazily.

A LangChain chat model or a LlamaIndex LLM is declared long before it is used, copied,
pickled and called from sync code, from ``asyncio.run`` scripts (a new event loop per call)
and from several threads. Building a ``zml.Client`` reads the zml.toml, so it must wait for the
first call; and an ``AsyncClient``'s connections belong to the event loop that opened them, so
every event loop needs its own. :class:`LoopClients` does both, once, for every adapter:

- one :class:`~zml.Client` for sync code, built on first use;
- one :class:`~zml.AsyncClient` per event loop, built on first use in that loop. When the loop
  shuts down through ``asyncio.run`` or an ``asyncio.Runner`` (which close the loop's
  asynchronous generators, ``loop.shutdown_asyncgens()``), that loop's client is closed with
  ``aclose()`` while the loop can still run it; a loop closed another way is noticed on the
  next use and its client is dropped (its sockets belong to a loop that can no longer run, so
  there is nothing left to await), without a "Task was destroyed but it is pending" error: no
  task is left waiting in the loop;
- thread-safe: a lock guards every build, so concurrent first calls build one client;
- copies (``copy.deepcopy``, pickling) start empty: clients hold sockets, never copied. An
  adapter gives its shallow copies (pydantic's ``model_copy``) a new ``LoopClients`` too: a
  copy may have another ``api_key`` or config, and must never use the original's clients.

The clients of one ``LoopClients`` share one fleet (built with ``fleet=`` the first client's):
one integration object is one set of capacity accounting, however it is called (sync, async,
in several event loops), so a node's slots are never counted twice. The configuration is read
once, by the first client.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import AsyncClient, Client
    from .fleet import Fleet

__all__ = ["LoopClients"]

ClientOptions = Callable[[], Mapping[str, Any]]
"""Returns the keyword arguments of ``zml.Client`` / ``zml.AsyncClient`` (read at build time)."""


class LoopClients:
    """Lazily built zml clients of one integration object: one sync, one per event loop.

    The options are passed to each call rather than stored, so that the object stays free of
    references to its owner (a model that holds it can be copied and pickled)::

        clients = zml.LoopClients()
        options = lambda: {"config": "zml.toml", "max_attempts": 3}

        clients.sync(options).infer(...)                       # sync code
        await clients.for_running_loop(options).infer(...)     # inside any event loop
        await clients.aclose()                                 # close this loop's client

    ``options()`` is called only when a client is built, and must return the keyword
    arguments of :class:`zml.Client` / :class:`zml.AsyncClient` (``api_key``, ``config``,
    ``timeout``, ``max_attempts``...).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: Client | None = None
        self._loops: dict[asyncio.AbstractEventLoop,
                          tuple[AsyncClient, AsyncGenerator[None, None]]] = {}
        self._fleet: Fleet | None = None

    def _options(self, options: ClientOptions) -> dict[str, Any]:
        """``options()``, with the shared fleet once a first client made it (call with the
        lock held): a ``fleet=`` brings its registry, so ``config=`` goes."""
        kwargs = dict(options())
        if self._fleet is not None and kwargs.get("fleet") is None:
            kwargs.pop("config", None)
            kwargs["fleet"] = self._fleet
        return kwargs

    def _share(self, client: Client | AsyncClient) -> None:
        if self._fleet is None:
            self._fleet = client.fleet

    def sync(self, options: ClientOptions) -> Client:
        """The sync client, built from ``options()`` on first use."""
        client = self._sync
        if client is None:
            with self._lock:
                client = self._sync
                if client is None:
                    from .client import Client

                    client = self._sync = Client(**self._options(options))
                    self._share(client)
        return client

    def for_running_loop(self, options: ClientOptions) -> AsyncClient:
        """The async client of the running event loop, built from ``options()`` on first use.

        Must be called from a coroutine (it raises ``RuntimeError`` otherwise, as
        ``asyncio.get_running_loop`` does). Clients of loops found closed are dropped here.
        """
        loop = asyncio.get_running_loop()
        entry = self._loops.get(loop)
        if entry is not None:
            return entry[0]
        with self._lock:
            entry = self._loops.get(loop)
            if entry is not None:
                return entry[0]
            for gone in [other for other in self._loops if other.is_closed()]:
                del self._loops[gone]
            from .client import AsyncClient

            client = AsyncClient(**self._options(options))
            self._share(client)
            self._loops[loop] = (client, _started(self._close_at_shutdown(loop, client)))
        return client

    async def _close_at_shutdown(
        self, loop: asyncio.AbstractEventLoop, client: AsyncClient
    ) -> AsyncGenerator[None, None]:
        """Stay suspended until the loop closes its asynchronous generators (at shutdown, or
        when this one is dropped while the loop runs), then close ``client``.

        A generator dropped after its loop closed is not resumed at all (the loop's finalizer
        hook skips it), so nothing here runs outside the loop, or takes the lock then.
        """
        try:
            yield
        finally:
            if self._forget(loop, client):
                await client.aclose()

    def _forget(self, loop: asyncio.AbstractEventLoop, client: AsyncClient) -> bool:
        with self._lock:
            entry = self._loops.get(loop)
            if entry is None or entry[0] is not client:
                return False
            del self._loops[loop]
            return True

    @property
    def built(self) -> bool:
        """Whether any client (sync, or async of a loop still open) exists now."""
        return self._sync is not None or any(not loop.is_closed() for loop in list(self._loops))

    @property
    def loop_count(self) -> int:
        """How many event loops have an async client now (closed loops not counted)."""
        return sum(1 for loop in list(self._loops) if not loop.is_closed())

    def close(self) -> None:
        """Close the sync client (a later call builds a new one)."""
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close the running event loop's async client, if it has one (a later call in this
        loop builds a new one). Clients of other loops are closed when their loop shuts down."""
        loop = asyncio.get_running_loop()
        with self._lock:
            entry = self._loops.pop(loop, None)
        if entry is None:
            return
        client, closer = entry
        await closer.aclose()  # forgotten above: it does not close the client itself
        await client.aclose()

    def __repr__(self) -> str:
        return f"LoopClients(sync={self._sync is not None}, loops={self.loop_count})"

    def __deepcopy__(self, memo: dict[int, Any]) -> LoopClients:
        return LoopClients()

    def __copy__(self) -> LoopClients:
        return LoopClients()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


def _started(closer: AsyncGenerator[None, None]) -> AsyncGenerator[None, None]:
    """``closer`` run to its ``yield`` from synchronous code in a running event loop: its first
    step registers it with the loop (``sys.set_asyncgen_hooks``, set by the running loop), which
    closes it at shutdown."""
    step = closer.asend(None)
    try:
        step.send(None)
    except StopIteration:
        return closer
    raise RuntimeError("the closer awaited before its yield")  # pragma: no cover
