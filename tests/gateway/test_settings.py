"""The [gateway] table, gateway keys and the error mapping, without a network."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import zml
from tests.conftest import MODEL, render_config
from zml.config import load_registry
from zml.gateway import GatewaySettings, create_app
from zml.gateway.auth import KeyRing
from zml.gateway.errors import reply_for, retry_after
from zml.gateway.settings import gateway_settings

FAMILIES = {"H100": {}}
NODES = [{"id": "n1", "family": "H100", "url": "http://127.0.0.1:9", "models": [MODEL],
          "max_concurrency": 2}]
POLICIES = {"prod": {"accelerator_chain": ["H100"]}}


def write(tmp_path: Path, gateway: str) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(render_config(FAMILIES, NODES, POLICIES) + "\n" + gateway + "\n")
    return path


def test_the_gateway_table_is_kept_raw_on_the_registry_and_validated_by_the_gateway(
        tmp_path: Path) -> None:
    path = write(tmp_path, '[gateway]\ndefault_policy = "prod"\n'
                 f'[gateway.aliases]\n"chat" = {{ model = "{MODEL}", policy = "prod" }}\n')
    registry = load_registry(path)
    assert registry.gateway["default_policy"] == "prod"
    settings = gateway_settings(registry)
    assert settings.default_policy == "prod"
    assert settings.aliases["chat"].model == MODEL
    assert settings.aliases["chat"].policy == "prod"
    assert not settings.auth_configured
    # The SDK client accepts a file with a [gateway] table.
    with zml.Client(config=path) as client:
        assert "prod" in client.policies


def test_a_file_without_the_table_gets_defaults(tmp_path: Path) -> None:
    settings = gateway_settings(load_registry(write(tmp_path, "")))
    assert settings == GatewaySettings()


@pytest.mark.parametrize(("gateway", "expected"), [
    ('[gateway]\ndefault_polcy = "prod"\n',
     ["unknown key gateway.default_polcy", "did you mean 'default_policy'"]),
    ('[gateway]\nmax_body_bytes = 10\n', ["gateway.max_body_bytes = 10"]),
    ('[gateway]\nmax_body_bytes = "4096"\n', ["gateway.max_body_bytes = '4096'"]),
    ('[gateway.aliases]\n"chat" = { modle = "x" }\n', ["unknown key gateway.aliases.chat.modle",
                                                       "did you mean 'model'"]),
    ('[gateway]\napi_keys_env = "ZML_API_KEY"\n', ["gateway.api_keys_env", "node"]),
    ('[gateway]\nbody_timeout_s = 0\n', ["gateway.body_timeout_s = 0"]),
    ('[gateway]\nbody_timeout_s = inf\n', ["gateway.body_timeout_s = inf"]),
    ('[gateway]\nbody_timeout_s = nan\n', ["gateway.body_timeout_s = nan"]),
    ('[gateway]\nbody_timeout_s = true\n', ["gateway.body_timeout_s = True"]),
    ('[gateway]\nbody_timeout_s = "30"\n', ["gateway.body_timeout_s = '30'"]),
    ('[gateway]\nallowed_hosts = "llm.example.com"\n',
     ["gateway.allowed_hosts = 'llm.example.com'", "must be a list of host names"]),
    ('[gateway]\nallowed_hosts = ["https://llm.example.com:443"]\n',
     ["gateway.allowed_hosts", "is not a host name", "no scheme, port or path"]),
    ('[gateway]\nallowed_hosts = [443]\n', ["gateway.allowed_hosts", "not 443"]),
])
def test_a_bad_gateway_key_names_the_key_and_the_value(tmp_path: Path, gateway: str,
                                                       expected: list[str]) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        gateway_settings(load_registry(write(tmp_path, gateway)))
    for text in expected:
        assert text in str(info.value)


def test_a_key_pasted_into_api_keys_env_is_never_shown(tmp_path: Path) -> None:
    key = "sk-gw-PASTED-0123456789"
    with pytest.raises(zml.PolicyConfigError) as info:
        gateway_settings(load_registry(write(tmp_path, f'[gateway]\napi_keys_env = "{key}"\n')))
    assert "gateway.api_keys_env = <not shown>" in str(info.value)
    assert key not in str(info.value) and info.value.value is None


def test_a_key_pasted_under_a_wrong_name_is_not_kept_in_the_error(tmp_path: Path) -> None:
    key = "gw-PASTED-GATEWAY-KEY-987654"
    with pytest.raises(zml.PolicyConfigError) as info:
        gateway_settings(load_registry(write(tmp_path, f'[gateway]\napi_keys = ["{key}"]\n')))
    assert "unknown key gateway.api_keys" in str(info.value)
    assert key not in str(info.value) and info.value.value is None


@pytest.mark.parametrize(("gateway", "expected"), [
    ('[gateway]\ndefault_policy = "prd"\n', ["default_policy = 'prd'", "known: prod"]),
    ('[gateway.aliases]\n"chat" = { model = "other-model" }\n', ["no node serves model "
                                                                 "'other-model'"]),
    (f'[gateway.aliases]\n"chat" = {{ model = "{MODEL}", policy = "nope" }}\n',
     ["policy 'nope' is not a known policy"]),
])
def test_an_alias_or_default_naming_an_unknown_model_or_policy_fails_at_start(
        tmp_path: Path, gateway: str, expected: list[str]) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        create_app(write(tmp_path, gateway), environ={}, probe_interval_s=None)
    for text in expected:
        assert text in str(info.value)


def test_keys_come_from_the_environment_variable_and_match_only_as_bearer_tokens() -> None:
    settings = GatewaySettings(api_keys_env="GW_KEYS")
    ring = KeyRing.from_settings(settings, None, {"GW_KEYS": " alpha , beta,,"})
    assert ring.enabled and len(ring) == 2
    assert ring.authenticate(b"Bearer alpha") is not None
    assert ring.authenticate(b"bearer beta") is not None
    for bad in (None, b"", b"alpha", b"Bearer ", b"Basic alpha", b"Bearer gamma"):
        assert ring.authenticate(bad) is None


def test_a_configured_key_source_with_no_key_refuses_to_serve_open(tmp_path: Path) -> None:
    with pytest.raises(zml.PolicyConfigError, match=r"\$GW_KEYS"):
        KeyRing.from_settings(GatewaySettings(api_keys_env="GW_KEYS"), None, {})
    assert not KeyRing.from_settings(GatewaySettings(), None, {}).enabled


def test_the_key_file_holds_hashes_and_optional_policies(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"k1").hexdigest()
    other = hashlib.sha256(b"k2").hexdigest()
    (tmp_path / "keys.txt").write_text(f"# comment\n\n{digest}  prod,batch  # team a\n{other}\n")
    settings = GatewaySettings(api_keys_file="keys.txt")
    ring = KeyRing.from_settings(settings, str(tmp_path / "zml.toml"), {})
    k1 = ring.authenticate(b"Bearer k1")
    k2 = ring.authenticate(b"Bearer k2")
    assert k1 is not None and k1.policies == {"prod", "batch"}
    assert k1.allows("prod") and not k1.allows("other") and not k1.allows(None)
    assert k2 is not None and k2.policies is None and k2.allows(None)
    assert ring.authenticate(f"Bearer {digest}".encode()) is None  # the hash is not the key


def test_a_bad_key_file_line_is_reported_without_echoing_it(tmp_path: Path) -> None:
    (tmp_path / "keys.txt").write_text("sk-plain-secret-key-pasted-by-mistake\n")
    with pytest.raises(zml.PolicyConfigError) as info:
        KeyRing.from_settings(GatewaySettings(api_keys_file=str(tmp_path / "keys.txt")), None,
                              {})
    assert "keys.txt:1" in str(info.value)
    assert "sk-plain-secret" not in str(info.value)
    with pytest.raises(zml.PolicyConfigError, match="cannot read"):
        KeyRing.from_settings(GatewaySettings(api_keys_file=str(tmp_path / "none.txt")), None,
                              {})


def test_the_body_timeout_is_30_seconds_unless_set(tmp_path: Path) -> None:
    assert GatewaySettings().body_timeout_s == 30.0
    settings = gateway_settings(load_registry(write(tmp_path, "[gateway]\nbody_timeout_s = 2\n")))
    assert settings.body_timeout_s == 2.0


def test_a_key_file_naming_an_unknown_policy_stops_the_gateway_at_start(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"k1").hexdigest()
    (tmp_path / "keys.txt").write_text(f"# team a\n{digest}  prod,prdo\n")
    path = write(tmp_path, '[gateway]\napi_keys_file = "keys.txt"\n')
    with pytest.raises(zml.PolicyConfigError) as info:
        create_app(path, environ={}, probe_interval_s=None)
    message = str(info.value)
    assert "keys.txt:2" in message and "'prdo'" in message and "did you mean 'prod'" in message
    assert "known: prod" in message and digest not in message
    assert info.value.suggestion == "prod" and info.value.field == "gateway.api_keys_file"
    (tmp_path / "keys.txt").write_text(f"{digest}  sk-live-pasted-by-mistake-9f2c\n")
    with pytest.raises(zml.PolicyConfigError) as info:
        create_app(path, environ={}, probe_interval_s=None)
    assert "keys.txt:1" in str(info.value) and "not a known policy" in str(info.value)
    assert "sk-live" not in str(info.value) and info.value.value is None  # never echoed


def test_a_key_file_with_a_byte_order_mark_is_read_and_one_not_in_utf8_is_refused(
        tmp_path: Path) -> None:
    digest = hashlib.sha256(b"k1").hexdigest()
    (tmp_path / "keys.txt").write_text(f"\ufeff{digest}  prod\n", encoding="utf-8")
    settings = GatewaySettings(api_keys_file="keys.txt")
    ring = KeyRing.from_settings(settings, str(tmp_path / "zml.toml"), {})
    key = ring.authenticate(b"Bearer k1")
    assert key is not None and key.policies == {"prod"}
    (tmp_path / "keys.txt").write_bytes(f"{digest}  caf\xe9\n".encode("latin-1"))
    with pytest.raises(zml.PolicyConfigError, match="not UTF-8"):
        KeyRing.from_settings(settings, str(tmp_path / "zml.toml"), {})


def context(final: str, *reasons: str) -> dict[str, object]:
    return {"policy": "p", "final_error": final, "recommendation": "",
            "evaluated": [{"family": f"F{i}", "nodes_checked": 1, "rejected_reason": r}
                          for i, r in enumerate(reasons)]}


@pytest.mark.parametrize(("ctx", "after"), [
    (context("no_viable_node", "all_nodes_over_capacity"), 1),
    (context("no_viable_node", "no_nodes_for_model", "all_nodes_over_capacity"), 1),
    (context("no_viable_node", "circuit_open"), 10),
    (context("queue_timeout", "all_nodes_over_capacity"), 1),
    (context("attempts_exhausted", "excluded_after_failure"), 10),
    (context("no_viable_node", "no_nodes_for_model"), None),
])
def test_retry_after_only_when_waiting_may_bring_capacity_back(ctx: dict[str, object],
                                                               after: int | None) -> None:
    assert retry_after(ctx) == after


def test_errors_are_openai_shaped() -> None:
    ctx = context("no_viable_node", "all_nodes_over_capacity")
    reply = reply_for(zml.RoutingError(ctx))
    body = json.loads(reply.body())
    assert reply.status == 503
    assert body["error"]["type"] == "routing_error"
    assert body["error"]["code"] == "no_viable_node"
    assert body["error"]["routing_context"] == ctx
    assert dict(reply.headers)[b"retry-after"] == b"1"
    bad = reply_for(zml.InvalidRequestError("messages must be a list", param="messages"))
    assert bad.status == 400 and bad.error["param"] == "messages"
    auth = reply_for(zml.AuthenticationError("node 'n1' answered HTTP 401: Incorrect API key "
                                             "provided: sk-abc123", status_code=401,
                                             node_id="n1"))
    assert auth.status == 502 and auth.error["code"] == "node_authentication_failed"
    assert "sk-abc123" not in auth.body().decode()
    limited = reply_for(zml.RateLimitError("slow down", retry_after=2.4, node_id="n1"))
    assert limited.status == 429 and dict(limited.headers)[b"retry-after"] == b"3"  # rounded up
    timeout = reply_for(zml.ZMLTimeoutError("deadline"))
    assert timeout.status == 504 and timeout.error["code"] == "deadline_exceeded"
    internal = reply_for(RuntimeError("boom"))
    assert internal.status == 500 and "boom" not in internal.body().decode()


def rate_limited(*errors: str, retry_after: float | None) -> zml.RoutingError:
    ctx = context("attempts_exhausted", "excluded_after_failure")
    ctx["attempts"] = [{"node_id": "n1", "accelerator": "H100", "error": e} for e in errors]
    exc = zml.RoutingError(ctx)
    exc.__cause__ = zml.RateLimitError("slow down", retry_after=retry_after, node_id="n1")
    return exc


@pytest.mark.parametrize(("retry", "header"), [(2.1, b"3"), (0.2, b"1"), (None, b"1")])
def test_attempts_that_were_all_rate_limited_are_a_429_keeping_the_routing_context(
        retry: float | None, header: bytes) -> None:
    reply = reply_for(rate_limited("rate_limited", "rate_limited", retry_after=retry))
    assert reply.status == 429 and dict(reply.headers)[b"retry-after"] == header
    assert reply.error["type"] == "rate_limit_error" and reply.error["code"] == "rate_limited"
    assert reply.error["routing_context"]["final_error"] == "attempts_exhausted"
    mixed = reply_for(rate_limited("rate_limited", "server_error", retry_after=retry))
    assert mixed.status == 503 and dict(mixed.headers)[b"retry-after"] == b"10"


def test_every_gateway_key_is_on_the_configuration_page() -> None:
    import re

    from zml.gateway import Alias

    text = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for anchor, model in (("gateway", GatewaySettings), ("gateway-aliases", Alias)):
        section = re.search(rf"\{{#{anchor}\}}\n(.*?)(?=\n## |\Z)", text, re.S)
        assert section, anchor
        documented = set(re.findall(r"^\| `([a-z_0-9]+)` \|", section.group(1), re.M))
        assert documented == set(model.model_fields), anchor
