"""Response objects: OpenAI-shaped chat completions and chunks, plus where each request went.

``ChatCompletion`` mirrors openai-python's, so code written against it works unchanged, and adds
``routing`` (always set). A full response is validated once; stream chunks are built with
``model_construct`` from the node's JSON (trusted fields, no per-chunk validation): the
streaming hot path must stay within a few microseconds per chunk.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

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
    model_config = ConfigDict(defer_build=True)


class _Open(BaseModel):
    """Node responses may carry more fields than we name; keep them (as openai-python does)."""

    model_config = ConfigDict(extra="allow", defer_build=True)


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
    evaluated: list[dict[str, Any]] = Field(default_factory=list)
    decision_us: float = 0.0
    attempts: list[Attempt] = Field(default_factory=list)
    queued_ms: float = 0.0
    cost: Cost | None = None
    server_address: str = ""
    metadata: dict[str, Any] = Field(default_factory=dict)


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

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


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


def trusted(cls: type[_M], values: dict[str, Any]) -> _M:
    """An instance of ``cls`` from ``values`` naming every field, without validation.

    The result equals ``cls.model_construct(**values)`` (a test holds it to that) at a third of
    the cost: it fills pydantic v2's instance slots directly instead of walking the fields.
    Only for data zml has already parsed (a node's JSON chunk), on the streaming hot path.
    """
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    object.__setattr__(obj, "__pydantic_fields_set__", set(values))
    object.__setattr__(obj, "__pydantic_extra__", {} if cls.model_config.get("extra") == "allow"
                       else None)
    object.__setattr__(obj, "__pydantic_private__", None)
    return obj


def _tool_call_delta(tc: dict[str, Any]) -> ChoiceDeltaToolCall:
    fn = tc.get("function")
    return trusted(ChoiceDeltaToolCall, {
        "index": tc.get("index", 0),
        "id": tc.get("id"),
        "type": tc.get("type"),
        "function": None if fn is None else trusted(
            ChoiceDeltaToolCallFunction, {"name": fn.get("name"), "arguments": fn.get("arguments")}
        ),
    })


def build_chunk(data: dict[str, Any], routing: RoutingInfo) -> ChatCompletionChunk:
    """A chunk from a node's decoded JSON, without validation (the hot path)."""
    choices = []
    for c in data.get("choices") or ():
        d = c.get("delta") or {}
        calls = d.get("tool_calls")
        delta = trusted(ChoiceDelta, {
            "role": d.get("role"),
            "content": d.get("content"),
            "tool_calls": [_tool_call_delta(tc) for tc in calls] if calls else None,
            "refusal": d.get("refusal"),
        })
        choices.append(trusted(ChunkChoice, {
            "index": c.get("index", 0),
            "delta": delta,
            "finish_reason": c.get("finish_reason"),
            "logprobs": c.get("logprobs"),
        }))
    usage = data.get("usage")
    return trusted(ChatCompletionChunk, {
        "id": data.get("id", ""),
        "object": data.get("object", "chat.completion.chunk"),
        "created": data.get("created", 0),
        "model": data.get("model", ""),
        "choices": choices,
        # Once per stream, so validated: the node's details stay as Usage's extra fields.
        "usage": Usage.model_validate(usage) if usage else None,
        "system_fingerprint": data.get("system_fingerprint"),
        "routing": routing,
    })
