"""What the caller asked: a frozen :class:`Request`, built once from validated arguments.

Everything about a request that cannot change while it is dispatched lives here (the model,
the encoded body, the policy or pinned family, the deadline); what happens to it is recorded
separately (:mod:`.record`), and the decisions are made by the flow (:mod:`.flow`). Building
a Request validates every argument, so nothing invalid is ever sent.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ..config import suggest
from ..errors import InvalidRequestError
from ..policy import Policy
from ..transport import encode_body
from ..validation import (
    ROLES,
    check_json,
    check_params,
    check_timeout,
    check_timeouts,
    validate_messages,
)

__all__ = ["OPENAI_PARAMS", "ROLES", "Request", "Timeouts", "build_body", "validate_messages"]

OPENAI_PARAMS = frozenset(
    {
        "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "presence_penalty",
        "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "stream_options",
        "reasoning_effort", "modalities", "prediction", "service_tier", "store", "extra_body",
    }
)
"""Parameters passed through to the node; anything else is a typo and is refused."""


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
        check_timeouts(self.total, self.connect, self.first_token, self.idle)

    @classmethod
    def of(cls, value: float | Timeouts | None) -> Timeouts:
        """Accept a number (the overall deadline), a Timeouts, or None (no overall deadline)."""
        if isinstance(value, Timeouts):
            return value
        return cls(total=check_timeout(value, "timeout"))


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
        prefix_blocks: ids of the prompt's leading prefix blocks, for ``affinity = "prefix"``
            (a replayed trace's ids; empty: computed from the body by :mod:`zml.prefix`).
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
    prefix_blocks: tuple[Hashable, ...] = ()

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


_OPENAI_SDK_OPTIONS = {
    "extra_headers": "zml sends the nodes' headers itself: set headers for every request on "
                     "the HTTP client (http_client=httpx2.Client(headers={...})), or per "
                     "request with a plugin's zml_request_headers hook",
    "extra_query": "a node URL takes no query string: pass node-specific fields in "
                   "extra_body={...}",
}
"""openai-python's request options that are not body fields, and what to do instead."""


def _check_params(params: Mapping[str, Any]) -> None:
    for key in params:
        if key in _OPENAI_SDK_OPTIONS:
            raise InvalidRequestError(
                f"{key} is an openai-python option zml does not take: "
                f"{_OPENAI_SDK_OPTIONS[key]}", param=key)
        if not isinstance(key, str) or key not in OPENAI_PARAMS:
            hint = suggest(str(key), OPENAI_PARAMS)
            raise InvalidRequestError(
                f"unknown parameter {key!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + "; pass other node-specific fields in extra_body={...}",
                param=str(key),
            )


_CORE_FIELDS = {
    "model": "pass the model as model=...",
    "messages": "pass the chat as messages=[...]",
    "stream": "use infer() for one answer, infer_stream() to stream",
}
"""The body fields zml validates, routes on and reads the answer by: never from ``extra_body``."""


def _check_extra(extra: Mapping[Any, Any]) -> None:
    """``extra_body`` adds fields; it must not replace the model routed on, the messages
    validated or whether the answer streams (the node would be asked for something else)."""
    for key, how in _CORE_FIELDS.items():
        if key in extra:
            raise InvalidRequestError(
                f"extra_body must not set {key!r}: {how}", param=f"extra_body.{key}"
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
    check_params(params)
    body: dict[str, Any] = {"model": model, "messages": msgs}
    extra = params.get("extra_body")
    for key, value in params.items():
        if key != "extra_body":
            body[key] = value
    if extra:
        if not isinstance(extra, Mapping):
            raise InvalidRequestError("extra_body must be a dict", param="extra_body")
        _check_extra(extra)
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
        if not isinstance(options["include_usage"], bool):
            raise InvalidRequestError(
                f"stream_options.include_usage must be true or false, got "
                f"{type(options['include_usage']).__name__}",
                param="stream_options.include_usage",
            )
        body["stream_options"] = options
    elif body.get("stream_options") is not None:  # as OpenAI and vLLM answer, before sending
        raise InvalidRequestError(
            "stream_options applies only to a stream: use infer_stream(), or leave it out",
            param="stream_options",
        )
    return encode_body(body), _text_size(msgs)


def frozen_metadata(metadata: object) -> Mapping[str, Any]:
    """The caller's ``metadata=`` as a read-only mapping.

    Validated as JSON (:func:`~zml.validation.check_json`: str keys, finite numbers, UTF-8
    text, at most :data:`~zml.validation.MAX_REQUEST_DEPTH` deep), because it is echoed in
    ``routing.metadata``, which responses, the gateway and telemetry serialise: a value that
    cannot be written as JSON must fail here, before a node does the work, not afterwards.
    """
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
    plain = dict(metadata)
    if plain:
        check_json(plain, "metadata")
    return MappingProxyType(plain)
