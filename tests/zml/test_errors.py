"""The error tree: one base, typed branches, the status map in one place."""

from __future__ import annotations

import json

import pytest

import zml
from zml.errors import status_error


def test_every_public_error_is_a_zml_error() -> None:
    names = [n for n in zml.__all__ if n.endswith("Error")]
    assert len(names) >= 17
    for name in names:
        assert issubclass(getattr(zml, name), zml.ZMLError), name


def test_alias_and_routing_error_string() -> None:
    assert zml.ZMLRoutingError is zml.RoutingError
    ctx = {"policy": "p", "evaluated": [], "final_error": "no_viable_node",
           "recommendation": "increase fleet capacity or enable queue_on_saturation"}
    err = zml.RoutingError(ctx)
    text = str(err)
    assert text.startswith("routing failed for policy 'p': no_viable_node")
    assert json.loads(text.split("routing_context = ", 1)[1]) == ctx
    assert err.routing_context is ctx


@pytest.mark.parametrize(
    ("status", "cls", "retryable"),
    [
        (400, zml.BadRequestError, False),
        (422, zml.BadRequestError, False),
        (401, zml.AuthenticationError, False),
        (403, zml.AuthenticationError, False),
        (404, zml.NotFoundError, False),
        (429, zml.RateLimitError, True),
        (500, zml.InternalServerError, True),
        (502, zml.NodeUnavailableError, True),
        (503, zml.NodeUnavailableError, True),
        (504, zml.NodeUnavailableError, True),
    ],
)
def test_status_map(status: int, cls: type[zml.NodeStatusError], retryable: bool) -> None:
    err = status_error(status, {"error": {"message": "nope"}}, node_id="n1")
    assert type(err) is cls
    assert err.retryable is retryable
    assert err.status_code == status
    assert "node 'n1' answered HTTP" in str(err) and "nope" in str(err)


def test_timeouts_are_also_builtin_timeouts() -> None:
    assert issubclass(zml.ZMLTimeoutError, TimeoutError)
    assert issubclass(zml.NodeTimeoutError, TimeoutError)
    assert issubclass(zml.IncompleteStreamError, zml.NodeProtocolError)
    assert issubclass(zml.InvalidRequestError, ValueError)


def test_retry_after_headers() -> None:
    import httpx2

    from zml.transport import _retry_after

    assert _retry_after(httpx2.Headers({"retry-after": "2"})) == 2.0
    assert _retry_after(httpx2.Headers({"retry-after-ms": "250", "retry-after": "1"})) == 0.25
    # a date in the past: retry now (dates are covered in tests/zml/test_transport_retry_after.py)
    assert _retry_after(httpx2.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})) == 0.0
    assert _retry_after(httpx2.Headers({})) is None


def test_credentials_are_read_from_a_requests_headers_as_from_a_mapping() -> None:
    import httpx2

    from zml.errors import credentials

    sent = httpx2.Headers([
        ("Host", "node"), ("Authorization", "Bearer sk-one"), ("API-Key", "azure-key"),
        ("x-other", "not a secret"), ("Cookie", ""), ("Proxy-Authorization", "Basic cHJveHk="),
    ])
    assert credentials(sent) == ("sk-one", "azure-key", "cHJveHk=")
    assert credentials(dict(sent.items())) == credentials(sent)
    assert credentials(None) == ()
    # Two Authorization headers are two credentials, each scrubbed on its own (a mapping
    # would join them into one value).
    assert credentials(httpx2.Headers([("authorization", "Bearer a"),
                                       ("Authorization", "Bearer b")])) == ("a", "b")
