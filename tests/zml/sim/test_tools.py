"""Tool calls and structured output: when the node calls a tool, the OpenAI shapes plain and
streamed, and arguments / content that validate against the caller's JSON Schema."""

from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 2, "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}

BOOKING = {
    "type": "function",
    "function": {
        "name": "book_trip",
        "description": "Book a trip",
        "parameters": {
            "type": "object",
            "$defs": {
                "traveller": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "minLength": 1},
                        "age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 130},
                        "email": {"type": ["string", "null"], "format": "email"},
                    },
                    "required": ["name", "age"],
                },
            },
            "properties": {
                "travellers": {"type": "array", "items": {"$ref": "#/$defs/traveller"}, "minItems": 2},
                "budget": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "refundable": {"type": "boolean"},
                "kind": {"const": "round_trip"},
                "notes": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]},
                "legs": {
                    "type": "array",
                    "prefixItems": [{"type": "string"}, {"type": "integer"}],
                    "items": False,
                },
                "meta": {"type": "null"},
            },
            "required": ["travellers", "budget", "refundable", "kind", "notes", "legs", "meta"],
        },
    },
}

NO_ARGS = {"type": "function", "function": {"name": "ping", "description": "no arguments"}}


def _validate(instance, schema):
    jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker()).validate(instance)


def _message(response):
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


async def test_auto_calls_the_mentioned_tool(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(
        await chat(client, messages=tk.user("What is the weather? use get_weather"), tools=[BOOKING, WEATHER])
    )
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    _validate(args, WEATHER["function"]["parameters"])


async def test_auto_matches_name_with_spaces_case_insensitively(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(await chat(client, messages=tk.user("Please Book Trip for us"), tools=[WEATHER, BOOKING]))
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "book_trip"


async def test_auto_without_mention_answers_text(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(await chat(client, messages=tk.user("Tell me a story"), tools=[WEATHER]))
    assert choice["finish_reason"] == "stop"
    assert isinstance(choice["message"]["content"], str)
    assert "tool_calls" not in choice["message"]


async def test_tool_choice_none_never_calls(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(
        await chat(client, messages=tk.user("use get_weather"), tools=[WEATHER], tool_choice="none")
    )
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


async def test_required_and_named_tool_choice(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(
        await chat(client, messages=tk.user("anything"), tools=[WEATHER, BOOKING], tool_choice="required")
    )
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    named = {"type": "function", "function": {"name": "book_trip"}}
    choice = _message(
        await chat(client, messages=tk.user("get_weather please"), tools=[WEATHER, BOOKING], tool_choice=named)
    )
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "book_trip"
    _validate(json.loads(call["function"]["arguments"]), BOOKING["function"]["parameters"])


async def test_complex_schema_arguments_validate_for_many_prompts(make_node, client_for, chat, tk):
    client = client_for(make_node())
    named = {"type": "function", "function": {"name": "book_trip"}}
    seen = set()
    for i in range(25):
        choice = _message(
            await chat(client, messages=tk.user(f"trip {i}"), tools=[BOOKING], tool_choice=named)
        )
        arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
        args = json.loads(arguments)
        _validate(args, BOOKING["function"]["parameters"])
        assert len(args["travellers"]) >= 2
        seen.add(arguments)
    assert len(seen) > 20


async def test_zero_argument_tool_gets_empty_object(make_node, client_for, chat, tk):
    client = client_for(make_node())
    choice = _message(await chat(client, messages=tk.user("ping the server"), tools=[NO_ARGS]))
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "{}"


async def test_after_a_tool_result_the_node_answers_text(make_node, client_for, chat):
    client = client_for(make_node())
    messages = [
        {"role": "user", "content": "use get_weather"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    for choice_param in ("auto", "required"):
        choice = _message(await chat(client, messages=messages, tools=[WEATHER], tool_choice=choice_param))
        assert choice["finish_reason"] == "stop"
        assert choice["message"]["content"]


async def test_streamed_tool_call_reassembles_to_the_plain_one(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    body = {"messages": tk.user("call get_weather"), "tools": [WEATHER], "stream_options": {"include_usage": True}}
    plain = (await chat(client, **body)).json()
    chunks = tk.chunks(await stream(client, **body))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    head, *fragments = deltas
    assert head["index"] == 0 and head["type"] == "function"
    assert head["id"].startswith("call_") and head["function"] == {"name": "get_weather", "arguments": ""}
    assert len(fragments) > 2
    assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
    arguments = "".join(f["function"]["arguments"] for f in fragments)
    plain_call = plain["choices"][0]["message"]["tool_calls"][0]
    assert arguments == plain_call["function"]["arguments"]
    assert head["id"] == plain_call["id"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"] == plain["usage"]


SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "uniqueItems": True},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "nested": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "count": {"type": "integer", "multipleOf": 5}},
            "required": ["ok", "count"],
        },
    },
    "required": ["title", "tags", "score", "nested"],
    "additionalProperties": False,
}


async def test_response_format_json_schema(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    response_format = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMA, "strict": True}}
    for i in range(10):
        choice = _message(await chat(client, messages=tk.user(f"q{i}"), response_format=response_format))
        assert choice["finish_reason"] == "stop"
        _validate(json.loads(choice["message"]["content"]), SCHEMA)
    events = await stream(client, response_format=response_format)
    content_chunks = [c for c in tk.chunks(events) if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) > 3
    _validate(json.loads(tk.streamed_content(events)), SCHEMA)


async def test_response_format_json_object(make_node, client_for, chat):
    client = client_for(make_node())
    choice = _message(await chat(client, response_format={"type": "json_object"}))
    value = json.loads(choice["message"]["content"])
    assert isinstance(value, dict) and value


async def test_response_format_text_is_prose(make_node, client_for, chat):
    client = client_for(make_node())
    plain = _message(await chat(client))["message"]["content"]
    assert _message(await chat(client, response_format={"type": "text"}))["message"]["content"] == plain
