"""LlamaIndex chat messages to the OpenAI-shaped dicts that ``zml`` sends to nodes.

Only what a node should see crosses over: text and images from ``blocks``, tool calls (from
``ToolCallBlock``s, or an OpenAI-style ``additional_kwargs["tool_calls"]`` list written by
another integration), and the ``name`` / ``tool_call_id`` keys. Everything else in
``additional_kwargs`` stays behind, so metadata that rides on a message (a routing record, a
token count) is never echoed back to the fleet in later requests. Content that cannot cross
(a document, audio, a role with no chat-completions name, tool arguments that are not JSON) is a
``zml.InvalidRequestError`` naming where it is (``messages[1].blocks[0]``), before any request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

import zml
from zml.validation import json_text

__all__ = ["to_zml_message", "to_zml_messages"]

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "developer",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "function",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
}

# Blocks that carry nothing for the node: prompt-cache markers and a model's own reasoning.
_SKIPPED_BLOCKS = (CachePoint, ThinkingBlock)


def to_zml_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Convert a chat for ``zml.Client.infer`` (``messages=``)."""
    return [to_zml_message(m, param=f"messages[{i}]") for i, m in enumerate(messages)]


def to_zml_message(message: ChatMessage, *, param: str = "message") -> dict[str, Any]:
    """Convert one message; ``zml.InvalidRequestError`` (a ``ValueError``) for content a
    chat-completions node cannot take, its ``param`` the message's ``param`` and the part."""
    role = _ROLES.get(message.role)
    if role is None:
        raise zml.InvalidRequestError(
            f"{param}.role is {message.role!r}, which zml cannot send: use one of "
            f"{sorted(str(r.value) for r in _ROLES)}",
            param=f"{param}.role",
        )
    parts: list[dict[str, Any]] = []
    texts: list[str] = []
    has_image = False
    tool_calls: list[dict[str, Any]] = []
    for position, block in enumerate(message.blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            has_image = True
            parts.append({"type": "image_url", "image_url": _image_url(block)})
        elif isinstance(block, ToolCallBlock):
            tool_calls.append(
                _tool_call_dict(block, len(tool_calls), f"{param}.blocks[{position}]")
            )
        elif not isinstance(block, _SKIPPED_BLOCKS):
            where = f"{param}.blocks[{position}]"
            raise zml.InvalidRequestError(
                f"{where} ({type(block).__name__}) cannot be sent through zml: a node takes "
                "text (TextBlock), images (ImageBlock) and tool calls (ToolCallBlock); "
                "convert it to text first, or leave it out",
                param=where,
            )
    out: dict[str, Any] = {"role": role}
    if has_image:
        out["content"] = parts
    elif texts:
        out["content"] = "\n".join(texts)
    else:
        out["content"] = None if role == "assistant" else ""

    extra = message.additional_kwargs
    if role == "assistant":
        if not tool_calls and extra.get("tool_calls"):
            tool_calls = [
                _plain_tool_call(tc, f"{param}.additional_kwargs['tool_calls'][{i}]")
                for i, tc in enumerate(extra["tool_calls"])
            ]
        if tool_calls:
            out["tool_calls"] = tool_calls
    elif role == "tool":
        tool_call_id = extra.get("tool_call_id")
        if tool_call_id is not None:
            out["tool_call_id"] = tool_call_id
    if extra.get("name") is not None and role in ("user", "system", "developer", "function"):
        out["name"] = extra["name"]
    return out


def _image_url(block: ImageBlock) -> dict[str, Any]:
    url: dict[str, Any]
    if block.url is not None and block.image is None and block.path is None:
        url = {"url": str(block.url)}
    else:
        data = block.resolve_image(as_base64=True).read()
        mimetype = block.image_mimetype or "image/png"
        url = {"url": f"data:{mimetype};base64,{data.decode('ascii')}"}
    if block.detail:
        url["detail"] = block.detail
    return url


def _tool_call_dict(block: ToolCallBlock, position: int, param: str) -> dict[str, Any]:
    kwargs = block.tool_kwargs
    arguments = kwargs if isinstance(kwargs, str) else json_text(kwargs, f"{param}.tool_kwargs")
    return {
        "id": block.tool_call_id or f"call_{position}",
        "type": "function",
        "function": {"name": block.tool_name, "arguments": arguments},
    }


def _plain_tool_call(tool_call: Any, param: str) -> dict[str, Any]:
    """An OpenAI tool call as a dict, from a dict or an object (openai-python, zml) alike."""
    if isinstance(tool_call, Mapping):
        function = tool_call.get("function") or {}
        call_id, call_type = tool_call.get("id"), tool_call.get("type", "function")
    else:
        function = getattr(tool_call, "function", None) or {}
        call_id, call_type = getattr(tool_call, "id", None), getattr(tool_call, "type", "function")
    if not isinstance(function, Mapping):
        function = {"name": function.name, "arguments": function.arguments}
    arguments = function.get("arguments") or "{}"
    if not isinstance(arguments, str):
        arguments = json_text(arguments, f"{param}.function.arguments")
    return {
        "id": call_id,
        "type": call_type or "function",
        "function": {"name": function.get("name"), "arguments": arguments},
    }


