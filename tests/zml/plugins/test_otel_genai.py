"""OpenAI chat requests in the GenAI conventions' shapes (zml.plugins.default.genai)."""

from __future__ import annotations

import json

from zml.plugins.default.genai import decode_body, input_messages, request_attributes


def test_messages_become_role_and_typed_parts() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "name": "ann", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "lookup", "arguments": "{\"q\": \"cat\"}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    assert input_messages(messages) == [
        {"role": "system", "parts": [{"type": "text", "content": "be brief"}]},
        {"role": "user", "name": "ann", "parts": [
            {"type": "text", "content": "what is this?"},
            {"type": "uri", "modality": "image", "uri": "https://example.com/cat.png"},
            {"type": "blob", "modality": "image", "mime_type": "image/png", "content": "AAAA"},
        ]},
        {"role": "assistant", "parts": [
            {"type": "tool_call", "id": "call_1", "name": "lookup", "arguments": {"q": "cat"}},
        ]},
        {"role": "tool", "parts": [
            {"type": "tool_call_response", "id": "call_1", "response": "a cat"},
        ]},
    ]


def test_request_attributes_only_for_parameters_that_are_set() -> None:
    body = {"model": "m", "messages": [], "max_completion_tokens": 10, "temperature": 1,
            "n": 1, "seed": True, "stop": "x"}
    assert request_attributes(body) == {
        "gen_ai.request.max_tokens": 10,
        "gen_ai.request.temperature": 1.0,
        "gen_ai.request.stop_sequences": ("x",),
    }
    assert request_attributes({"n": 3})["gen_ai.request.choice.count"] == 3
    assert request_attributes({}) == {}


def test_decode_body_tolerates_what_is_not_a_json_object() -> None:
    assert decode_body(b"[1]") == {} and decode_body(b"{") == {}
    assert decode_body(json.dumps({"a": 1}).encode()) == {"a": 1}
