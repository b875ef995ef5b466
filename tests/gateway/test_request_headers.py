"""Request headers the gateway reads: one ``Authorization`` and one ``x-zml-policy`` (two are
refused, whatever their order; with keys, the key is checked first), a body declared JSON,
and a policy name outside ASCII, as UTF-8 or as the gateway itself sends it."""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import quote

import httpx2
import pytest

from tests.conftest import MODEL

from .conftest import GATEWAY_KEY, GatewayServer, raw_exchange

Make = Callable[..., GatewayServer]
MSGS = [{"role": "user", "content": "hi"}]
BODY = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2}).encode()
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}, "batch-é": {"accelerator_chain": ["H100"]}}
KEYED = '[gateway]\ndefault_policy = "prod"\napi_keys_env = "GW_KEYS"'


@pytest.fixture
def keyed(serve_gateway: Make) -> GatewayServer:
    return serve_gateway(NODES, POLICIES, gateway=KEYED, environ={"GW_KEYS": GATEWAY_KEY})


def _post(gw: GatewayServer, headers: list[tuple[str, bytes]]) -> httpx2.Response:
    return httpx2.post(f"{gw.base_url}/chat/completions", content=BODY, headers=headers,
                       timeout=30)


@pytest.mark.parametrize("order", ["good-first", "bad-first"])
def test_two_authorization_headers_are_refused_in_either_order(keyed: GatewayServer,
                                                               order: str) -> None:
    pair = [("authorization", f"Bearer {GATEWAY_KEY}".encode()),
            ("authorization", b"Bearer not-a-key")]
    if order == "bad-first":
        pair.reverse()
    chat = _post(keyed, [*pair, ("content-type", b"application/json")])
    assert chat.status_code == 401  # which key a proxy in front checked is unknown
    assert "more than one Authorization header" in chat.json()["error"]["message"]
    models = httpx2.get(f"{keyed.base_url}/models", headers=pair, timeout=30)
    assert models.status_code == 401
    one = [("authorization", f"Bearer {GATEWAY_KEY}".encode())]
    assert _post(keyed, one).status_code == 200  # one key, no content-type: read as JSON
    assert httpx2.get(f"{keyed.base_url}/models", headers=one, timeout=30).status_code == 200


@pytest.mark.parametrize("sent", [b"prod ", b" prod", b"\tprod\t"])
def test_whitespace_around_a_policy_header_is_not_part_of_the_name(keyed: GatewayServer,
                                                                   sent: bytes) -> None:
    """RFC 9110 5.5: the whitespace around a field value is not part of it (a server may
    still pass it on)."""
    # Sent on a raw socket: httpx2 itself refuses to send such a value.
    head, body = raw_exchange(
        keyed, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Authorization: Bearer " + GATEWAY_KEY.encode() + b"\r\n"
        b"x-zml-policy:" + sent + b"\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
    assert head.startswith(b"HTTP/1.1 200 "), head
    assert json.loads(body)["zml_routing"]["policy"] == "prod"


def test_two_policy_headers_are_refused(keyed: GatewayServer) -> None:
    auth = ("authorization", f"Bearer {GATEWAY_KEY}".encode())
    two = [("x-zml-policy", b"prod"), ("x-zml-policy", b"batch-e")]
    r = _post(keyed, [auth, *two])
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-zml-policy"
    assert _post(keyed, two).status_code == 401  # the key is checked first


def test_two_authorization_headers_on_an_open_gateway_are_a_400(serve_gateway: Make) -> None:
    open_gw = serve_gateway(NODES, POLICIES, gateway='[gateway]\ndefault_policy = "prod"')
    r = _post(open_gw, [("authorization", b"Bearer a"), ("authorization", b"Bearer b")])
    assert r.status_code == 400 and r.json()["error"]["param"] == "authorization"


@pytest.mark.parametrize("kind", [b"text/plain", b"application/x-www-form-urlencoded",
                                  b"multipart/form-data; boundary=x", b"text/plain;charset=UTF-8"])
def test_a_body_not_declared_json_is_refused_with_415(serve_gateway: Make, kind: bytes) -> None:
    """What a form can send (a page's request is refused for its Origin first: test_hosts)."""
    open_gw = serve_gateway(NODES, POLICIES, gateway='[gateway]\ndefault_policy = "prod"')
    r = _post(open_gw, [("content-type", kind)])
    assert r.status_code == 415
    error = r.json()["error"]
    assert error["code"] == "unsupported_media_type" and "application/json" in error["message"]
    assert open_gw.node("h100-1").stats.requests_total == 0
    for ok in (b"application/json", b"application/json; charset=utf-8", b"application/x+json"):
        assert _post(open_gw, [("content-type", ok)]).status_code == 200


@pytest.mark.parametrize("sent", ["batch-é".encode(), quote("batch-é").encode(),
                                  "batch-é".encode("latin-1")])
def test_a_non_ascii_policy_name_is_chosen_as_utf8_or_percent_encoded(
        keyed: GatewayServer, sent: bytes) -> None:
    auth = ("authorization", f"Bearer {GATEWAY_KEY}".encode())
    r = _post(keyed, [auth, ("x-zml-policy", sent)])
    assert r.status_code == 200, r.text
    assert r.json()["zml_routing"]["policy"] == "batch-é"
    assert r.headers["x-zml-policy"] == quote("batch-é")  # what a client can send back
