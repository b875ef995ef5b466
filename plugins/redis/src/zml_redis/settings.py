"""Where Redis is and how the plugin uses it: read from the environment when a client is built.

===========================  ==========  ================================================
variable                     default     meaning
===========================  ==========  ================================================
``ZML_REDIS_URL``            (unset)     ``redis://[user:password@]host:port/db``; unset:
                                         the plugin does nothing
``ZML_REDIS_PREFIX``         ``zml``     prefix of every key and channel (one per fleet)
``ZML_REDIS_LEASE_TTL_S``    ``10``      a slot lease expires this long after its last
                                         renewal (held leases are renewed every TTL/3)
``ZML_REDIS_TIMEOUT_MS``     ``100``     socket timeout of a lease acquisition; past it
                                         the request goes on with local state
``ZML_REDIS_SYNC_S``         ``0.5``     how often each process reads every node's global
                                         lease count into its routing state (releases
                                         are announced at once besides)
``ZML_REDIS_LEDGER``         ``1``       ``0``: share policies only, not slots and health
===========================  ==========  ================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from . import ENV_URL

__all__ = [
    "ENV_LEDGER",
    "ENV_PREFIX",
    "ENV_SYNC",
    "ENV_TIMEOUT",
    "ENV_TTL",
    "ENV_URL",
    "Settings",
    "redact",
]

ENV_PREFIX = "ZML_REDIS_PREFIX"
ENV_TTL = "ZML_REDIS_LEASE_TTL_S"
ENV_TIMEOUT = "ZML_REDIS_TIMEOUT_MS"
ENV_SYNC = "ZML_REDIS_SYNC_S"
ENV_LEDGER = "ZML_REDIS_LEDGER"


def redact(url: str) -> str:
    """``url`` without its password, for messages and source names."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def _number(environ: Mapping[str, str], name: str, default: float, minimum: float) -> float:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class Settings:
    """The plugin's settings (hashable: one connection hub per distinct settings)."""

    url: str
    prefix: str = "zml"
    lease_ttl_s: float = 10.0
    timeout_s: float = 0.1
    sync_s: float = 0.5
    ledger: bool = True

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
    def lease_ttl_ms(self) -> int:
        """The TTL in whole milliseconds, as the Lua scripts take it."""
        return max(1, round(self.lease_ttl_s * 1000))

    @property
    def where(self) -> str:
        """The URL without its password."""
        return redact(self.url)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings | None:
        """The settings in ``environ`` (default: ``os.environ``); None when ``ZML_REDIS_URL``
        is unset or empty. Raises ValueError for a malformed value."""
        env = os.environ if environ is None else environ
        url = env.get(ENV_URL, "").strip()
        if not url:
            return None
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{ENV_URL}={redact(url)!r} is not a redis://, rediss:// or unix:// URL")
        prefix = env.get(ENV_PREFIX, "").strip() or "zml"
        return cls(
            url=url,
            prefix=prefix,
            lease_ttl_s=_number(env, ENV_TTL, 10.0, 0.2),
            timeout_s=_number(env, ENV_TIMEOUT, 100.0, 1.0) / 1000.0,
            sync_s=_number(env, ENV_SYNC, 0.5, 0.01),
            ledger=env.get(ENV_LEDGER, "1").strip().lower() not in ("0", "false", "no", "off"),
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
