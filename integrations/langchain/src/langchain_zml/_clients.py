"""The zml clients behind one ``ChatZML``: built on first use, never in ``__init__``.

Building a client reads and validates the zml.toml (nothing is sent), so a model can be
declared anywhere, copied and serialised, and only a call needs the configuration.

The async client's connections belong to the event loop they were opened in, so each event
loop gets its own client (a script calling ``asyncio.run`` twice works); routing state is
zml's and is shared per process, whichever client routes.

A deep copy or an unpickled copy of a model starts with no clients: they hold sockets.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import zml

__all__ = ["Clients"]


class Clients:
    """Lazily built ``zml.Client`` and per-loop ``zml.AsyncClient`` of one model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sync: zml.Client | None = None
        self._async: tuple[asyncio.AbstractEventLoop, zml.AsyncClient] | None = None

    def sync(self, options: Callable[[], dict[str, Any]]) -> zml.Client:
        """The sync client, built from ``options()`` on first use."""
        client = self._sync
        if client is None:
            with self._lock:
                client = self._sync
                if client is None:
                    client = self._sync = zml.Client(**options())
        return client

    def for_running_loop(self, options: Callable[[], dict[str, Any]]) -> zml.AsyncClient:
        """The async client of the running event loop, built from ``options()`` on first use."""
        loop = asyncio.get_running_loop()
        pair = self._async
        if pair is None or pair[0] is not loop:
            with self._lock:
                pair = self._async
                if pair is None or pair[0] is not loop:
                    pair = self._async = (loop, zml.AsyncClient(**options()))
        return pair[1]

    @property
    def built(self) -> bool:
        """Whether a client has been built yet."""
        return self._sync is not None or self._async is not None

    def close(self) -> None:
        """Close the sync client (a later call builds a new one)."""
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close the async client if it belongs to the running loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pair = self._async
            if pair is None or pair[0] is not loop:
                return
            self._async = None
        await pair[1].aclose()

    def __deepcopy__(self, memo: dict[int, Any]) -> Clients:
        return Clients()

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
