"""What the caller asked: a frozen :class:`Request`, built once from validated arguments.

Everything about a request that cannot change while it is dispatched lives here (the model,
the encoded body, the policy or pinned family, the deadline); what happens to it is recorded
separately (:mod:`.record`), and the decisions are made by the flow (:mod:`.flow`). Building
a Request validates every argument, so nothing invalid is ever sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..config import suggest
from ..errors import InvalidRequestError
from ..policy import Policy
from ..transport import encode_body

__all__ = ["OPENAI_PARAMS", "ROLES", "Request", "Timeouts", "build_body", "validate_messages"]

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

OPENAI_PARAMS = frozenset(
    {
        "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "presence_penalty",
        "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "stream_options",
        "reasoning_effort", "modalities", "prediction", "service_tier", "store", "extra_body",
    }
)
"""Parameters passed through to the node; anything else is a typo and is refused."""


def _check_seconds(name: str, value: object, *, optional: bool) -> None:
    if value is None and optional:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        allowed = "a positive, finite number of seconds" + (" or None" if optional else "")
        raise InvalidRequestError(
            f"Timeouts.{name} must be {allowed}, got {value!r}", param=f"timeout.{name}"
        )


@dataclass(frozen=True)
class Timeouts:
    """Timeouts in seconds (None: no limit).

    Attributes:
        total: the overall deadline of a request: queueing, every attempt, and the whole stream.
        connect: establishing a connection to a node.
        first_token: from sending to the first content of a streamed answer (per attempt).
        idle: between two chunks of a stream.

    Raises:
        InvalidRequestError: a field that is not a positive, finite number (or None where
            allowed).
    """

    total: float | None = 600.0
    connect: float = 5.0
    first_token: float | None = None
    idle: float | None = 60.0

    def __post_init__(self) -> None:
        _check_seconds("total", self.total, optional=True)
        _check_seconds("connect", self.connect, optional=False)
        _check_seconds("first_token", self.first_token, optional=True)
        _check_seconds("idle", self.idle, optional=True)

    @classmethod
    def of(cls, value: float | Timeouts | None) -> Timeouts:
        """Accept a number (the overall deadline), a Timeouts, or None (no overall deadline)."""
        if isinstance(value, Timeouts):
            return value
        if value is None:
            return cls(total=None)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise InvalidRequestError(
                "timeout must be a positive, finite number of seconds, a zml.Timeouts, or None "
                f"(no deadline); got {value!r}",
                param="timeout",
            )
        return cls(total=float(value))


@dataclass(frozen=True)
class Request:
    """One logical request as the caller asked for it; never changes once built.

    Attributes:
        model: the model name.
        policy: the resolved policy, or None (any healthy node, or the pinned family).
        accelerator: the pinned family (the 0.2 style), or None.
        body: the encoded JSON body sent to nodes.
        stream: whether the answer is streamed.
        metadata: the caller's labels (read-only).
        timeouts: the request's timeouts.
        started_at: when it was built (the dispatcher's clock, seconds).
        prompt_chars: the length of the messages' text content (a size hint for routing).
    """

    model: str
    policy: Policy | None
    accelerator: str | None
    body: bytes
    stream: bool
    metadata: Mapping[str, Any]
    timeouts: Timeouts
    started_at: float
    prompt_chars: int = 0

    @property
    def deadline(self) -> float | None:
        """The overall deadline on the dispatcher's clock (None: none)."""
        total = self.timeouts.total
        return None if total is None else self.started_at + total

    @property
    def policy_name(self) -> str | None:
        """The policy's name, or None."""
        return self.policy.name if self.policy is not None else None

    @property
    def health_threshold(self) -> float:
        """Nodes below this health score are skipped (the policy's, else 0.5)."""
        return self.policy.health_threshold if self.policy is not None else 0.5


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of role/content mappings; return it as dicts."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            "messages must be a list of {'role': ..., 'content': ...} mappings, got "
            f"{type(messages).__name__}; e.g. messages=[{{'role': 'user', 'content': 'Hello'}}]",
            param="messages",
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got "
                f"{type(msg).__name__}",
                param=f"messages[{i}]",
            )
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role = {role!r} is not a chat role; use one of "
                + ", ".join(sorted(ROLES)),
                param=f"messages[{i}].role",
            )
        content = msg.get("content")
        if content is None:
            if not (role == "assistant" and msg.get("tool_calls")):
                raise InvalidRequestError(
                    f"messages[{i}] ({role}) has no 'content'; only an assistant message "
                    "with tool_calls may omit it",
                    param=f"messages[{i}].content",
                )
        elif not isinstance(content, str | list):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of content parts, got "
                f"{type(content).__name__}",
                param=f"messages[{i}].content",
            )
        out.append(dict(msg))
    return out


def _text_size(messages: Sequence[Mapping[str, Any]]) -> int:
    size = 0
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str):
            size += len(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    size += len(part["text"])
    return size


def _check_params(params: Mapping[str, Any]) -> None:
    for key in params:
        if key not in OPENAI_PARAMS:
            hint = suggest(str(key), OPENAI_PARAMS)
            raise InvalidRequestError(
                f"unknown parameter {key!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + "; pass other node-specific fields in extra_body={...}",
                param=str(key),
            )


def build_body(
    model: object, messages: object, params: Mapping[str, Any], *, stream: bool
) -> tuple[bytes, int]:
    """Validate the model, messages and parameters; return the encoded body and the prompt's
    text size (characters)."""
    if not isinstance(model, str) or not model.strip():
        raise InvalidRequestError(
            f"model must be a non-empty model name, got {model!r}", param="model"
        )
    msgs = validate_messages(messages)
    _check_params(params)
    body: dict[str, Any] = {"model": model, "messages": msgs}
    extra = params.get("extra_body")
    for key, value in params.items():
        if key != "extra_body":
            body[key] = value
    if extra:
        if not isinstance(extra, Mapping):
            raise InvalidRequestError("extra_body must be a dict", param="extra_body")
        body.update(extra)
    if stream:
        body["stream"] = True
        options = body.get("stream_options") or {}
        if not isinstance(options, Mapping):
            raise InvalidRequestError(
                "stream_options must be a dict, e.g. {'include_usage': True}",
                param="stream_options",
            )
        options = dict(options)
        options.setdefault("include_usage", True)
        body["stream_options"] = options
    return encode_body(body), _text_size(msgs)


def frozen_metadata(metadata: object) -> Mapping[str, Any]:
    """The caller's ``metadata=`` as a read-only mapping (validated: a dict with str keys)."""
    if metadata is None:
        return MappingProxyType({})
    if not isinstance(metadata, Mapping):
        raise InvalidRequestError(
            f"metadata must be a dict, got {type(metadata).__name__}", param="metadata"
        )
    for key in metadata:
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"metadata keys must be strings, got {key!r}", param="metadata"
            )
    return MappingProxyType(dict(metadata))
