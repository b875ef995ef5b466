"""NodeConfig's URL and key rules: no credentials or control characters, api_key_env, redaction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import zml
from zml.cli import main
from zml.config import (
    NodeConfig,
    load_registry,
    node_api_key,
    registry_from_mapping,
)
from zml.node_urls import display_url, redact_url


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


@pytest.mark.parametrize("field", ["id", "family", "models"])
@pytest.mark.parametrize(("bad", "fragment"), [
    ("n0\r\nx-injected: yes", "a carriage return"),  # a header of every reply, else
    ("n0\x85", "control character (U+0085)"),
    ("n0 ", "whitespace"),
    (" ", "whitespace"),
])
def test_a_name_that_cannot_go_in_a_header_is_refused(tmp_path: Path, field: str, bad: str,
                                                      fragment: str) -> None:
    """Node ids, families and models go into response headers, metric labels and logs: a
    control character would break the reply of every request the node serves, after the
    node did the work."""
    node = {"id": "n1", "family": "H100", "url": "http://127.0.0.1:8000", "models": ["m"],
            "max_concurrency": 1, field: [bad] if field == "models" else bad}
    path = tmp_path / "zml.toml"
    path.write_text("[accelerators.H100]\n[[nodes]]\n"
                    + "".join(f"{k} = {json.dumps(v)}\n" for k, v in node.items()))
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert fragment in str(info.value) and info.value.field.startswith(f"nodes[0].{field}")


@pytest.mark.parametrize("text", [
    '[accelerators."H\\u0007"]\n',
    '[accelerators.H100]\n[policies."p\\u0007"]\naccelerator_chain = ["H100"]\n',
])
def test_a_family_or_policy_name_that_cannot_go_in_a_header_is_refused(tmp_path: Path,
                                                                      text: str) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(text)
    with pytest.raises(zml.PolicyConfigError, match=r"control character \(U\+0007\)"):
        load_registry(path)


def test_a_policy_name_from_code_is_checked_too() -> None:
    with pytest.raises(zml.PolicyConfigError, match="ends with a newline") as info:
        zml.Policy(name="p\n", accelerator_chain=["H100"])
    assert info.value.field == "name"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://127.0.0.1:8000/?api-key=TOKEN", "http://127.0.0.1:8000/?…"),
        ("https://gpu.example/v1?token=TOKEN&x=1", "https://gpu.example/v1?…"),
        ("http://127.0.0.1:8000#TOKEN", "http://127.0.0.1:8000#…"),
    ],
)
def test_a_query_or_fragment_in_a_url_is_refused_and_not_shown(url: str, shown: str) -> None:
    # A token in the query would be sent in the middle of the path (zml appends /v1/...) and
    # shown in routing info, spans and `zml fleet status`.
    with pytest.raises(zml.PolicyConfigError) as info:
        _node(url=url)
    text = str(info.value)
    assert "query string or fragment" in text and repr(shown) in text
    assert "TOKEN" not in text and "TOKEN" not in str(info.value.value)
    assert info.value.field == "url"


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


NODE_TOML = ('[[nodes]]\nid = "n1"\nfamily = "H100"\nurl = "http://127.0.0.1:8000"\n'
             'models = ["m"]\nmax_concurrency = 1\n')


@pytest.mark.parametrize(("table", "key", "where"), [
    ("[accelerators.H100]\n", "cost_per_hour", "accelerators.H100.cost_per_hour"),
    ("[accelerators.H100]\n", "cost_per_1k_tokens", "accelerators.H100.cost_per_1k_tokens"),
    ("[accelerators.H100.sim]\n", "ttft_ms", "accelerators.H100.sim.ttft_ms"),
    ("[accelerators.H100.sim]\n", "kv_cache_tokens", "accelerators.H100.sim.kv_cache_tokens"),
    ("[nodes.sim]\n", "queue_size", "nodes[0].sim.queue_size"),
    ("[nodes.sim.faults]\n", "error_rate", "nodes[0].sim.faults.error_rate"),
    ("[nodes.sim.faults]\n", "seed", "nodes[0].sim.faults.seed"),
])
@pytest.mark.parametrize("value", ['"4"', "true"])
def test_every_number_of_the_file_is_a_number_not_a_string_or_a_bool(
        tmp_path: Path, table: str, key: str, where: str, value: str) -> None:
    """As for nodes and policies: ``"4"`` is a typo'd number, ``true`` is not 1 (pydantic's lax
    mode would have taken both)."""
    path = tmp_path / "zml.toml"
    head = "[accelerators.H100]\n" if table.startswith("[nodes") else ""
    body = NODE_TOML if table.startswith("[nodes") else ""
    path.write_text(head + body + table + f"{key} = {value}\n")
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert info.value.field == where, str(info.value)
    assert f"{where} = " in str(info.value)


def test_a_key_pasted_under_a_wrong_name_is_not_kept_in_the_error(tmp_path: Path) -> None:
    key = "sk-live-PASTED-NODE-KEY-123456"
    path = tmp_path / "zml.toml"
    path.write_text("[accelerators.H100]\n" + NODE_TOML + f'api_key = "{key}"\n')
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert "unknown key nodes[0].api_key; did you mean 'api_key_env'?" in str(info.value)
    assert key not in repr(info.value) and info.value.value is None


@pytest.mark.parametrize("url", [b"http://admin:hunter2@n1:8000", bytearray(b"http://n1:8000")])
def test_a_node_url_must_be_a_string_not_bytes(url: object) -> None:
    """pydantic would take bytes for a str, past the no-credentials rule (credentials and all,
    which the HTTP client then sends as Basic auth)."""
    with pytest.raises(zml.PolicyConfigError) as info:
        _node(url=url)
    assert "url must be a string" in str(info.value) and info.value.field == "url"
    assert "hunter2" not in str(info.value)
    with pytest.raises(zml.PolicyConfigError, match="url must be a string"):
        registry_from_mapping({"accelerators": {"H100": {}}, "nodes": [
            {"id": "n1", "family": "H100", "url": url, "models": ["m"], "max_concurrency": 1}]})


def test_a_node_url_with_port_0_is_refused() -> None:
    with pytest.raises(ValueError, match="has port 0, which no node listens on"):
        _node(url="http://localhost:0")


def test_api_key_env_names_an_environment_variable() -> None:
    assert _node(api_key_env="H100_KEY").api_key_env == "H100_KEY"
    for bad in ["1KEY", "MY-KEY", "", "A B", "sk-abc123"]:
        with pytest.raises(Exception, match="must be the name of an environment variable"):
            _node(api_key_env=bad)


def test_a_key_pasted_into_api_key_env_is_never_shown(tmp_path: Path) -> None:
    key = "sk-live-PASTED-0123456789"
    path = tmp_path / "zml.toml"
    path.write_text(f'[accelerators.H100]\n[[nodes]]\nid = "n1"\nfamily = "H100"\n'
                    f'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 1\n'
                    f'api_key_env = "{key}"\n')
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert "nodes[0].api_key_env = <not shown>" in str(info.value)
    assert "not the key itself" in str(info.value)
    assert key not in str(info.value) and key not in repr(info.value.value)


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


# Passwords that end the URL's authority early (#, ?, /), URLs too malformed to parse (one
# slash, no scheme, an unclosed IPv6 bracket): the password must still never be shown.
LEAKY_URLS = [
    "http:/alice:S3C_RETPW@127.0.0.1:8000",
    "http://alice:S3C#RETPW@127.0.0.1:8000",
    "http://alice:S3C?RETPW@127.0.0.1:8000",
    "http://alice:S3C/RETPW@127.0.0.1:8000",
    "http://alice:1234/S3C_RETPW@127.0.0.1:8000",  # parses: host "alice", port 1234, a path
    "alice:S3C_RETPW@127.0.0.1:8000",
    "http://alice:S3C_RETPW@[::1",
]


def _assert_hidden(*texts: object) -> None:
    for text in map(str, texts):
        assert "S3C" not in text and "RETPW" not in text and "alice" not in text, text


@pytest.mark.parametrize("url", LEAKY_URLS)
def test_a_malformed_url_with_credentials_never_shows_the_password(
    url: str, tmp_path: Path
) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        _node(url=url)
    assert "contains credentials" in str(info.value) and info.value.field == "url"
    _assert_hidden(info.value, repr(info.value.value), info.value.args)
    path = tmp_path / "zml.toml"
    path.write_text(f'[accelerators.H100]\n[[nodes]]\nid = "n1"\nfamily = "H100"\n'
                    f"url = {json.dumps(url)}\nmodels = [\"m\"]\nmax_concurrency = 1\n")
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert str(info.value).startswith(f"{path}: node 'n1': url ")
    _assert_hidden(info.value, repr(info.value.value))


def test_policy_check_never_shows_a_password_of_a_malformed_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zml.toml"
    path.write_text("[accelerators.H100]\n" + "".join(
        f'[[nodes]]\nid = "n{i}"\nfamily = "H100"\nurl = {json.dumps(url)}\nmodels = ["m"]\n'
        "max_concurrency = 1\n" for i, url in enumerate(LEAKY_URLS)))
    assert main(["policy", "check", "--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("contains credentials") == len(LEAKY_URLS)
    _assert_hidden(captured.out, captured.err)


@pytest.mark.parametrize(
    "body",
    [
        '[nodes]\nid = "n1"\nurl = "http://alice:S3C_RETPW@127.0.0.1:1"\n',  # a table, not [[ ]]
        '[[nodes]]\nid = "n1"\nfamily = "H100"\nurl = ["http://alice:S3C_RETPW@127.0.0.1:1"]\n'
        'models = ["m"]\nmax_concurrency = 1\n',
    ],
)
def test_a_url_in_a_bad_value_that_pydantic_reports_is_redacted(body: str, tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text("[accelerators.H100]\n" + body)
    with pytest.raises(zml.PolicyConfigError) as info:
        load_registry(path)
    assert "127.0.0.1:1" in str(info.value)  # the value is shown, without its userinfo
    _assert_hidden(info.value, repr(info.value.value))


def test_an_at_sign_in_a_path_must_be_percent_encoded() -> None:
    with pytest.raises(zml.PolicyConfigError, match="must be written %40"):
        _node(url="http://127.0.0.1:8000/a@b")
    assert _node(url="http://127.0.0.1:8000/a%40b").url == "http://127.0.0.1:8000/a%40b"


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/",
                                 "https://llm.example.com/proxy/V1"])
def test_an_openai_style_base_url_is_refused_with_the_root_to_write(url: str) -> None:
    """zml adds /v1 itself: such a node was "ok" to `zml policy check`, "up" to `zml fleet
    status`, and then answered 404 to every request (/v1/v1/chat/completions)."""
    with pytest.raises(zml.PolicyConfigError, match="ends in /v1, which zml adds itself") as info:
        _node(url=url)
    root = url.rstrip("/")[:-3]
    assert str(info.value).endswith(f"write the server's root, {root!r}")
    assert _node(url="http://127.0.0.1:8000/v1beta").url.endswith("/v1beta")


def test_an_unparsable_url_is_a_clear_error() -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        _node(url="http://[::1")
    assert str(info.value) == ("node 'n1': url 'http://[::1' is not a valid URL (Invalid IPv6 "
                               "URL); write e.g. 'http://127.0.0.1:8000' or 'http://[::1]:8000'")
    assert _node(url="http://[::1]:8000").url == "http://[::1]:8000"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http:/alice:PW@h:1", "…@h:1"),
        ("http://alice:P/W@h:1", "…@h:1"),
        ("http://alice:P#W@h:1", "http://h:1"),
        ("http://h:1/x", "http://h:1/x"),
    ],
)
def test_display_url_hides_everything_up_to_the_last_at(url: str, shown: str) -> None:
    assert display_url(url) == shown


def test_a_zml_toml_nested_too_deeply_is_one_config_error(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(zml.PolicyConfigError, match="nested too deeply to read"):
        load_registry(path)


def test_a_zml_toml_with_a_byte_order_mark_says_so(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_bytes(b"\xef\xbb\xbf[accelerators.H100]\n")
    with pytest.raises(zml.PolicyConfigError, match=r"byte-order mark \(BOM\): re-save it"):
        load_registry(path)
