"""An OpenAI chat request as the OpenTelemetry GenAI semantic conventions describe it.

The telemetry plugin (:mod:`.otel`) records a request's sampling parameters as
``gen_ai.request.*`` span attributes and, when the user opted in, its messages as
``gen_ai.input.messages``. The conventions do not take OpenAI's JSON as it is: messages are
``{"role", "parts": [...]}``, each part typed (``text``, ``tool_call``,
``tool_call_response``, ``uri``, ``blob``; see the conventions' ``gen-ai-input-messages.json``).
Both conversions are pure functions of the decoded body, kept here so they can be tested alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["decode_body", "input_messages", "request_attributes"]

_FLOAT_PARAMS = (
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
)


def decode_body(body: bytes) -> Mapping[str, Any]:
    """The request's JSON body as a mapping (empty if it is not a JSON object)."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return {}
    return decoded if isinstance(decoded, Mapping) else {}


def request_attributes(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``gen_ai.request.*`` attributes of a chat request's parameters that are set.

    ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
    ``frequency_penalty``, ``presence_penalty``, ``stop`` (as ``stop_sequences``), ``n``
    (as ``choice.count``, only when not 1), ``response_format`` (as ``gen_ai.output.type``).
    """
    attrs: dict[str, Any] = {}
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        attrs["gen_ai.request.max_tokens"] = max_tokens
    for key, name in _FLOAT_PARAMS:
        value = body.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            attrs[name] = float(value)
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        attrs["gen_ai.request.seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        attrs["gen_ai.request.stop_sequences"] = (stop,)
    elif isinstance(stop, list) and stop and all(isinstance(s, str) for s in stop):
        attrs["gen_ai.request.stop_sequences"] = tuple(stop)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n != 1:
        attrs["gen_ai.request.choice.count"] = n
    response_format = body.get("response_format")
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind in ("json_object", "json_schema"):
            attrs["gen_ai.output.type"] = "json"
        elif kind == "text":
            attrs["gen_ai.output.type"] = "text"
    return attrs


def _content_parts(content: object) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if not isinstance(content, list):
        return [{"type": "text", "content": str(content)}]
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            parts.append({"type": "text", "content": str(part.get("text", ""))})
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            parts.append(_media(str(url or ""), "image"))
        elif kind == "input_audio":
            audio = part.get("input_audio")
            audio = audio if isinstance(audio, Mapping) else {}
            fmt = audio.get("format")
            parts.append({"type": "blob", "modality": "audio",
                          "mime_type": f"audio/{fmt}" if fmt else None,
                          "content": str(audio.get("data", ""))})
        else:
            parts.append({"type": str(kind or "unknown"),
                          **{k: v for k, v in part.items() if k != "type"}})
    return parts


def _media(url: str, modality: str) -> dict[str, Any]:
    """A ``data:`` URL as a blob part (its base64 content), any other URL as a uri part."""
    if url.startswith("data:") and "," in url:
        header, _, data = url[5:].partition(",")
        mime = header.split(";", 1)[0] or None
        return {"type": "blob", "modality": modality, "mime_type": mime, "content": data}
    return {"type": "uri", "modality": modality, "uri": url}


def _arguments(raw: object) -> object:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def input_messages(messages: object) -> list[dict[str, Any]]:
    """OpenAI chat messages in the GenAI conventions' input-messages schema.

    Each message becomes ``{"role": ..., "parts": [...]}``: text content (a string or
    ``text`` parts) as ``text`` parts, images as ``uri`` (or ``blob`` for ``data:`` URLs),
    audio as ``blob``, an assistant's ``tool_calls`` as ``tool_call`` parts (arguments decoded
    from JSON), a ``tool`` message as a ``tool_call_response`` part; a ``name`` is kept.
    """
    if not isinstance(messages, list):
        return []
    converted: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = str(message.get("role", "user"))
        out: dict[str, Any] = {"role": role}
        if role == "tool":
            parts: list[dict[str, Any]] = [{
                "type": "tool_call_response",
                "id": message.get("tool_call_id"),
                "response": message.get("content"),
            }]
        else:
            parts = _content_parts(message.get("content"))
            for call in message.get("tool_calls") or ():
                if not isinstance(call, Mapping):
                    continue
                function = call.get("function")
                function = function if isinstance(function, Mapping) else {}
                parts.append({
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": str(function.get("name", "")),
                    "arguments": _arguments(function.get("arguments")),
                })
        out["parts"] = parts
        name = message.get("name")
        if isinstance(name, str):
            out["name"] = name
        converted.append(out)
    return converted
