"""The OpenAI chat-completions protocol as the simulated node speaks it: validation and the
reply's data (its plan is decided by `zml.sim.planning`, its JSON / SSE encodings are in
`zml.sim.encoding`). Pure functions, no I/O and no clock, so the node's ASGI code only paces
and sends what is decided here.

Reply rules (deterministic for a given model, messages and `seed`; "mentions", "call" and
"quoted string" are defined in `zml.sim.cues`):
- tools are called when `tools` are given, `tool_choice` is not "none" and the last message is
  not a tool result (after a tool result the node always answers in text, so agent loops
  end): a named `tool_choice` calls that tool; "required" calls the first tool the last
  message mentions, else the first tool; "auto" (the default) calls a tool the last message
  mentions when that message is from the user. A mention by whole name (or the name with
  `_`/`-` read as spaces, case-insensitively) beats one by a meaningful word of the name
  ("weather" for `get_weather`); among equals, the first tool in `tools` wins;
- parallel calls: under "auto" or "required", unless `parallel_tool_calls` is false, when the
  last message is from the user and mentions several of the tools (`cues.mentioned_tools`:
  each occurrence counts for one tool only), the reply calls each of them once, in the order
  they are mentioned, each call with its own id and arguments. Otherwise (one mention, a
  named `tool_choice`, `parallel_tool_calls: false`) the reply is one call, chosen as above;
- each call's arguments validate against its tool's `parameters`; the last user message fills
  what it can: a call written in it (`magic_function(3)`) fills that tool's parameters in
  declaration order, else its first quoted string fills the first string parameter, each
  value converted to the parameter's type and kept only if its schema accepts it; the rest is
  generated. Each call draws its arguments, then its id, from the request's generator, in
  call order;
- else `response_format` json_object / json_schema gives JSON content. json_object: when the
  last user message names keys in quotes ("with 'setup' and 'punchline' keys"), an object of
  exactly those keys with string values, else an object with "answer" and "confidence";
- else prose of 16-48 words, sized by the request's own seed (at least vLLM's `min_tokens`).
`max_tokens` (or `max_completion_tokens`) caps the content, like a real model that may stop
earlier (finish_reason "length" when it cuts); with vLLM's `ignore_eos: true` the prose runs to
exactly `max_tokens` (finish_reason "length"), which benchmarks and demos use for fixed-size or
long streams. The first `stop` sequence then truncates the content (finish_reason "stop").
Tool calls are never cut (finish_reason "tool_calls").

Streamed, a reply opens with a role chunk; each tool call then sends one chunk with its
`index` (0, 1, ... in call order), `id`, `type` and `function.name` (and empty arguments),
followed by chunks of `index` and argument fragments only, the calls one after another.
The tool name counts as one completion token, each argument fragment as one.

What else a reply carries, as vLLM (or OpenAI, where vLLM has no equivalent) sends it:
- `n` (1-16) choices, each planned by the rules above from its own generator (choice 0 is the
  reply the request gets with `n` = 1). Choices are generated side by side, so the reply
  takes as long as its longest choice. Streamed, every chunk holds one choice, named by its
  `index`: each choice opens with its own role chunk, a step sends one chunk per choice that
  still has a token, and every choice ends with its own finish_reason chunk;
- `logprobs` (see `zml.sim.logprobs`) on every choice when the request sets `logprobs: true`
  (with `top_logprobs`, 0-20; `top_logprobs` without `logprobs` is a 400, as in vLLM);
  streamed, each content chunk carries the entries of its own token;
- `usage` counts the prompt once and the tokens of every choice, with
  `prompt_tokens_details.cached_tokens`: a prefix cache that holds the earlier turns, i.e.
  the prompt tokens of every message but the last, in whole blocks of 16 tokens (vLLM's
  default block size; a one-message prompt has none cached);
- `reasoning_effort` ("minimal", "low", "medium", "high") makes each choice think first:
  4, 8, 16 or 32 hidden reasoning tokens, paced before the first visible token, counted in
  `completion_tokens` and in `completion_tokens_details.reasoning_tokens` (OpenAI's shape;
  that object is sent only then). `max_tokens` caps the visible tokens only;
- `system_fingerprint` on the completion and on every chunk (as OpenAI sends it): `fp_`
  and 10 hex digits of the model's name.

Sampling parameters (`temperature`, `top_p`, `min_p`, `top_k`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty`) do not change the reply, but are checked as vLLM
checks them: a value of the wrong type or out of range is a 400 naming the parameter.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zml.sim.encoding import ChunkEncoder, completion_body
from zml.sim.logprobs import MAX_TOP_LOGPROBS

__all__ = [
    "ApiError",
    "ChatRequest",
    "ChunkEncoder",
    "Plan",
    "Reply",
    "ToolCall",
    "completion_body",
    "parse_request",
    "reply_units",
]

MAX_CHOICES = 16
"""The most choices (`n`) one request may ask for."""
CACHE_BLOCK_TOKENS = 16
"""The prefix cache's block size: cached prompt tokens come in whole blocks."""
MAX_REPLY_UNITS = 500_000
"""The most a reply may hold, planned whole before its first token: choices x content tokens
x (1, or 2 + `top_logprobs` with `logprobs`; see :func:`reply_units`). Larger is a 400: a
plan is built in CPU time and held in memory whole (500,000 tokens: about 0.5 s, 40 MB)."""
PROSE_MAX_TOKENS = 48
"""The longest prose a reply has without `ignore_eos` (or a larger `min_tokens`)."""
REASONING_TOKENS: Mapping[str, int] = {"minimal": 4, "low": 8, "medium": 16, "high": 32}
"""Hidden reasoning tokens per choice, by `reasoning_effort`."""

_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_JSON_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "minLength": 1},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["answer", "confidence"],
}


class ApiError(Exception):
    """An error answered as OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> bytes:
        """The JSON error document."""
        error = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        return json.dumps({"error": error}).encode()


@dataclass(frozen=True)
class ChatRequest:
    """The fields of a chat request that shape the reply."""

    model: str
    messages: list[dict[str, Any]]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop: tuple[str, ...]
    seed: int
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    response_format: dict[str, Any] | None
    """The JSON Schema of the content, or None for prose; json_object keeps a placeholder that
    planning replaces by the keys the prompt names (see the module docstring)."""
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning_tokens: int = 0
    """Hidden reasoning tokens per choice (from `reasoning_effort`; 0 without)."""


@dataclass(frozen=True)
class ToolCall:
    """One function call of a reply; `pieces` are the fragments of `arguments`, streamed."""

    id: str
    name: str
    arguments: str
    pieces: tuple[str, ...]

    @property
    def tokens(self) -> int:
        """Generated tokens of the call: its name, then one per argument fragment."""
        return 1 + len(self.pieces)


@dataclass(frozen=True)
class Reply:
    """One choice of a reply.

    `pieces` are content tokens (none when the reply calls tools); `tool_calls` the calls, in
    order; `logprobs` one entry per piece when the request asked for them (else None);
    `reasoning_tokens` hidden tokens generated before the first piece.
    """

    pieces: list[str]
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    logprobs: list[dict[str, Any]] | None = None
    reasoning_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        """Generated tokens: reasoning, content, tool calls (each tool name counts as one)."""
        return self.reasoning_tokens + len(self.pieces) + sum(call.tokens for call in self.tool_calls)

    @property
    def content(self) -> str | None:
        """The full content, or None when the reply calls tools."""
        return None if self.tool_calls else "".join(self.pieces)


@dataclass(frozen=True)
class Plan:
    """The whole reply (all its choices), decided before the first token is paced out."""

    model: str
    prompt_tokens: int
    choices: tuple[Reply, ...]
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        """Decode steps of the reply: the generated tokens of its longest choice (the choices
        are generated side by side). With `n` = 1, the reply's generated tokens."""
        return max(choice.completion_tokens for choice in self.choices)

    @property
    def pieces(self) -> list[str]:
        """The first choice's content tokens."""
        return self.choices[0].pieces

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The first choice's tool calls."""
        return self.choices[0].tool_calls

    @property
    def finish_reason(self) -> str:
        """The first choice's finish reason."""
        return self.choices[0].finish_reason

    @property
    def content(self) -> str | None:
        """The first choice's content, or None when it calls tools."""
        return self.choices[0].content

    @property
    def system_fingerprint(self) -> str:
        """`fp_` and 10 hex digits of the model's name (the same for every reply of a model)."""
        return "fp_" + hashlib.blake2b(self.model.encode(), digest_size=5).hexdigest()

    def usage(self) -> dict[str, Any]:
        """The OpenAI `usage` object: the prompt once, the tokens of every choice."""
        completion = sum(choice.completion_tokens for choice in self.choices)
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        reasoning = sum(choice.reasoning_tokens for choice in self.choices)
        if reasoning:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def _int_or_none(body: Mapping[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(f"{key} must be an integer >= {minimum}, got {value!r}", key)
    return value


_SAMPLING: tuple[tuple[str, float, float, bool], ...] = (
    ("temperature", 0.0, math.inf, False),
    ("top_p", 0.0, 1.0, True),
    ("min_p", 0.0, 1.0, False),
    ("presence_penalty", -2.0, 2.0, False),
    ("frequency_penalty", -2.0, 2.0, False),
    ("repetition_penalty", 0.0, math.inf, True),
)
"""The sampling numbers checked as vLLM's SamplingParams checks them: (name, low, high, whether
``low`` itself is refused). They do not change the reply; a bad one is a 400."""


def _check_sampling(body: Mapping[str, Any]) -> None:
    for key, low, high, low_open in _SAMPLING:
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value):
            raise _bad(f"{key} must be a number, got {value!r}", key)
        if value < low or (low_open and value == low) or value > high:
            span = f"in {'(' if low_open else '['}{low:g}, {high:g}]" if high < math.inf \
                else f"{'>' if low_open else '>='} {low:g}"
            raise _bad(f"{key} must be {span}, got {value!r}", key)
    top_k = body.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < -1):
        raise _bad(f"top_k must be -1 or 0 (disabled) or a positive integer, got {top_k!r}",
                   "top_k")


def parse_request(raw: bytes, served: Sequence[str]) -> ChatRequest:
    """Validate a chat-completions body; raise `ApiError` (400 / 404) as vLLM would."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model is required", "model")
    if model not in served:
        raise ApiError(
            404,
            f"The model `{model}` does not exist.",
            type="NotFoundError",
            code="model_not_found",
            param="model",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise _bad(f"messages[{i}] must be an object with a valid role", "messages")
    n = _int_or_none(body, "n", 1) or 1
    if n > MAX_CHOICES:
        raise _bad(f"n must be at most {MAX_CHOICES}, got {n}", "n")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad("logprobs must be a boolean", "logprobs")
    top_logprobs = _int_or_none(body, "top_logprobs", 0)
    if top_logprobs is not None:
        if top_logprobs > MAX_TOP_LOGPROBS:
            raise _bad(f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {top_logprobs}", "top_logprobs")
        if not logprobs:
            raise _bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    _check_sampling(body)
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_TOKENS:
        raise _bad(f"reasoning_effort must be one of {sorted(REASONING_TOKENS)}, got {effort!r}", "reasoning_effort")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    max_tokens = _int_or_none(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int_or_none(body, "max_tokens", 1)
    min_tokens = _int_or_none(body, "min_tokens", 0) or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got "
                   f"{min_tokens}.", "min_tokens")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise _bad("ignore_eos must be a boolean", "ignore_eos")
    seed = _int_or_none(body, "seed", -(2**63)) or 0
    stop_raw = body.get("stop")
    if stop_raw is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_raw, str):
        stop = (stop_raw,) if stop_raw else ()
    elif isinstance(stop_raw, list) and all(isinstance(s, str) for s in stop_raw):
        stop = tuple(s for s in stop_raw if s)
    else:
        raise _bad("stop must be a string or a list of strings", "stop")
    tools = _parse_tools(body.get("tools"))
    tool_choice = _parse_tool_choice(body.get("tool_choice"), tools)
    parallel_tool_calls = body.get("parallel_tool_calls")
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    elif not isinstance(parallel_tool_calls, bool):
        raise _bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    response_format = _parse_response_format(body.get("response_format"))
    request = ChatRequest(
        model=model,
        messages=messages,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        stop=stop,
        seed=seed,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        n=n,
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs or 0,
        reasoning_tokens=0 if effort is None else REASONING_TOKENS[effort],
    )
    units = reply_units(request)
    if units > MAX_REPLY_UNITS:
        raise _bad(
            f"this reply would hold {units:,} tokens and logprobs entries (n x max_tokens or "
            f"min_tokens x logprobs); a simulated node plans at most {MAX_REPLY_UNITS:,}: lower "
            "max_tokens, min_tokens, n or top_logprobs",
            "max_tokens" if ignore_eos and max_tokens is not None else "min_tokens")
    return request


def reply_units(request: ChatRequest) -> int:
    """The most a reply to ``request`` can hold, counted for :data:`MAX_REPLY_UNITS`: its
    choices x the content tokens of its longest possible choice x (2 + `top_logprobs` with
    `logprobs`: the token, its entry and the alternatives; else 1). Tool calls and JSON
    content are bounded on their own (:data:`zml.sim.schemagen.MAX_SIZE`)."""
    if request.ignore_eos and request.max_tokens is not None:
        longest = request.max_tokens
    else:
        longest = max(PROSE_MAX_TOKENS, request.min_tokens)
        if request.max_tokens is not None:
            longest = min(longest, request.max_tokens)
    per_token = 2 + request.top_logprobs if request.logprobs else 1
    return request.n * longest * per_token


def _parse_tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad("tools must be a list", "tools")
    for i, tool in enumerate(raw):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        params = function.get("parameters")
        if params is not None and not isinstance(params, (dict, bool)):
            raise _bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
    return raw


def _parse_tool_choice(raw: Any, tools: list[dict[str, Any]]) -> Any:
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise _bad('tool_choice "required" needs tools', "tool_choice")
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        function = raw.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not any(t["function"]["name"] == name for t in tools):
            raise _bad(f"tool_choice names a tool that is not in tools: {name!r}", "tool_choice")
        return raw
    raise _bad("tool_choice must be none, auto, required or a named function", "tool_choice")


def _parse_response_format(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _JSON_OBJECT_SCHEMA
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is True:
            return {"type": "object"}
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema must be a JSON Schema", "response_format")
        return schema
    raise _bad("response_format.type must be text, json_object or json_schema", "response_format")
