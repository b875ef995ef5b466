"""A client's requests to its nodes are what httpx2's ``build_request`` would build.

``zml.transport.PostRequests`` keeps the merge of the HTTP client's default headers with each
header dict the client sends again and again; whatever the HTTP client holds (its default
headers, changed at any time, cookies, query parameters), the request must be the same.
"""

from __future__ import annotations

import asyncio

import httpx2
import pytest

from zml.transport import PostRequests

URL = httpx2.URL("http://127.0.0.1:8000/v1/chat/completions")
BODY = b'{"model": "m", "messages": []}'
TIMEOUT = {"connect": 1.0, "read": 2.0, "write": 3.0, "pool": None}
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-test"}


def same(built: httpx2.Request, expected: httpx2.Request) -> None:
    assert built.method == expected.method
    assert built.url == expected.url
    assert built.headers.raw == expected.headers.raw
    assert built.read() == expected.read()
    assert built.extensions == expected.extensions
    assert built.extensions["timeout"] is expected.extensions["timeout"]


def expected(http: httpx2.Client, headers: dict[str, str] = HEADERS) -> httpx2.Request:
    return http.build_request("POST", URL, content=BODY, headers=headers,
                              extensions={"timeout": TIMEOUT})


@pytest.mark.parametrize("reuse", [True, False])
def test_a_plain_client(reuse: bool) -> None:
    with httpx2.Client() as http:
        posts = PostRequests(http)
        for _ in range(2):  # built, then from the kept merge
            same(posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=reuse), expected(http))


def test_a_reused_header_dict_does_not_go_through_build_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The point of PostRequests: the kept merge is used, not httpx2's per-request one.
    with httpx2.Client() as http:
        want = expected(http)
        posts = PostRequests(http)

        def refuse(*args: object, **kwargs: object) -> httpx2.Request:
            raise AssertionError("build_request was called for a reused header dict")

        monkeypatch.setattr(http, "build_request", refuse)
        for _ in range(2):
            same(posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=True), want)


def test_default_headers_are_merged_and_followed_when_they_change() -> None:
    with httpx2.Client(headers={"User-Agent": "team-app", "X-Team": "search",
                                "Authorization": "Bearer default"}) as http:
        posts = PostRequests(http)
        same(posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=True), expected(http))
        http.headers["X-Team"] = "ads"
        del http.headers["User-Agent"]
        built = posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=True)
        same(built, expected(http))
        assert built.headers["x-team"] == "ads"
        assert built.headers["authorization"] == "Bearer sk-test"


def test_a_request_changed_after_it_was_built_leaves_the_next_one_alone() -> None:
    with httpx2.Client() as http:
        posts = PostRequests(http)
        first = posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=True)
        first.headers["traceparent"] = "00-1-2-01"
        del first.headers["authorization"]
        same(posts.build(URL, BODY, HEADERS, TIMEOUT, reuse=True), expected(http))


def test_one_merge_per_header_dict() -> None:
    node_headers = {"content-type": "application/json", "authorization": "Bearer node-key"}
    with httpx2.Client() as http:
        posts = PostRequests(http)
        for headers in (HEADERS, node_headers, HEADERS, node_headers):
            same(posts.build(URL, BODY, headers, TIMEOUT, reuse=True), expected(http, headers))


def test_one_merge_per_node() -> None:
    with httpx2.Client() as http:
        posts = PostRequests(http)
        for url in (URL, httpx2.URL("http://[::1]:8001/v1/chat/completions"), URL):
            built = posts.build(url, BODY, HEADERS, TIMEOUT, reuse=True)
            same(built, http.build_request("POST", url, content=BODY, headers=HEADERS,
                                           extensions={"timeout": TIMEOUT}))
            assert built.headers.raw[0] == (b"Host", url.netloc)


@pytest.mark.parametrize("default", [{"Host": "front.example"}, {"Transfer-Encoding": "chunked"},
                                     {"Content-Length": "7"}])
def test_a_client_that_sets_what_a_request_adds_itself(default: dict[str, str]) -> None:
    with httpx2.Client(headers=default) as http:
        same(PostRequests(http).build(URL, BODY, HEADERS, TIMEOUT, reuse=True), expected(http))


def test_cookies_and_query_parameters_of_the_http_client_are_sent() -> None:
    with httpx2.Client(cookies={"session": "abc"}, params={"api-version": "2024-06-01"}) as http:
        built = PostRequests(http).build(URL, BODY, HEADERS, TIMEOUT, reuse=True)
        same(built, expected(http))
        assert built.headers["cookie"] == "session=abc"
        assert built.url.params["api-version"] == "2024-06-01"


def test_the_async_client_too() -> None:
    http = httpx2.AsyncClient(headers={"X-Team": "search"})
    try:
        built = PostRequests(http).build(URL, BODY, HEADERS, TIMEOUT, reuse=True)
        assert built.headers.raw == http.build_request(
            "POST", URL, content=BODY, headers=HEADERS,
            extensions={"timeout": TIMEOUT}).headers.raw
    finally:
        asyncio.run(http.aclose())
