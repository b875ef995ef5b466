"""Requests from web pages: the gateway's Host and Origin checks.

A gateway without keys answers whoever reaches it, and a web page open in the user's browser
can reach a gateway on the user's machine too. Two rules, checked before any route, keep pages
out (the same defence Ollama, Jupyter and Django's ``ALLOWED_HOSTS`` have):

* **Host.** A request that arrives over loopback (the connection's local address is in
  127.0.0.0/8 or ``::1``) must be addressed to a loopback name: its ``Host`` is ``localhost``, a
  name under ``.localhost``, a loopback address, or a name of ``[gateway] allowed_hosts``. A page
  that had its own domain resolve to 127.0.0.1 (DNS rebinding) sends its domain as ``Host``, and
  is refused: otherwise it could read the answers as if it were the gateway's own page.
  Requests that arrive on another address (a gateway serving the network) are not checked: a
  network peer can call the gateway directly anyway.
* **Origin.** A request with an ``Origin`` header (only browsers send one) is refused unless
  the origin's host is the request's own host, or a name of ``allowed_hosts``. The gateway
  serves programs, not pages (it answers no CORS preflight), so no legitimate page calls it
  across origins; a page that tried (a form, or ``fetch`` with a body of no declared type, which
  a browser sends without a preflight) would spend the fleet's compute in the user's name.

``allowed_hosts`` entries are host names (or addresses), matched case-insensitively: a name, a
name with a leading dot for the domain and every subdomain (``.example.com``), or ``"*"`` for
any host (both rules off). A reverse proxy on the same machine that passes its clients' ``Host``
on (Caddy does, nginx with ``proxy_set_header Host $host``) needs its public name listed.

A refusal is an OpenAI-shaped 403 that says which rule refused and how to allow the host.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zml.errors import safe_detail

from .errors import error_reply

if TYPE_CHECKING:
    from .app import Gateway

__all__ = ["HostCheckMiddleware", "HostRule", "host_name", "is_loopback_name"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_CHAT = "/v1/chat/completions"
_KNOWN_ADDRESSES = 64
"""How many local addresses a middleware remembers as loopback or not (a host has a few)."""


def _loopback_ip(text: str) -> bool:
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback  # ::ffff:127.0.0.1 (not loopback to ipaddress)
    return ip.is_loopback


def is_loopback_name(name: str) -> bool:
    """Whether ``name`` (lower case, no port) can only mean this machine: ``localhost``, a name
    under ``.localhost`` (RFC 6761: browsers resolve those themselves, never through DNS), or a
    loopback address."""
    return name == "localhost" or name.endswith(".localhost") or _loopback_ip(name)


def host_name(value: str) -> str | None:
    """The host of a ``Host`` header value, lower case, without port, brackets or final dot
    (None when it is not a host: empty, or an unclosed ``[``)."""
    text = value.strip().lower()
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        return text[1:end] or None
    head, sep, tail = text.rpartition(":")
    if sep and tail.isdigit() and ":" not in head:
        text = head
    text = text.rstrip(".")
    return text or None


class HostRule:
    """``[gateway] allowed_hosts``: which names a request's Host and Origin may carry."""

    def __init__(self, allowed: Iterable[str]) -> None:
        names = {n.lower().strip("[]").rstrip(".") for n in allowed}
        self.any: bool = "*" in names
        self.exact: frozenset[str] = frozenset(n for n in names if not n.startswith("."))
        self.domains: tuple[str, ...] = tuple(sorted(n for n in names if n.startswith(".")))

    def listed(self, name: str) -> bool:
        """Whether ``name`` is allowed by the list itself."""
        return self.any or name in self.exact or any(
            name.endswith(d) or name == d[1:] for d in self.domains)


class HostCheckMiddleware:
    """Refuse a request over loopback addressed to a foreign name, and a web page's request
    from another origin (see the module's docstring)."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app: ASGIApp = app
        self.gateway: Gateway = gateway
        self.rule: HostRule = HostRule(gateway.settings.allowed_hosts)
        self._loopback: dict[str, bool] = {}
        self._fine: set[tuple[bool, bytes]] = set()
        """(over loopback, Host value) pairs seen allowed: the common case costs a lookup."""

    def _over_loopback(self, scope: Scope) -> bool:
        server = scope.get("server")
        if not server:
            return False
        address = str(server[0])
        known = self._loopback.get(address)
        if known is None:
            known = _loopback_ip(address)
            if len(self._loopback) < _KNOWN_ADDRESSES:
                self._loopback[address] = known
        return known

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.rule.any:
            await self.app(scope, receive, send)
            return
        host = origin = None
        for name, value in scope["headers"]:
            if name == b"host":
                host = value
            elif name == b"origin":
                origin = value
        problem = self._problem(scope, host, origin)
        if problem is None:
            await self.app(scope, receive, send)
            return
        code, message = problem
        if scope.get("path") == _CHAT:
            self.gateway.metrics.finished(None, "", "", "forbidden", False, 0.0)
        reply = error_reply(403, message, "permission_error", code=code, outcome="forbidden")
        body = reply.body()
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _problem(self, scope: Scope, host: bytes | None,
                 origin: bytes | None) -> tuple[str, str] | None:
        """(code, message) when a rule refuses the request, else None."""
        # No Host at all (HTTP/1.0) is not a page: browsers always send one.
        loopback = self._over_loopback(scope)
        if origin is None and (host is None or (loopback, host) in self._fine):
            return None  # the common case: a program, with a Host already seen allowed
        name = None if host is None else host_name(host.decode("latin-1"))
        if host is not None and loopback and (
                name is None or not (is_loopback_name(name) or self.rule.listed(name))):
            shown = safe_detail(host.decode("latin-1"), 120)
            return "host_not_allowed", (
                f"Host {shown!r} is not allowed: this gateway answers requests that reach it "
                "over loopback only when they are addressed to a loopback name (localhost, "
                "127.0.0.1, [::1]), so that a web page cannot reach it by DNS rebinding; behind "
                "a reverse proxy that passes its own Host on, add that name to [gateway] "
                "allowed_hosts")
        if origin is None:
            if host is not None and len(self._fine) < _KNOWN_ADDRESSES:
                self._fine.add((loopback, host))
            return None
        text = origin.decode("latin-1")
        try:
            origin_host = urlsplit(text.strip()).hostname
        except ValueError:
            origin_host = None
        if origin_host is not None and (origin_host == name or self.rule.listed(origin_host)):
            return None
        return "origin_not_allowed", (
            f"a request from the web page at Origin {safe_detail(text, 120)!r} is refused: "
            "the gateway serves programs, not pages, and answers a browser only from its own "
            "host, so that a page the user happens to visit cannot spend the fleet's compute; "
            "call it from a program (which sends no Origin), or add the page's host to "
            "[gateway] allowed_hosts")
