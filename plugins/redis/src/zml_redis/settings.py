"""Where Redis is and how the plugin uses it: read from the environment when a client is built.

===========================  ==========  ===========  ====================================
variable                     default     range        meaning
===========================  ==========  ===========  ====================================
``ZML_REDIS_URL``            (unset)                  ``redis://[user:password@]host:port/db``;
                                                      unset: the plugin does nothing
``ZML_REDIS_PREFIX``         ``zml``                  prefix of every key and channel (one
                                                      per fleet)
``ZML_REDIS_LEASE_TTL_S``    ``10``      0.2-3600     a slot lease expires this long after
                                                      its last renewal (held leases are
                                                      renewed every TTL/3)
``ZML_REDIS_TIMEOUT_MS``     ``100``     1-2000       socket timeout of a lease acquisition;
                                                      past it the request goes on with
                                                      local state
``ZML_REDIS_SYNC_S``         ``0.5``     0.01-60      how often each process reads every
                                                      node's global lease count into its
                                                      routing state (releases are announced
                                                      at once besides)
``ZML_REDIS_LEDGER``         ``1``                    ``0``/``false``/``no``/``off``: share
                                                      policies only, not slots and health
                                                      (``1``/``true``/``yes``/``on``: share
                                                      all)
===========================  ==========  ===========  ====================================

The ranges are inclusive; their upper ends keep every wait on Redis bounded:

* ``ZML_REDIS_LEASE_TTL_S`` at most an hour (:data:`LEASE_TTL_MAX_S`): a process that dies
  keeps its slots for up to one TTL, and held leases are renewed every TTL/3 anyway, so a long
  request never needs a long TTL. (Far larger values break outright: at ``1e15`` Redis refuses
  the acquire script's ``PEXPIRE`` of 3 TTLs, after the lease was written.)
* ``ZML_REDIS_TIMEOUT_MS`` at most 2 s (:data:`TIMEOUT_MAX_MS`), the timeout of the plugin's
  own background commands: a short timeout is what lets a request facing a Redis that hangs go
  on with local accounting instead of waiting (three timeouts in a row mark Redis down).
* ``ZML_REDIS_SYNC_S`` at most a minute (:data:`SYNC_MAX_S`): it bounds how long a process
  routes on stale global loads, and how late it sees slots freed by leases that expired (a
  crashed process's).
* a URL's ``socket_timeout`` or ``socket_connect_timeout`` at most a minute
  (:data:`URL_TIMEOUT_MAX_S`): it replaces the 2 s timeout of the listener, of the policy
  store's reads and of ``zml policies``.

The lower ends: a TTL under 0.2 s would need renewals more often than every 67 ms, a timeout
under 1 ms leaves a loaded Redis no time to answer, and syncing more often than every 10 ms
loads Redis for nothing.

Every value is checked when a client is built: a URL redis-py could not use (a bad port, a
``#`` or ``/`` left unencoded in a password, an unknown or malformed query parameter, a
timeout that is not a number of seconds above 0 and up to 60), a number that is not finite or
is out of its range, or a ``ZML_REDIS_LEDGER`` that is none of its on/off spellings (case does
not matter; empty: the default) fails it with a :class:`SettingsError` (a
``zml.PolicyConfigError``) naming the variable, the value, what is accepted and how to fix
it. :class:`Settings` built in code is held to the same ranges (``timeout_s`` in seconds)
and fails the same way, naming the field. No message, log line or repr shows a password: :func:`redact` hides ``user:password@`` and
the values of query parameters such as ``?password=`` (redis-py's form for ``unix://`` sockets).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

import zml

from . import ENV_URL

__all__ = [
    "BUILD_TIMEOUT_MAX_S",
    "BUILD_TIMEOUT_S",
    "ENV_LEDGER",
    "ENV_PREFIX",
    "ENV_SYNC",
    "ENV_TIMEOUT",
    "ENV_TTL",
    "ENV_URL",
    "LEASE_TTL_MAX_S",
    "LEASE_TTL_MIN_S",
    "SYNC_MAX_S",
    "SYNC_MIN_S",
    "TIMEOUT_MAX_MS",
    "TIMEOUT_MIN_MS",
    "URL_TIMEOUT_MAX_S",
    "Settings",
    "SettingsError",
    "check_url",
    "redact",
    "scrub",
]

ENV_PREFIX = "ZML_REDIS_PREFIX"
ENV_TTL = "ZML_REDIS_LEASE_TTL_S"
ENV_TIMEOUT = "ZML_REDIS_TIMEOUT_MS"
ENV_SYNC = "ZML_REDIS_SYNC_S"
ENV_LEDGER = "ZML_REDIS_LEDGER"

BUILD_TIMEOUT_S = 0.25
"""Least timeout of the read of the policy store made while a client is built (see
:attr:`Settings.build_timeout_s`)."""
BUILD_TIMEOUT_MAX_S = 1.0
"""Most timeout of that read, whatever ``ZML_REDIS_TIMEOUT_MS`` says."""

LEASE_TTL_MIN_S = 0.2
"""Least ``ZML_REDIS_LEASE_TTL_S`` (leases are renewed every TTL/3)."""
LEASE_TTL_MAX_S = 3600.0
"""Most ``ZML_REDIS_LEASE_TTL_S``: a crashed process's slots come back within an hour."""
TIMEOUT_MIN_MS = 1.0
"""Least ``ZML_REDIS_TIMEOUT_MS``."""
TIMEOUT_MAX_MS = 2000.0
"""Most ``ZML_REDIS_TIMEOUT_MS``: no request waits on Redis longer than the plugin's own
background commands do (``hub.BACKGROUND_TIMEOUT_S``); a slower Redis is treated as down."""
SYNC_MIN_S = 0.01
"""Least ``ZML_REDIS_SYNC_S``."""
SYNC_MAX_S = 60.0
"""Most ``ZML_REDIS_SYNC_S``: global loads are read at least once a minute."""
URL_TIMEOUT_MAX_S = 60.0
"""Most timeout a URL may set (``?socket_timeout=``, ``?socket_connect_timeout=``), in
seconds."""

SECRET_WORDS = ("pass", "token", "secret")
"""A query parameter whose name holds one of these is a secret (``?password=``: redis-py's
form for ``unix://`` sockets); its value is never shown."""
TIMEOUT_PARAMETERS = ("socket_timeout", "socket_connect_timeout", "timeout")
ENCODE_HINT = "percent-encode '/', '?', '#' and '@' in a password (%2F, %3F, %23, %40)"


class SettingsError(zml.PolicyConfigError, ValueError):
    """A malformed ``ZML_REDIS_*`` value or Redis URL (never showing a password). ``field``
    names the variable or option; also a ValueError, as before it was typed."""


def _secret_name(name: str) -> bool:
    name = unquote_plus(name).lower()
    return any(word in name for word in SECRET_WORDS)


def _redact_query(query: str) -> str:
    items = []
    for item in query.split("&"):
        name, eq, _ = item.partition("=")
        items.append(f"{name}=***" if eq and _secret_name(name) else item)
    return "&".join(items)


def _suspect(url: str) -> bool:
    """Whether ``url`` does not split where redis-py will split it: a password holding one
    of ``/?#`` ends the user info early, and the rest of it is taken for host, path or query."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a malformed port)
    except ValueError:
        return True
    return "#" in url or "@" in parts.path + parts.query


def redact(url: str) -> str:
    """``url`` without its secrets, for messages, reprs and source names: the password of
    ``user:password@`` and the values of query parameters named like ``password``, ``token``
    or ``secret`` become ``***``. A URL that does not parse cleanly loses everything up to its
    last ``@`` (where a password could be) and its ``#fragment``. Never raises."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if not sep or _suspect(url):
        rest = rest.rpartition("@")[2]
        rest, hashmark, _ = rest.partition("#")
        head, qmark, query = rest.partition("?")
        userinfo = "***@" if "@" in url else ""
        return (f"{scheme}{sep}{userinfo}{head}{qmark}{_redact_query(query)}"
                + ("#***" if hashmark else ""))
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        host = netloc.rpartition("@")[2]
        netloc = f"{parts.username}:***@{host}" if parts.username else f":***@{host}"
    query = f"?{_redact_query(parts.query)}" if parts.query else ""
    return f"{scheme}://{netloc}{parts.path}{query}"


def _secrets(url: str) -> list[str]:
    found: list[str] = []
    _, _, rest = url.partition("://")
    if "@" in rest:
        found.append(rest.rpartition("@")[0])
    with_password = rest.rpartition("@")[0].partition(":")[2]
    found += [with_password, unquote(with_password)]
    for item in rest.partition("?")[2].split("&"):
        name, eq, value = item.partition("=")
        if eq and _secret_name(name):
            found += [value, unquote_plus(value)]
    return sorted({s for s in found if len(s) >= 2}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """``text`` (an error message about ``url``) with ``url``'s secrets replaced by ``***``."""
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def check_url(url: str, name: str = ENV_URL) -> str:
    """``url`` if redis-py can connect with it, else :class:`SettingsError` naming ``name``
    (the variable or option), what is wrong and how to fix it, never the password."""
    shown = f"{name}={redact(url)!r}"

    def error(problem: str) -> SettingsError:
        return SettingsError(f"{shown} {problem}", field=name, value=redact(url))

    scheme = url.partition("://")[0]
    if scheme not in ("redis", "rediss", "unix") or "://" not in url:
        raise error("is not a redis://, rediss:// or unix:// URL "
                    "(redis://[user:password@]host:port/db)")
    if "#" in url:
        raise error(f"contains '#', which would end the URL there: {ENCODE_HINT}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise error(f"has no valid host:port (a port is 1-65535; {ENCODE_HINT})") from None
    if port == 0:
        raise error("has port 0: a port is 1-65535")
    if scheme != "unix":
        if "@" in parts.path:
            raise error(f"has an '@' after the host: {ENCODE_HINT}")
        db = unquote(parts.path).replace("/", "")
        if db and not db.isdigit():
            raise error(f"has path {parts.path!r}: the path is the database number, as in /0")
    from redis.connection import Connection, parse_url
    from redis.exceptions import RedisError

    try:
        kwargs: dict[str, Any] = parse_url(url)  # type: ignore[no-untyped-call]
        connection_class = kwargs.pop("connection_class", Connection)
        connection_class(**kwargs)  # checks the query parameters' names; does not connect
    except TypeError as exc:
        raise error(f"has a query parameter redis-py does not know ({scrub(str(exc), url)})"
                    ) from None
    except (ValueError, RedisError) as exc:
        raise error(f"is not usable by redis-py: {scrub(str(exc), url)}") from None
    for parameter in TIMEOUT_PARAMETERS:
        value = kwargs.get(parameter)
        if value is not None and not (math.isfinite(value) and 0 < value <= URL_TIMEOUT_MAX_S):
            raise error(f"sets {parameter}={value}: it must be a finite number of seconds "
                        f"above 0 and at most {URL_TIMEOUT_MAX_S:g} (a longer one lets a "
                        "Redis that hangs stall the plugin's commands): set it within that "
                        "range or leave it out")
    return url


LEDGER_ON = ("1", "true", "yes", "on")
"""The spellings of ``ZML_REDIS_LEDGER`` that share slots and health (any letter case)."""
LEDGER_OFF = ("0", "false", "no", "off")
"""The spellings that share policies only."""


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    """An on/off variable: one of :data:`LEDGER_ON` or :data:`LEDGER_OFF` (any case), or
    empty for ``default``; anything else is a :class:`SettingsError` naming the variable, the
    value and the accepted spellings (a typo must not silently mean "on")."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    value = raw.lower()
    if value in LEDGER_ON:
        return True
    if value in LEDGER_OFF:
        return False
    raise SettingsError(
        f"{name}={raw!r} is neither on nor off: set it to one of {', '.join(LEDGER_ON)} "
        f"(share slots and health: the default) or {', '.join(LEDGER_OFF)} (share policies "
        "only), in any letter case, or leave it unset",
        field=name, value=raw,
    )


@dataclass(frozen=True)
class _Range:
    """The accepted values of a numeric variable (inclusive), and why not more."""

    default: float
    minimum: float
    maximum: float
    unit: str
    """``s`` or ``ms``."""
    too_large: str
    """What a value above :attr:`maximum` would do."""


_TTL = _Range(10.0, LEASE_TTL_MIN_S, LEASE_TTL_MAX_S, "s",
              "a crashed process's leases would hold its slots that long")
_TIMEOUT = _Range(100.0, TIMEOUT_MIN_MS, TIMEOUT_MAX_MS, "ms",
                  "a request would wait that long on a Redis that hangs instead of going on "
                  "with local accounting")
_SYNC = _Range(0.5, SYNC_MIN_S, SYNC_MAX_S, "s",
               "routing would use global loads that old, and see slots freed by expired "
               "leases that late")
_TIMEOUT_S = _Range(_TIMEOUT.default / 1000.0, TIMEOUT_MIN_MS / 1000.0, TIMEOUT_MAX_MS / 1000.0,
                    "s", _TIMEOUT.too_large)
"""``Settings.timeout_s``: :data:`_TIMEOUT` in seconds."""


def _number(environ: Mapping[str, str], name: str, spec: _Range) -> float:
    """A numeric variable: a finite number within ``spec``'s range, or empty for its default;
    anything else is a :class:`SettingsError` naming the variable, the value, the range and
    the fix."""
    raw = environ.get(name, "").strip()
    if not raw:
        return spec.default
    allowed = f"from {spec.minimum:g} to {spec.maximum:g} {spec.unit}"
    fix = f"set it to a number {allowed}, or unset it for the default ({spec.default:g})"

    def error(problem: str) -> SettingsError:
        return SettingsError(f"{name}={raw!r} {problem}: {fix}", field=name, value=raw)

    try:
        value = float(raw)
    except ValueError:
        raise error("is not a number") from None
    problem = _out_of_range(value, spec)
    if problem:
        raise error(problem)
    return value


def _out_of_range(value: float, spec: _Range) -> str:
    """What is wrong with ``value`` for ``spec`` (in ``spec``'s unit), or ``""``."""
    if not math.isfinite(value):
        return "must be a finite number"
    if value < spec.minimum:
        return f"must be at least {spec.minimum:g} {spec.unit}"
    if value > spec.maximum:
        return f"must be at most {spec.maximum:g} {spec.unit} (above it, {spec.too_large})"
    return ""


def _check_field(name: str, value: object, spec: _Range) -> None:
    """A numeric :class:`Settings` field built in code: a real number (not a bool) within
    ``spec``, else a :class:`SettingsError` naming the field, the value and the range."""
    fix = f"pass a number of seconds from {spec.minimum:g} to {spec.maximum:g}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"Settings({name}={value!r}) is not a number: {fix}",
                            field=name, value=repr(value))
    problem = _out_of_range(value, spec)
    if problem:
        raise SettingsError(f"Settings({name}={value!r}) {problem}: {fix}",
                            field=name, value=repr(value))


@dataclass(frozen=True)
class Settings:
    """The plugin's settings (hashable: one connection hub per distinct settings). Its repr
    shows the URL without its password."""

    url: str
    prefix: str = "zml"
    lease_ttl_s: float = 10.0
    timeout_s: float = 0.1
    sync_s: float = 0.5
    ledger: bool = True

    def __post_init__(self) -> None:
        """Settings built in code are held to the same ranges as the variables (the module's
        table; ``timeout_s`` is in seconds, ``ZML_REDIS_TIMEOUT_MS`` in milliseconds): a
        :class:`SettingsError` names the field, the value and the accepted range."""
        if not isinstance(self.url, str):
            raise SettingsError(
                f"Settings(url=...) is a {type(self.url).__name__}, not a str: pass the URL "
                "as a string (redis://[user:password@]host:port/db)", field="url", value="")
        check_url(self.url, "url")
        if not isinstance(self.prefix, str) or not self.prefix.strip():
            raise SettingsError(
                f"Settings(prefix={self.prefix!r}) is not a non-empty string: pass the key "
                "prefix of this fleet, such as 'zml'", field="prefix", value=repr(self.prefix))
        _check_field("lease_ttl_s", self.lease_ttl_s, _TTL)
        _check_field("timeout_s", self.timeout_s, _TIMEOUT_S)
        _check_field("sync_s", self.sync_s, _SYNC)
        if not isinstance(self.ledger, bool):
            raise SettingsError(
                f"Settings(ledger={self.ledger!r}) is not a bool: pass True (share slots and "
                "health) or False (share policies only)", field="ledger",
                value=repr(self.ledger))

    @property
    def renew_s(self) -> float:
        """How often held leases are renewed: a third of the TTL, so two renewals may fail
        (or be late) before a lease of a live process expires."""
        return self.lease_ttl_s / 3.0

    @property
    def connect_timeout_s(self) -> float:
        """Timeout of opening a connection on the request path: at least a second, since a
        burst of new connections (at start, after an outage) handshakes at once; pooled
        connections are reused, so this is paid rarely, and once per outage at most."""
        return max(self.timeout_s, 1.0)

    @property
    def build_timeout_s(self) -> float:
        """Timeout of the store read made while a client is built (one try; to connect, and
        again for each reply): :data:`BUILD_TIMEOUT_S` (0.25 s), or the acquire timeout if
        longer, up to :data:`BUILD_TIMEOUT_MAX_S` (1 s). A Redis that hangs costs a build
        this long (the event loop, for an ``AsyncClient``), and then the client starts as
        while Redis is down."""
        return min(max(self.timeout_s, BUILD_TIMEOUT_S), BUILD_TIMEOUT_MAX_S)

    @property
    def lease_ttl_ms(self) -> int:
        """The TTL in whole milliseconds, as the Lua scripts take it."""
        return max(1, round(self.lease_ttl_s * 1000))

    @property
    def where(self) -> str:
        """The URL without its password."""
        return redact(self.url)

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        shown["url"] = self.where
        return f"Settings({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings in ``environ`` (default: ``os.environ``); None when ``ZML_REDIS_URL``
        is unset or empty. Raises :class:`SettingsError` for a malformed value (a URL redis-py
        cannot use, a number that is not finite or out of its range (see the module's table), a
        ``ZML_REDIS_LEDGER`` that is not one of ``1``/``true``/``yes``/``on``/``0``/``false``/``no``/``off``)."""
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL, "").strip()
        if not url:
            return None
        check_url(url)
        prefix = env.get(ENV_PREFIX, "").strip() or "zml"
        return cls(
            url=url,
            prefix=prefix,
            lease_ttl_s=_number(env, ENV_TTL, _TTL),
            timeout_s=_number(env, ENV_TIMEOUT, _TIMEOUT) / 1000.0,
            sync_s=_number(env, ENV_SYNC, _SYNC),
            ledger=_flag(env, ENV_LEDGER, True),
        )

    # --- keys and channels ---------------------------------------------------------------------

    def lease_key(self, node_id: str) -> str:
        """The sorted set of a node's leases (member: lease id, score: expiry in ms)."""
        return f"{self.prefix}:lease:{node_id}"

    @property
    def events_channel(self) -> str:
        """Pub/sub channel of node health events (failures, recoveries)."""
        return f"{self.prefix}:events"

    @property
    def policies_key(self) -> str:
        """Hash: policy name → JSON object of its fields."""
        return f"{self.prefix}:policies"

    @property
    def policy_versions_key(self) -> str:
        """Hash: policy name → its version (incremented by every push and removal)."""
        return f"{self.prefix}:policies:versions"

    @property
    def store_version_key(self) -> str:
        """String: the store's version (incremented by every push and removal)."""
        return f"{self.prefix}:policies:version"

    @property
    def policies_channel(self) -> str:
        """Pub/sub channel announcing each change of the policy store."""
        return f"{self.prefix}:policies:changed"
