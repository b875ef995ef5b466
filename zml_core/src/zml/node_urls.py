"""Node URLs as configured in ``zml.toml``: what a node URL may hold, and how one is shown.

A node URL is ``scheme://host:port[/path]``: credentials, a query string or a fragment are
refused when the file is read (:func:`url_problem`), and every place that shows a node's URL
(fleet status, the CLI, routing metadata, telemetry, error messages) shows it through
:func:`redact_url` or :func:`display_url`, never with a password.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .errors import PolicyConfigError

__all__ = ["display_url", "redact_url", "url_problem"]


def url_problem(url: str, node_id: object = None) -> None:
    """Refuse a node URL with credentials, an ``@``, control characters, an unparsable
    authority, or a path ending in ``/v1`` (an OpenAI-style base URL: zml adds ``/v1``
    itself), as a PolicyConfigError.

    The message and ``.value`` show the URL through :func:`display_url`, never the password.
    """
    who = f"node {node_id!r}" if isinstance(node_id, str) else "a node"
    shown = display_url(url)
    bad = next((c for c in url if ord(c) < 0x20 or ord(c) == 0x7F or c.isspace()), None)
    if bad is not None:
        raise PolicyConfigError(
            f"{who}: url {shown!r} contains a control character or whitespace "
            f"(U+{ord(bad):04X}); write the URL on one line, without spaces",
            field="url",
            value=shown,
        )
    if "@" in url:
        raise PolicyConfigError(
            f"{who}: url {shown!r} (shown without them) contains credentials "
            "(user:password@); zml never "
            "sends credentials from a URL: remove them, and put the node's key in an environment "
            "variable named by api_key_env = \"NAME\" (sent as a Bearer token), or pass "
            "api_key= / set ZML_API_KEY for every node (an '@' that is part of a path must be "
            "written %40)",
            field="url",
            value=shown,
        )
    if "?" in url or "#" in url:
        # A query often carries a token (``?api-key=...``): never shown, never sent, and zml
        # appends /v1/... to the URL, so a query would end up in the middle of the path.
        cut = min(i for i in (url.find("?"), url.find("#")) if i >= 0)
        shown = display_url(url[:cut]) + ("?…" if url[cut] == "?" else "#…")
        raise PolicyConfigError(
            f"{who}: url {shown!r} (shown without it) has a query string or fragment; a node "
            "URL is scheme://host:port[/path] only: remove it, and put the node's key in an "
            "environment variable named by api_key_env = \"NAME\" (sent as a Bearer token)",
            field="url",
            value=shown,
        )
    try:
        path = urlsplit(url).path
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise PolicyConfigError(
            f"{who}: url {shown!r} is not a valid URL ({exc}); write e.g. "
            "'http://127.0.0.1:8000' or 'http://[::1]:8000'",
            field="url",
            value=shown,
        ) from None
    if path.rstrip("/").lower().endswith("/v1"):
        root = display_url(url).rstrip("/")[:-3]
        raise PolicyConfigError(
            f"{who}: url {shown!r} ends in /v1, which zml adds itself (it sends to "
            f"{shown.rstrip('/')}/v1/chat/completions, and probes /health and /metrics at the "
            f"root): write the server's root, {root!r}",
            field="url",
            value=shown,
        )


def display_url(url: str) -> str:
    """``url`` safe to show in a message: :func:`redact_url`, and when an ``@`` is left (a URL
    too malformed to find its userinfo), everything up to the last ``@`` replaced by ``…``."""
    shown = redact_url(url)
    return f"…@{shown.rsplit('@', 1)[1]}" if "@" in shown else shown


def redact_url(url: str) -> str:
    """``url`` without userinfo (``http://user:pass@host`` → ``http://host``), for display.

    Everything that shows a node's URL (fleet status, the CLI, routing metadata, telemetry)
    shows it through this function.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url.rsplit("@", 1)[-1] if "@" in url.split("/", 1)[0] else url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = authority.rsplit("@", 1)[1]
    return f"{scheme}{sep}{authority}{slash}{path}"
