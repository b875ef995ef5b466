"""The Host and Origin checks (``zml.gateway.hosts``): a web page in the user's browser may
not drive a gateway on the user's machine, by DNS rebinding or by a cross-site request, while
programs (which send a loopback Host and no Origin) are answered as before."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from tests.conftest import MODEL

from .conftest import GatewayServer, raw_exchange
from .test_bad_requests import outcomes

Make = Callable[..., GatewayServer]
MSGS = [{"role": "user", "content": "hi"}]
BODY = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2}).encode()
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}}
OPEN = '[gateway]\ndefault_policy = "prod"'


@pytest.fixture
def gw(serve_gateway: Make) -> GatewayServer:
    return serve_gateway(NODES, POLICIES, gateway=OPEN)


def exchange(gw: GatewayServer, host: bytes, path: bytes = b"/v1/chat/completions",
             extra: bytes = b"") -> tuple[int, dict[str, Any]]:
    """One request with this Host, as a browser sends it (a POST's body with no type)."""
    if path == b"/v1/chat/completions":
        request = (b"POST " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + extra
                   + b"Connection: close\r\nContent-Length: " + str(len(BODY)).encode()
                   + b"\r\n\r\n" + BODY)
    else:
        request = (b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n" + extra
                   + b"Connection: close\r\n\r\n")
    head, body = raw_exchange(gw, request)
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:
        return status, {"text": body.decode("latin-1")}


def test_dns_rebinding_a_foreign_host_over_loopback_is_refused_on_every_path(
        gw: GatewayServer) -> None:
    port = gw.url.rsplit(":", 1)[1].encode()
    for path in (b"/v1/chat/completions", b"/v1/models", b"/ready", b"/metrics", b"/health"):
        status, body = exchange(gw, b"rebind.evil.example:" + port, path)
        assert status == 403, (path, body)
        error = body["error"]
        assert error["type"] == "permission_error" and error["code"] == "host_not_allowed"
        assert "'rebind.evil.example:" in error["message"]
        assert "[gateway] allowed_hosts" in error["message"]  # how to allow a proxy's name
    assert gw.node("h100-1").stats.requests_total == 0
    assert outcomes(gw) == {"forbidden": 1.0}  # the chat request, counted


@pytest.mark.parametrize("host", [b"127.0.0.1:{port}", b"localhost:{port}", b"LOCALHOST.",
                                  b"app.localhost:{port}", b"127.0.0.2", b"[::1]:{port}"])
def test_loopback_names_are_answered(gw: GatewayServer, host: bytes) -> None:
    port = gw.url.rsplit(":", 1)[1].encode()
    status, body = exchange(gw, host.replace(b"{port}", port))
    assert status == 200, body
    assert body["zml_routing"]["policy"] == "prod"


def test_allowed_hosts_lets_a_reverse_proxys_names_through(serve_gateway: Make) -> None:
    gw = serve_gateway(NODES, POLICIES, gateway=OPEN + '\nallowed_hosts = ["LLM.example.com", '
                       '".corp.example", "[::2]"]')
    for host in (b"llm.example.com", b"llm.example.com:443", b"corp.example", b"a.b.corp.example",
                 b"[::2]:8400"):
        status, body = exchange(gw, host)
        assert status == 200, (host, body)
    for host in (b"example.com", b"evilcorp.example", b"llm.example.com.evil.example"):
        status, body = exchange(gw, host)
        assert (status, body["error"]["code"]) == (403, "host_not_allowed"), host
    # A page of a listed host may call it (the operator said so).
    status, _ = exchange(gw, b"llm.example.com", extra=b"Origin: https://llm.example.com\r\n")
    assert status == 200


def test_a_web_pages_request_from_another_origin_is_refused(gw: GatewayServer) -> None:
    """What ``fetch(url, {method: "POST", body: new Blob([json])})`` sends from any page: no
    content type, so no CORS preflight; the gateway must not run it."""
    for origin in (b"https://evil.example", b"null", b"http://localhost:3000", b"not a url["):
        r = httpx2.post(f"{gw.base_url}/chat/completions", content=BODY,
                        headers={"origin": origin.decode()}, timeout=30)
        assert r.status_code == 403, origin
        error = r.json()["error"]
        assert error["code"] == "origin_not_allowed"
        assert "allowed_hosts" in error["message"] and "program" in error["message"]
    r = httpx2.get(f"{gw.base_url}/models", headers={"origin": "https://evil.example"},
                   timeout=30)
    assert r.status_code == 403
    assert gw.node("h100-1").stats.requests_total == 0
    # The gateway's own origin (a page it served, which it does not, or a tool that sends it).
    r = httpx2.post(f"{gw.base_url}/chat/completions", content=BODY,
                    headers={"origin": gw.url}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_star_turns_both_checks_off(serve_gateway: Make) -> None:
    gw = serve_gateway(NODES, POLICIES, gateway=OPEN + '\nallowed_hosts = ["*"]')
    status, body = exchange(gw, b"anything.example", extra=b"Origin: https://evil.example\r\n")
    assert status == 200, body


def test_a_request_arriving_on_another_address_is_not_host_checked(gw: GatewayServer) -> None:
    """A gateway serving the network (bound to 0.0.0.0): a peer that reaches it on a LAN
    address may call it by any name; a page's Origin is still checked."""
    from zml.gateway.hosts import HostCheckMiddleware

    reached: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    check = HostCheckMiddleware(inner, gw.gateway)

    def scope(server: tuple[str, int], headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
        return {"type": "http", "path": "/v1/models", "server": server, "headers": headers}

    lan = ("192.0.2.10", 8400)
    asyncio.run(check(scope(lan, [(b"host", b"gateway.lan:8400")]), receive, send))
    assert reached == ["/v1/models"] and not sent
    # The same Host over loopback (IPv4-mapped): what was fine on the LAN address is not here.
    asyncio.run(check(scope(("::ffff:127.0.0.1", 8400), [(b"host", b"gateway.lan:8400")]),
                      receive, send))
    assert reached == ["/v1/models"] and sent[0]["status"] == 403
    sent.clear()
    asyncio.run(check(scope(lan, [(b"host", b"gateway.lan"), (b"origin", b"http://evil.example")]),
                      receive, send))
    assert reached == ["/v1/models"] and sent[0]["status"] == 403


def test_a_keyed_gateway_hides_its_paths_from_callers_without_a_key(serve_gateway: Make) -> None:
    key = "gw-hosts-key-5e2a90"
    gw = serve_gateway(NODES, POLICIES, gateway=OPEN + '\napi_keys_env = "GW_KEYS"',
                       environ={"GW_KEYS": key})
    auth = {"authorization": f"Bearer {key}"}
    for method, path in (("GET", "/v1/nope"), ("POST", "/v1/models"),
                         ("POST", "/v1/chat/completions/")):
        anonymous = httpx2.request(method, f"{gw.url}{path}", timeout=30)
        assert anonymous.status_code == 401, (method, path)
        assert anonymous.json()["error"]["code"] == "invalid_api_key"
        known = httpx2.request(method, f"{gw.url}{path}", headers=auth, timeout=30)
        assert known.status_code in (404, 405), (method, path, known.status_code)
        assert "error" in known.json()


def test_a_trailing_slash_is_an_openai_shaped_404_not_a_redirect(gw: GatewayServer) -> None:
    r = httpx2.post(f"{gw.base_url}/chat/completions/", content=BODY, timeout=30)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
    assert "/v1/chat/completions/" in r.json()["error"]["message"]
