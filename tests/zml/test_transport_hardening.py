"""zml.transport's non-streamed parts against hostile input: typed, bounded, secret-free."""

from __future__ import annotations

import asyncio
import json
import math
from email.utils import formatdate

import httpx2
import pytest

import zml
from zml.transport import (
    MAX_BODY_BYTES,
    MAX_JSON_DEPTH,
    RETRY_AFTER_MAX_S,
    aread_body,
    auth_headers,
    check_status,
    completion_shape_problem,
    decode_completion,
    loads_limited,
    map_transport_error,
    read_body,
    retry_after_seconds,
    safe_detail,
)

NOW = 1_700_000_000.0


def _h(**headers: str) -> httpx2.Headers:
    return httpx2.Headers({k.replace("_", "-"): v for k, v in headers.items()})


# --- Retry-After ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry_after": "2"}, 2.0),
        ({"retry_after": " 2.5 "}, 2.5),
        ({"retry_after": "0"}, 0.0),
        ({"retry_after": "-1"}, 0.0),
        ({"retry_after": "-inf"}, 0.0),
        ({"retry_after": "999999"}, RETRY_AFTER_MAX_S),
        ({"retry_after": "1e400"}, RETRY_AFTER_MAX_S),
        ({"retry_after": "inf"}, RETRY_AFTER_MAX_S),
        ({"retry_after": "Infinity"}, RETRY_AFTER_MAX_S),
        ({"retry_after": "nan"}, None),
        ({"retry_after": "soon"}, None),
        ({"retry_after": "1_000"}, None),
        ({"retry_after": ""}, None),
        ({"retry_after": "5, 6"}, None),
        ({"retry_after_ms": "250"}, 0.25),
        ({"retry_after_ms": "250", "retry_after": "9"}, 0.25),
        ({"retry_after_ms": "nan", "retry_after": "3"}, 3.0),
        ({"retry_after_ms": "inf"}, RETRY_AFTER_MAX_S),
        ({"retry_after_ms": "-5"}, 0.0),
        ({"retry_after_ms": "Wed, 21 Oct 2015 07:28:00 GMT"}, None),
        ({}, None),
    ],
)
def test_retry_after_is_read_defensively_and_capped(headers: dict[str, str],
                                                    expected: float | None) -> None:
    assert retry_after_seconds(_h(**headers), now=NOW) == expected


def test_retry_after_as_an_http_date() -> None:
    ahead = formatdate(NOW + 30, usegmt=True)
    assert retry_after_seconds(_h(retry_after=ahead), now=NOW) == pytest.approx(30.0)
    far = formatdate(NOW + 10 * 86400, usegmt=True)
    assert retry_after_seconds(_h(retry_after=far), now=NOW) == RETRY_AFTER_MAX_S
    past = formatdate(NOW - 30, usegmt=True)
    assert retry_after_seconds(_h(retry_after=past), now=NOW) == 0.0
    naive = "Tue, 14 Nov 2023 22:13:50 -0000"  # no zone: read as UTC
    assert retry_after_seconds(_h(retry_after=naive), now=NOW) == pytest.approx(30.0)
    assert retry_after_seconds(_h(retry_after="Fri, 31 Dec 9999 23:59:59 GMT"), now=NOW) \
        == RETRY_AFTER_MAX_S
    assert retry_after_seconds(_h(retry_after="Mon, 99 Foo 2020 99:99:99 GMT"), now=NOW) is None


def test_a_429_carries_the_capped_retry_after() -> None:
    with pytest.raises(zml.RateLimitError) as info:
        check_status(429, _h(retry_after="inf"), b"{}", "n1")
    assert info.value.retry_after == RETRY_AFTER_MAX_S
    assert math.isfinite(info.value.retry_after)


# --- status, redirects, failures ----------------------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_a_protocol_error_saying_so(status: int) -> None:
    headers = _h(location="https://bob:hunter2@gateway.example/v2?x=1")
    with pytest.raises(zml.NodeProtocolError) as info:
        check_status(status, headers, b"", "n1")
    text = str(info.value)
    assert f"node 'n1' answered with a redirect (HTTP {status} to https://gateway.example/v2" \
        in text
    assert "hunter2" not in text and "bob" not in text
    assert info.value.node_id == "n1" and not info.value.retryable


def test_a_redirect_without_location() -> None:
    with pytest.raises(zml.NodeProtocolError, match=r"redirect \(HTTP 304\)"):
        check_status(304, _h(), b"", "n1")


def test_an_error_body_is_kept_bounded_and_parsed_safely() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(zml.InternalServerError) as info:
        check_status(500, _h(), deep, "n1")
    assert isinstance(info.value.body, str)
    with pytest.raises(zml.InternalServerError) as info:
        check_status(500, _h(), b"x" * (10 * 2**20), "n1")
    assert isinstance(info.value.body, str) and len(info.value.body) <= 64 * 1024
    with pytest.raises(zml.BadRequestError, match="Bearer \\[redacted\\]"):
        check_status(400, _h(), json.dumps(
            {"error": {"message": "bad header Authorization: Bearer sk-leaked"}}).encode(), "n1")


def test_a_header_the_http_stack_refuses_is_a_client_config_error() -> None:
    exc = httpx2.LocalProtocolError("Illegal header value b'Bearer sk-secret\\n'")
    with pytest.raises(zml.ClientConfigError) as info:
        map_transport_error(exc, "n1")
    assert "sk-secret" not in str(info.value)
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert isinstance(info.value, zml.InvalidRequestError)
    assert not info.value.node_fault and not info.value.retryable


def test_node_failures_stay_node_errors_without_secrets() -> None:
    err = map_transport_error(httpx2.ConnectError("[Errno 111] Connection refused"), "n1")
    assert isinstance(err, zml.NodeConnectionError) and err.node_fault
    assert "Connection refused" in str(err)
    err = map_transport_error(
        httpx2.RemoteProtocolError("peer said authorization: Bearer sk-x at http://u:p@h/"), "n1")
    assert "sk-x" not in str(err) and "u:p@" not in str(err)
    assert isinstance(map_transport_error(httpx2.ReadTimeout("t"), "n1"), zml.NodeTimeoutError)


def test_safe_detail_removes_credentials_and_line_ends() -> None:
    text = safe_detail("x-api-key: abc123\nBasic dXNlcjpwYXNz https://me:pw@h/p", limit=500)
    assert "abc123" not in text and "dXNlcjpwYXNz" not in text and "pw@" not in text
    assert "\n" not in text
    assert len(safe_detail("y" * 1000)) == 200


def test_auth_headers_validate_the_key() -> None:
    assert auth_headers("sk-1")["authorization"] == "Bearer sk-1"
    assert "authorization" not in auth_headers(None)
    with pytest.raises(zml.InvalidRequestError, match=r"^\$K ends with a newline"):
        auth_headers("sk\n", param="$K")


# --- bodies -----------------------------------------------------------------------------------


def test_decode_completion_accepts_a_completion() -> None:
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                         "finish_reason": "stop"}], "usage": None}
    assert decode_completion(json.dumps(body).encode(), "n1") == body


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"", "an empty body"),
        (b"   ", "an empty body"),
        (b"not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[5]", "the body is an array, not an object"),
        (b'"s"', "the body is a string"),
        (b"{}", "'choices' is null, not an array"),
        (b'{"choices": "abc"}', "'choices' is a string, not an array"),
        (b'{"choices": [5]}', "choices[0] is a number, not an object"),
        (b'{"choices": [{}]}', "choices[0].message is null, not an object"),
        (b'{"choices": [{"message": "x"}]}', "choices[0].message is a string"),
        (b'{"choices": [{"message": {"content": 5}}]}',
         "choices[0].message.content is a number, not a string or null"),
        (b'{"choices": [{"message": {"content": "x", "tool_calls": "zz"}}]}',
         "choices[0].message.tool_calls is a string, not an array"),
        (b'{"choices": [{"message": {"content": "x"}, "finish_reason": 1}]}',
         "choices[0].finish_reason is a number"),
        (b'{"choices": [], "usage": [1]}', "'usage' is an array, not an object"),
    ],
)
def test_malformed_bodies_are_protocol_errors_naming_the_node(body: bytes, problem: str) -> None:
    with pytest.raises(zml.NodeProtocolError) as info:
        decode_completion(body, "n1")
    assert problem in str(info.value) and "node 'n1'" in str(info.value)
    assert info.value.node_id == "n1"


def test_depth_and_size_limits() -> None:
    ok = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert loads_limited(ok, "n1") is not None
    over = b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1)
    with pytest.raises(zml.NodeProtocolError, match="nests more than"):
        loads_limited(over, "n1")
    with pytest.raises(zml.NodeProtocolError, match="nests more than"):
        decode_completion(b'{"choices": [' * 200_000, "n1")
    with pytest.raises(zml.NodeProtocolError, match="more than zml reads"):
        decode_completion(b" " * (MAX_BODY_BYTES + 1), "n1")
    assert completion_shape_problem({"choices": []}) is None


def _streamed(content: bytes, declared: bool) -> httpx2.MockTransport:
    def handler(request: httpx2.Request) -> httpx2.Response:
        headers = {"content-length": str(len(content))} if declared else {}
        return httpx2.Response(200, headers=headers,
                               stream=httpx2.ByteStream(content) if declared else _chunks(content))

    return httpx2.MockTransport(handler)


class _chunks(httpx2.SyncByteStream, httpx2.AsyncByteStream):
    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(0, len(self.data), 1000):
            yield self.data[i : i + 1000]

    async def __aiter__(self):  # type: ignore[no-untyped-def]
        for i in range(0, len(self.data), 1000):
            yield self.data[i : i + 1000]


@pytest.mark.parametrize("declared", [True, False])
def test_read_body_stops_at_the_limit(declared: bool) -> None:
    with httpx2.Client(transport=_streamed(b"y" * 5000, declared)) as http:
        with http.stream("POST", "http://n1/") as r:
            assert read_body(r, "n1", limit=5000) == b"y" * 5000
        with http.stream("POST", "http://n1/") as r, \
                pytest.raises(zml.NodeProtocolError, match="more than"):
            read_body(r, "n1", limit=4999)

    async def main() -> None:
        async with httpx2.AsyncClient(transport=_streamed(b"y" * 5000, declared)) as http:
            async with http.stream("POST", "http://n1/") as r:
                assert await aread_body(r, "n1", limit=5000) == b"y" * 5000
            async with http.stream("POST", "http://n1/") as r:
                with pytest.raises(zml.NodeProtocolError, match="more than"):
                    await aread_body(r, "n1", limit=4999)

    asyncio.run(main())
