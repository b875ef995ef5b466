"""``x-request-id``: on every gateway response, kept from the caller when plausible, sent on to
the node, named in the log line and the body of an unexpected error; and ``GET
/v1/models/{id}``, which the openai SDKs call as ``models.retrieve``."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest

from tests.conftest import MODEL
from tests.e2e.hostile import serving, write_config

from .conftest import GatewayServer, _Thread

Make = Callable[..., GatewayServer]
MSGS = [{"role": "user", "content": "hi"}]
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}}
FRESH = re.compile(r"req_[0-9a-f]{32}")


@pytest.fixture
def gw(serve_gateway: Make) -> GatewayServer:
    return serve_gateway(NODES, POLICIES, gateway='[gateway]\ndefault_policy = "prod"')


def test_every_response_carries_a_fresh_request_id(gw: GatewayServer) -> None:
    url = gw.base_url
    chat = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    responses = [
        httpx2.post(f"{url}/chat/completions", json=chat, timeout=30),
        httpx2.post(f"{url}/chat/completions", json={**chat, "stream": True}, timeout=30),
        httpx2.post(f"{url}/chat/completions", json={"model": MODEL}, timeout=30),  # 400
        httpx2.get(f"{url}/models", timeout=30),
        httpx2.get(f"{url}/nowhere", timeout=30),  # 404 of the router
        httpx2.get(f"{gw.url}/health", timeout=30),
    ]
    assert [r.status_code for r in responses] == [200, 200, 400, 200, 404, 200]
    ids = [r.headers.get_list("x-request-id") for r in responses]
    assert all(len(one) == 1 and FRESH.fullmatch(one[0]) for one in ids), ids
    assert len({one[0] for one in ids}) == len(ids)


@pytest.mark.parametrize(("sent", "kept"), [
    ("trace-7f3a:1.2_x", True), ("a" * 128, True),
    ("a" * 129, False), ("has space", False), ("", False), ("ünï", False),
])
def test_a_plausible_caller_id_is_kept_and_anything_else_replaced(
        gw: GatewayServer, sent: str, kept: bool) -> None:
    r = httpx2.get(f"{gw.base_url}/models", headers={"x-request-id": sent.encode()}, timeout=30)
    got = r.headers["x-request-id"]
    assert got == sent if kept else FRESH.fullmatch(got)


def test_the_openai_sdk_reads_the_id_and_retrieves_models(gw: GatewayServer) -> None:
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0) as oa:
        raw = oa.chat.completions.with_raw_response.create(
            model=MODEL, messages=MSGS, max_tokens=2)  # type: ignore[arg-type]
        assert FRESH.fullmatch(raw.headers["x-request-id"])
        assert raw.parse()._request_id == raw.headers["x-request-id"]
        model = oa.models.retrieve(MODEL)  # an id with a "/" in it
        assert model.id == MODEL and model.object == "model"
        with pytest.raises(openai.NotFoundError) as info:
            oa.models.retrieve("no-such-model")
        assert info.value.code == "model_not_found"
        assert FRESH.fullmatch(info.value.request_id or "")


def test_the_node_gets_the_gateway_request_s_id(tmp_path: Path) -> None:
    from zml.gateway import create_app

    with serving() as hostile:
        _node_gets_the_id(hostile, tmp_path, create_app)


def _node_gets_the_id(hostile: Any, tmp_path: Path, create_app: Any) -> None:
    config = write_config(tmp_path / "zml.toml", hostile, {"n-ok": "ok"},
                          extra='[gateway]\ndefault_policy = "hostile"\n')
    thread = _Thread(create_app(config, environ={}, probe_interval_s=None)).start()
    try:
        r = httpx2.post(f"http://127.0.0.1:{thread.port}/v1/chat/completions",
                        json={"model": MODEL, "messages": MSGS},
                        headers={"x-request-id": "caller-42"}, timeout=30)
        s = httpx2.post(f"http://127.0.0.1:{thread.port}/v1/chat/completions",
                        json={"model": MODEL, "messages": MSGS, "stream": True}, timeout=30)
    finally:
        thread.stop()
    assert r.status_code == s.status_code == 200
    sent = [req.headers.get("x-request-id") for req in hostile.requests_for("ok")]
    assert sent == ["caller-42", s.headers["x-request-id"]]


def test_an_unexpected_error_names_its_request_id_in_the_body_and_the_log(
        gw: GatewayServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(routing: object) -> Any:
        raise RuntimeError("a bug in the gateway")

    monkeypatch.setattr("zml.gateway.completions.routing_headers", broken)
    caplog.set_level(logging.ERROR, logger="zml.gateway")
    r = httpx2.post(f"{gw.base_url}/chat/completions",
                    json={"model": MODEL, "messages": MSGS, "max_tokens": 2}, timeout=30)
    rid = r.headers["x-request-id"]
    assert r.status_code == 500 and f"request {rid}" in r.json()["error"]["message"]
    (record,) = [rec for rec in caplog.records if "unexpected error" in rec.getMessage()]
    assert rid in record.getMessage()
