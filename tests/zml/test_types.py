"""Response objects: OpenAI shapes, and the unvalidated chunk path equal to pydantic's own."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st
from pydantic import BaseModel, ValidationError

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
    build_completion,
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


# --- full responses: build_completion equals pydantic's validation -----------------------------

COMPLETIONS: list[dict[str, Any]] = [
    {"id": "x", "object": "chat.completion", "created": 5, "model": "m",
     "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                  "finish_reason": "stop", "logprobs": None}],
     "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}},
    {"id": "x", "model": "m", "choices": []},
    {"id": "x", "model": "m", "choices": [{"message": {}}], "usage": {}},
    {"id": "x", "model": "m", "system_fingerprint": "fp", "prompt_logprobs": None,
     "kv_transfer_params": {"a": 1},
     "choices": [{"index": 1, "message": {"content": None, "reasoning_content": "r",
                                          "refusal": "no"},
                  "stop_reason": None, "logprobs": {"content": []}}],
     "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}},
    {"id": "x", "model": "m", "choices": [{"message": {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "call_2", "function": {"name": "g", "arguments": "", "extra": 1}, "x": 2}]},
        "finish_reason": "tool_calls"}]},
]

# What pydantic coerces, fills or refuses: build_completion leaves these to it.
NEEDS_VALIDATION: list[dict[str, Any]] = [
    {"id": "x", "model": "m", "created": 5.0, "choices": []},
    {"id": "x", "model": "m", "created": True, "choices": []},
    {"id": 1, "model": "m", "choices": []},
    {"model": "m", "choices": []},
    {"id": "x", "choices": []},
    {"id": "x", "model": "m", "choices": [{"message": {"role": "user", "content": "hi"}}]},
    {"id": "x", "model": "m", "choices": [{"message": {"role": None}}]},
    {"id": "x", "model": "m", "choices": [{"index": "0", "message": {}}]},
    {"id": "x", "model": "m", "choices": [{}]},
    {"id": "x", "model": "m", "choices": [{"message": {"content": 3}}]},
    {"id": "x", "model": "m", "choices": [{"message": {"tool_calls": [{"id": "c"}]}}]},
    {"id": "x", "model": "m", "choices": [{"message": {"tool_calls": [
        {"id": "c", "type": "other", "function": {"name": "f", "arguments": ""}}]}}]},
    {"id": "x", "model": "m", "choices": [], "usage": {"prompt_tokens": "3"}},
    {"id": "x", "model": "m", "choices": [], "usage": []},
    {"id": "x", "model": "m", "choices": {}},
]


def _validated(data: dict[str, Any]) -> ChatCompletion:
    return ChatCompletion.model_validate({**data, "routing": ROUTING})


def _fields_set_tree(obj: object) -> object:
    """Every model's fields set and extras, recursively (what == does not compare)."""
    if isinstance(obj, list):
        return [_fields_set_tree(o) for o in obj]
    if isinstance(obj, BaseModel):
        return (type(obj), sorted(obj.model_fields_set), obj.__pydantic_extra__,
                {k: _fields_set_tree(v) for k, v in obj.__dict__.items()})
    return obj


def _built(data: dict[str, Any]) -> ChatCompletion | None:
    data = copy.deepcopy(data)
    data["routing"] = ROUTING
    return build_completion(data, ROUTING)


@pytest.mark.parametrize("data", COMPLETIONS)
def test_built_completions_equal_validated_ones(data: dict[str, Any]) -> None:
    fast = _built(data)
    assert fast is not None
    ref = _validated(data)
    assert fast == ref
    assert fast.routing is ROUTING
    assert _fields_set_tree(fast) == _fields_set_tree(ref)
    assert fast.model_dump(exclude_unset=True) == ref.model_dump(exclude_unset=True)
    assert fast.model_dump_json() == ref.model_dump_json()


@pytest.mark.parametrize("data", NEEDS_VALIDATION)
def test_completions_that_need_validation_are_left_to_pydantic(data: dict[str, Any]) -> None:
    assert _built(data) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=False) | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=2), inner, max_size=2),
    max_leaves=4,
)


def _maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``value``, sometimes any JSON value instead (then pydantic decides)."""
    return st.integers(0, 9).flatmap(lambda i: _JSON if i == 9 else value)


_FUNCTION = st.fixed_dictionaries({"name": _maybe(st.text(max_size=2)),
                                   "arguments": _maybe(st.text(max_size=2))},
                                  optional={"x": _JSON})
_TOOL_CALL = st.fixed_dictionaries({"id": _maybe(st.text(max_size=2)),
                                    "function": _maybe(_FUNCTION)},
                                   optional={"type": _maybe(st.just("function")), "x": _JSON})
_MESSAGE = st.fixed_dictionaries({}, optional={
    "role": _maybe(st.just("assistant")), "content": _maybe(st.text(max_size=3) | st.none()),
    "tool_calls": _maybe(st.lists(_maybe(_TOOL_CALL), max_size=2) | st.none()),
    "refusal": _maybe(st.none()), "x": _JSON})
_CHOICE = st.fixed_dictionaries({"message": _maybe(_MESSAGE)}, optional={
    "index": _maybe(st.integers(0, 3)),
    "finish_reason": _maybe(st.sampled_from(["stop", "length"]) | st.none()),
    "logprobs": _JSON, "x": _JSON})
_USAGE = st.fixed_dictionaries({}, optional={
    "prompt_tokens": _maybe(st.integers(0, 9)), "completion_tokens": _maybe(st.integers(0, 9)),
    "total_tokens": _maybe(st.integers(0, 9)), "prompt_tokens_details": _JSON})
_COMPLETION = st.fixed_dictionaries({
    "id": _maybe(st.text(max_size=3)), "model": _maybe(st.text(max_size=3)),
    "choices": _maybe(st.lists(_maybe(_CHOICE), max_size=2))}, optional={
    "object": _maybe(st.just("chat.completion")), "created": _maybe(st.integers(0, 9)),
    "usage": _maybe(_USAGE | st.none()), "system_fingerprint": _maybe(st.none()), "x": _JSON})


@given(_COMPLETION)
@settings(max_examples=400, derandomize=True, deadline=None, database=None)
def test_build_completion_is_validation_or_nothing(data: dict[str, Any]) -> None:
    fast = _built(data)
    try:
        ref = _validated(data)
    except ValidationError:
        assert fast is None
        return
    if fast is not None:
        assert fast == ref
        assert _fields_set_tree(fast) == _fields_set_tree(ref)
