"""Gateway keys: who may call ``zml serve``, kept apart from the key zml sends to nodes.

Two sources, both optional (with neither, the gateway is open: fine on loopback, logged at
start):

* ``[gateway] api_keys_env = "ZML_GATEWAY_KEYS"``: the variable holds plain keys separated by
  commas (whitespace around them is ignored);
* ``[gateway] api_keys_file = "gateway-keys.txt"``: one key per line as the hex SHA-256 of the
  key, optionally followed by the policies that key may use, comma-separated::

      # sha256 of the key                                               allowed policies
      9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08  llama3-production,batch
      60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752

  (``printf %s "$KEY" | sha256sum`` prints a key's hash). A key without a list may use any
  policy; a key with one may use only those, and never the no-policy route. The file is UTF-8
  (a byte-order mark is ignored), and every policy it names must be known when the gateway
  starts (:meth:`KeyRing.check`): a misspelled one would make its key useless.

A bad line is reported by file and line number, never echoed (a plain key pasted by mistake
must not reach a log); an unknown policy is named only when it is close to a known one.

Only digests are held in memory, and a request is matched by the digest of the Bearer token it
presents; the token itself is never stored, forwarded to a node, logged or put in a message.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from zml.config import suggest
from zml.errors import PolicyConfigError

from .settings import GatewaySettings

__all__ = ["GatewayKey", "KeyRing"]

logger: logging.Logger = logging.getLogger("zml.gateway")

_HEX = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class GatewayKey:
    """A gateway key, as its digest and what it may do."""

    digest: bytes
    policies: frozenset[str] | None = None
    """The policies this key may use; None: any (including no policy)."""
    origin: str | None = field(default=None, compare=False)
    """Where the key was read (``path:line`` of the key file), for messages."""

    def allows(self, policy: str | None) -> bool:
        """Whether a request with this key may run under ``policy``."""
        return self.policies is None or (policy is not None and policy in self.policies)


class KeyRing:
    """The gateway keys in force: matches ``Authorization: Bearer ...`` headers."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Sequence[GatewayKey] | None) -> None:
        self._keys = None if keys is None else {k.digest: k for k in keys}

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (False: no key source is configured)."""
        return self._keys is not None

    def __len__(self) -> int:
        return 0 if self._keys is None else len(self._keys)

    def authenticate(self, authorization: bytes | None) -> GatewayKey | None:
        """The key an ``Authorization`` header value presents, or None when it is not valid."""
        if self._keys is None or not authorization:
            return None
        scheme, _, token = authorization.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        return self._keys.get(hashlib.sha256(token).digest())

    def check(self, policies: Collection[str], source: str | None = None) -> None:
        """Fail (PolicyConfigError) on a key allowed a policy that is not in ``policies``.

        The message names the key file and line; the policy itself only when it is close to
        a known one (a typo), since an unknown word there may be a plain key pasted by mistake.
        """
        for key in (self._keys or {}).values():
            for name in sorted(key.policies or ()):
                if name in policies:
                    continue
                hint = suggest(name, policies)
                known = ", ".join(sorted(policies)) or "none are configured"
                raise PolicyConfigError(
                    f"{key.origin or 'gateway key'}: "
                    + (f"policy {name!r} is not a known policy; did you mean {hint!r}?"
                       if hint else "a policy on this line is not a known policy")
                    + f" (known: {known})",
                    field="gateway.api_keys_file", value=name if hint else None,
                    suggestion=hint, source=source)

    @classmethod
    def from_settings(cls, settings: GatewaySettings, source: str | None,
                      environ: Mapping[str, str]) -> KeyRing:
        """Read the keys named by ``settings``; a configured source that yields no key fails
        (PolicyConfigError) rather than serving open."""
        if not settings.auth_configured:
            return cls(None)
        keys: list[GatewayKey] = []
        if settings.api_keys_env is not None:
            keys += _env_keys(settings.api_keys_env, environ)
        path = settings.keys_file(source)
        if path is not None:
            keys += _file_keys(path)
        if not keys:
            raise PolicyConfigError(
                "[gateway] names key sources, but they hold no key: set "
                + (f"${settings.api_keys_env}" if settings.api_keys_env else "")
                + (" or " if settings.api_keys_env and path else "")
                + (f"add hashes to {path}" if path else "")
                + " (a gateway with api_keys_env/api_keys_file never serves without keys)",
                field="gateway.api_keys_env" if settings.api_keys_env else "gateway.api_keys_file",
                source=source,
            )
        return cls(keys)


def _env_keys(variable: str, environ: Mapping[str, str]) -> list[GatewayKey]:
    raw = environ.get(variable, "")
    return [GatewayKey(hashlib.sha256(k.encode()).digest())
            for k in (part.strip() for part in raw.split(",")) if k]


def _file_keys(path: Path) -> list[GatewayKey]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: Windows editors write a BOM
    except OSError as exc:
        raise PolicyConfigError(
            f"cannot read the gateway key file {str(path)!r}: {exc.strerror}",
            field="gateway.api_keys_file", value=str(path),
        ) from None
    except UnicodeDecodeError as exc:
        raise PolicyConfigError(
            f"the gateway key file {str(path)!r} is not UTF-8 text (byte {exc.start}): save "
            "it as UTF-8", field="gateway.api_keys_file", value=str(path),
        ) from None
    keys: list[GatewayKey] = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if not _HEX.fullmatch(fields[0]) or len(fields) > 2:
            # Never echo the line: a plain key pasted by mistake must not reach a log.
            raise PolicyConfigError(
                f"{path}:{number}: expected a 64-digit hex SHA-256 of a key, then optionally "
                "policies separated by commas (write `printf %s \"$KEY\" | sha256sum`)",
                field="gateway.api_keys_file", value=str(path),
            )
        policies = None
        if len(fields) == 2:
            policies = frozenset(p for p in fields[1].split(",") if p)
        keys.append(GatewayKey(bytes.fromhex(fields[0]), policies, f"{path}:{number}"))
    return keys
