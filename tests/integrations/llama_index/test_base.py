"""The ZML class without a fleet: its place in LlamaIndex's hierarchy, fields, serialization,
message conversion and tool-call parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llama_index.core.base.llms.base import BaseLLM
from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    ChatResponse,
    ContentBlock,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.tools import FunctionTool
from pydantic import SecretStr

import zml
from llama_index.llms.zml import ZML
from llama_index.llms.zml.messages import to_zml_messages


def get_weather(city: str) -> str:
    """Return the weather in a city."""
    return f"Sunny in {city}"


def test_exports() -> None:
    import llama_index.llms.zml as package

    assert package.__all__ == ["ZML"]


def test_base_classes() -> None:
    names = [cls.__name__ for cls in ZML.__mro__]
    assert BaseLLM.__name__ in names
    assert issubclass(ZML, FunctionCallingLLM)
    assert ZML.class_name() == "ZML"


def test_metadata() -> None:
    llm = ZML(model="m", context_window=8192, max_tokens=100)
    meta = llm.metadata
    assert meta.is_chat_model is True
    assert meta.is_function_calling_model is True
    assert meta.model_name == "m"
    assert (meta.context_window, meta.num_output) == (8192, 100)


def test_api_key_is_never_serialized() -> None:
    llm = ZML(model="m", api_key="sk-secret", policy="llama3-production", config="zml.toml")
    data = llm.to_dict()
    assert "api_key" not in data
    assert "sk-secret" not in llm.to_json()
    assert "sk-secret" not in repr(llm)
    assert "sk-secret" not in json.dumps(llm.to_payload())
    assert data["class_name"] == "ZML"
    assert (data["model"], data["policy"], data["config"]) == ("m", "llama3-production", "zml.toml")
    clone = ZML.from_dict(data)
    assert (clone.model, clone.policy, clone.api_key) == ("m", "llama3-production", None)


def test_config_path_serializes_as_text(tmp_path: Path) -> None:
    llm = ZML(model="m", config=tmp_path / "zml.toml")
    assert llm.to_dict()["config"] == str(tmp_path / "zml.toml")


def test_config_registry_is_kept_and_serializes_as_its_source() -> None:
    registry = zml.Registry(source="/etc/zml/zml.toml")
    llm = ZML(model="m", config=registry)
    assert llm.config is registry
    assert llm.to_dict()["config"] == "/etc/zml/zml.toml"


def test_policy_and_accelerator_together_are_refused_at_construction(tmp_path: Path) -> None:
    """With the error a call raises for them (not a pydantic ValidationError), from the
    constructor and from from_dict alike."""
    config = tmp_path / "zml.toml"
    config.write_text('[accelerators.H100]\n[[nodes]]\nid = "h100-a"\nfamily = "H100"\n'
                      'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 1\n')
    adhoc = {"name": "adhoc", "accelerator_chain": ["H100"]}
    client = zml.Client(config=config, probe_interval_s=None)
    with client, pytest.raises(zml.InvalidRequestError) as on_call:  # refused before sending
        client.infer("m", [{"role": "user", "content": "hi"}], policy=adhoc, accelerator="H100")
    for build in (
        lambda: ZML(model="m", policy="p", accelerator="H100"),
        lambda: ZML(model="m", policy=adhoc, accelerator="H100", config=config),
        lambda: ZML.from_dict({"model": "m", "policy": "p", "accelerator": "H100"}),
    ):
        with pytest.raises(zml.InvalidRequestError, match="either policy= or accelerator=") as info:
            build()
        assert type(info.value) is zml.InvalidRequestError
        assert info.value.param == on_call.value.param == "accelerator"
        assert str(info.value) == str(on_call.value)
    assert ZML(model="m", accelerator="H100").accelerator == "H100"  # either one alone is fine


def test_no_client_before_first_call() -> None:
    llm = ZML(model="m", config="/nonexistent/zml.toml")  # read lazily, on the first call
    assert not llm._clients.built


def test_a_copy_gets_clients_of_its_own(tmp_path: Path) -> None:
    """``model_copy(update={"api_key": ...})`` must not send the original's key (pydantic's
    copy shares private attributes: the copy's first call built the clients for both)."""
    config = tmp_path / "zml.toml"
    config.write_text(
        '[accelerators.H100]\n[[nodes]]\nid = "h100-1"\nfamily = "H100"\n'
        'url = "http://127.0.0.1:9"\nmodels = ["m"]\nmax_concurrency = 1\n')
    llm = ZML(model="m", config=config, api_key="team-a-key")
    team_b = llm.model_copy(update={"api_key": SecretStr("team-b-key")})
    assert team_b._clients is not llm._clients
    assert team_b._get_client()._dispatcher.headers["authorization"] == "Bearer team-b-key"
    assert llm._get_client()._dispatcher.headers["authorization"] == "Bearer team-a-key"
    team_b.close()
    assert llm._clients.built
    llm.close()


def test_request_parameters() -> None:
    llm = ZML(model="m", policy="p", temperature=0.2, max_tokens=64,
              additional_kwargs={"seed": 7}, zml_metadata={"team": "search"})
    model, messages, params = llm._request([ChatMessage(role="user", content="hi")], {"top_p": 0.5})
    assert model == "m"
    assert messages == [{"role": "user", "content": "hi"}]
    assert params == {"policy": "p", "temperature": 0.2, "max_tokens": 64, "seed": 7,
                      "top_p": 0.5, "metadata": {"team": "search"}}
    # A per-call accelerator replaces the configured policy (zml takes one or the other).
    _, _, params = llm._request([ChatMessage(content="hi")], {"accelerator": "H100"})
    assert params["accelerator"] == "H100" and "policy" not in params


def test_messages_keep_routing_metadata_out() -> None:
    routing = {"node_id": "h100-a", "accelerator": "H100"}
    assistant = ChatMessage(role="assistant", content="Hello",
                            additional_kwargs={"zml_routing": routing, "prompt_tokens": 3})
    out = to_zml_messages([ChatMessage(role="system", content="Be brief."),
                           ChatMessage(role="user", content="Hi"), assistant])
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]


def test_messages_with_tool_calls_and_results() -> None:
    call = ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[ToolCallBlock(tool_call_id="call_1", tool_name="get_weather",
                              tool_kwargs={"city": "Paris"})],
    )
    result = ChatMessage(role=MessageRole.TOOL, content="Sunny",
                         additional_kwargs={"tool_call_id": "call_1"})
    assert to_zml_messages([call, result]) == [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "Sunny", "tool_call_id": "call_1"},
    ]


def test_messages_with_openai_style_tool_calls() -> None:
    """A message written by another integration (tool calls in additional_kwargs)."""
    message = ChatMessage(role="assistant", content=None, additional_kwargs={"tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]})
    assert to_zml_messages([message])[0]["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]


def test_messages_with_images() -> None:
    message = ChatMessage(role="user", blocks=[
        TextBlock(text="What is this?"),
        ImageBlock(url="https://example.com/cat.png"),
        ImageBlock(image=b"\x89PNG", image_mimetype="image/png"),
    ])
    content = to_zml_messages([message])[0]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1] == {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert content[2]["image_url"]["url"].startswith("data:image/png;base64,")


@pytest.mark.parametrize("block", [
    DocumentBlock(data=b"%PDF-1.4 hi", document_mimetype="application/pdf"),
    AudioBlock(audio=b"RIFF....", format="wav"),
], ids=["document", "audio"])
def test_content_zml_cannot_send_is_an_invalid_request(block: ContentBlock) -> None:
    messages = [ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", blocks=[TextBlock(text="Read this:"), block])]
    with pytest.raises(zml.InvalidRequestError) as info:
        ZML(model="m").chat(messages)  # refused before any client or request exists
    name = type(block).__name__
    assert info.value.param == "messages[1].blocks[1]"
    assert str(info.value).startswith(f"messages[1].blocks[1] ({name}) cannot be sent")
    assert "TextBlock" in str(info.value) and "ImageBlock" in str(info.value)


def test_tool_arguments_that_are_not_json_are_an_invalid_request() -> None:
    blocks = ChatMessage(role="assistant", blocks=[
        ToolCallBlock(tool_call_id="c1", tool_name="f", tool_kwargs={"x": {1, 2}})])
    openai_style = ChatMessage(role="assistant", content=None, additional_kwargs={"tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": {1}}}}]})
    with pytest.raises(zml.InvalidRequestError, match="cannot be sent as JSON") as info:
        to_zml_messages([ChatMessage(role="user", content="hi"), blocks])
    assert info.value.param == "messages[1].blocks[0].tool_kwargs.x"
    with pytest.raises(zml.InvalidRequestError, match="cannot be sent as JSON") as info:
        to_zml_messages([openai_style])
    assert info.value.param == \
        "messages[0].additional_kwargs['tool_calls'][0].function.arguments.x"


def test_prepare_chat_with_tools() -> None:
    llm = ZML(model="m")
    tool = FunctionTool.from_defaults(fn=get_weather)
    history = [ChatMessage(role="system", content="You help.")]

    auto = llm._prepare_chat_with_tools([tool], user_msg="Weather?", chat_history=history)
    assert [m.role for m in auto["messages"]] == [MessageRole.SYSTEM, MessageRole.USER]
    assert history == [ChatMessage(role="system", content="You help.")]  # not mutated
    assert auto["tools"][0]["function"]["name"] == "get_weather"
    assert auto["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert auto["tool_choice"] == "auto"
    assert auto["parallel_tool_calls"] is False

    required = llm._prepare_chat_with_tools([tool], user_msg="x", tool_required=True,
                                            allow_parallel_tool_calls=True)
    assert required["tool_choice"] == "required"
    assert "parallel_tool_calls" not in required

    named = llm._prepare_chat_with_tools([tool], user_msg="x", tool_required=True,
                                         tool_choice="get_weather")
    assert named["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert llm._prepare_chat_with_tools([tool], "x", tool_choice="none")["tool_choice"] == "none"

    bare = llm._prepare_chat_with_tools([], user_msg="x", tool_required=True)
    assert "tools" not in bare and "tool_choice" not in bare


def _tool_response(*calls: ToolCallBlock) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role="assistant", blocks=list(calls)))


def test_strict_tools_as_llama_index_openai_sends_them() -> None:
    """``chat_with_tools(..., strict=True)`` was refused as an unknown parameter."""
    llm = ZML(model="m")
    tool = FunctionTool.from_defaults(fn=get_weather)
    strict = llm._prepare_chat_with_tools([tool], user_msg="x", strict=True)
    function = strict["tools"][0]["function"]
    assert function["strict"] is True and function["parameters"]["additionalProperties"] is False
    assert "strict" not in strict  # a tool setting, not a request parameter
    plain = llm._prepare_chat_with_tools([tool], user_msg="x")
    assert "strict" not in plain["tools"][0]["function"]


def test_tool_calls_from_partial_json() -> None:
    llm = ZML(model="m")
    partial = _tool_response(ToolCallBlock(tool_call_id="c1", tool_name="get_weather",
                                           tool_kwargs='{"city": "Paris", "days": 3'))
    (selection,) = llm.get_tool_calls_from_response(partial)
    assert (selection.tool_id, selection.tool_name) == ("c1", "get_weather")
    assert selection.tool_kwargs == {"city": "Paris", "days": 3}
    # An unterminated string value is read as not known yet (llama-index's parse_partial_json).
    (selection,) = llm.get_tool_calls_from_response(
        _tool_response(ToolCallBlock(tool_name="get_weather", tool_kwargs='{"city": "Par')))
    assert list(selection.tool_kwargs) == ["city"]

    for text in ("", '{"ci', "[1, 2", "not json {"):
        (selection,) = llm.get_tool_calls_from_response(
            _tool_response(ToolCallBlock(tool_name="f", tool_kwargs=text)))
        assert isinstance(selection.tool_kwargs, dict)

    done = _tool_response(ToolCallBlock(tool_call_id="c2", tool_name="f", tool_kwargs={"a": 1}))
    assert llm.get_tool_calls_from_response(done)[0].tool_kwargs == {"a": 1}


def test_no_tool_calls() -> None:
    llm = ZML(model="m")
    text = ChatResponse(message=ChatMessage(role="assistant", content="Hello"))
    assert llm.get_tool_calls_from_response(text, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="tool call"):
        llm.get_tool_calls_from_response(text)


def test_single_tool_call_unless_parallel_allowed() -> None:
    llm = ZML(model="m")
    calls = [ToolCallBlock(tool_call_id=f"c{i}", tool_name="f", tool_kwargs={}) for i in range(2)]
    kept = llm._validate_chat_with_tools_response(_tool_response(*calls), [])
    assert [s.tool_id for s in llm.get_tool_calls_from_response(kept)] == ["c0"]
    both = llm._validate_chat_with_tools_response(_tool_response(*calls), [],
                                                  allow_parallel_tool_calls=True)
    assert len(llm.get_tool_calls_from_response(both)) == 2



def test_offline_guard() -> None:
    """conftest.py refuses connections beyond loopback (LlamaIndex must not download)."""
    import socket

    with pytest.raises(OSError, match="only loopback"), socket.socket() as sock:
        sock.connect(("192.0.2.1", 443))  # TEST-NET-1: never routed
