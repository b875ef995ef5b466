"""zml answers as LlamaIndex ``ChatResponse``s, with where each request went.

Every response carries the routing record (``zml.RoutingInfo`` as a plain dict) twice:
``additional_kwargs["zml_routing"]`` for application code, and ``raw["zml_routing"]`` beside
``raw["usage"]``, where LlamaIndex's ``TokenCountingHandler`` reads token counts. It is never put
in ``message.additional_kwargs``: a message goes back to the fleet in the next turn of a chat.

Tool calls become ``ToolCallBlock``s of the assistant message, and also, as
llama-index-llms-openai puts them, OpenAI-shaped dicts in ``message.additional_kwargs
["tool_calls"]``: LlamaIndex's structured streaming (``stream_structured_predict``,
``as_structured_llm(...).stream_chat``) reads the partial objects from there. While a stream is
running the arguments are the JSON text received so far (the blocks' and the dicts' alike); the
final response of a stream (and a plain response) holds the blocks' parsed, when they parse.
Sending such a message back uses the blocks, never both.

``response.logprobs`` (when the request asked for them) holds one list of ``LogProb`` per
generated token: its ``top_logprobs`` alternatives, most likely first, or the sampled token
alone when no alternatives were asked for (llama-index-llms-openai drops those tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ContentBlock,
    LogProb,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.utils import parse_partial_json

import zml

__all__ = ["StreamAccumulator", "from_completion", "parse_arguments", "to_logprobs"]

ROUTING_KEY = "zml_routing"


def from_completion(completion: zml.ChatCompletion) -> ChatResponse:
    """The ``ChatResponse`` of a non-streamed zml answer."""
    routing = completion.routing.model_dump()
    blocks: list[ContentBlock] = []
    tool_calls: list[dict[str, Any]] = []
    logprobs = None
    if completion.choices:
        choice = completion.choices[0]
        message = choice.message
        if message.content is not None:
            blocks.append(TextBlock(text=message.content))
        for call in message.tool_calls or ():
            blocks.append(
                ToolCallBlock(
                    tool_call_id=call.id,
                    tool_name=call.function.name,
                    tool_kwargs=_final_arguments(call.function.arguments),
                )
            )
            tool_calls.append(_tool_call(call.id, call.function.name, call.function.arguments))
        logprobs = to_logprobs(choice.logprobs)
    raw = completion.model_dump(exclude={"routing"})
    raw[ROUTING_KEY] = routing
    return ChatResponse(
        message=_message(blocks, tool_calls),
        raw=raw,
        logprobs=logprobs,
        additional_kwargs=_extras(routing, raw.get("usage")),
    )


def _message(blocks: list[ContentBlock], tool_calls: list[dict[str, Any]]) -> ChatMessage:
    extra = {"tool_calls": tool_calls} if tool_calls else {}
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def _tool_call(call_id: str | None, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def to_logprobs(raw: Any) -> list[list[LogProb]] | None:
    """``response.logprobs`` from an OpenAI ``logprobs`` object (None when there is none)."""
    content = raw.get("content") if isinstance(raw, Mapping) else None
    if content is None:
        return None
    return [_token_logprobs(entry) for entry in content]


def _token_logprobs(entry: Mapping[str, Any]) -> list[LogProb]:
    return [
        LogProb(token=alt["token"], logprob=alt["logprob"], bytes=alt.get("bytes") or [])
        for alt in entry.get("top_logprobs") or [entry]
    ]


class StreamAccumulator:
    """Folds zml stream chunks into the running ``ChatResponse``s of a LlamaIndex stream.

    ``add`` returns a response for each chunk that adds content or tool-call text (None for
    chunks that carry only a role, a finish_reason or usage); ``final`` returns the closing
    response: no delta, the whole message with parsed tool calls, finish_reason and usage.
    """

    __slots__ = (
        "_calls",
        "_id",
        "_logprobs",
        "_model",
        "_routing",
        "_text",
        "finish_reason",
        "usage",
    )

    def __init__(self, routing: zml.RoutingInfo) -> None:
        self._routing = routing.model_dump()
        self._text: str | None = None
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, arguments text]
        self._id = ""
        self._model = ""
        self._logprobs: list[list[LogProb]] | None = None
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: zml.ChatCompletionChunk) -> ChatResponse | None:
        """Take one chunk; return the response to yield for it, if any."""
        self._id = chunk.id or self._id
        self._model = chunk.model or self._model
        if chunk.usage is not None:
            self.usage = chunk.usage.model_dump()  # with the node's cached/reasoning details
        delta = ""
        changed = False
        for choice in chunk.choices:
            if choice.index != 0:
                continue
            d = choice.delta
            if d.content:
                delta += d.content
                self._text = (self._text or "") + d.content
                changed = True
            elif d.content is not None and self._text is None:
                self._text = ""
            for fragment in d.tool_calls or ():
                self._merge(fragment)
                changed = True
            logprobs = to_logprobs(choice.logprobs)
            if logprobs is not None:
                self._logprobs = [*(self._logprobs or ()), *logprobs]
            if choice.finish_reason is not None:
                self.finish_reason = choice.finish_reason
        if not changed:
            return None
        return self._response(delta, final=False)

    def final(self) -> ChatResponse:
        """The last response of the stream (empty delta, complete message, usage)."""
        return self._response("", final=True)

    def _merge(self, fragment: Any) -> None:
        entry = self._calls.get(fragment.index)
        if entry is None:
            entry = self._calls[fragment.index] = [None, "", ""]
        if fragment.id:
            entry[0] = fragment.id
        function = fragment.function
        if function is not None:
            if function.name:
                entry[1] += function.name
            if function.arguments:
                entry[2] += function.arguments

    def _response(self, delta: str, *, final: bool) -> ChatResponse:
        blocks: list[ContentBlock] = []
        tool_calls: list[dict[str, Any]] = []
        if self._text is not None:
            blocks.append(TextBlock(text=self._text))
        for index in sorted(self._calls):
            call_id, name, arguments = self._calls[index]
            blocks.append(
                ToolCallBlock(
                    tool_call_id=call_id,
                    tool_name=name,
                    tool_kwargs=_final_arguments(arguments) if final else arguments,
                )
            )
            tool_calls.append(_tool_call(call_id, name, arguments))
        raw = {
            "id": self._id,
            "model": self._model,
            "delta": delta,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            ROUTING_KEY: self._routing,
        }
        return ChatResponse(
            message=_message(blocks, tool_calls),
            delta=delta,
            raw=raw,
            logprobs=None if self._logprobs is None else list(self._logprobs),
            additional_kwargs=_extras(self._routing, self.usage if final else None),
        )


def _extras(routing: dict[str, Any], usage: dict[str, Any] | None) -> dict[str, Any]:
    extras: dict[str, Any] = {ROUTING_KEY: routing}
    if usage:
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            if key in usage:
                extras[key] = usage[key]
    return extras


def _final_arguments(text: str) -> dict[str, Any] | str:
    """Parsed arguments when they are a JSON object, else the text as the node sent it."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def parse_arguments(arguments: dict[str, Any] | str) -> dict[str, Any]:
    """Tool arguments as a dict, from a dict or JSON text that may be cut short (streaming)."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():
        return {}
    try:
        value = parse_partial_json(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
