"""curl against the gateway (the binary on PATH): what a shell script or any HTTP tool sees.

Without curl the test FAILS with a message saying what to install.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import pytest

from tests.conftest import MODEL, system_tool

from .conftest import GATEWAY_KEY, GatewayServer

NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}}


def curl(*args: str) -> tuple[dict[str, str], str, int]:
    """Run curl -i; return the headers (lower-cased names), the body and the status."""
    binary = system_tool("curl", packages=["curl"], why="this test calls the gateway with curl",
                         how="Debian/Ubuntu: apt-get install curl")
    result = subprocess.run([binary, "-sS", "-i", "--max-time", "30", *args],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    head, _, body = result.stdout.replace("\r\n", "\n").partition("\n\n")
    status_line, *lines = head.split("\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    return headers, body, int(status_line.split()[1])


@pytest.fixture
def gw(serve_gateway: Callable[..., GatewayServer]) -> GatewayServer:
    return serve_gateway(NODES, POLICIES,
                         gateway='[gateway]\ndefault_policy = "prod"\napi_keys_env = "GW_KEYS"',
                         environ={"GW_KEYS": GATEWAY_KEY})


def test_curl_json_completion_with_routing_headers(gw: GatewayServer) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 3})
    headers, text, status = curl(f"{gw.base_url}/chat/completions",
                                 "-H", f"Authorization: Bearer {GATEWAY_KEY}",
                                 "-H", "Content-Type: application/json", "-d", body)
    assert status == 200
    assert headers["x-zml-node-id"] == "h100-1"
    assert headers["x-zml-policy"] == "prod"
    data = json.loads(text)
    assert data["choices"][0]["message"]["content"]
    assert data["zml_routing"]["accelerator"] == "H100"


def test_curl_streams_sse_to_done(gw: GatewayServer) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 3, "stream": True})
    headers, text, status = curl("-N", f"{gw.base_url}/chat/completions",
                                 "-H", f"Authorization: Bearer {GATEWAY_KEY}",
                                 "-H", "Content-Type: application/json", "-d", body)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["zml_routing"]["node_id"] == "h100-1"


def test_curl_without_a_key_gets_401_and_ops_routes_need_none(gw: GatewayServer) -> None:
    headers, text, status = curl(f"{gw.base_url}/chat/completions", "-d", "{}")
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    assert json.loads(text)["error"]["code"] == "invalid_api_key"
    _, health, status = curl(f"{gw.url}/health")
    assert status == 200 and json.loads(health) == {"status": "ok"}
    _, metrics, status = curl(f"{gw.url}/metrics")
    assert status == 200 and "zml_gateway_requests_total" in metrics
