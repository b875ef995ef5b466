"""LangChain messages to the OpenAI chat messages that zml sends to a node.

Most message kinds are left to LangChain's own ``convert_to_openai_messages``, which already
knows the OpenAI, Anthropic and standard (v1) content-block formats. Assistant messages are
built here: their content may hold provider blocks (``tool_use``, ``thinking``, v1
``tool_call`` blocks) that an OpenAI-compatible node would reject, while ``tool_calls`` is the
one place a node reads the calls from. Tool-call arguments that are not JSON are a
``zml.InvalidRequestError`` naming the message (``messages[1].tool_calls[0].args``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage, convert_to_openai_messages

from zml.validation import json_text

__all__ = ["to_openai_messages"]


def to_openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """The chat as a list of OpenAI message dicts, in order."""
    return [
        _assistant(m, f"messages[{i}]") if isinstance(m, AIMessage)
        else convert_to_openai_messages(m)
        for i, m in enumerate(messages)
    ]


def _assistant(message: AIMessage, param: str) -> dict[str, Any]:
    tool_calls: list[dict[str, Any]] = [
        {
            "id": call["id"],
            "type": "function",
            "function": {
                "name": call["name"],
                "arguments": json_text(call["args"], f"{param}.tool_calls[{i}].args"),
            },
        }
        for i, call in enumerate(message.tool_calls)
    ]
    tool_calls.extend(
        {
            "id": call["id"],
            "type": "function",
            "function": {"name": call["name"] or "", "arguments": call["args"] or ""},
        }
        for call in message.invalid_tool_calls
    )
    out: dict[str, Any] = {"role": "assistant", "content": _text(message.content)}
    if tool_calls:
        out["tool_calls"] = tool_calls
    if message.name:
        out["name"] = message.name
    return out


def _text(content: str | list[str | dict[str, Any]]) -> str:
    """The text of an assistant message: its string, or its text blocks joined."""
    if isinstance(content, str):
        return content
    parts = [
        block if isinstance(block, str) else block.get("text", "")
        for block in content
        if isinstance(block, str) or block.get("type") == "text"
    ]
    return "\n".join(p for p in parts if p)


