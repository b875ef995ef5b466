"""Named policies kept in Redis: the store (written by ``zml policies``) and the live source.

Keys (``{prefix}`` is ``ZML_REDIS_PREFIX``, default ``zml``):

* ``{prefix}:policies`` — hash: policy name → JSON object of its ``zml.Policy`` fields;
* ``{prefix}:policies:versions`` — hash: policy name → its version, bumped by every push and
  removal (a policy removed and pushed again goes on counting);
* ``{prefix}:policies:version`` — the store's version, bumped by every change;
* channel ``{prefix}:policies:changed`` — ``{"op": "push"|"rm", "names": [...], "version": N}``
  after every change.

A change is one Lua script (write, bump versions, publish), so a reader never sees a policy
without its version, nor misses the announcement of a change it can read.

:class:`RedisPolicySource` keeps a mirror of the whole store in memory: lookups never touch
the network (so they keep working while Redis is down, with the last policies seen). The hub's
listener thread reads the store again when a change is announced, and after every
(re)subscription; then the source calls its subscribers, and clients drop their cached policies.
A store found empty at a lower version than the one mirrored (Redis restarted without its data)
is reported once and ignored until the next push: clients keep the policies they had.

Keys edited by hand into what ``zml policies`` never writes (a key of the wrong type, a
version that is not an integer) raise :class:`CorruptStoreError` naming the key: building a
client then fails with a ``zml.PolicyConfigError``, ``zml policies`` prints one line, and a
running client logs one warning and keeps the policies it had. (A single row that is not a
JSON object only fails the requests that name that policy.)
"""

from __future__ import annotations

import json
import logging
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

import zml

from . import scripts
from .hub import Hub
from .settings import URL_TIMEOUT_MAX_S, Settings, SettingsError

__all__ = ["CorruptStoreError", "PolicyStore", "RedisPolicySource", "Snapshot", "StoreError"]

log = logging.getLogger("zml.redis")


class StoreError(Exception):
    """A store operation that cannot be done (a missing policy...)."""


class CorruptStoreError(StoreError):
    """A key of the store holds what ``zml policies`` never writes (edited by hand): a value
    of the wrong type, or a version that is not an integer. ``key`` names it."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Snapshot:
    """The whole store at one version."""

    version: int = 0
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Name → stored fields (without ``name``)."""
    versions: dict[str, int] = field(default_factory=dict)
    """Name → the policy's version."""
    invalid: dict[str, str] = field(default_factory=dict)
    """Name → stored text that is not a JSON object (written by hand, not by ``push``)."""


def _decode(raw: str) -> dict[str, Any] | None:
    try:
        fields = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return fields if isinstance(fields, dict) else None


def _version(raw: Any, key: str, name: str | None = None) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        where = key if name is None else f"{key} (field {name!r})"
        fix = (f"HSET {key} {name} N" if name is not None else f"SET {key} N")
        raise CorruptStoreError(
            f"{where} holds {str(raw)[:40]!r}, not an integer version (edited by hand?): set "
            f"it to a whole number, at least the highest version clients have seen "
            f"(redis-cli {fix})", key,
        ) from None


def read_snapshot(client: redis.Redis, settings: Settings) -> Snapshot:
    """Read the whole store atomically (one MULTI/EXEC). Raises :class:`CorruptStoreError`
    naming a key that holds the wrong type of value or a version that is not an integer."""
    keys = (settings.policies_key, settings.policy_versions_key, settings.store_version_key)
    pipe = client.pipeline(transaction=True)
    pipe.hgetall(settings.policies_key)
    pipe.hgetall(settings.policy_versions_key)
    pipe.get(settings.store_version_key)
    replies = pipe.execute(raise_on_error=False)
    for key, reply in zip(keys, replies, strict=True):
        if isinstance(reply, ResponseError) and str(reply).startswith("WRONGTYPE"):
            kind = "a string" if key == settings.store_version_key else "a hash"
            raise CorruptStoreError(
                f"{key} holds the wrong type of value for the policy store ({kind} is "
                f"expected; edited by hand?): delete it (redis-cli DEL {key}) and push the "
                "policies again", key,
            )
        if isinstance(reply, Exception):
            raise reply
    raw, versions, version = replies
    policies: dict[str, dict[str, Any]] = {}
    invalid: dict[str, str] = {}
    for name, text in raw.items():
        fields = _decode(text)
        if fields is None:
            invalid[name] = text
        else:
            policies[name] = fields
    return Snapshot(
        _version(version, settings.store_version_key),
        policies,
        {name: _version(versions.get(name), settings.policy_versions_key, name)
         for name in raw},
        invalid,
    )


class PolicyStore:
    """Write access to the policies in Redis (what ``zml policies`` uses).

    Nothing here validates: callers validate against the fleet registry first (see
    :func:`zml_redis.cli.validate`).
    """

    def __init__(self, url: str, prefix: str = "zml", timeout_s: float = 2.0) -> None:
        """Connect lazily to ``url``; a URL redis-py cannot use, an empty ``prefix`` or a
        ``timeout_s`` that is not a number of seconds above 0 and at most
        :data:`~zml_redis.settings.URL_TIMEOUT_MAX_S` raises
        :class:`~zml_redis.settings.SettingsError` (never showing the password)."""
        self.settings = Settings(url=url, prefix=prefix)
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not (math.isfinite(timeout_s) and 0 < timeout_s <= URL_TIMEOUT_MAX_S)):
            raise SettingsError(
                f"PolicyStore(timeout_s={timeout_s!r}) is not a number of seconds above 0 and "
                f"at most {URL_TIMEOUT_MAX_S:g}: pass one (the default is 2)",
                field="timeout_s", value=repr(timeout_s))
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True,
        )
        self._push = self.client.register_script(scripts.PUSH)
        self._remove = self.client.register_script(scripts.REMOVE)

    def __enter__(self) -> PolicyStore:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.client.close()

    def _keys(self) -> list[str]:
        s = self.settings
        return [s.policies_key, s.policy_versions_key, s.store_version_key]

    def push(self, policies: Mapping[str, Mapping[str, Any]]) -> tuple[int, dict[str, int]]:
        """Write (create or replace) every policy at once; return the store's new version and
        each policy's."""
        if not policies:
            raise StoreError("nothing to push")
        args: list[str] = [self.settings.policies_channel]
        for name, fields in policies.items():
            args += [name, json.dumps(dict(fields), sort_keys=True)]
        version, versions = self._run(self._push, args)
        return int(version), {n: int(v) for n, v in zip(policies, versions, strict=True)}

    def _run(self, script: Any, args: list[str]) -> Any:
        try:
            return script(keys=self._keys(), args=args)
        except ResponseError as exc:
            mark, _, rest = str(exc).partition(" ")
            if mark != scripts.CORRUPT_MARK:
                raise
            key, _, why = rest.partition(" ")
            raise CorruptStoreError(
                f"{key} {why} (edited by hand?); nothing was written: repair or delete it "
                "(redis-cli), then push again", key,
            ) from None

    def remove(self, names: Iterable[str]) -> tuple[int, dict[str, int]]:
        """Remove policies, all or none (StoreError naming a missing one)."""
        wanted = list(dict.fromkeys(names))
        if not wanted:
            raise StoreError("nothing to remove")
        version, result = self._run(self._remove, [self.settings.policies_channel, *wanted])
        if int(version) == 0:
            raise StoreError(f"no policy {result!r} in the store; nothing was removed")
        return int(version), {n: int(v) for n, v in zip(wanted, result, strict=True)}

    def snapshot(self) -> Snapshot:
        """Every policy with its version, and the store's version."""
        return read_snapshot(self.client, self.settings)


def _lost(current: Snapshot, new: Snapshot) -> bool:
    """Whether ``new`` looks like a store that lost its data rather than one emptied by
    ``rm`` (which bumps the version): empty, at a lower version."""
    return new.version < current.version and not new.policies and not new.invalid


class RedisPolicySource:
    """A :class:`zml.plugins.PolicySource` with ``subscribe``: an in-memory mirror of the
    store, read again by the hub's listener when the store announces a change."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        settings = hub.settings
        self.name = f"redis:{settings.where}/{settings.prefix}"
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None
        self._lost_reported = False
        self._corrupt_reported: str | None = None
        self._subscribers: list[Callable[[], Callable[[], None] | None]] = []
        self._read_at_build()
        hub.on_message(settings.policies_channel, self._changed)
        hub.on_subscribed(self._resubscribed)
        if hub.subscribed.is_set():  # a change announced before the handler was added
            self._read_at_build()
        hub.start()

    def _read_at_build(self) -> None:
        """Read the store while a client is built, on the builder's thread: one try within
        ``settings.build_timeout_s`` (to connect and per reply; see :meth:`Hub.build_client`).
        A Redis that is down or hangs is an outage (one warning; the client starts without
        the store's policies, and gets them when the listener is subscribed again); a corrupt
        store fails the build with a ``zml.PolicyConfigError``."""
        hub = self.hub
        if not hub.connected:  # already known to be down: no I/O, as for acquisitions
            return
        client = hub.build_client()
        try:
            self._reload(client)
        except redis.RedisError as exc:  # down at start: no policies from it until it is back
            hub.failed(exc)
        except CorruptStoreError as exc:
            raise zml.PolicyConfigError(
                f"policy source {self.name!r}: {exc}", field=exc.key, source=self.name,
            ) from None
        finally:
            client.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"RedisPolicySource({self.name!r}, version={self.version})"

    @property
    def version(self) -> int:
        """The store version mirrored (0: never read)."""
        snapshot = self._snapshot
        return 0 if snapshot is None else snapshot.version

    def versions(self) -> dict[str, int]:
        """Each mirrored policy's version."""
        snapshot = self._snapshot
        return {} if snapshot is None else dict(snapshot.versions)

    def reload(self) -> bool:
        """Read the store again; if it changed, call the subscribers. Returns whether it did.
        (Through the hub's background client: up to 2 s per try, two tries.)"""
        return self._reload(self.hub.client)

    def _reload(self, client: redis.Redis) -> bool:
        snapshot = read_snapshot(client, self.hub.settings)
        with self._lock:
            current = self._snapshot
            if current is not None and current == snapshot:
                return False
            if current is not None and current.policies and _lost(current, snapshot):
                if not self._lost_reported:
                    self._lost_reported = True
                    log.warning(
                        "zml-redis: the policy store %s is empty at version %d, older than the "
                        "version %d read before: Redis lost its data (restarted without "
                        "persistence?); keeping what was read before (%d policies) until the next push",
                        self.name, snapshot.version, current.version, len(current.policies),
                    )
                return False
            self._snapshot = snapshot
            self._lost_reported = False
        self._notify()
        return True

    def _reload_or_keep(self) -> None:
        """Reload; a store made corrupt by hand meanwhile is reported (once per key) and the
        policies read before are kept, as for a store that lost its data."""
        try:
            self.reload()
        except CorruptStoreError as exc:
            if self._corrupt_reported != exc.key:
                self._corrupt_reported = exc.key
                log.warning("zml-redis: policy store %s: %s; keeping what was read before "
                            "(%d policies)", self.name, exc, len(self.list()))
            return
        self._corrupt_reported = None

    def _changed(self, data: str) -> None:
        self._reload_or_keep()

    def _resubscribed(self) -> None:
        self._reload_or_keep()  # changes announced while the listener was away

    def _notify(self) -> None:
        with self._lock:
            alive = [(ref, ref()) for ref in self._subscribers]
            self._subscribers = [ref for ref, callback in alive if callback is not None]
        for _, callback in alive:
            if callback is not None:
                callback()

    # --- PolicySource ----------------------------------------------------------------------------

    def get(self, name: str) -> dict[str, Any] | None:
        """The mirrored fields of policy ``name`` (with ``name``), or None."""
        snapshot = self._snapshot
        if snapshot is None:
            return None
        fields = snapshot.policies.get(name)
        if fields is None and name in snapshot.invalid:
            raise zml.PolicyConfigError(
                f"policy source {self.name!r}: the stored fields of policy {name!r} are not a "
                "JSON object; push it again with 'zml policies push'",
                field="policy",
                value=name,
                source=self.name,
            )
        return None if fields is None else {**fields, "name": name}

    def list(self) -> list[str]:
        """The mirrored policy names, sorted."""
        snapshot = self._snapshot
        return [] if snapshot is None else sorted([*snapshot.policies, *snapshot.invalid])

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from the listener thread) after each change of the store.

        Bound methods are held weakly, so a client that goes away is not kept alive by it.
        """
        ref: Callable[[], Callable[[], None] | None]
        if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
            ref = weakref.WeakMethod(callback)
        else:
            ref = _Strong(callback)
        with self._lock:
            self._subscribers.append(ref)


class _Strong:
    """A strong reference that looks like a weak one."""

    __slots__ = ("callback",)

    def __init__(self, callback: Callable[[], None]) -> None:
        self.callback = callback

    def __call__(self) -> Callable[[], None]:
        return self.callback
