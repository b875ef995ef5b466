"""zml answers as LlamaIndex ``ChatResponse``s, with where each request went.

Every response carries the routing record (``zml.RoutingInfo`` as a plain dict) twice:
``additional_kwargs["zml_routing"]`` for application code, and ``raw["zml_routing"]`` beside
``raw["usage"]``, where LlamaIndex's ``TokenCountingHandler`` reads token counts. It is never put
in ``message.additional_kwargs``: a message goes back to the fleet in the next turn of a chat.

Tool calls become ``ToolCallBlock``s of the assistant message. While a stream is running their
arguments are the JSON text received so far; the final response of a stream (and a plain
response) holds them parsed, when they parse.
"""

from __future__ import annotations

import json
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ContentBlock,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.utils import parse_partial_json

import zml

__all__ = ["StreamAccumulator", "from_completion", "parse_arguments"]

ROUTING_KEY = "zml_routing"


def from_completion(completion: zml.ChatCompletion) -> ChatResponse:
    """The ``ChatResponse`` of a non-streamed zml answer."""
    routing = completion.routing.model_dump()
    blocks: list[ContentBlock] = []
    if completion.choices:
        message = completion.choices[0].message
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
    raw = completion.model_dump(exclude={"routing"})
    raw[ROUTING_KEY] = routing
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
        raw=raw,
        additional_kwargs=_extras(routing, raw.get("usage")),
    )


class StreamAccumulator:
    """Folds zml stream chunks into the running ``ChatResponse``s of a LlamaIndex stream.

    ``add`` returns a response for each chunk that adds content or tool-call text (None for
    chunks that carry only a role, a finish_reason or usage); ``final`` returns the closing
    response: no delta, the whole message with parsed tool calls, finish_reason and usage.
    """

    __slots__ = ("_calls", "_id", "_model", "_routing", "_text", "finish_reason", "usage")

    def __init__(self, routing: zml.RoutingInfo) -> None:
        self._routing = routing.model_dump()
        self._text: str | None = None
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, arguments text]
        self._id = ""
        self._model = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def add(self, chunk: zml.ChatCompletionChunk) -> ChatResponse | None:
        """Take one chunk; return the response to yield for it, if any."""
        self._id = chunk.id or self._id
        self._model = chunk.model or self._model
        if chunk.usage is not None:
            u = chunk.usage
            self.usage = {
                "prompt_tokens": u.prompt_tokens,
                "completion_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
            }
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
        raw = {
            "id": self._id,
            "model": self._model,
            "delta": delta,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            ROUTING_KEY: self._routing,
        }
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
            delta=delta,
            raw=raw,
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
