"""ChatZML without a fleet: configuration, the request it builds, and the response converters."""

from __future__ import annotations

import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from langchain_core.load import dumpd, dumps, load, loads
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import RunnableBinding
from pydantic import BaseModel, Field, SecretStr, ValidationError

import zml
from langchain_zml import ChatZML
from langchain_zml._responses import ChunkConverter, chat_result

MODEL = "meta-llama/llama-3-8b-instruct"
ROUTING = {
    "node_id": "h100-1",
    "accelerator": "H100",
    "policy": "llama3-production",
    "queue_depth": 0,
    "attempts": [
        {"node_id": "h100-2", "accelerator": "H100", "error": "unavailable", "status_code": 503}
    ],
}


class Joke(BaseModel):
    """A joke."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def bound_kwargs(runnable: Any) -> dict[str, Any]:
    """The kwargs bound by bind()/bind_tools(), from a binding or the first step of a chain."""
    if isinstance(runnable, RunnableBinding):
        return dict(runnable.kwargs)
    return bound_kwargs(runnable.first)


# --- configuration -------------------------------------------------------------------------


def test_aliases_and_defaults() -> None:
    llm = ChatZML(model_name=MODEL, stop_sequences=["\n\n"])
    assert llm.model == MODEL
    assert llm.stop == ["\n\n"]
    assert llm.policy is None
    assert llm.max_retries == 2
    assert llm.stream_usage is True
    assert llm._llm_type == "zml-chat"


def test_api_key_from_env_is_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_API_KEY", "sk-from-env")
    llm = ChatZML(model=MODEL)
    assert llm.api_key is not None
    assert llm.api_key.get_secret_value() == "sk-from-env"
    assert "sk-from-env" not in repr(llm)
    assert ChatZML(model=MODEL, api_key="explicit").api_key.get_secret_value() == "explicit"


def test_misspelled_field_is_refused() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        ChatZML(model=MODEL, temprature=0.2)


def test_policy_and_accelerator_are_exclusive(tmp_path: Path) -> None:
    """Refused at construction with the error a call raises, not a ValidationError."""
    config = tmp_path / "zml.toml"
    config.write_text(
        '[accelerators.H100]\n[[nodes]]\nid = "h100-1"\nfamily = "H100"\n'
        f'url = "http://127.0.0.1:9"\nmodels = ["{MODEL}"]\nmax_concurrency = 1\n'
    )
    adhoc = {"name": "adhoc", "accelerator_chain": ["H100"]}
    client = zml.Client(config=config, probe_interval_s=None)
    with client, pytest.raises(zml.InvalidRequestError) as on_call:  # refused before sending
        client.infer(MODEL, [{"role": "user", "content": "Hi"}], policy=adhoc, accelerator="H100")
    for policy in ("llama3-production", adhoc):
        with pytest.raises(zml.InvalidRequestError, match="either policy= or accelerator=") as info:
            ChatZML(model=MODEL, policy=policy, accelerator="H100", config=config)
        assert type(info.value) is zml.InvalidRequestError
        assert info.value.param == on_call.value.param == "accelerator"
        assert str(info.value) == str(on_call.value)


def test_model_kwargs_cannot_shadow_fields_or_routing() -> None:
    for key in ("model", "policy", "temperature", "stop"):
        with pytest.raises(ValidationError, match="model_kwargs may not set"):
            ChatZML(model=MODEL, model_kwargs={key: "x"})


def test_max_retries_maps_to_max_attempts() -> None:
    assert ChatZML(model=MODEL, max_retries=0)._client_options()["max_attempts"] == 1
    assert ChatZML(model=MODEL, max_retries=4)._client_options()["max_attempts"] == 5
    with pytest.raises(ValidationError):
        ChatZML(model=MODEL, max_retries=-1)


def test_construction_is_lazy_and_config_errors_propagate(tmp_path: Path) -> None:
    llm = ChatZML(model=MODEL, policy="llama3-production", config=tmp_path / "missing.toml")
    assert not llm._clients.built
    with pytest.raises(zml.PolicyConfigError) as info:
        llm.invoke("Hello")
    assert type(info.value) is zml.PolicyConfigError
    assert info.value.field == "config"


def test_copies_get_clients_of_their_own(tmp_path: Path) -> None:
    """A copy never uses the original's clients: made with ``update={"api_key": ...}`` (or
    another config), it would send the original's key to the original's fleet, or lend it its
    own (pydantic's copy shares private attributes)."""
    config = tmp_path / "zml.toml"
    config.write_text(
        '[accelerators.H100]\n[[nodes]]\nid = "h100-1"\nfamily = "H100"\n'
        f'url = "http://127.0.0.1:9"\nmodels = ["{MODEL}"]\nmax_concurrency = 1\n'
    )
    llm = ChatZML(model=MODEL, config=config, api_key="team-a-key")
    client = llm._sync_client()  # reads the config; sends nothing
    assert llm._sync_client() is client
    team_b = llm.model_copy(update={"api_key": SecretStr("team-b-key")})
    assert team_b._sync_client() is not client
    assert team_b._sync_client()._dispatcher.headers["authorization"] == "Bearer team-b-key"
    assert client._dispatcher.headers["authorization"] == "Bearer team-a-key"
    assert copy.copy(llm)._clients is not llm._clients
    team_b.close()
    assert llm._clients.built  # closing the copy leaves the original's client alone
    for clone in (copy.deepcopy(llm), pickle.loads(pickle.dumps(llm))):
        assert isinstance(clone, ChatZML)
        assert clone.model == MODEL
        assert not clone._clients.built
    llm.close()
    assert not llm._clients.built


def test_model_name_reads_as_in_chat_openai() -> None:
    assert ChatZML(model_name=MODEL).model_name == MODEL == ChatZML(model=MODEL).model_name


def test_identifying_and_langsmith_params() -> None:
    policy: dict[str, Any] = {"name": "adhoc", "accelerator_chain": ["H100"]}
    llm = ChatZML(model=MODEL, policy=policy, temperature=0.5, max_tokens=64, stop=["END"])
    assert llm._identifying_params == {
        "model": MODEL,
        "policy": policy,
        "temperature": 0.5,
        "max_tokens": 64,
        "stop": ["END"],
    }
    assert llm._get_ls_params() == {
        "ls_provider": "zml",
        "ls_model_name": MODEL,
        "ls_model_type": "chat",
        "ls_temperature": 0.5,
        "ls_max_tokens": 64,
        "ls_stop": ["END"],
    }
    override = llm._get_ls_params(stop=["x"], model="other", temperature=0.0)
    assert override["ls_model_name"] == "other"
    assert override["ls_temperature"] == 0.0
    assert override["ls_stop"] == ["x"]
    assert "ls_stop" not in ChatZML(model=MODEL, stop=[])._get_ls_params()


@pytest.mark.filterwarnings("ignore:The function `load` is in beta")
def test_serialization_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_API_KEY", "sk-secret")
    llm = ChatZML(model=MODEL, policy="llama3-production", temperature=0.0, max_tokens=10)
    data = dumpd(llm)
    assert "sk-secret" not in json.dumps(data)
    loaded = load(
        data,
        valid_namespaces=["langchain_zml"],
        allowed_objects=[ChatZML],
        secrets_from_env=True,
    )
    assert isinstance(loaded, ChatZML)
    assert loaded.asdict() == llm.asdict()
    assert loaded.api_key is not None
    assert loaded.api_key.get_secret_value() == "sk-secret"


@pytest.mark.filterwarnings("ignore:The function `loads` is in beta")
def test_timeouts_and_a_registry_from_a_file_survive_dumps_and_loads(tmp_path: Path) -> None:
    """Both are documented field types; dumps() wrote them as "not_implemented", which
    loads() refuses."""
    config = tmp_path / "zml.toml"
    config.write_text('[accelerators.H100]\n[[nodes]]\nid = "h100-1"\nfamily = "H100"\n'
                      f'url = "http://127.0.0.1:9"\nmodels = ["{MODEL}"]\nmax_concurrency = 1\n')
    timeouts = zml.Timeouts(total=5, first_token=2)
    llm = ChatZML(model=MODEL, config=zml.config.load_registry(config), timeout=timeouts,
                  api_key="sk-secret")
    text = dumps(llm)
    assert "not_implemented" not in text and "sk-secret" not in text
    loaded = loads(text, valid_namespaces=["langchain_zml"], allowed_objects=[ChatZML],
                   secrets_map={"ZML_API_KEY": "sk-secret"})
    assert isinstance(loaded, ChatZML)
    assert loaded.timeout == timeouts and loaded.config == str(config)


@pytest.mark.filterwarnings("ignore:The function `loads` is in beta")
def test_a_config_path_survives_dumps_and_loads(tmp_path: Path) -> None:
    llm = ChatZML(model=MODEL, config=tmp_path / "zml.toml", api_key="sk-secret")
    assert llm.config == str(tmp_path / "zml.toml")  # kept as text, which dumps can carry
    loaded = loads(
        dumps(llm),
        valid_namespaces=["langchain_zml"],
        allowed_objects=[ChatZML],
        secrets_map={"ZML_API_KEY": "sk-secret"},
    )
    assert isinstance(loaded, ChatZML)
    assert loaded.config == str(tmp_path / "zml.toml")


# --- the request ----------------------------------------------------------------------------


def test_a_stop_string_is_one_sequence() -> None:
    """As in openai-python and ChatOpenAI: stop="END" is ["END"], never ["E", "N", "D"]."""
    llm = ChatZML(model=MODEL)
    stop: Any = "END"
    assert llm._request([HumanMessage("Hi")], stop, {}, stream=False)["stop"] == ["END"]
    assert llm._get_ls_params(stop=stop)["ls_stop"] == ["END"]
    assert ChatZML(model=MODEL, stop=stop).stop == ["END"]
    pair: Any = ("a", "b")
    assert llm._request([HumanMessage("Hi")], pair, {}, stream=False)["stop"] == ["a", "b"]


@pytest.mark.parametrize("stop", [123, ["END", 7], {"END"}])
def test_a_stop_that_is_not_text_is_an_invalid_request(stop: Any) -> None:
    llm = ChatZML(model=MODEL)  # refused before any client or zml.toml is needed
    with pytest.raises(zml.InvalidRequestError, match="stop must be a string or a list") as info:
        llm.invoke("Hi", stop=stop)
    assert info.value.param == "stop"
    assert "ls_stop" not in llm._get_ls_params(stop=stop)  # tracing metadata does not raise


def test_tool_call_arguments_that_are_not_json_are_an_invalid_request() -> None:
    call = {"name": "f", "args": {"x": {1, 2}}, "id": "c1", "type": "tool_call"}
    history = [HumanMessage("hi"), AIMessage("", tool_calls=[call])]
    with pytest.raises(zml.InvalidRequestError, match="cannot be sent as JSON") as info:
        ChatZML(model=MODEL).invoke(history)
    assert info.value.param == "messages[1].tool_calls[0].args.x"
    assert str(info.value).startswith("messages[1].tool_calls[0].args.x is a set")


def test_request_merges_model_and_call_options() -> None:
    llm = ChatZML(
        model=MODEL,
        policy="llama3-production",
        temperature=0.1,
        max_tokens=32,
        stop=["END"],
        model_kwargs={"seed": 7, "top_p": 0.9},
        zml_metadata={"team": "search"},
    )
    messages = [SystemMessage("Be brief."), HumanMessage("Hi", name="ann")]
    request = llm._request(messages, None, {"top_p": 0.5}, stream=False)
    assert request == {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi", "name": "ann"},
        ],
        "policy": "llama3-production",
        "accelerator": None,
        "metadata": {"team": "search"},
        "temperature": 0.1,
        "max_tokens": 32,
        "stop": ["END"],
        "seed": 7,
        "top_p": 0.5,
    }


def test_request_per_call_overrides() -> None:
    llm = ChatZML(model=MODEL, policy="llama3-production", stop=["END"])
    request = llm._request(
        [HumanMessage("Hi")],
        [],
        {"model": "other", "accelerator": "MI300X", "zml_metadata": {"job": 1}},
        stream=False,
    )
    assert request["model"] == "other"
    assert (request["policy"], request["accelerator"]) == (None, "MI300X")
    assert request["metadata"] == {"job": 1}
    assert "stop" not in request  # an explicit [] means no stop sequences
    pinned = ChatZML(model=MODEL, accelerator="H100")
    request = pinned._request([HumanMessage("Hi")], ["x"], {"policy": "p"}, stream=False)
    assert (request["policy"], request["accelerator"], request["stop"]) == ("p", None, ["x"])


def test_request_stream_usage_and_langchain_kwargs() -> None:
    llm = ChatZML(model=MODEL)
    request = llm._request(
        [HumanMessage("Hi")],
        None,
        {"stream": True, "ls_structured_output_format": {"schema": {}}},
        stream=True,
    )
    assert request["stream_options"] == {"include_usage": True}
    assert "stream" not in request
    assert "ls_structured_output_format" not in request
    off = llm._request([HumanMessage("Hi")], None, {"stream_usage": False}, stream=True)
    assert off["stream_options"] == {"include_usage": False}
    quiet = ChatZML(model=MODEL, stream_usage=False)
    assert quiet._request([HumanMessage("Hi")], None, {}, stream=True)["stream_options"] == {
        "include_usage": False
    }
    assert "stream_options" not in llm._request([HumanMessage("Hi")], None, {}, stream=False)


def test_assistant_messages_keep_text_and_tool_calls_only() -> None:
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    history = [
        HumanMessage("What is 1 + 2?"),
        AIMessage(  # Anthropic-style content with a tool_use block
            [
                {"type": "text", "text": "Let me add."},
                {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 1, "b": 2}},
            ],
            tool_calls=[call],
        ),
        ToolMessage("3", tool_call_id="c1", name="add"),
        AIMessage(  # standard (v1) blocks
            [{"type": "reasoning", "reasoning": "hm"}, {"type": "text", "text": "It is 3."}]
        ),
        AIMessage(
            "",
            invalid_tool_calls=[
                {
                    "name": "add",
                    "args": "{bad",
                    "id": "c2",
                    "error": "x",
                    "type": "invalid_tool_call",
                }
            ],
        ),
    ]
    messages = ChatZML(model=MODEL)._request(history, None, {}, stream=False)["messages"]
    assert messages == [
        {"role": "user", "content": "What is 1 + 2?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1", "name": "add"},
        {"role": "assistant", "content": "It is 3."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{bad"}}
            ],
        },
    ]


# --- tools and structured output -------------------------------------------------------------


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("any", "required"),
        (True, "required"),
        ("required", "required"),
        ("auto", "auto"),
        ("none", "none"),
        ("add", {"type": "function", "function": {"name": "add"}}),
        (
            {"type": "function", "function": {"name": "add"}},
            {"type": "function", "function": {"name": "add"}},
        ),
    ],
)
def test_bind_tools_tool_choice(choice: Any, expected: Any) -> None:
    bound = bound_kwargs(ChatZML(model=MODEL).bind_tools([add], tool_choice=choice))
    assert bound["tool_choice"] == expected
    assert bound["tools"][0]["type"] == "function"
    assert bound["tools"][0]["function"]["name"] == "add"


def test_bind_tools_options() -> None:
    llm = ChatZML(model=MODEL)
    assert "tool_choice" not in bound_kwargs(llm.bind_tools([add]))
    assert "tool_choice" not in bound_kwargs(llm.bind_tools([add], tool_choice=False))
    bound = bound_kwargs(llm.bind_tools([Joke], strict=True, parallel_tool_calls=False))
    assert bound["parallel_tool_calls"] is False
    assert bound["tools"][0]["function"]["strict"] is True
    with pytest.raises(ValueError, match="names no bound tool"):
        llm.bind_tools([add], tool_choice="multiply")


def test_with_structured_output_methods() -> None:
    llm = ChatZML(model=MODEL)
    calling = bound_kwargs(llm.with_structured_output(Joke))
    assert calling["tool_choice"] == {"type": "function", "function": {"name": "Joke"}}
    assert calling["tools"][0]["function"]["name"] == "Joke"
    assert calling["ls_structured_output_format"]["kwargs"]["method"] == "function_calling"

    schema = bound_kwargs(llm.with_structured_output(Joke, method="json_schema", strict=True))
    spec = schema["response_format"]["json_schema"]
    assert schema["response_format"]["type"] == "json_schema"
    assert (spec["name"], spec["strict"]) == ("Joke", True)
    assert set(spec["schema"]["properties"]) == {"setup", "punchline"}

    mode = bound_kwargs(llm.with_structured_output(None, method="json_mode"))
    assert mode == {"response_format": {"type": "json_object"}}


def test_with_structured_output_refuses_bad_arguments() -> None:
    llm = ChatZML(model=MODEL)
    with pytest.raises(ValueError, match="unsupported arguments"):
        llm.with_structured_output(Joke, tools=[add])
    with pytest.raises(ValueError, match="needs a schema"):
        llm.with_structured_output(None, method="json_schema")
    with pytest.raises(ValueError, match="method must be"):
        llm.with_structured_output(Joke, method="xml")  # type: ignore[arg-type]


def test_structured_output_parsers() -> None:
    llm = ChatZML(model=MODEL)
    pydantic_chain = llm.with_structured_output(Joke, method="json_mode")
    assert isinstance(pydantic_chain.last, PydanticOutputParser)  # type: ignore[attr-defined]
    dict_chain = llm.with_structured_output(Joke.model_json_schema(), method="json_schema")
    assert isinstance(dict_chain.last, JsonOutputParser)  # type: ignore[attr-defined]
    raw = llm.with_structured_output(Joke, include_raw=True)
    assert set(raw.output_schema.model_json_schema()["properties"]) >= {"raw"}


# --- response converters ---------------------------------------------------------------------


def completion(**overrides: Any) -> zml.ChatCompletion:
    data: dict[str, Any] = {
        "id": "chatcmpl-1",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there."},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        "routing": ROUTING,
        **overrides,
    }
    return zml.ChatCompletion.model_validate(data)


def test_chat_result_metadata() -> None:
    result = chat_result(completion())
    message = result.generations[0].message
    assert isinstance(message, AIMessage)
    assert message.content == "Hello there."
    assert message.id == "chatcmpl-1"
    assert message.usage_metadata == {"input_tokens": 5, "output_tokens": 3, "total_tokens": 8}
    meta = message.response_metadata
    assert (meta["model_name"], meta["finish_reason"], meta["model_provider"]) == (
        MODEL,
        "stop",
        "zml",
    )
    routing = meta["zml_routing"]
    assert routing["node_id"] == "h100-1"
    assert routing["accelerator"] == "H100"
    assert routing["policy"] == "llama3-production"
    assert routing["queue_depth"] == 0
    assert routing["attempts"][0]["node_id"] == "h100-2"
    assert "cost" not in routing  # only when known
    json.dumps(meta)  # plain data


def test_chat_result_cost_and_usage_details() -> None:
    routing = {**ROUTING, "cost": {"amount": 0.002, "basis": "node_seconds"}}
    usage = {
        "prompt_tokens": 10,
        "completion_tokens": 6,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 4},
        "completion_tokens_details": {"reasoning_tokens": 2},
    }
    message = chat_result(completion(routing=routing, usage=usage)).generations[0].message
    assert message.response_metadata["zml_routing"]["cost"] == {
        "amount": 0.002,
        "currency": "USD",
        "basis": "node_seconds",
    }
    assert message.usage_metadata == {  # type: ignore[attr-defined]
        "input_tokens": 10,
        "output_tokens": 6,
        "total_tokens": 16,
        "input_token_details": {"cache_read": 4},
        "output_token_details": {"reasoning": 2},
    }


def test_chat_result_tool_calls() -> None:
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        },
        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1,'}},
    ]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": None, "tool_calls": calls},
        "finish_reason": "tool_calls",
    }
    message = chat_result(completion(choices=[choice])).generations[0].message
    assert isinstance(message, AIMessage)
    assert message.content == ""
    assert message.tool_calls == [
        {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    ]
    assert [c["id"] for c in message.invalid_tool_calls] == ["c2"]


def chunk(
    choices: list[dict[str, Any]], usage: dict[str, int] | None = None
) -> zml.ChatCompletionChunk:
    return zml.ChatCompletionChunk.model_validate(
        {"id": "chatcmpl-2", "model": MODEL, "choices": choices, "usage": usage, "routing": ROUTING}
    )


def delta(finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"index": 0, "delta": fields, "finish_reason": finish_reason}


def test_chunk_converter_puts_metadata_on_the_last_chunk_only() -> None:
    node_chunks = [
        chunk([delta(role="assistant", content="")]),
        chunk([delta(content="Hello")]),
        chunk([delta(content=" there.")]),
        chunk([delta("stop")]),
        chunk([], usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}),
    ]
    converter = ChunkConverter()
    out = [g for g in map(converter.chunk, node_chunks) if g is not None]
    out.append(converter.last())
    assert [g.message.content for g in out] == ["Hello", " there.", ""]
    carrying = [g for g in out if "zml_routing" in g.message.response_metadata]
    assert carrying == [out[-1]]
    assert [g.message.usage_metadata is not None for g in out] == [False, False, True]  # type: ignore[attr-defined]
    full = out[0].message
    for g in out[1:]:
        full = full + g.message
    assert isinstance(full, AIMessageChunk)
    assert full.content == "Hello there."
    assert full.chunk_position == "last"
    assert full.usage_metadata == {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7}
    meta = full.response_metadata
    assert (meta["model_name"], meta["finish_reason"], meta["model_provider"]) == (
        MODEL,
        "stop",
        "zml",
    )
    assert meta["zml_routing"]["node_id"] == "h100-1"
    assert meta["zml_routing"]["queue_depth"] == 0


def test_chunk_converter_tool_call_deltas() -> None:
    head = {
        "index": 0,
        "id": "c1",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    node_chunks = [
        chunk([delta(role="assistant", content=None)]),
        chunk([delta(tool_calls=[head])]),
        chunk([delta(tool_calls=[{"index": 0, "function": {"arguments": '{"a": 1, '}}])]),
        chunk([delta(tool_calls=[{"index": 0, "function": {"arguments": '"b": 2}'}}])]),
        chunk([delta("tool_calls")]),
    ]
    converter = ChunkConverter()
    full: AIMessageChunk | None = None
    for node_chunk in node_chunks:
        generation = converter.chunk(node_chunk)
        if generation is not None:
            assert isinstance(generation.message, AIMessageChunk)
            full = generation.message if full is None else full + generation.message
    assert full is not None
    last = converter.last().message
    assert isinstance(last, AIMessageChunk)
    full = full + last
    assert full.tool_calls == [
        {"name": "add", "args": {"a": 1, "b": 2}, "id": "c1", "type": "tool_call"}
    ]
    assert full.response_metadata["finish_reason"] == "tool_calls"
    assert full.usage_metadata is None  # the node sent no usage
