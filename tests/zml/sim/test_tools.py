"""Tool calls and structured output: when the node calls a tool (or several in parallel), the
OpenAI shapes plain and streamed, arguments / content that validate against the caller's JSON
Schema, and what the node takes from the prompt (tool arguments, tools named by a word,
json_object keys)."""

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
    # no keys named in quotes: the default object
    assert set(value) == {"answer", "confidence"}
    assert isinstance(value["answer"], str) and 0 <= value["confidence"] <= 1


async def test_response_format_text_is_prose(make_node, client_for, chat):
    client = client_for(make_node())
    plain = _message(await chat(client))["message"]["content"]
    assert _message(await chat(client, response_format={"type": "text"}))["message"]["content"] == plain


# -- what the node reads in the prompt ----------------------------------------------------------

MAGIC = {
    "type": "function",
    "function": {
        "name": "magic_function",
        "description": "Apply a magic function to an input.",
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "integer", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000}},
            "required": ["input"],
        },
    },
}
CUSTOMER = {
    "type": "function",
    "function": {
        "name": "unicode_customer",
        "parameters": {
            "type": "object",
            "properties": {"customer_name": {"type": "string"}, "description": {"type": "string"}},
            "required": ["customer_name", "description"],
        },
    },
}
LOCATION_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather at a location.",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}
ALERTS = {"type": "function", "function": {"name": "weather_alerts", "parameters": {"type": "object", "properties": {}}}}
WIPE = {"type": "function", "function": {"name": "delete_all", "parameters": {"type": "object", "properties": {}}}}


async def _call(chat, client, **body):
    choice = _message(await chat(client, **body))
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    return call


async def test_a_call_in_the_prompt_fills_the_arguments(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    query = tk.user("What is the value of magic_function(3)? Use the tool.")
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "magic_function"}}):
        call = await _call(chat, client, messages=query, tools=[MAGIC], tool_choice=tool_choice)
        assert call["function"] == {"name": "magic_function", "arguments": '{"input": 3}'}
    fragments = [
        c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
        for c in tk.chunks(await stream(client, messages=query, tools=[MAGIC], tool_choice="required"))
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert json.loads("".join(fragments)) == {"input": 3}


async def test_a_prompt_value_the_schema_rejects_is_generated(make_node, client_for, chat, tk):
    client = client_for(make_node())
    for text in ("magic_function(5000)", "magic_function('three')", "magic_function(2.5)"):
        call = await _call(chat, client, messages=tk.user(text), tools=[MAGIC])
        args = json.loads(call["function"]["arguments"])
        _validate(args, MAGIC["function"]["parameters"])


async def test_a_quoted_string_fills_the_first_string_parameter(make_node, client_for, chat, tk):
    client = client_for(make_node())
    for name in ("你好啊集团", "こんにちは株式会社"):
        text = f"Create a customer named '{name}' (Hello Group) - a technology company"
        call = await _call(chat, client, messages=tk.user(text), tools=[CUSTOMER], tool_choice="required")
        assert f'"customer_name": "{name}"' in call["function"]["arguments"]  # not \\u-escaped
        args = json.loads(call["function"]["arguments"])
        assert args["customer_name"] == name
        _validate(args, CUSTOMER["function"]["parameters"])


async def test_arguments_come_from_the_last_user_message(make_node, client_for, chat, tk):
    client = client_for(make_node())
    messages = [
        {"role": "user", "content": "magic_function(3)"},
        {"role": "system", "content": "magic_function(7)"},
    ]
    call = await _call(chat, client, messages=messages, tools=[MAGIC], tool_choice="required")
    assert json.loads(call["function"]["arguments"]) == {"input": 3}
    later = [*messages, {"role": "user", "content": [{"type": "text", "text": "now magic_function(8)"}]}]
    call = await _call(chat, client, messages=later, tools=[MAGIC], tool_choice="required")
    assert json.loads(call["function"]["arguments"]) == {"input": 8}


async def test_filled_optional_parameters_appear_in_declaration_order(make_node, client_for, chat, tk):
    tool = {
        "type": "function",
        "function": {
            "name": "plan",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}},
                "additionalProperties": False,
            },
        },
    }
    client = client_for(make_node())
    for i in range(10):
        call = await _call(chat, client, messages=tk.user(f"plan(1, 'x', true) #{i}"), tools=[tool])
        assert call["function"]["arguments"] == '{"a": 1, "b": "x", "c": true}'


async def test_auto_calls_a_tool_a_meaningful_word_names(make_node, client_for, chat, tk):
    client = client_for(make_node())
    question = {"role": "user", "content": "What is the weather in San Francisco, CA?"}
    call = await _call(chat, client, messages=[question], tools=[LOCATION_WEATHER])
    assert call["function"]["name"] == "get_weather"
    _validate(json.loads(call["function"]["arguments"]), LOCATION_WEATHER["function"]["parameters"])
    history = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [{**call}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "It's sunny."},
    ]
    choice = _message(await chat(client, messages=history, tools=[LOCATION_WEATHER]))
    assert choice["finish_reason"] == "stop" and choice["message"]["content"]


async def test_a_whole_name_beats_a_word_and_generic_words_do_not_count(make_node, client_for, chat, tk):
    client = client_for(make_node())
    call = await _call(chat, client, messages=tk.user("Any weather alerts today?"), tools=[LOCATION_WEATHER, ALERTS])
    assert call["function"]["name"] == "weather_alerts"
    call = await _call(chat, client, messages=tk.user("Is it raining? check the weather"), tools=[ALERTS, LOCATION_WEATHER])
    assert call["function"]["name"] == "weather_alerts"  # both by a word: the first tool wins
    choice = _message(await chat(client, messages=tk.user("Please delete everything"), tools=[WIPE]))
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]


async def test_json_object_has_exactly_the_keys_the_prompt_names(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    text = (
        "Tell me a joke about cats. Return the result as a JSON with 'setup' and "
        "'punchline' keys. Return nothing other than JSON."
    )
    body = {"messages": tk.user(text), "response_format": {"type": "json_object"}}
    content = _message(await chat(client, **body))["message"]["content"]
    value = json.loads(content)
    assert list(value) == ["setup", "punchline"]
    assert all(isinstance(v, str) and v for v in value.values())
    assert tk.streamed_content(await stream(client, **body)) == content
    quoted = tk.user('Answer in JSON with the keys "city", "country" and "city" again')
    value = json.loads(_message(await chat(client, messages=quoted, response_format={"type": "json_object"}))["message"]["content"])
    assert list(value) == ["city", "country"]


# -- parallel tool calls -------------------------------------------------------------------------

PARALLEL_TOOLS = [WEATHER, MAGIC, BOOKING]
PARALLEL_TEXT = "First book_trip, then magic_function(3), and get_weather for 'Paris'."
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in PARALLEL_TOOLS}


async def _calls(chat, client, **body):
    choice = _message(await chat(client, **body))
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    return choice["message"]["tool_calls"]


async def test_several_mentioned_tools_are_called_in_mention_order(make_node, client_for, chat, tk):
    client = client_for(make_node())
    body = {"messages": tk.user(PARALLEL_TEXT), "tools": PARALLEL_TOOLS}
    calls = await _calls(chat, client, **body)
    assert [c["function"]["name"] for c in calls] == ["book_trip", "magic_function", "get_weather"]
    assert len({c["id"] for c in calls}) == 3
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        _validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    by_name = {c["function"]["name"]: json.loads(c["function"]["arguments"]) for c in calls}
    assert by_name["magic_function"] == {"input": 3}  # its own call in the prompt
    assert by_name["get_weather"]["city"] == "Paris"  # the first quoted string
    assert await _calls(chat, client, **body) == calls  # deterministic, ids too
    # "required" calls them all as well; the order is the text's, not the list's
    required = await _calls(chat, client, **body, tool_choice="required")
    assert [c["function"]["name"] for c in required] == ["book_trip", "magic_function", "get_weather"]
    reordered = await _calls(chat, client, messages=tk.user("get_weather, then magic_function(3)"), tools=PARALLEL_TOOLS)
    assert [c["function"]["name"] for c in reordered] == ["get_weather", "magic_function"]


async def test_tools_named_by_words_are_called_in_parallel(make_node, client_for, chat, tk):
    client = client_for(make_node())
    text = "What's the weather in Paris? And book a trip there."
    calls = await _calls(chat, client, messages=tk.user(text), tools=[BOOKING, LOCATION_WEATHER])
    assert [c["function"]["name"] for c in calls] == ["get_weather", "book_trip"]
    # one occurrence names one tool: "weather alerts" is not also a mention of get_weather
    calls = await _calls(chat, client, messages=tk.user("Any weather alerts today?"), tools=[LOCATION_WEATHER, ALERTS])
    assert [c["function"]["name"] for c in calls] == ["weather_alerts"]


async def test_parallel_usage_counts_every_call(make_node, client_for, chat, tk):
    client = client_for(make_node())
    response = await chat(client, messages=tk.user(PARALLEL_TEXT), tools=PARALLEL_TOOLS)
    body = response.json()
    calls = body["choices"][0]["message"]["tool_calls"]
    single = {"messages": tk.user(PARALLEL_TEXT), "tools": PARALLEL_TOOLS, "parallel_tool_calls": False}
    one = (await chat(client, **single)).json()
    assert body["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] > one["usage"]["completion_tokens"] >= 2
    assert body["usage"]["completion_tokens"] > 2 * len(calls)


async def test_parallel_tool_calls_false_keeps_one_call(make_node, client_for, chat, tk):
    client = client_for(make_node())
    calls = await _calls(
        chat, client, messages=tk.user(PARALLEL_TEXT), tools=PARALLEL_TOOLS, parallel_tool_calls=False
    )
    # one call, chosen by the one-call rule: the first tool of the list that is mentioned
    [call] = calls
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] == "Paris"
    for tool_choice in ("auto", "required"):
        [call] = await _calls(
            chat, client, messages=tk.user(PARALLEL_TEXT), tools=PARALLEL_TOOLS,
            tool_choice=tool_choice, parallel_tool_calls=False,
        )
        assert call["function"]["name"] == "get_weather"
    # a named tool_choice is one call whatever the prompt mentions
    named = {"type": "function", "function": {"name": "magic_function"}}
    [call] = await _calls(chat, client, messages=tk.user(PARALLEL_TEXT), tools=PARALLEL_TOOLS, tool_choice=named)
    assert call["function"] == {"name": "magic_function", "arguments": '{"input": 3}'}


async def test_a_single_mention_is_still_one_call(make_node, client_for, chat, tk):
    client = client_for(make_node())
    messages = tk.user("What is magic_function(3)? Use the tool.")
    replies = []
    for extra in ({}, {"parallel_tool_calls": True}, {"parallel_tool_calls": None}, {"parallel_tool_calls": False}):
        calls = await _calls(chat, client, messages=messages, tools=PARALLEL_TOOLS, **extra)
        assert [c["function"]["name"] for c in calls] == ["magic_function"]
        replies.append(calls)
    assert all(r == replies[0] for r in replies)  # the flag changes nothing for one mention


async def test_parallel_needs_the_mentions_in_a_user_message(make_node, client_for, chat):
    client = client_for(make_node())
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "system", "content": "use get_weather and book_trip"},
    ]
    calls = await _calls(chat, client, messages=messages, tools=PARALLEL_TOOLS, tool_choice="required")
    assert [c["function"]["name"] for c in calls] == ["get_weather"]  # the one-call rule
    choice = _message(await chat(client, messages=messages, tools=PARALLEL_TOOLS))
    assert choice["finish_reason"] == "stop"  # auto answers a non-user message in text


async def test_after_parallel_tool_results_the_node_answers_text(make_node, client_for, chat, tk):
    client = client_for(make_node())
    question = tk.user(PARALLEL_TEXT)
    calls = await _calls(chat, client, messages=question, tools=PARALLEL_TOOLS)
    history = [
        *question,
        {"role": "assistant", "content": None, "tool_calls": calls},
        *({"role": "tool", "tool_call_id": c["id"], "content": "done"} for c in calls),
    ]
    choice = _message(await chat(client, messages=history, tools=PARALLEL_TOOLS))
    assert choice["finish_reason"] == "stop" and choice["message"]["content"]


async def test_streamed_parallel_calls_reassemble_to_the_plain_ones(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    body = {"messages": tk.user(PARALLEL_TEXT), "tools": PARALLEL_TOOLS, "stream_options": {"include_usage": True}}
    plain = (await chat(client, **body)).json()
    plain_calls = plain["choices"][0]["message"]["tool_calls"]
    chunks = tk.chunks(await stream(client, **body))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    deltas = []
    for chunk in chunks:
        if chunk["choices"] and "tool_calls" in chunk["choices"][0]["delta"]:
            assert chunk["choices"][0]["finish_reason"] is None
            [delta] = chunk["choices"][0]["delta"]["tool_calls"]  # one fragment per chunk
            deltas.append(delta)
    indices = [d["index"] for d in deltas]
    assert indices == sorted(indices) and set(indices) == {0, 1, 2}  # one call after another
    streamed = []
    for index, plain_call in enumerate(plain_calls):
        head, *fragments = [d for d in deltas if d["index"] == index]
        assert head == {
            "index": index,
            "id": plain_call["id"],
            "type": "function",
            "function": {"name": plain_call["function"]["name"], "arguments": ""},
        }
        assert fragments
        assert all(set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments)
        streamed.append("".join(f["function"]["arguments"] for f in fragments))
    assert streamed == [c["function"]["arguments"] for c in plain_calls]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"] == plain["usage"]
    # one paced step per generated token: a head per call, then one per argument fragment
    assert len(deltas) == plain["usage"]["completion_tokens"]


async def test_streamed_parallel_tool_calls_false_is_one_call(make_node, client_for, stream, tk):
    client = client_for(make_node())
    events = await stream(client, messages=tk.user(PARALLEL_TEXT), tools=PARALLEL_TOOLS, parallel_tool_calls=False)
    deltas = [
        c["choices"][0]["delta"]["tool_calls"][0]
        for c in tk.chunks(events)
        if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
    ]
    assert {d["index"] for d in deltas} == {0}
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather"]
    assert tk.chunks(events)[-1]["choices"][0]["finish_reason"] == "tool_calls"
