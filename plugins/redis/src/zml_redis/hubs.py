"""One :class:`~zml_redis.hub.Hub` per process and per :class:`~zml_redis.settings.Settings`.

A hub is this process's link to one Redis (connections, background threads, the shared lease
and health state), so every client of the process with the same settings goes through the same
one: that is what lets them share node capacity, as replicas in other processes do. A forked
child gets its own hub (the key holds the process id). At exit, every hub is closed, so queued
lease releases are sent before the process goes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading

from .hub import Hub
from .settings import Settings

__all__ = ["close_all", "hub_for"]

_hubs: dict[tuple[int, Settings], Hub] = {}
_hubs_lock = threading.Lock()


def hub_for(settings: Settings) -> Hub:
    """This process's hub for ``settings`` (made on first use; a forked child gets its own)."""
    key = (os.getpid(), settings)
    with _hubs_lock:
        hub = _hubs.get(key)
        if hub is None:
            hub = _hubs[key] = Hub(settings)
        return hub


def close_all() -> None:
    """Close every hub of this process (tests; at exit, queued releases are sent first)."""
    with _hubs_lock:
        hubs = list(_hubs.values())
        _hubs.clear()
    for hub in hubs:
        with contextlib.suppress(Exception):
            hub.close()


atexit.register(close_all)
