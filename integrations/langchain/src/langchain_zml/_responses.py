"""zml answers to LangChain messages: one converter for a whole response, one for a chunk.

Every message carries ``response_metadata["zml_routing"]`` (where the request went and why),
``id``, ``model_name``, ``system_fingerprint`` (when the node sends one), ``finish_reason``,
``model_provider`` and ``usage_metadata`` (with cached and reasoning token details when the
node reports them); ``logprobs`` when they were asked for. The keys are ChatOpenAI's.

A stream spreads these over several node chunks (the finish reason on one, usage on a final
chunk without choices), but LangChain merges chunk metadata by concatenating strings and
summing numbers, so each must appear on exactly one chunk. :class:`ChunkConverter` therefore
emits content and tool-call deltas as they arrive (each content chunk with its own
``logprobs``, whose ``content`` lists LangChain's merge concatenates), and gathers the rest
into a single final chunk, marked ``chunk_position="last"``, that it builds when the stream
ends.
"""

from __future__ import annotations

from typing import Any, cast

from langchain_core.messages import AIMessage, AIMessageChunk, InvalidToolCall, ToolCall
from langchain_core.messages.ai import InputTokenDetails, OutputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers.openai_tools import make_invalid_tool_call, parse_tool_call
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

import zml

__all__ = ["PROVIDER", "ChunkConverter", "chat_result", "routing_metadata", "usage_metadata"]

PROVIDER = "zml"


def routing_metadata(routing: zml.RoutingInfo) -> dict[str, Any]:
    """``response_metadata["zml_routing"]``: the routing info as plain data (cost when known)."""
    data = routing.model_dump(mode="json")
    if data.get("cost") is None:
        data.pop("cost", None)
    return data


def usage_metadata(usage: zml.Usage | None) -> UsageMetadata | None:
    """LangChain's token counts from an OpenAI ``usage`` object (with cache/reasoning details)."""
    if usage is None:
        return None
    counts = {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
    }
    result = cast("UsageMetadata", counts)
    cached = _detail(usage, "prompt_tokens_details", "cached_tokens")
    if cached is not None:
        result["input_token_details"] = InputTokenDetails(cache_read=cached)
    reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens")
    if reasoning is not None:
        result["output_token_details"] = OutputTokenDetails(reasoning=reasoning)
    return result


def _detail(usage: zml.Usage, group: str, key: str) -> int | None:
    details = getattr(usage, group, None)
    value = details.get(key) if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


def chat_result(completion: zml.ChatCompletion) -> ChatResult:
    """A whole (non-streamed) completion as a ChatResult, one generation per choice."""
    usage = usage_metadata(completion.usage)
    routing = routing_metadata(completion.routing)
    generations = []
    for choice in completion.choices:
        message = choice.message
        tool_calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for raw in message.tool_calls or ():
            raw_call = raw.model_dump()
            try:
                parsed = parse_tool_call(raw_call, return_id=True)
            except ValueError as exc:
                invalid.append(make_invalid_tool_call(raw_call, str(exc)))
            else:
                if parsed is not None:
                    tool_calls.append(parsed)  # type: ignore[arg-type]
        metadata: dict[str, Any] = {
            "id": completion.id,
            "model_name": completion.model,
            "finish_reason": choice.finish_reason,
            "model_provider": PROVIDER,
            "zml_routing": routing,
        }
        if completion.system_fingerprint:
            metadata["system_fingerprint"] = completion.system_fingerprint
        info: dict[str, Any] = {"finish_reason": choice.finish_reason}
        if choice.logprobs is not None:
            metadata["logprobs"] = info["logprobs"] = choice.logprobs
        extra: dict[str, Any] = {"refusal": message.refusal} if message.refusal else {}
        ai = AIMessage(
            content=message.content or "",
            tool_calls=tool_calls,
            invalid_tool_calls=invalid,
            additional_kwargs=extra,
            response_metadata=metadata,
            usage_metadata=usage,
            id=completion.id or None,
        )
        generations.append(ChatGeneration(message=ai, generation_info=info))
    llm_output: dict[str, Any] = {"id": completion.id, "model_name": completion.model}
    if completion.system_fingerprint:
        llm_output["system_fingerprint"] = completion.system_fingerprint
    if completion.usage is not None:
        llm_output["token_usage"] = completion.usage.model_dump()
    return ChatResult(generations=generations, llm_output=llm_output)


class ChunkConverter:
    """Converts the chunks of one stream; builds the single metadata-bearing final chunk."""

    __slots__ = ("fingerprint", "finish_reason", "id", "model", "routing", "usage")

    def __init__(self) -> None:
        self.id: str | None = None
        self.model = ""
        self.fingerprint: str | None = None
        self.finish_reason: str | None = None
        self.usage: zml.Usage | None = None
        self.routing: zml.RoutingInfo | None = None

    def chunk(self, chunk: zml.ChatCompletionChunk) -> ChatGenerationChunk | None:
        """The content or tool-call delta of a node chunk (None if it has neither).

        The chunk's model, finish reason, usage and routing are kept for :meth:`last`. Only the
        first choice (index 0) is read: a LangChain stream is one message.
        """
        self.id = self.id or chunk.id or None
        self.model = chunk.model or self.model
        self.fingerprint = chunk.system_fingerprint or self.fingerprint
        self.routing = chunk.routing
        if chunk.usage is not None:
            self.usage = chunk.usage
        choice = next((c for c in chunk.choices if c.index == 0), None)
        if choice is None:
            return None
        if choice.finish_reason:
            self.finish_reason = choice.finish_reason
        delta = choice.delta
        calls = [
            tool_call_chunk(
                name=call.function.name if call.function else None,
                args=call.function.arguments if call.function else None,
                id=call.id,
                index=call.index,
            )
            for call in delta.tool_calls or ()
        ]
        if not delta.content and not calls:
            return None
        metadata: dict[str, Any] = {"model_provider": PROVIDER}
        info: dict[str, Any] | None = None
        if choice.logprobs is not None:
            metadata["logprobs"] = choice.logprobs
            info = {"logprobs": choice.logprobs}
        message = AIMessageChunk(
            content=delta.content or "",
            tool_call_chunks=calls,
            response_metadata=metadata,
            id=self.id,
        )
        return ChatGenerationChunk(message=message, generation_info=info)

    def last(self) -> ChatGenerationChunk:
        """The final chunk: no content, and everything that must be counted once."""
        metadata: dict[str, Any] = {
            "model_name": self.model,
            "finish_reason": self.finish_reason,
            "model_provider": PROVIDER,
        }
        if self.id:
            metadata["id"] = self.id
        if self.fingerprint:
            metadata["system_fingerprint"] = self.fingerprint
        if self.routing is not None:
            metadata["zml_routing"] = routing_metadata(self.routing)
        message = AIMessageChunk(
            content="",
            response_metadata=metadata,
            usage_metadata=usage_metadata(self.usage),
            chunk_position="last",
            id=self.id,
        )
        return ChatGenerationChunk(
            message=message, generation_info={"finish_reason": self.finish_reason}
        )
