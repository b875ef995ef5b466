"""A planned reply as bytes: the `chat.completion` JSON and the SSE events of a stream.

Kept apart from `zml.sim.planning` (which decides what to answer) because this is the hot path
of the benchmarks: a streamed token costs one small `json.dumps` and a few byte joins, the
per-choice event heads being built once per reply. The layout of a stream (role chunk per
choice, one chunk per choice and token, a finish_reason chunk per choice, the usage chunk,
`[DONE]`) is described in `zml.sim.protocol`'s docstring.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zml.sim.protocol import Plan, Reply, ToolCall

__all__ = ["ChunkEncoder", "completion_body"]


def _message(reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in reply.tool_calls
        ]
    return message


def completion_body(plan: Plan, completion_id: str, created: int) -> bytes:
    """The non-streamed `chat.completion` JSON."""
    choices = [
        {
            "index": index,
            "message": _message(reply),
            "logprobs": None if reply.logprobs is None else {"content": reply.logprobs},
            "finish_reason": reply.finish_reason,
        }
        for index, reply in enumerate(plan.choices)
    ]
    return json.dumps(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": plan.model,
            "system_fingerprint": plan.system_fingerprint,
            "choices": choices,
            "usage": plan.usage(),
        }
    ).encode()


_OPEN_TAIL = b',"logprobs":null,"finish_reason":null}]}\n\n'


def _steps(reply: Reply) -> list[tuple[int, ToolCall, str | None]] | None:
    """Per step of a tool-call reply: (call index, the call, argument fragment or None for its
    head); None for a reply in text."""
    if not reply.tool_calls:
        return None
    return [
        step
        for index, call in enumerate(reply.tool_calls)
        for step in [(index, call, None), *((index, call, piece) for piece in call.pieces)]
    ]


class ChunkEncoder:
    """Encodes the SSE events of one streamed reply, all its choices."""

    __slots__ = ("_call_steps", "_completion_id", "_created", "_heads", "_plan")

    def __init__(self, plan: Plan, completion_id: str, created: int) -> None:
        self._plan = plan
        self._call_steps = [_steps(reply) for reply in plan.choices]
        self._completion_id = completion_id
        self._created = created
        prefix = (
            f'data: {{"id":"{completion_id}","object":"chat.completion.chunk","created":{created},'
            f'"model":{json.dumps(plan.model)},"system_fingerprint":"{plan.system_fingerprint}",'
            f'"choices":[{{"index":'
        )
        self._heads = [f'{prefix}{index},"delta":'.encode() for index in range(len(plan.choices))]

    def delta(self, delta: Mapping[str, Any], choice: int = 0) -> bytes:
        """One `chat.completion.chunk` event carrying `delta` for `choice`."""
        return self._heads[choice] + json.dumps(delta).encode() + _OPEN_TAIL

    def step(self, index: int) -> bytes:
        """The events of the index-th decode step: one per choice with a visible token then
        (each choice's role chunk first when index is 0).

        Hidden reasoning tokens come first and send nothing. For tool calls, a call's head
        (index, id, type, name) is the step of its name, then each argument fragment is a
        step; the calls follow one another.
        """
        return b"".join(self._choice_step(choice, index) for choice in range(len(self._heads)))

    def _choice_step(self, choice: int, index: int) -> bytes:
        reply = self._plan.choices[choice]
        steps = self._call_steps[choice]
        token = index - reply.reasoning_tokens
        opening = b""
        if index == 0:
            opening = self.delta({"role": "assistant", "content": None if steps else ""}, choice)
        if token < 0:
            return opening
        if steps is None:
            if token >= len(reply.pieces):
                return opening
            head = self._heads[choice] + b'{"content":' + json.dumps(reply.pieces[token]).encode() + b"}"
            if reply.logprobs is None:
                return opening + head + _OPEN_TAIL
            entry = json.dumps({"content": [reply.logprobs[token]]}).encode()
            return opening + head + b',"logprobs":' + entry + b',"finish_reason":null}]}\n\n'
        if token >= len(steps):
            return opening
        position, call, piece = steps[token]
        delta: dict[str, Any]
        if piece is None:
            function = {"name": call.name, "arguments": ""}
            delta = {"index": position, "id": call.id, "type": "function", "function": function}
        else:
            delta = {"index": position, "function": {"arguments": piece}}
        return opening + self.delta({"tool_calls": [delta]}, choice)

    @property
    def steps(self) -> int:
        """How many paced steps the reply has (at least one, for the role chunks)."""
        return max(1, self._plan.completion_tokens)

    def malformed(self) -> bytes:
        """An event whose data is not valid JSON (a cut-off chunk)."""
        return self._heads[0] + b'{"content": "unterminated\n\n'

    def tail(self, include_usage: bool) -> bytes:
        """The final chunk of each choice (its finish_reason), the optional usage chunk, and
        `[DONE]`."""
        plan = self._plan
        out = b"".join(
            head + b'{},"logprobs":null,"finish_reason":"' + reply.finish_reason.encode() + b'"}]}\n\n'
            for head, reply in zip(self._heads, plan.choices, strict=True)
        )
        if include_usage:
            usage = {
                "id": self._completion_id,
                "object": "chat.completion.chunk",
                "created": self._created,
                "model": plan.model,
                "system_fingerprint": plan.system_fingerprint,
                "choices": [],
                "usage": plan.usage(),
            }
            out += b"data: " + json.dumps(usage).encode() + b"\n\n"
        return out + b"data: [DONE]\n\n"
