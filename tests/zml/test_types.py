"""Response objects: OpenAI shapes, and the unvalidated chunk path equal to pydantic's own."""

from __future__ import annotations

from typing import Any

import pytest

from zml.types import (
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceDelta,
    ChoiceDeltaToolCall,
    ChoiceDeltaToolCallFunction,
    ChunkChoice,
    RoutingInfo,
    Usage,
    build_chunk,
)

ROUTING = RoutingInfo(node_id="n", accelerator="H100", policy="p", queue_depth=0)

CHUNKS: list[dict[str, Any]] = [
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [{"index": 0, "delta": {"content": " hi"}, "finish_reason": None}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [{"index": 0, "delta": {"tool_calls": [
         {"index": 0, "id": "call_1", "type": "function",
          "function": {"name": "f", "arguments": ""}}]}}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "choices": [{"index": 0, "delta": {"tool_calls": [
         {"index": 0, "function": {"arguments": "{\"a\": 1}"}}]}, "finish_reason": "tool_calls"}]},
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m", "choices": [],
     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
    {"id": "c1", "object": "chat.completion.chunk", "created": 5, "model": "m",
     "system_fingerprint": "fp_1", "choices": [],
     "usage": {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44,
               "prompt_tokens_details": {"cached_tokens": 32},
               "completion_tokens_details": {"reasoning_tokens": 2}}},
]


def _reference(data: dict[str, Any]) -> ChatCompletionChunk:
    """The same chunk through pydantic's model_construct."""
    choices = []
    for c in data["choices"]:
        d = c.get("delta") or {}
        calls = None
        if d.get("tool_calls"):
            calls = [ChoiceDeltaToolCall.model_construct(
                index=tc.get("index", 0), id=tc.get("id"), type=tc.get("type"),
                function=ChoiceDeltaToolCallFunction.model_construct(
                    name=tc["function"].get("name"), arguments=tc["function"].get("arguments")),
            ) for tc in d["tool_calls"]]
        delta = ChoiceDelta.model_construct(role=d.get("role"), content=d.get("content"),
                                            tool_calls=calls, refusal=None)
        choices.append(ChunkChoice.model_construct(index=c.get("index", 0), delta=delta,
                                                   finish_reason=c.get("finish_reason"),
                                                   logprobs=None))
    usage = data.get("usage")
    return ChatCompletionChunk.model_construct(
        id=data["id"], object=data["object"], created=data["created"], model=data["model"],
        choices=choices, usage=Usage.model_construct(**usage) if usage else None,
        system_fingerprint=data.get("system_fingerprint"), routing=ROUTING)


@pytest.mark.parametrize("data", CHUNKS)
def test_fast_chunks_equal_pydantic_constructed_ones(data: dict[str, Any]) -> None:
    fast = build_chunk(data, ROUTING)
    ref = _reference(data)
    assert fast == ref
    assert fast.model_dump() == ref.model_dump()
    assert fast.model_dump_json() == ref.model_dump_json()
    assert fast.model_fields_set == ref.model_fields_set
    assert ChatCompletionChunk.model_validate(fast.model_dump()).model_dump() == ref.model_dump()


def test_chunks_keep_usage_details_and_system_fingerprint() -> None:
    chunk = build_chunk(CHUNKS[-1], ROUTING)
    assert chunk.system_fingerprint == "fp_1"
    assert chunk.usage is not None
    assert chunk.usage.model_extra == {"prompt_tokens_details": {"cached_tokens": 32},
                                       "completion_tokens_details": {"reasoning_tokens": 2}}


def test_completion_keeps_unknown_node_fields_and_routing() -> None:
    c = ChatCompletion.model_validate({
        "id": "x", "model": "m", "prompt_logprobs": None, "kv_transfer_params": {"a": 1},
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi",
                                             "reasoning_content": "r"},
                     "finish_reason": "stop", "stop_reason": None}],
        "routing": ROUTING,
    })
    assert c.routing is ROUTING
    assert c.model_extra == {"prompt_logprobs": None, "kv_transfer_params": {"a": 1}}
    assert c.choices[0].message.model_extra == {"reasoning_content": "r"}
