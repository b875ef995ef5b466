"""The official ``openai`` npm package on Node.js against the gateway.

The package is installed with npm into a temporary folder once per test session (the npm
registry must be reachable); a small script (``js/client.mjs``) makes a JSON request with
``.withResponse()`` headers, a stream with usage, and two failing requests, and prints what it
saw as JSON. Without node or npm they are installed with apt-get where we are root on a
Debian-like machine; otherwise the test FAILS with a message saying what to install.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import MODEL, system_tool

from .conftest import GATEWAY_KEY, GatewayServer

SCRIPT = Path(__file__).parent / "js" / "client.mjs"
NPM_PACKAGE = "openai@^7"
FAMILIES = {"H100": {}, "MI300X": {}}
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4},
         {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}, "amd": {"accelerator_chain": ["MI300X"]}}


def _tool(name: str) -> str:
    return system_tool(name, packages=["nodejs", "npm"],
                       why="this test runs the official openai npm package on Node.js",
                       how="Node.js 18+ with npm; Debian/Ubuntu: apt-get install nodejs npm")


@pytest.fixture(scope="session")
def node_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the openai npm package installed (once per session)."""
    node, npm = _tool("node"), _tool("npm")
    folder = tmp_path_factory.mktemp("npm-openai")
    (folder / "package.json").write_text('{"name": "zml-gateway-test", "private": true, '
                                         '"type": "module"}\n')
    result = subprocess.run(
        [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", NPM_PACKAGE],
        cwd=folder, capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        pytest.fail(f"npm install {NPM_PACKAGE} failed:\n{result.stderr[-2000:]}",
                    pytrace=False)
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    assert int(version.stdout.strip().lstrip("v").split(".")[0]) >= 18, version.stdout
    shutil.copy(SCRIPT, folder / SCRIPT.name)
    return folder


def test_the_openai_npm_package_gets_completions_streams_headers_and_errors(
        serve_gateway: Callable[..., GatewayServer], node_project: Path) -> None:
    gw = serve_gateway(NODES, POLICIES, families=FAMILIES,
                       gateway='[gateway]\ndefault_policy = "prod"\napi_keys_env = "GW_KEYS"',
                       environ={"GW_KEYS": GATEWAY_KEY})
    result = subprocess.run(
        [_tool("node"), SCRIPT.name, gw.base_url, GATEWAY_KEY, MODEL], cwd=node_project,
        capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["json"]["content"]
    assert out["json"]["completionTokens"] == 5
    assert out["json"]["headers"] == {"node": "h100-1", "accelerator": "H100",
                                      "policy": "prod", "attempts": "1"}
    assert out["json"]["zmlRouting"]["node_id"] == "h100-1"
    assert out["stream"]["text"]
    assert out["stream"]["usage"]["completion_tokens"] == 4
    assert out["stream"]["zmlRouting"]["node_id"] == "mi300x-1"
    assert out["stream"]["zmlRouting"]["policy"] == "amd"
    assert out["badPolicy"]["status"] == 400
    assert out["badPolicy"]["param"] == "x-zml-policy"
    assert out["badPolicy"]["code"] == "unknown_policy"
    assert out["badPolicy"]["name"] == "BadRequestError"
    assert out["badKey"] == {"status": 401, "name": "AuthenticationError"}
