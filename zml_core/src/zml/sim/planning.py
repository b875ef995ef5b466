"""Deciding the reply to a validated request: the reply rules of :mod:`zml.sim.protocol`
(tools, structured content, prose; `max_tokens`, `ignore_eos`, `stop`; choices, logprobs and
the prefix cache), as pure functions of the request.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from zml.sim.cues import json_keys, mentioned_tools, mentions_name, mentions_word, tool_arguments
from zml.sim.logprobs import content_logprobs
from zml.sim.protocol import (
    _JSON_OBJECT_SCHEMA,
    CACHE_BLOCK_TOKENS,
    PROSE_MAX_TOKENS,
    ChatRequest,
    Plan,
    Reply,
    ToolCall,
)
from zml.sim.schemagen import SchemaGenerationError, generate_json
from zml.sim.textgen import (
    count_prompt_tokens,
    json_pieces,
    message_text,
    request_rng,
    synth_tokens,
)

__all__ = ["plan_reply"]


def _mentioned_tool(tools: list[dict[str, Any]], message: Mapping[str, Any]) -> dict[str, Any] | None:
    text = message_text(message)
    if not text:
        return None
    for mentions in (mentions_name, mentions_word):
        for tool in tools:
            if mentions(tool["function"]["name"], text):
                return tool
    return None


def _pick_tools(request: ChatRequest) -> list[dict[str, Any]]:
    """The tools the reply calls, in call order (see the module docstring)."""
    choice = request.tool_choice
    last = request.messages[-1]
    if not request.tools or choice == "none" or last.get("role") == "tool":
        return []
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return [next(t for t in request.tools if t["function"]["name"] == name)]
    if choice != "required" and last.get("role") != "user":
        return []
    tool = _mentioned_tool(request.tools, last)
    if tool is None:
        return [request.tools[0]] if choice == "required" else []
    if request.parallel_tool_calls and last.get("role") == "user":
        names = [t["function"]["name"] for t in request.tools]
        order = mentioned_tools(names, message_text(last))
        if len(order) > 1:
            return [request.tools[i] for i in order]
    return [tool]


def _last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            return message_text(message)
    return ""


def _generate(schema: Any, rng: random.Random) -> Any:
    try:
        return generate_json(schema, rng)
    except SchemaGenerationError:
        return {}


def _structured(schema: Any, rng: random.Random) -> str:
    return json.dumps(_generate(schema, rng), ensure_ascii=False)


def _arguments(function: Mapping[str, Any], text: str, rng: random.Random) -> str:
    """A tool call's arguments: generated, then overlaid with what the prompt fills."""
    params = function.get("parameters")
    if params is None or params is True or params == {}:
        return "{}"
    value = _generate(params, rng)
    filled = tool_arguments(function["name"], params, text)
    if filled and isinstance(value, dict):
        order = [*params["properties"], *value]
        merged = {**value, **filled}
        value = {key: merged[key] for key in dict.fromkeys(order) if key in merged}
    return json.dumps(value, ensure_ascii=False)


def _json_object_schema(text: str) -> dict[str, Any]:
    keys = json_keys(text)
    if not keys:
        return _JSON_OBJECT_SCHEMA
    return {
        "type": "object",
        "properties": {key: {"type": "string", "minLength": 1} for key in keys},
        "required": keys,
        "additionalProperties": False,
    }


def _cached_tokens(request: ChatRequest) -> int:
    """The prefix-cache hit: the earlier messages' prompt tokens, in whole blocks."""
    earlier = count_prompt_tokens(request.messages[:-1])
    return earlier // CACHE_BLOCK_TOKENS * CACHE_BLOCK_TOKENS


def plan_reply(request: ChatRequest) -> Plan:
    """Decide the complete reply to a validated request (see the module docstring)."""
    choices = []
    for choice in range(request.n):
        rng = request_rng(request.model, request.messages, request.seed, choice)
        reply = _plan_choice(request, rng)
        if request.logprobs:
            entries = content_logprobs(reply.pieces, request.top_logprobs, random.Random(rng.getrandbits(64)))
            reply = dataclasses.replace(reply, logprobs=entries)
        choices.append(reply)
    prompt_tokens = count_prompt_tokens(request.messages, request.tools or None)
    return Plan(request.model, prompt_tokens, tuple(choices), min(prompt_tokens, _cached_tokens(request)))


def _plan_choice(request: ChatRequest, rng: random.Random) -> Reply:
    """One choice, drawn from `rng` (see the module docstring)."""
    tools = _pick_tools(request)
    if tools:
        text = _last_user_text(request.messages)
        calls: list[ToolCall] = []
        for tool in tools:
            function = tool["function"]
            arguments = _arguments(function, text, rng)
            call_id = f"call_{rng.getrandbits(96):024x}"
            calls.append(ToolCall(call_id, function["name"], arguments, tuple(json_pieces(arguments))))
        return Reply([], tuple(calls), "tool_calls", reasoning_tokens=request.reasoning_tokens)
    cap = request.max_tokens
    schema = request.response_format
    if schema is _JSON_OBJECT_SCHEMA:  # json_object: the keys the prompt names, if any
        schema = _json_object_schema(_last_user_text(request.messages))
    if schema is not None:
        pieces = json_pieces(_structured(schema, rng))
    elif request.ignore_eos and cap is not None:
        pieces = synth_tokens(rng, cap + 1)
    else:
        pieces = synth_tokens(rng, max(rng.randint(16, PROSE_MAX_TOKENS), request.min_tokens))
    finish = "stop"
    if cap is not None and len(pieces) > cap:
        pieces = pieces[:cap]
        finish = "length"
    if request.stop:
        pieces, cut = _apply_stop(pieces, request.stop)
        if cut:
            finish = "stop"
    return Reply(pieces, (), finish, reasoning_tokens=request.reasoning_tokens)


def _apply_stop(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[str], bool]:
    text = "".join(pieces)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not found:
        return pieces, False
    end = min(found)
    out: list[str] = []
    used = 0
    for piece in pieces:
        if used + len(piece) <= end:
            out.append(piece)
            used += len(piece)
            continue
        if end > used:
            out.append(piece[: end - used])
        break
    return out, True
