"""NodeConfig's URL and key rules: no credentials or control characters, api_key_env, redaction."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zml
from zml.config import NodeConfig, load_registry, node_api_key, redact_url


def _node(**fields: Any) -> NodeConfig:
    base: dict[str, Any] = {"id": "n1", "family": "H100", "url": "http://127.0.0.1:8000",
                            "models": ["m"], "max_concurrency": 2}
    return NodeConfig(**{**base, **fields})


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://alice:PW@127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("http://alice@127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("https://:PW@gpu.example/v1", "https://gpu.example/v1"),
        ("http://a:b@c:d@127.0.0.1:1", "http://127.0.0.1:1"),
    ],
)
def test_credentials_in_a_url_are_refused_and_not_shown(url: str, shown: str) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        _node(url=url)
    text = str(info.value)
    assert "contains credentials" in text and repr(shown) in text
    assert "PW" not in text and "alice" not in text and "PW" not in str(info.value.value)
    assert "api_key_env" in text and info.value.field == "url"


def test_credentials_in_a_zml_toml_are_refused_at_load(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text('[accelerators.H100]\n[[nodes]]\nid = "n1"\nfamily = "H100"\n'
                    'url = "http://alice:PW@127.0.0.1:8000"\nmodels = ["m"]\n'
                    "max_concurrency = 1\n")
    with pytest.raises(zml.PolicyConfigError, match="node 'n1': url") as info:
        load_registry(path)
    assert "PW" not in str(info.value)


@pytest.mark.parametrize("bad", ["\n", "\r", "\t", " ", "\0", "\x7f", "\u2028"])
def test_control_characters_in_a_url_are_refused(bad: str) -> None:
    with pytest.raises(zml.PolicyConfigError, match="control character or whitespace"):
        _node(url=f"http://127.0.0.1:8000/{bad}x")


def test_a_good_url_is_kept() -> None:
    assert _node(url="http://127.0.0.1:8000/").url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://u:p@h:1/x?q=1", "http://h:1/x?q=1"),
        ("http://h:1/a@b", "http://h:1/a@b"),
        ("h:1", "h:1"),
        ("u:p@h", "h"),
        ("http://h", "http://h"),
        ("", ""),
    ],
)
def test_redact_url_strips_userinfo_only(url: str, shown: str) -> None:
    assert redact_url(url) == shown


@pytest.mark.parametrize("field", ["max_concurrency", "max_queue"])
def test_counts_must_be_integers_not_strings(field: str) -> None:
    with pytest.raises(Exception) as info:
        _node(**{field: "2"})
    assert "valid integer" in str(info.value)


def test_api_key_env_names_an_environment_variable() -> None:
    assert _node(api_key_env="H100_KEY").api_key_env == "H100_KEY"
    for bad in ["1KEY", "MY-KEY", "", "A B", "sk-abc123"]:
        with pytest.raises(Exception, match="must be the name of an environment variable"):
            _node(api_key_env=bad)


def test_node_api_key_reads_and_checks_the_variable() -> None:
    node = _node(api_key_env="NODE_KEY")
    assert node_api_key(node, {"NODE_KEY": "sk-1"}) == "sk-1"
    assert node_api_key(_node(), {"NODE_KEY": "sk-1"}) is None
    with pytest.raises(zml.PolicyConfigError, match="NODE_KEY is not set"):
        node_api_key(node, {})
    with pytest.raises(zml.PolicyConfigError, match="NODE_KEY is empty"):
        node_api_key(node, {"NODE_KEY": ""})
    with pytest.raises(zml.InvalidRequestError) as info:
        node_api_key(node, {"NODE_KEY": "sk-hidden\n"})
    assert str(info.value).startswith("$NODE_KEY (api_key_env of node 'n1') ends with a newline")
    assert "hidden" not in str(info.value)


def test_node_api_key_reads_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_KEY_2", "sk-2")
    assert node_api_key(_node(api_key_env="NODE_KEY_2")) == "sk-2"
