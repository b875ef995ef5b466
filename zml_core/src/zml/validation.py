"""Checks on what a caller hands zml, made before anything is built, sent or charged to a node.

A bad argument must fail at the call that passed it, as a typed error that names the argument
(``messages[2].content``, ``extra_body.logit_bias``, ``timeout.idle``), and never later as a
raw ``TypeError`` from ``json``, a ``UnicodeEncodeError`` from the HTTP stack, or a "node
timeout" that lowers the health of a node that was never reached. Everything here is pure: no
I/O, no state; dispatch, the clients and ``zml.Timeouts`` call these functions.

The rules, in the order they are checked:

* **API keys** are sent as ``Authorization: Bearer <key>``, so a key must be a header-safe
  token: visible ASCII only (``!`` to ``~``), no spaces, no control characters. The error says
  what is wrong ("api_key ends with a newline") and where, never what the key is.
* **Messages** are a non-empty list of mappings with a chat ``role`` (a string) and a
  ``content`` (a string or a list of parts; only an assistant message with ``tool_calls`` may
  omit it). Every string in a message must be encodable as UTF-8 (no lone surrogates).
* **Parameters and messages are JSON**: values are None, bools, ints, finite floats, strings,
  lists/tuples and mappings with string keys, nested at most :data:`MAX_REQUEST_DEPTH` deep.
  NaN and infinities are refused (JSON has no such numbers; Python's ``json`` would write a bare
  ``NaN`` token that servers reject or misread); bytes, sets and other objects are refused.
* **accelerator** is a string; a **policy dict** has string keys.
* **Timeouts** are positive, finite numbers of seconds, or None for "no limit". An infinite
  timeout is refused rather than read as "no limit": None says that explicitly.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidRequestError, PolicyConfigError

__all__ = [
    "MAX_REQUEST_DEPTH",
    "MAX_SECONDS",
    "ROLES",
    "brief_repr",
    "check_accelerator",
    "check_api_key",
    "check_json",
    "check_params",
    "check_policy_mapping",
    "check_scale",
    "check_timeout",
    "check_timeouts",
    "encode_json",
    "json_text",
    "name_problem",
    "validate_messages",
]

MAX_REQUEST_DEPTH = 64
"""How deeply lists and mappings may nest in a request (messages, tools, extra_body...)."""

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The chat roles a message may have."""

_CONTROL_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\0": "a NUL byte",
                  " ": "a space"}


# --- API keys ---------------------------------------------------------------------------------


def check_api_key(key: object, *, param: str = "api_key") -> str | None:
    """``key`` if it can be sent as a Bearer token; None for None or ``""`` (no key).

    Raises:
        InvalidRequestError: ``key`` is not a string, or holds a character that is not visible
            ASCII. The message names the problem and its position, never the key itself.
    """
    if key is None:
        return None
    if not isinstance(key, str):
        raise InvalidRequestError(
            f"{param} must be a string, got {type(key).__name__}", param=param
        )
    if not key:
        return None
    tail = key[len(key.rstrip()):]
    head = key[: len(key) - len(key.lstrip())]
    if tail and len(tail) < len(key):
        ch = "\n" if "\n" in tail else tail[-1]
        raise _key_error(param, f"ends with {_describe(ch)}", ch)
    if head:
        raise _key_error(param, f"starts with {_describe(head[0])}", head[0])
    for i, ch in enumerate(key):
        if not "!" <= ch <= "~":
            raise _key_error(param, f"{_where(key, i)} {_describe(ch)}", ch, edge=False)
    return key


def _key_error(param: str, problem: str, ch: str, *, edge: bool = True) -> InvalidRequestError:
    return InvalidRequestError(
        f"{param} {problem}: an API key is sent in an HTTP header and may hold only visible "
        "ASCII characters"
        + ("; strip the line end (a key read from a file keeps it)" if ch in "\r\n" else "")
        + ("; strip the surrounding whitespace" if edge and ch in " \t" else ""),
        param=param,
    )


def name_problem(name: str) -> str | None:
    """Why ``name`` (a node id, family, model or policy name) cannot be one, or None.

    Names go into response headers (``x-zml-node-id``...), metric labels and logs: a control
    character there (a CR, a newline) would break the reply of every request the node serves,
    after it did the work. So would whitespace around it, silently, in a header a client sends.
    """
    for i, ch in enumerate(name):
        if ch < " " or "\x7f" <= ch <= "\x9f":
            what = _describe(ch) if ch <= "\x7f" else f"a control character (U+{ord(ch):04X})"
            return (f"{_where(name, i)} {what}; names are shown in headers, metrics and logs, "
                    "which cannot carry one")
    if name != name.strip():
        return "starts or ends with whitespace; remove it"
    return None


def _where(key: str, i: int) -> str:
    if i == len(key) - 1:
        return "ends with"
    if i == 0:
        return "starts with"
    return f"contains, at position {i},"


def _describe(ch: str) -> str:
    if ch in _CONTROL_NAMES:
        return _CONTROL_NAMES[ch]
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"a control character (U+{ord(ch):04X})"
    if unicodedata.category(ch).startswith("Z"):
        return f"a space character (U+{ord(ch):04X})"
    return "a non-ASCII character"  # not shown: it may be part of the secret


# --- JSON values ------------------------------------------------------------------------------


def check_json(value: object, path: str, *, depth: int = MAX_REQUEST_DEPTH) -> None:
    """Check that ``value`` can be sent as JSON exactly as given.

    ``path`` names ``value`` in errors (``temperature``, ``messages[0]``); nested values are
    named ``path.key`` and ``path[i]``. Iterative, so neither deep nesting nor a cycle can
    exhaust the stack: both end at the depth limit.

    Raises:
        InvalidRequestError: a NaN or infinite float, a string that is not encodable UTF-8, a
            mapping key that is not a string (integer token ids in ``logit_bias`` aside), a value of a type JSON does not have, or nesting
            deeper than ``depth``.
    """
    stack: list[tuple[object, str, int]] = [(value, path, 0)]
    while stack:
        item, where, level = stack.pop()
        if item is None or isinstance(item, bool | int):
            continue
        if isinstance(item, str):
            _check_text(item, where)
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidRequestError(
                    f"{where} = {item!r}: numbers must be finite (JSON has no NaN or infinity)",
                    param=where,
                )
        elif isinstance(item, Mapping | list | tuple):
            if level >= depth:
                raise InvalidRequestError(
                    f"{where} nests lists/mappings more than {depth} deep (or contains itself)",
                    param=where,
                )
            if isinstance(item, Mapping):
                for key, sub in item.items():
                    if isinstance(key, int) and not isinstance(key, bool) \
                            and where.rpartition(".")[2] == "logit_bias":
                        # token ids (as LangChain passes them): JSON writes them as strings
                        stack.append((sub, f"{where}.{key}", level + 1))
                        continue
                    if not isinstance(key, str):
                        raise InvalidRequestError(
                            f"{where} has a key {_short(key)} of type {type(key).__name__}; "
                            "JSON object keys must be strings",
                            param=where,
                        )
                    _check_text(key, f"{where} key")
                    stack.append((sub, f"{where}.{key}", level + 1))
            else:
                stack.extend((sub, f"{where}[{i}]", level + 1) for i, sub in enumerate(item))
        else:
            hint = " (decode it to a str)" if isinstance(item, bytes | bytearray) else (
                " (use a list)" if isinstance(item, set | frozenset) else "")
            raise InvalidRequestError(
                f"{where} is a {type(item).__name__}, which cannot be sent as JSON{hint}; "
                "use None, bool, int, float, str, list or dict",
                param=where,
            )


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{where} is not valid Unicode text: a lone surrogate (U+{ord(text[exc.start]):04X}) "
            f"at position {exc.start} cannot be encoded as UTF-8 (text decoded with "
            "errors='surrogateescape' or split mid-pair?)",
            param=where,
        ) from None


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_text(value: object, param: str) -> str:
    """``value`` as JSON text (``ensure_ascii=False``), refusing what JSON cannot carry.

    For values that become JSON text inside a request, e.g. a tool call's arguments (which
    the adapters receive as dicts).

    Raises:
        InvalidRequestError: naming ``param`` and the part at fault (``param.key[0]``).
    """
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        pass
    check_json(value, param)
    raise InvalidRequestError(f"{param} cannot be encoded as JSON", param=param)


def encode_json(body: Mapping[str, Any], *, what: str = "request") -> bytes:
    """``body`` as compact UTF-8 JSON, refusing what JSON cannot carry.

    The fast path is one ``json.dumps(..., allow_nan=False)``; only when it fails is the body
    walked (:func:`check_json`) to name the part at fault.

    Raises:
        InvalidRequestError: naming the parameter at fault.
    """
    try:
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")
    except (ValueError, TypeError, UnicodeEncodeError, RecursionError):
        pass
    for key, value in body.items():
        check_json(value, str(key))
    raise InvalidRequestError(f"the {what} cannot be encoded as JSON", param=None)


# --- messages and parameters ------------------------------------------------------------------


def _as_mapping(msg: object) -> object:
    """A pydantic message (such as ``response.choices[0].message``, appended to the chat as
    with openai-python) as the dict it dumps to, without its unset (None) fields; anything
    else as it is."""
    dump = getattr(type(msg), "model_dump", None)
    if dump is None or not callable(dump):
        return msg
    try:
        return dump(msg, mode="json", exclude_none=True)
    except Exception:  # not pydantic's, or not serialisable: refused as not a mapping
        return msg


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of role/content mappings (or pydantic messages,
    such as an answer's ``choices[0].message``, taken as their dump); return it as dicts.

    Raises:
        InvalidRequestError: naming the message (``messages[i]``) and the field at fault.
    """
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
            msg = _as_mapping(msg)
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got "
                f"{type(msg).__name__}; e.g. {{'role': 'user', 'content': 'Hello'}}",
                param=f"messages[{i}]",
            )
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role = {_short(role)} is not a chat role; use one of "
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
        if not _plain(msg):
            check_json(msg, f"messages[{i}]")
        out.append(dict(msg))
    return out


def _plain(msg: Mapping[Any, Any]) -> bool:
    # Only ASCII string keys and values (the common message): nothing check_json could refuse,
    # so it skips the walk. (``isascii`` reads a flag of the string: no scan.)
    for key, value in msg.items():
        if type(key) is not str or type(value) is not str or not value.isascii() \
                or not key.isascii():
            return False
    return True


_MAPPING_PARAMS = {
    "extra_body": "of extra request fields",
    "stream_options": "e.g. {'include_usage': True}",
    "logit_bias": "token id -> bias",
    "metadata": "of labels",
}


def check_params(params: Mapping[str, Any]) -> None:
    """Check every passed-through parameter is JSON (names checked by dispatch).

    Raises:
        InvalidRequestError: naming the parameter path (``temperature``, ``extra_body.x[0]``).
    """
    for key, value in params.items():
        if not isinstance(key, str):
            raise InvalidRequestError(
                f"parameter names must be strings, got {_short(key)}", param=None
            )
        if key in _MAPPING_PARAMS and value is not None and not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"{key} must be a dict ({_MAPPING_PARAMS[key]}), got {type(value).__name__}",
                param=key,
            )
        kind = type(value)
        if kind is int or kind is bool or value is None or (kind is str and value.isascii()) \
                or (kind is float and math.isfinite(value)):
            continue  # what check_json would pass at once, without the call
        check_json(value, key)


def check_accelerator(accelerator: object) -> str | None:
    """``accelerator`` if it is None or a family name (a non-empty string).

    Raises:
        InvalidRequestError: any other value.
    """
    if accelerator is None:
        return None
    if not isinstance(accelerator, str) or not accelerator:
        raise InvalidRequestError(
            f"accelerator must be the name of an accelerator family (a string such as 'H100'), "
            f"got {_short(accelerator)}",
            param="accelerator",
        )
    return accelerator


def check_policy_mapping(policy: Mapping[Any, Any]) -> None:
    """Check a policy given as a dict before it is used as Policy fields.

    Raises:
        PolicyConfigError: a key that is not a string (``policy={1: 2}``).
    """
    for key in policy:
        if not isinstance(key, str):
            raise PolicyConfigError(
                f"a policy dict's keys must be Policy field names (strings), got {_short(key)} "
                f"of type {type(key).__name__}; e.g. {{'name': 'p', 'accelerator_chain': "
                "['H100']}",
                field="policy",
                value=key,
            )


# --- timeouts ---------------------------------------------------------------------------------


MAX_SECONDS = 365 * 24 * 3600.0
"""The longest timeout or interval accepted (a year): longer ones are refused rather than
overflow a thread wait or a socket timeout (None is the way to say "no limit")."""


def check_timeout(value: object, param: str) -> float | None:
    """``value`` as seconds: a positive finite number up to :data:`MAX_SECONDS`, or None (no
    limit).

    Raises:
        InvalidRequestError: a bool, a non-number, zero, a negative number, NaN, infinity or
            more than :data:`MAX_SECONDS`.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(
            f"{param} must be a number of seconds or None, got {type(value).__name__}",
            param=param,
        )
    seconds = _seconds(value)
    if seconds > MAX_SECONDS and (not math.isinf(seconds) or isinstance(value, int)):
        raise InvalidRequestError(
            f"{param} = {brief_repr(value)}: a timeout may be at most {MAX_SECONDS:.0f} s (a year); "
            "pass None for no limit",
            param=param,
        )
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidRequestError(
            f"{param} = {value!r}: a timeout must be a positive number of seconds (None: no "
            "limit)",
            param=param,
        )
    if math.isinf(seconds):
        raise InvalidRequestError(
            f"{param} = {value!r}: pass None for no limit, not infinity", param=param
        )
    return seconds


def _seconds(value: int | float) -> float:
    """``value`` as a float; an int too large for one is infinity (more than any limit)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf


def brief_repr(value: object) -> str:
    """``repr(value)``, cut to 40 characters (a huge number or string in a message)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_scale(value: object, param: str, *, zero_ok: bool = True) -> float:
    """``value`` as a finite number ``>= 0`` (``> 0`` unless ``zero_ok``): a time or rate
    scale of the simulator and replay.

    Raises:
        InvalidRequestError: a bool, a non-number, NaN, infinity, or out of range.
    """
    ok = isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(_seconds(value)) and (value >= 0 if zero_ok else value > 0)
    if not ok:
        bound = ">= 0" if zero_ok else "> 0"
        raise InvalidRequestError(f"{param} must be a finite number {bound}, got "
                                  f"{brief_repr(value)}", param=param)
    return float(value)  # type: ignore[arg-type]


def check_timeouts(
    total: object, connect: object, first_token: object, idle: object, *, prefix: str = "timeout"
) -> None:
    """Check the fields of a ``zml.Timeouts`` (called from its ``__post_init__``).

    Raises:
        InvalidRequestError: naming the field (``timeout.connect``).
    """
    for name, value in (("total", total), ("connect", connect), ("first_token", first_token),
                        ("idle", idle)):
        check_timeout(value, f"{prefix}.{name}")
