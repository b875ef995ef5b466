"""zml.validation: every bad input is a typed error naming the parameter, and no key is echoed."""

from __future__ import annotations

import math
from typing import Any

import pytest

import zml
from zml.validation import (
    MAX_REQUEST_DEPTH,
    check_accelerator,
    check_api_key,
    check_json,
    check_params,
    check_policy_mapping,
    check_timeout,
    check_timeouts,
    encode_json,
    validate_messages,
)


@pytest.mark.parametrize("key", ["sk-abc", "sk_ABC.123-~!", "x" * 300])
def test_a_header_safe_key_is_accepted(key: str) -> None:
    assert check_api_key(key) == key


def test_no_key_and_an_empty_key_mean_no_key() -> None:
    assert check_api_key(None) is None
    assert check_api_key("") is None


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("sk-secret\n", "api_key ends with a newline"),
        ("sk-secret\r\n", "api_key ends with a newline"),
        ("sk-secret\r", "api_key ends with a carriage return"),
        ("sk-secret ", "api_key ends with a space"),
        ("\tsk-secret", "api_key starts with a tab"),
        ("sk-\0secret", "api_key contains, at position 3, a NUL byte"),
        ("sk-\x07secret", "api_key contains, at position 3, a control character (U+0007)"),
        ("sk-\x7fsecret", "api_key contains, at position 3, a control character (U+007F)"),
        ("sk-sécret", "api_key contains, at position 4, a non-ASCII character"),
        ("sk-se\u00a0cret", "a space character (U+00A0)"),
        ("sk-se\ud800cret", "a non-ASCII character"),
    ],
)
def test_a_bad_key_names_the_problem_and_never_the_key(key: str, problem: str) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        check_api_key(key)
    assert problem in str(info.value)
    assert "secret" not in str(info.value) and "cret" not in str(info.value)
    assert info.value.param == "api_key"


def test_a_key_that_is_not_a_string_is_refused() -> None:
    with pytest.raises(zml.InvalidRequestError, match="api_key must be a string, got bytes"):
        check_api_key(b"sk-abc")


def test_the_key_error_names_where_the_key_came_from() -> None:
    with pytest.raises(zml.InvalidRequestError, match=r"^\$NODE_KEY ends with a newline"):
        check_api_key("k\n", param="$NODE_KEY")


# --- JSON values ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "path"),
    [
        (math.nan, "temperature"),
        (math.inf, "temperature"),
        (-math.inf, "temperature"),
        ({"a": [1, {"b": math.nan}]}, "temperature.a[1].b"),
        (b"bytes", "temperature"),
        ({1, 2}, "temperature"),
        (frozenset(), "temperature"),
        (object(), "temperature"),
        (complex(1, 2), "temperature"),
        ({1: "x"}, "temperature"),
        ({("a",): "x"}, "temperature"),
        ("lone \ud800 surrogate", "temperature"),
        ({"k\udcff": 1}, "temperature key"),
    ],
)
def test_values_json_cannot_carry_are_refused_with_their_path(value: Any, path: str) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        check_json(value, "temperature")
    assert info.value.param == path
    assert str(info.value).startswith(path)


def test_json_values_pass() -> None:
    check_json({"a": [1, 2.5, True, None, "é", ("t", "u")], "b": {"c": -0.0}}, "extra_body")


def test_deep_or_cyclic_values_stop_at_the_depth_limit() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(zml.InvalidRequestError, match=f"more than {MAX_REQUEST_DEPTH} deep"):
        check_json(deep, "tools")
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    with pytest.raises(zml.InvalidRequestError, match="contains itself"):
        check_json(cyclic, "tools")


def test_encode_json_refuses_nan_and_names_the_parameter() -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        encode_json({"model": "m", "temperature": math.nan})
    assert info.value.param == "temperature"
    assert b"NaN" not in encode_json({"model": "m", "temperature": 0.5})
    assert encode_json({"t": "é"}) == '{"t":"é"}'.encode()


def test_check_params_names_nested_parameters() -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        check_params({"extra_body": {"logit_bias": {"5": math.inf}}})
    assert info.value.param == "extra_body.logit_bias.5"
    with pytest.raises(zml.InvalidRequestError, match=r"extra_body must be a dict \(of extra request fields\)"):
        check_params({"extra_body": [1]})
    check_params({"temperature": 0.2, "stop": ["\n"], "extra_body": None})


# --- messages ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ("hello", "messages"),
        (b"hello", "messages"),
        (None, "messages"),
        ([], "messages"),
        ([1], "messages[0]"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        ([{"role": ["user"], "content": "x"}], "messages[0].role"),
        ([{"role": {"u": 1}, "content": "x"}], "messages[0].role"),
        ([{"role": 5, "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": "a \ud83d b"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}],
         "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "name": b"n"}], "messages[0].name"),
        ([{"role": "user", "content": "x", 3: "y"}], "messages[0]"),
    ],
)
def test_bad_messages_name_the_message_and_field(messages: Any, param: str) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        validate_messages(messages)
    assert info.value.param == param


def test_good_messages_come_back_as_dicts() -> None:
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
            {"role": "user", "content": [{"type": "text", "text": "é"}]}]
    assert validate_messages(tuple(msgs)) == msgs


# --- accelerator, policy dicts, timeouts ---------------------------------------------------------


@pytest.mark.parametrize("value", [["H100"], {"H100"}, 5, b"H100", ""])
def test_accelerator_must_be_a_family_name(value: Any) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        check_accelerator(value)
    assert info.value.param == "accelerator"
    assert check_accelerator("H100") == "H100" and check_accelerator(None) is None


def test_a_policy_dict_with_a_non_string_key_is_a_policy_error() -> None:
    with pytest.raises(zml.PolicyConfigError, match="keys must be Policy field names"):
        check_policy_mapping({1: 2})
    check_policy_mapping({"name": "p"})


@pytest.mark.parametrize("value", [0, -1, -0.5, math.nan, math.inf, -math.inf, True, "5", [1]])
def test_a_bad_timeout_is_refused(value: Any) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        check_timeout(value, "timeout.idle")
    assert info.value.param == "timeout.idle"


def test_infinity_is_refused_in_favour_of_none() -> None:
    with pytest.raises(zml.InvalidRequestError, match="pass None for no limit"):
        check_timeout(math.inf, "timeout")


def test_good_timeouts_pass() -> None:
    assert check_timeout(None, "t") is None
    assert check_timeout(2, "t") == 2.0
    assert check_timeout(1e-3, "t") == 1e-3
    check_timeouts(600.0, 5.0, None, 60.0)
    with pytest.raises(zml.InvalidRequestError, match=r"^timeout\.connect = -1"):
        check_timeouts(600.0, -1, None, 60.0)


# --- through the public API: the checks dispatch must call ---------------------------------------

WIRING = "needs core wiring: "


@pytest.fixture
def client(tmp_path: Any) -> Any:
    import httpx2

    path = tmp_path / "zml.toml"
    path.write_text('[accelerators.H100]\n[[nodes]]\nid = "n"\nfamily = "H100"\n'
                    'url = "http://n:1"\nmodels = ["m"]\nmax_concurrency = 2\n')
    http = httpx2.Client(transport=httpx2.MockTransport(lambda r: httpx2.Response(500)))
    with zml.Client(config=path, http_client=http) as c:
        yield c


MSG = [{"role": "user", "content": "hi"}]


def test_nan_and_bytes_in_parameters_never_reach_the_wire(client: Any) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        client.infer("m", MSG, temperature=math.nan)
    assert info.value.param == "temperature"
    with pytest.raises(zml.InvalidRequestError) as info:
        client.infer("m", MSG, extra_body={"tags": {"a", "b"}})
    assert info.value.param == "extra_body.tags"
    with pytest.raises(zml.InvalidRequestError) as info:
        client.infer("m", [{"role": "user", "content": "x\ud800"}])
    assert info.value.param == "messages[0].content"


def test_an_unhashable_role_is_an_invalid_request(client: Any) -> None:
    with pytest.raises(zml.InvalidRequestError, match=r"messages\[0\].role"):
        client.infer("m", [{"role": ["user"], "content": "hi"}])


def test_a_list_accelerator_is_an_invalid_request(client: Any) -> None:
    with pytest.raises(zml.InvalidRequestError, match="accelerator must be the name"):
        client.infer("m", MSG, accelerator=["H100"])


def test_a_policy_dict_with_int_keys_is_a_policy_error(client: Any) -> None:
    with pytest.raises(zml.PolicyConfigError, match="keys must be Policy field names"):
        client.infer("m", MSG, policy={1: 2})


def test_stream_options_that_are_not_a_dict_are_an_invalid_request(client: Any) -> None:
    with pytest.raises(zml.InvalidRequestError, match="stream_options must be a dict"):
        client.infer_stream("m", MSG, stream_options=5)
    with pytest.raises(zml.InvalidRequestError, match="must be true or false") as info:
        client.infer_stream("m", MSG, stream_options={"include_usage": "no"})
    assert info.value.param == "stream_options.include_usage"


def test_stream_options_without_a_stream_are_an_invalid_request(client: Any) -> None:
    """As OpenAI and vLLM answer (400): they apply only to a stream."""
    with pytest.raises(zml.InvalidRequestError, match="use infer_stream") as info:
        client.infer("m", MSG, stream_options={"include_usage": True})
    assert info.value.param == "stream_options"


@pytest.mark.parametrize("fields", [{"connect": -1}, {"idle": 0}, {"total": math.nan},
                                    {"first_token": math.inf}, {"total": "5"}])
def test_a_bad_timeouts_field_is_refused_at_construction(fields: dict[str, Any]) -> None:
    with pytest.raises(zml.InvalidRequestError, match=r"^timeout\."):
        zml.Timeouts(**fields)


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_an_infinite_or_nan_timeout_is_refused(value: float) -> None:
    with pytest.raises(zml.InvalidRequestError, match="timeout"):
        zml.Timeouts.of(value)


@pytest.mark.parametrize("value", [1e12, 1e300, 10**400, 365 * 24 * 3600 + 1])
def test_a_timeout_longer_than_a_year_is_refused(value: float) -> None:
    """Longer ones would overflow a thread wait or a socket timeout (and a sync client's
    deadline thread with them); None says "no limit"."""
    with pytest.raises(zml.InvalidRequestError, match=r"at most 31536000 s \(a year\); pass None"):
        zml.Timeouts(total=value)
    assert zml.Timeouts(total=365 * 24 * 3600).total == 365 * 24 * 3600


@pytest.mark.parametrize("kind", [zml.Client, zml.AsyncClient])
@pytest.mark.parametrize("value", [1e300, 10**400, math.nan, math.inf, 0, -1, True, "2"])
def test_a_bad_probe_interval_is_refused(kind: Any, value: Any) -> None:
    """By both clients (an async one took 0 and probed every node in a busy loop)."""
    with pytest.raises(zml.InvalidRequestError, match="probe_interval_s") as info:
        kind(config=zml.config.Registry(), probe_interval_s=value)
    assert len(str(info.value)) < 200


def test_http_client_must_be_the_client_kind_s_own() -> None:
    import asyncio

    import httpx2

    registry = zml.config.Registry()
    with pytest.raises(zml.InvalidRequestError, match="got int"):
        zml.Client(config=registry, http_client=5)  # type: ignore[arg-type]
    other = httpx2.AsyncClient()
    with pytest.raises(zml.InvalidRequestError, match="belongs to the other kind"):
        zml.Client(config=registry, http_client=other)  # type: ignore[arg-type]
    asyncio.run(other.aclose())
    with httpx2.Client() as sync, \
            pytest.raises(zml.InvalidRequestError, match=r"an httpx2\.AsyncClient for a zml"):
        zml.AsyncClient(config=registry, http_client=sync)  # type: ignore[arg-type]


def test_an_answer_s_message_object_can_go_back_into_the_chat() -> None:
    """openai-python's pattern: ``messages.append(response.choices[0].message)``."""
    from zml.types import ChatCompletionMessage

    said = ChatCompletionMessage(content="Paris.")
    called = ChatCompletionMessage.model_validate({"tool_calls": [
        {"id": "c1", "function": {"name": "f", "arguments": "{}"}}]})
    out = validate_messages([{"role": "user", "content": "Capital?"}, said, called])
    assert out[1] == {"role": "assistant", "content": "Paris."}
    assert out[2] == {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


def test_a_message_that_is_not_a_mapping_says_what_one_looks_like() -> None:
    with pytest.raises(zml.InvalidRequestError, match=r"messages\[0\] must be a mapping .*"
                       r"got int; e\.g\. \{'role': 'user', 'content': 'Hello'\}"):
        validate_messages([5])
