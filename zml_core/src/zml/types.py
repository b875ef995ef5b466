"""Response objects: OpenAI-shaped chat completions and chunks, plus where each request went.

``ChatCompletion`` mirrors openai-python's, so code written against it works unchanged, and adds
``routing`` (always set). A full response is validated once; stream chunks are built with
``trusted`` from the node's JSON, type-checked while they are built but not validated by
pydantic: the streaming hot path must stay within a few microseconds per chunk.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "Attempt",
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "Choice",
    "ChoiceDelta",
    "ChoiceDeltaToolCall",
    "ChoiceDeltaToolCallFunction",
    "ChunkChoice",
    "Cost",
    "Function",
    "RoutingInfo",
    "Usage",
]


class _Model(BaseModel):
    """Base of zml's response types (validation deferred to first use)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(defer_build=True)


class _Open(BaseModel):
    """Node responses may carry more fields than we name; keep them (as openai-python does)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(extra="allow", defer_build=True)


class Cost(_Model):
    """What a request cost, from the cost-attribution hook."""

    amount: float
    """The cost, in ``currency``."""
    currency: str = "USD"
    basis: str
    """How it was computed, e.g. ``"node_seconds"`` or ``"tokens"``."""


class Attempt(_Model):
    """One failed attempt before the one that served the request (see ``RoutingInfo.attempts``)."""

    node_id: str
    accelerator: str
    error: str
    """A short stable kind: ``connection_error``, ``timeout``, ``unavailable``, ``rate_limited``..."""
    status_code: int | None = None
    message: str = ""


class RoutingInfo(_Model):
    """Where a request went and why; set on every response, chunk and node error.

    Attributes:
        node_id: the node that served the request.
        accelerator: its accelerator family.
        policy: the policy's name, or None for a call without a policy.
        queue_depth: requests waiting in the node's queue (beyond its slots) at dispatch.
        node_load: requests on the node (running + waiting) at dispatch, before this one.
        predicted_ttft_ms: the routing engine's time-to-first-token prediction.
        evaluated: the decision trace, one entry per family looked at (chain order), each
            ``{"family", "nodes_checked", "rejected_reason"}``; the chosen family has None.
        decision_us: how long the routing decision took, in microseconds.
        attempts: failed attempts before this one (failover), in order.
        queued_ms: time spent in the client-side queue (``queue_on_saturation``), if any.
        cost: the request's cost, when costs are configured.
        server_address: host:port of the node.
        metadata: the per-call ``metadata={...}`` (team, service...), for chargeback.
    """

    node_id: str
    accelerator: str
    policy: str | None
    queue_depth: int
    node_load: int = 0
    predicted_ttft_ms: float = 0.0
    evaluated: list[dict[str, Any]] = []
    decision_us: float = 0.0
    attempts: list[Attempt] = []
    queued_ms: float = 0.0
    cost: Cost | None = None
    server_address: str = ""
    metadata: dict[str, Any] = {}


class Function(_Open):
    """The function a tool call invokes: its name and JSON-encoded arguments."""

    name: str
    arguments: str


class ChatCompletionMessageToolCall(_Open):
    """A tool call made by the assistant."""

    id: str
    type: Literal["function"] = "function"
    function: Function


class ChatCompletionMessage(_Open):
    """The assistant's message."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    refusal: str | None = None


class Choice(_Open):
    """One completion choice."""

    index: int = 0
    message: ChatCompletionMessage
    finish_reason: str | None = None
    logprobs: Any = None


class Usage(_Open):
    """Token counts of a request; a node's details (``prompt_tokens_details``,
    ``completion_tokens_details``) are kept as extra fields, plain dicts."""

    prompt_tokens: int = Field(default=0, strict=True, ge=0)
    completion_tokens: int = Field(default=0, strict=True, ge=0)
    total_tokens: int = Field(default=0, strict=True, ge=0)


class ChatCompletion(_Open):
    """A chat completion, shaped as the OpenAI API's, with ``routing`` always set."""

    id: str
    object: str = "chat.completion"
    created: int = 0
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    routing: RoutingInfo


class ChoiceDeltaToolCallFunction(_Open):
    """A fragment of a streamed tool call's function."""

    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(_Open):
    """A fragment of a streamed tool call (merge fragments by ``index``)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: ChoiceDeltaToolCallFunction | None = None


class ChoiceDelta(_Open):
    """What a chunk adds to the message."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None
    refusal: str | None = None


class ChunkChoice(_Open):
    """One choice of a streamed chunk."""

    index: int = 0
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: Any = None


class ChatCompletionChunk(_Open):
    """A streamed chunk, shaped as OpenAI's ``chat.completion.chunk``, with ``routing``."""

    id: str
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    routing: RoutingInfo


_M = TypeVar("_M", bound=BaseModel)

_new = object.__new__
_setattr = object.__setattr__


def trusted(cls: type[_M], values: dict[str, Any], extra: dict[str, Any] | None = None) -> _M:
    """An instance of ``cls`` from ``values`` naming every field, without validation.

    The result equals ``cls.model_construct(**values, **extra)`` (a test holds it to that) at
    a fraction of the cost: it fills pydantic v2's instance slots directly instead of walking
    the fields. ``extra`` holds fields the model does not name (kept by ``extra="allow"``
    models). Only for data zml has already parsed and checked, on the streaming hot path.
    """
    obj = _new(cls)
    _setattr(obj, "__dict__", values)
    if extra:
        _setattr(obj, "__pydantic_fields_set__", {*values, *extra})
        _setattr(obj, "__pydantic_extra__", extra)
    else:
        _setattr(obj, "__pydantic_fields_set__", set(values))
        _setattr(obj, "__pydantic_extra__", {} if cls.model_config.get("extra") == "allow"
                 else None)
    _setattr(obj, "__pydantic_private__", None)
    return obj


class MalformedChunk(ValueError):
    """What is wrong with a node's stream event (the stream decoder adds the node's name)."""


_DELTA_FIELDS = frozenset({"role", "content", "tool_calls", "refusal"})
_CHOICE_FIELDS = frozenset({"index", "delta", "finish_reason", "logprobs"})
_CHUNK_FIELDS = frozenset({"id", "object", "created", "model", "choices", "usage",
                           "system_fingerprint"})
_USAGE_FIELDS = frozenset({"prompt_tokens", "completion_tokens", "total_tokens"})


def _kind(value: object) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"


def _bad(where: str, value: object, expected: str) -> MalformedChunk:
    return MalformedChunk(f"{where} is {_kind(value)}, expected {expected}")


def _text(value: object, where: str) -> str | None:
    if value is None or type(value) is str:
        return value
    raise _bad(where, value, "a string or null")


def _count(value: object, where: str, default: int = 0) -> int:
    if value is None:
        return default
    if type(value) is int:
        return value
    raise _bad(where, value, "an integer")


def _extra(obj: dict[str, Any], known: frozenset[str]) -> dict[str, Any] | None:
    if known.issuperset(obj):
        return None
    return {k: v for k, v in obj.items() if k not in known}


def _tool_call_delta(tc: object, where: str) -> ChoiceDeltaToolCall:
    if type(tc) is not dict:
        raise _bad(where, tc, "an object")
    fn = tc.get("function")
    function = None
    if fn is not None:
        if type(fn) is not dict:
            raise _bad(f"{where}.function", fn, "an object or null")
        function = trusted(ChoiceDeltaToolCallFunction, {
            "name": _text(fn.get("name"), f"{where}.function.name"),
            "arguments": _text(fn.get("arguments"), f"{where}.function.arguments"),
        })
    return trusted(ChoiceDeltaToolCall, {
        "index": _count(tc.get("index"), f"{where}.index"),
        "id": _text(tc.get("id"), f"{where}.id"),
        "type": _text(tc.get("type"), f"{where}.type"),
        "function": function,
    })


def _tokens(value: object, where: str) -> int:
    if value is None:
        return 0
    if type(value) is int and value >= 0:
        return value
    raise _bad(where, value, "a non-negative integer")


def _usage(usage: object) -> Usage:
    # (as Usage's own fields check a whole answer's: an integer, not "3" nor true, nor < 0)
    if type(usage) is not dict:
        raise _bad("usage", usage, "an object or null")
    return trusted(Usage, {
        "prompt_tokens": _tokens(usage.get("prompt_tokens"), "usage.prompt_tokens"),
        "completion_tokens": _tokens(usage.get("completion_tokens"), "usage.completion_tokens"),
        "total_tokens": _tokens(usage.get("total_tokens"), "usage.total_tokens"),
    }, _extra(usage, _USAGE_FIELDS))


def _choice(c: object, i: int) -> ChunkChoice:
    if type(c) is not dict:
        raise _bad(f"choices[{i}]", c, "an object")
    d = c.get("delta")
    if d is None:
        d = {}
    elif type(d) is not dict:
        raise _bad(f"choices[{i}].delta", d, "an object")
    content = d.get("content")
    if content is not None and type(content) is not str:
        raise _bad(f"choices[{i}].delta.content", content, "a string or null")
    role = d.get("role")
    if role is not None and type(role) is not str:
        raise _bad(f"choices[{i}].delta.role", role, "a string or null")
    calls = d.get("tool_calls")
    tool_calls = None
    if calls:
        if type(calls) is not list:
            raise _bad(f"choices[{i}].delta.tool_calls", calls, "a list or null")
        tool_calls = [_tool_call_delta(tc, f"choices[{i}].delta.tool_calls[{j}]")
                      for j, tc in enumerate(calls)]
    refusal = d.get("refusal")
    if refusal is not None and type(refusal) is not str:
        raise _bad(f"choices[{i}].delta.refusal", refusal, "a string or null")
    # (the checks are spelled out, not calls: this runs for every chunk)
    delta = trusted(ChoiceDelta, {
        "role": role,
        "content": content,
        "tool_calls": tool_calls,
        "refusal": refusal,
    }, None if _DELTA_FIELDS.issuperset(d) else _extra(d, _DELTA_FIELDS))
    reason = c.get("finish_reason")
    if reason is not None and type(reason) is not str:
        raise _bad(f"choices[{i}].finish_reason", reason, "a string or null")
    index = c.get("index", 0)
    if type(index) is not int:
        raise _bad(f"choices[{i}].index", index, "an integer")
    return trusted(ChunkChoice, {
        "index": index,
        "delta": delta,
        "finish_reason": reason,
        "logprobs": c.get("logprobs"),
    }, None if _CHOICE_FIELDS.issuperset(c) else _extra(c, _CHOICE_FIELDS))


def build_chunk(data: dict[str, Any], routing: RoutingInfo) -> ChatCompletionChunk:
    """A chunk from a node's decoded JSON, checked but not validated (the hot path).

    Every field is type-checked while the chunk is built (one walk, no copies): a shape that is
    not an OpenAI ``chat.completion.chunk`` raises :class:`MalformedChunk` saying what was wrong.
    Fields the models do not name (``system_fingerprint``, a delta's ``reasoning_content``...)
    are kept as extras, as openai-python does.
    """
    raw = data.get("choices")
    if type(raw) is not list:
        raise _bad("choices", raw, "a list") if "choices" in data \
            else MalformedChunk("it has no 'choices'")
    choices = [_choice(raw[0], 0)] if len(raw) == 1 \
        else [_choice(c, i) for i, c in enumerate(raw)]
    usage = data.get("usage")
    cid = data.get("id", "")
    if type(cid) is not str:
        raise _bad("id", cid, "a string")
    model = data.get("model", "")
    if type(model) is not str:
        raise _bad("model", model, "a string")
    obj = data.get("object", "chat.completion.chunk")
    if type(obj) is not str:
        raise _bad("object", obj, "a string")
    created = data.get("created")
    if type(created) is not int:
        created = _count(created, "created")
    fingerprint = data.get("system_fingerprint")
    if fingerprint is not None and type(fingerprint) is not str:
        raise _bad("system_fingerprint", fingerprint, "a string or null")
    return trusted(ChatCompletionChunk, {
        "id": cid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": None if usage is None or usage == {} else _usage(usage),
        "system_fingerprint": fingerprint,
        "routing": routing,
    }, None if _CHUNK_FIELDS.issuperset(data) else _extra(data, _CHUNK_FIELDS))
