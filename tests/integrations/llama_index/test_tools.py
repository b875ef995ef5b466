"""Function calling through zml on simulated nodes: chat_with_tools, streamed tool calls,
predict_and_call, and a FunctionAgent that runs to completion.

The simulated node calls a tool when ``tool_choice`` asks for one, or ("auto") when the last
user message names the tool; after a tool result it answers in text.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, ToolCallBlock
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel

from llama_index.llms.zml import ZML

MODEL = "meta-llama/llama-3-8b-instruct"  # as in conftest.py
POLICY = "llama3-production"


def get_weather(city: str) -> str:
    """Return the current weather in a city."""
    return f"Sunny and 21 C in {city}"


def get_time(timezone: str) -> str:
    """Return the current time in a timezone."""
    return f"12:00 in {timezone}"


WEATHER = FunctionTool.from_defaults(fn=get_weather)
TIME = FunctionTool.from_defaults(fn=get_time)


def test_chat_with_tools_required(llm: ZML) -> None:
    response = llm.chat_with_tools([WEATHER, TIME], user_msg="Plan my day.", tool_required=True)
    (call,) = llm.get_tool_calls_from_response(response)
    assert call.tool_name == "get_weather"  # "required": the first tool, none being mentioned
    assert isinstance(call.tool_kwargs["city"], str)
    assert call.tool_id
    assert response.raw["choices"][0]["finish_reason"] == "tool_calls"
    assert response.additional_kwargs["zml_routing"]["policy"] == POLICY


def test_chat_with_tools_choice(llm: ZML) -> None:
    named = llm.chat_with_tools([WEATHER, TIME], user_msg="Plan my day.", tool_choice="get_time")
    assert [c.tool_name for c in llm.get_tool_calls_from_response(named)] == ["get_time"]

    auto = llm.chat_with_tools([WEATHER, TIME], user_msg="Plan my day.")
    assert llm.get_tool_calls_from_response(auto, error_on_no_tool_call=False) == []
    assert auto.message.content

    mentioned = llm.chat_with_tools([WEATHER, TIME], user_msg="What does get_time say in UTC?")
    assert [c.tool_name for c in llm.get_tool_calls_from_response(mentioned)] == ["get_time"]

    none = llm.chat_with_tools([WEATHER], user_msg="Use get_weather.", tool_choice="none")
    assert llm.get_tool_calls_from_response(none, error_on_no_tool_call=False) == []


def test_tool_result_round_trip(llm: ZML) -> None:
    first = llm.chat_with_tools([WEATHER], user_msg="Use get_weather for Paris.")
    (call,) = llm.get_tool_calls_from_response(first)
    history = [
        ChatMessage(role="user", content="Use get_weather for Paris."),
        first.message,
        ChatMessage(role="tool", content=get_weather(**call.tool_kwargs),
                    additional_kwargs={"tool_call_id": call.tool_id}),
    ]
    answer = llm.chat_with_tools([WEATHER], chat_history=history)
    assert llm.get_tool_calls_from_response(answer, error_on_no_tool_call=False) == []
    assert answer.message.content


def test_stream_chat_with_tools(llm: ZML) -> None:
    responses = list(llm.stream_chat_with_tools([WEATHER], user_msg="x", tool_required=True))
    assert len(responses) > 2
    for r in responses:
        assert r.additional_kwargs["zml_routing"]["policy"] == POLICY
        # Every chunk's tool calls can be read, however far their JSON has come.
        (call,) = llm.get_tool_calls_from_response(r)
        assert call.tool_name == "get_weather"
    final = responses[-1]
    (block,) = [b for b in final.message.blocks if isinstance(b, ToolCallBlock)]
    assert isinstance(block.tool_kwargs, dict)  # parsed once the stream is complete
    assert llm.get_tool_calls_from_response(final)[0].tool_kwargs == block.tool_kwargs
    assert final.raw["finish_reason"] == "tool_calls"
    assert final.raw["usage"]["completion_tokens"] > 0


async def test_astream_chat_with_tools(allm: ZML) -> None:
    gen = await allm.astream_chat_with_tools([WEATHER], user_msg="x", tool_required=True)
    responses = [r async for r in gen]
    (call,) = allm.get_tool_calls_from_response(responses[-1])
    assert call.tool_name == "get_weather" and "city" in call.tool_kwargs


def test_predict_and_call(llm: ZML) -> None:
    output = llm.predict_and_call([WEATHER], user_msg="Use get_weather please.")
    assert output.response.startswith("Sunny and 21 C in ")
    assert output.sources[0].tool_name == "get_weather"


class Song(BaseModel):
    """A song."""

    title: str
    length_seconds: int


def test_structured_predict(llm: ZML) -> None:
    """LlamaIndex's structured output for function-calling LLMs: a forced tool call."""
    song = llm.structured_predict(Song, PromptTemplate("Write a song about {topic}."),
                                  topic="accelerators")
    assert isinstance(song, Song)
    assert isinstance(song.length_seconds, int)


# llama-index's workflow machinery inspects the agent's pydantic attributes (not ours).
@pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")
@pytest.mark.parametrize("streaming", [True, False])
async def test_function_agent(zml_config: Path, streaming: bool) -> None:
    llm = ZML(model=MODEL, policy=POLICY, config=zml_config)
    cities: list[str] = []

    def weather(city: str) -> str:
        """Return the current weather in a city."""
        cities.append(city)
        return f"Sunny in {city}"

    agent = FunctionAgent(
        tools=[FunctionTool.from_defaults(fn=weather, name="get_weather")],
        llm=llm,
        system_prompt="You answer weather questions with the get_weather tool.",
        streaming=streaming,
    )
    try:
        handler = agent.run(user_msg="What is the weather in Paris? Use get_weather.")
        events = [event async for event in handler.stream_events()]
        result = await handler
    finally:
        await llm.aclose()

    tool_results = [e for e in events if isinstance(e, ToolCallResult)]
    assert [r.tool_name for r in tool_results] == ["get_weather"]
    assert len(cities) == 1
    assert tool_results[0].tool_output.content == f"Sunny in {cities[0]}"
    outputs = [e for e in events if isinstance(e, AgentOutput)]
    assert len(outputs) == 2  # the tool call, then the answer
    for output in outputs:
        assert output.raw["zml_routing"]["policy"] == POLICY
    assert isinstance(result, AgentOutput)
    assert [c.tool_name for c in result.tool_calls] == ["get_weather"]
    assert result.response.content
