"""One process's link to one Redis: connections, background threads, and the shared state.

A :class:`Hub` exists once per process and per :class:`~zml_redis.settings.Settings`
(:mod:`zml_redis.hubs` keeps them); every
client's ledger (:mod:`zml_redis.ledger`) and the policy source (:mod:`zml_redis.policies`)
of that process go through it.

What runs where:

* **the request's path**: one ``EVALSHA`` of the acquire script per dispatch, on a
  connection of the calling thread's own with a short socket timeout (sync clients), or of a
  small thread pool (``zml-redis-acquire``) that async clients await. Nothing else:
  ``release`` and health events are queued for the worker.
* **a client's build**: the policy source reads the store once (:meth:`Hub.build_client`:
  one try, ``Settings.build_timeout_s``, 0.25 s by default, to connect and per reply), so a
  Redis that hangs delays a build by about that much and the client starts as while it is
  down.
* **the worker thread** (``zml-redis-worker``): sends queued releases and health events in
  one pipeline as soon as they arrive (the release script deletes the leases and, for nodes
  that were full, publishes their new counts, so other processes see freed slots at once); renews the leases the
  process holds every TTL/3; every ``sync_s`` reads each node's global lease count into the
  routing state of every client (which also catches leases that expired); while Redis is down,
  pings it every 0.5 s and resumes.
* **the listener thread** (``zml-redis-listener``): a pub/sub connection on the events and
  policy channels; applies other processes' health events and lease counts to this process's
  fleets, and tells the policy source about store changes.

Degradation: the first refused or dropped connection (or three acquire timeouts in a row)
marks the hub *down* and logs ONE warning (logger ``zml.redis``). (A lease key edited by hand
into another type is no outage: one warning names it, and only that node's slots are counted
locally.) While down, every acquire answers True at once without I/O (the process's own
slot accounting still holds, as without the plugin) and the leases granted meanwhile are kept
locally; when Redis answers again, they are written back, the policy store is read again, and
one INFO line says shared state resumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.exceptions import NoScriptError, ResponseError, TimeoutError as RedisTimeoutError
from redis.retry import Retry

from zml.fleet import Fleet, LoadMark, NodeState, report_load as merge_load

from . import scripts
from .settings import Settings, scrub

__all__ = ["Attached", "Hub", "report_load"]

log = logging.getLogger("zml.redis")

RECONNECT_S = 0.5
"""While Redis is down: how often the worker tries it again."""
BACKGROUND_TIMEOUT_S = 2.0
"""Socket timeout of the worker's and the listener's commands (not on the request path)."""
MAX_PENDING = 10_000
"""Releases and health events waiting for the worker, at most (older ones are dropped: an
unreleased lease expires by itself within its TTL)."""
RENEW_CHUNK = 500
TIMEOUTS_TO_DOWN = 3
BATCH_S = 0.002
"""The worker waits this long after being woken, to send what arrives meanwhile at once."""
ACQUIRE_THREADS = 8
"""Threads that run async clients' lease acquisitions (a round trip each, ~0.1 ms)."""


class Attached(Protocol):
    """What the hub needs of a client's ledger: its fleet and each node's lease key."""

    @property
    def fleet(self) -> Fleet:
        """The client's fleet."""
        ...

    @property
    def keys(self) -> Mapping[NodeState, str]:
        """Each node of the fleet, with its lease key."""
        ...


def report_load(node: NodeState, count: int, now: float, mark: LoadMark | None = None) -> None:
    """Make ``count`` (the leases every process holds on ``node``) the node's reported load,
    without a probe's effect on health (a lease count is no liveness observation). ``mark``,
    taken before the count was read, takes off this process's requests that ended since."""
    merge_load(node, now, count, mark)


_SCRIPTS = {name: getattr(scripts, name) for name in ("ACQUIRE", "RELEASE", "RENEW", "LOADS")}
_SHA = {name: hashlib.sha1(source.encode()).hexdigest() for name, source in _SCRIPTS.items()}


def _round_trip(conn: Any, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
    """One write of every command, then every reply in order (error replies as exceptions)."""
    conn.send_packed_command(conn.pack_commands(commands))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(conn.read_response())
        except ResponseError as exc:  # the reply was read whole: the next one follows
            replies.append(exc)
    return replies


class Hub:
    """Connections, threads and shared state for one Redis, in one process (see the module
    docstring). Build it with :func:`hub_for`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.origin = uuid.uuid4().hex
        """This process's id in health events (its own events are not applied twice)."""
        self._conn_kwargs: dict[str, Any] = {
            **parse_url(settings.url),  # type: ignore[no-untyped-call]
            "socket_connect_timeout": settings.connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),
            "decode_responses": True,
        }
        self._local = threading.local()
        self._epoch = 0
        """Bumped when Redis comes back: connections opened before reconnect first."""
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self._slow = redis.Redis.from_url(  # one retry: a pooled connection may be stale
            settings.url, socket_timeout=BACKGROUND_TIMEOUT_S,
            socket_connect_timeout=BACKGROUND_TIMEOUT_S, retry=Retry(NoBackoff(), 1),
            decode_responses=True,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, None]] = {}
        self._capacity: dict[str, int] = {}
        """Each lease key's capacity (the release script announces slots freed on full nodes)."""
        self._releases: deque[tuple[str, str]] = deque(maxlen=MAX_PENDING)
        self._events: deque[str] = deque(maxlen=MAX_PENDING)
        self._tainted: set[str] = set()
        self._ledgers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handlers: dict[str, list[Callable[[str], None]]] = {
            settings.events_channel: [self._on_event],
            settings.policies_channel: [],
        }
        self._subscribed_callbacks: list[Callable[[], None]] = []
        self._down = False
        self._wrong_keys: set[str | None] = set()  # reported by refused()
        self._timeouts = 0
        self.outages = 0
        """How many times Redis was found unreachable (each logged once)."""
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self.subscribed = threading.Event()
        """Set while the listener is subscribed (tests wait on it)."""

    def __repr__(self) -> str:
        state = "down" if self._down else "up"
        return f"Hub({self.settings.where!r}, prefix={self.settings.prefix!r}, {state})"

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """False while Redis is considered unreachable."""
        return not self._down

    def start(self) -> None:
        """Start the worker and listener threads (idempotent)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        for name, target in (("zml-redis-worker", self._work),
                             ("zml-redis-listener", self._listen)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def close(self, timeout: float = 2.0) -> None:
        """Stop the threads, send the releases still queued (best effort), close connections.

        Waits at most ``timeout`` in all for the threads to finish what they are sending; not
        at all while Redis is down (then nothing can be sent, and a thread waiting on a Redis
        that hangs would hold the process's exit for its socket timeout: the threads are
        daemons, and stop by themselves)."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + (0.0 if self._down else timeout)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not self._down:
            with contextlib.suppress(Exception):
                self._flush()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(Exception):
                conn.disconnect()
        self._slow.close()

    def attach(self, ledger: Attached) -> None:
        """Feed ``ledger``'s fleet with global loads and health events (while it lives)."""
        self._ledgers.add(ledger)
        self.start()

    def on_message(self, channel: str, handler: Callable[[str], None]) -> None:
        """Call ``handler(data)`` (listener thread) for each message on a hub channel."""
        self._handlers[channel].append(handler)

    def on_subscribed(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (listener thread) after each (re)subscription: what was
        published while the listener was not subscribed has to be read again."""
        self._subscribed_callbacks.append(callback)

    @property
    def client(self) -> redis.Redis:
        """A sync client for background reads and writes (socket timeout 2 s, one retry)."""
        return self._slow

    def build_client(self) -> redis.Redis:
        """A new sync client for the reads made while a client is built, on the builder's
        thread (the event loop, for an ``AsyncClient``): one try, and
        ``settings.build_timeout_s`` (0.25 s by default, 1 s at most) to connect and for
        each reply,
        whatever the URL's own timeouts, so a Redis that hangs delays a build that long, not
        the 2 s (twice) of :attr:`client`. The caller closes it
        (``client.connection_pool.disconnect()``)."""
        timeout = self.settings.build_timeout_s
        kwargs = {**self._conn_kwargs, "socket_timeout": timeout,
                  "socket_connect_timeout": timeout}
        return redis.Redis(connection_pool=redis.ConnectionPool(**kwargs))

    # --- leases --------------------------------------------------------------------------------

    def acquire(self, node: NodeState, key: str, capacity: int, lease_id: str) -> bool:
        """Take a lease on ``key`` if fewer than ``capacity`` are held (True when down)."""
        if self._down:
            return self._hold(key, lease_id)
        mark = node.fleet.load_mark(node)
        try:
            count = int(self._execute(("EVALSHA", _SHA["ACQUIRE"], 1, key, lease_id, capacity,
                                       self.settings.lease_ttl_ms))[0])
        except Exception as exc:
            return self._acquire_failed(exc, key, lease_id)
        return self._granted(node, key, lease_id, count, mark)

    def _connection(self, timeout: float | None = None) -> Any:
        """This thread's own connection (socket timeout: the acquire timeout, or ``timeout``).

        Commands go straight through it, without the client's command layer and connection
        pool (retries, events, pool metrics): a third of the CPU of ``Script.__call__`` on the
        path of every request.
        """
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None:
            kwargs = dict(self._conn_kwargs)
            connection_class = kwargs.pop("connection_class", redis.Connection)
            kwargs["socket_timeout"] = timeout or self.settings.timeout_s
            conn = local.conn = connection_class(**kwargs)
            local.epoch = self._epoch
            with self._lock:
                self._connections.add(conn)
        elif local.epoch != self._epoch:
            # Opened before an outage: its socket may be dead (Redis restarted). The thread
            # that owns it drops it, so no other thread's command is cut.
            conn.disconnect()
            local.epoch = self._epoch
        return conn

    def _execute(self, *commands: tuple[Any, ...], timeout: float | None = None) -> list[Any]:
        """Send ``commands`` in one write on this thread's connection and return their replies
        (raising the first error). A script Redis does not have (it restarted) is loaded and
        its command sent again."""
        conn = self._connection(timeout)
        try:
            replies = _round_trip(conn, commands)
            missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
            if missing:
                _round_trip(conn, [("SCRIPT", "LOAD", source) for source in _SCRIPTS.values()])
                again = _round_trip(conn, [commands[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
        except BaseException:
            conn.disconnect()  # in an unknown state: the next command connects again
            raise
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def aacquire(self, node: NodeState, key: str, capacity: int, lease_id: str) -> bool:
        """As :meth:`acquire`, for async clients: the round trip runs on the hub's small
        thread pool, so its timeout is the socket's, measured by the kernel. (A timeout
        measured by a busy event loop fires late *and* spuriously: a reply that arrived in
        time is dropped because the loop ran the timer first.)"""
        if self._down:
            return self._hold(key, lease_id)
        future = self._pool().submit(self.acquire, node, key, capacity, lease_id)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller went away; if the lease was granted meanwhile, give it back.
            future.add_done_callback(lambda _f: self.release(key, lease_id))
            raise

    def _pool(self) -> ThreadPoolExecutor:
        pool = self._executor
        if pool is None:
            with self._lock:
                pool = self._executor
                if pool is None:
                    pool = self._executor = ThreadPoolExecutor(
                        ACQUIRE_THREADS, thread_name_prefix="zml-redis-acquire")
        return pool

    def release(self, key: str, lease_id: str) -> None:
        """Give a lease back: forget it now, delete it from Redis in the worker."""
        with self._lock:
            leases = self._held.get(key)
            if leases is None or lease_id not in leases:
                return
            del leases[lease_id]
            if not leases:
                del self._held[key]
        self._drop(key, lease_id)

    def held(self) -> dict[str, list[str]]:
        """The leases this process holds, by lease key (a copy)."""
        with self._lock:
            return {key: list(ids) for key, ids in self._held.items()}

    def _acquire_failed(self, exc: Exception, key: str, lease_id: str) -> bool:
        # A lone slow answer (a busy event loop, a GC pause) is not an outage: the request
        # goes on, and Redis is declared down after TIMEOUTS_TO_DOWN timeouts in a row, or at
        # once when it refuses or drops the connection. The lease may have been written: it
        # is held (renewed, released) like a granted one.
        if isinstance(exc, RedisTimeoutError):
            with self._lock:
                self._timeouts += 1
                lone = self._timeouts < TIMEOUTS_TO_DOWN
            if lone:
                return self._hold(key, lease_id)
        self.failed(exc, key)
        return self._hold(key, lease_id)

    def _granted(self, node: NodeState, key: str, lease_id: str, count: int,
                 mark: LoadMark) -> bool:
        self._timeouts = 0
        self._capacity[key] = node.max_concurrency + node.max_queue
        if count < 0:
            return False
        self._hold(key, lease_id)
        report_load(node, count, time.monotonic(), mark)
        return True

    def _hold(self, key: str, lease_id: str) -> bool:
        with self._lock:
            self._held.setdefault(key, {})[lease_id] = None
        return True

    def _drop(self, key: str, lease_id: str) -> None:
        self._releases.append((key, lease_id))
        self._wake.set()

    # --- health --------------------------------------------------------------------------------

    def publish_health(self, node_id: str, ok: bool) -> None:
        """Tell the other processes that a call on ``node_id`` failed (or, after failures,
        succeeded again). Queued for the worker; never blocks."""
        with self._lock:
            if ok:
                if node_id not in self._tainted:
                    return  # healthy nodes' successes are not news
                self._tainted.discard(node_id)
            else:
                self._tainted.add(node_id)
        if self._down:
            return
        self._events.append(json.dumps({"o": self.origin, "n": node_id, "ok": ok}))
        self._wake.set()

    def _on_event(self, data: str) -> None:
        event = json.loads(data)
        if event.get("o") == self.origin:
            return
        loads = event.get("loads")
        if loads is not None:  # another process released leases: slots freed
            now = time.monotonic()
            for ledger in list(self._ledgers):
                for node, key in ledger.keys.items():
                    count = loads.get(key)
                    if count is not None:
                        report_load(node, int(count), now)
            return
        node_id = str(event["n"])
        ok = bool(event["ok"])
        with self._lock:
            if ok:
                self._tainted.discard(node_id)
            else:
                self._tainted.add(node_id)
        now = time.monotonic()
        seen: set[int] = set()
        for ledger in list(self._ledgers):
            fleet: Fleet = ledger.fleet
            try:
                node = fleet.node(node_id)
            except KeyError:
                continue
            if id(node) in seen:  # clients of one process share node state
                continue
            seen.add(id(node))
            if ok:
                fleet.record_success(node, now, None, None)
            else:
                fleet.record_failure(node, now)

    # --- up and down ---------------------------------------------------------------------------

    def failed(self, exc: BaseException, key: str | None = None) -> None:
        """A Redis command (on ``key``, if known) failed: go down (one warning per outage);
        the worker retries. A key of the wrong type is no outage: see :meth:`refused`."""
        if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
            self.refused(exc, key)
            return
        with self._lock:
            if self._down or self._stop.is_set():
                return
            self._down = True
            self.outages += 1
            self._events.clear()
        state = ("refuses the plugin's commands" if isinstance(exc, ResponseError)
                 else "is unreachable")
        log.warning(
            "zml-redis: Redis at %s %s (%s: %s); serving with this process's own fleet state "
            "until it is back (retrying every %.1f s)",
            self.settings.where, state, type(exc).__name__, scrub(str(exc), self.settings.url),
            RECONNECT_S,
        )
        self._wake.set()

    def refused(self, exc: BaseException, key: str | None = None) -> None:
        """``key`` (None: some lease key) holds the wrong type of value, edited by hand: Redis
        is reachable, so the hub stays up; one warning per key."""
        with self._lock:
            if key in self._wrong_keys:
                return
            self._wrong_keys.add(key)
        log.warning("zml-redis: at %s, %s holds the wrong type of value (edited by hand?): "
                    "delete it; until then this process counts that node's slots on its own "
                    "(%s)", self.settings.where, repr(key) if key else "a lease key",
                    scrub(str(exc), self.settings.url))

    def _resume(self) -> None:
        self._execute(("PING",), timeout=BACKGROUND_TIMEOUT_S)
        with self._lock:
            self._epoch += 1
            self._down = False
            self._timeouts = 0
        # Leases taken while down (and those Redis lost if it restarted empty) count again.
        self._renew_held("ADD")
        self._flush()
        log.info("zml-redis: Redis at %s is reachable again; shared fleet state resumed",
                 self.settings.where)

    # --- the worker ------------------------------------------------------------------------------

    def _work(self) -> None:
        now = time.monotonic()
        next_renew = now + self.settings.renew_s
        next_sync = now
        next_try = now
        while not self._stop.is_set():
            now = time.monotonic()
            if self._down:
                if now >= next_try:
                    next_try = now + RECONNECT_S
                    try:
                        self._resume()
                        next_sync = next_renew = now
                    except Exception as exc:
                        log.debug("zml-redis: still unreachable: %s", exc)
                        with self._lock:
                            self._down = True
                        self._events.clear()
                timeout = next_try - time.monotonic()
            else:
                try:
                    self._flush()
                    if now >= next_renew:
                        next_renew = now + self.settings.renew_s
                        self._renew_held("XX")
                    if now >= next_sync:
                        next_sync = now + self.settings.sync_s
                        self._sync_loads()
                except Exception as exc:
                    self.failed(exc)
                    if self._down:
                        next_try = time.monotonic() + RECONNECT_S
                        continue
                timeout = min(next_renew, next_sync) - time.monotonic()
            if self._wake.wait(max(0.0, timeout)) and not self._stop.is_set():
                # Let releases that arrive together go in one round trip (and leave the
                # requests' threads the interpreter meanwhile).
                time.sleep(BATCH_S)
            self._wake.clear()

    def _flush(self) -> None:
        releases: dict[str, list[str]] = {}
        events: list[str] = []
        while True:
            try:
                key, lease_id = self._releases.popleft()
            except IndexError:
                break
            releases.setdefault(key, []).append(lease_id)
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                break
        commands: list[tuple[Any, ...]] = []
        if releases:
            args: list[Any] = [self.settings.events_channel, self.origin]
            for key, ids in releases.items():
                args += [self._capacity.get(key, 0), len(ids), *ids]
            commands.append(("EVALSHA", _SHA["RELEASE"], len(releases), *releases, *args))
        commands += [("PUBLISH", self.settings.events_channel, event) for event in events]
        if commands:
            self._execute(*commands, timeout=BACKGROUND_TIMEOUT_S)

    def _renew_held(self, mode: str) -> None:
        ttl = self.settings.lease_ttl_ms
        commands = [
            ("EVALSHA", _SHA["RENEW"], 1, key, ttl, mode, *ids[i:i + RENEW_CHUNK])
            for key, ids in self.held().items()
            for i in range(0, len(ids), RENEW_CHUNK)
        ]
        if commands:
            self._execute(*commands, timeout=BACKGROUND_TIMEOUT_S)

    def _sync_loads(self) -> None:
        ledgers = list(self._ledgers)
        if not ledgers:
            return
        keys: dict[str, None] = {}
        for ledger in ledgers:
            keys.update(dict.fromkeys(ledger.keys.values()))
        order = list(keys)
        marks = {node: node.fleet.load_mark(node) for ledger in ledgers for node in ledger.keys}
        counts = self._execute(("EVALSHA", _SHA["LOADS"], len(order), *order),
                               timeout=BACKGROUND_TIMEOUT_S)[0]
        by_key = dict(zip(order, counts, strict=True))
        now = time.monotonic()
        for ledger in ledgers:
            for node, key in ledger.keys.items():
                count = int(by_key[key])
                if count >= 0:  # -1: not a sorted set (see LOADS)
                    report_load(node, count, now, marks[node])

    # --- the listener ----------------------------------------------------------------------------

    def _listen(self) -> None:
        client = redis.Redis.from_url(
            self.settings.url, socket_timeout=BACKGROUND_TIMEOUT_S,
            socket_connect_timeout=BACKGROUND_TIMEOUT_S, retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        try:
            while not self._stop.is_set():
                pubsub = client.pubsub(  # type: ignore[no-untyped-call]
                    ignore_subscribe_messages=True)
                try:
                    pubsub.subscribe(*self._handlers)
                    self.subscribed.set()
                    for callback in list(self._subscribed_callbacks):
                        self._safely(callback)
                    while not self._stop.is_set():
                        message = pubsub.get_message(timeout=0.25)
                        if message is not None and message.get("type") == "message":
                            for handler in list(self._handlers.get(message["channel"], ())):
                                self._safely(handler, str(message["data"]))
                except Exception as exc:
                    if not self._stop.is_set():
                        self.failed(exc)
                finally:
                    self.subscribed.clear()
                    with contextlib.suppress(Exception):
                        pubsub.close()
                self._stop.wait(RECONNECT_S)
        finally:
            client.close()

    def _safely(self, function: Callable[..., None], *args: Any) -> None:
        try:
            function(*args)
        except redis.RedisError as exc:
            self.failed(exc)
        except Exception:
            log.exception("zml-redis: a message handler failed")
