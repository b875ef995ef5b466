"""What the simulated node reads in the prompt, so its replies follow the simplest requests.

A real model takes tool arguments and JSON keys from what the user wrote, and calls the tool
the user asks about. The node imitates the common cases with fixed rules, pure functions of
the text (so the same request still gets the same reply):

- *quoted strings*: '...' or "..." (the opening quote not preceded and the closing quote not
  followed by a letter or digit, so the apostrophes of "what's" or "players'" don't count) or
  “...”; on one line, neither starting nor ending with whitespace; in order of appearance.
- *a call*: the tool's own name (not preceded by a letter, digit or `_`) followed at once by a
  parenthesised list of one or more literals separated by commas, e.g. `magic_function(3)` or
  `book(2, "Paris", true)`. Literals are numbers, `true` / `false` (or `True` / `False`),
  `null` (or `None`) and quoted strings ('...' and "..." with backslash escapes of the quote
  and the backslash, or “...”). The first occurrence that parses counts.
- *tool arguments* (`tool_arguments`): from a call, the literals fill the tool's top-level
  `properties` in declaration order (extra literals are ignored); otherwise the first quoted
  string (other than the tool's name) fills the first parameter whose schema names the
  "string" type. A literal keeps its own type when the parameter's schema names that type
  (an integer passes for a number) or names no type; else it is converted to each type the
  schema names, in order (integer, number, boolean, string or null: `"3"` and `3.0` to 3,
  `3` to "3", `"true"` to true). The first candidate the schema accepts (bounds, enum,
  pattern, ... all checked) is used; when none is, the parameter is not filled and keeps its
  generated value.
- *a mention of a tool* (`mentions_name`, `mentions_word`): its whole name, or the name with
  `_` / `-` read as spaces, appears case-insensitively in the text; or, weaker, one of the
  meaningful words of its name appears as a whole word. The name splits on `_`, `-` and
  lower-to-upper case changes ("getWeather"); words shorter than 4 letters and generic ones
  (`GENERIC_WORDS`: get, set, fetch, call, run, ...) are not meaningful.
- *the tools a text mentions, in order* (`mentioned_tools`): every occurrence of a name (as
  above) or of a meaningful word is attributed to at most one tool, name occurrences before
  word occurrences, then the tool listed first, then the earlier occurrence; an occurrence that
  overlaps one already attributed is ignored (so "weather alerts" names `weather_alerts` and
  not also `get_weather`, and one "weather" names only the first of two weather tools). The
  tools with an attributed occurrence are mentioned, ordered by their first one (ties by the
  list). The first tool of the list that the simpler rules find (a name mention before a word
  mention) always wins its occurrences, so it is always among them.
- *JSON keys* (`json_keys`): the quoted strings without whitespace (at most 64 characters),
  first appearance first, without repeats.
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from zml.sim.schemagen import accepts, declared_types, json_type

__all__ = [
    "GENERIC_WORDS",
    "call_literals",
    "json_keys",
    "mentioned_tools",
    "mentions_name",
    "mentions_word",
    "name_words",
    "quoted_strings",
    "tool_arguments",
]

GENERIC_WORDS: frozenset[str] = frozenset(
    {
        "get", "set", "fetch", "call", "run", "do", "make", "create", "update", "delete", "list",
        "tool", "tools", "function", "func", "with", "from", "into", "about",
    }
)
"""Words of a tool's name too common to signal a mention of the tool."""

_QUOTED_RE = re.compile(
    r"(?<!\w)'(?P<single>[^'\s](?:[^'\n]*[^'\s])?)'(?!\w)"
    r'|(?<!\w)"(?P<double>[^"\s](?:[^"\n]*[^"\s])?)"(?!\w)'
    r"|“(?P<curly>[^”\s](?:[^”\n]*[^”\s])?)”"
)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_LITERAL_RE = re.compile(
    rf"""\s*(?:
        (?P<number>{_NUMBER})(?![\w.])
        | (?P<true>true|True)(?!\w)
        | (?P<false>false|False)(?!\w)
        | (?P<null>null|None)(?!\w)
        | '(?P<single>(?:[^'\\\n]|\\.)*)'
        | "(?P<double>(?:[^"\\\n]|\\.)*)"
        | “(?P<curly>[^”\n]*)”
    )\s*(?P<sep>[,)])""",
    re.VERBOSE,
)
_CLOSE_RE = re.compile(r"\s*\)")
_ESCAPE_RE = re.compile(r"\\([\\'\"])")
_INTEGER_RE = re.compile(r"[-+]?\d+")
_CAMEL_RE = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NAME_SPLIT_RE = re.compile(r"[\W_]+")
_WORD_RE = re.compile(r"\w+")
_MAX_KEY = 64
_NOTHING: Any = object()


class Literal(NamedTuple):
    """A literal argument of a call: its JSON value and its text as written."""

    value: Any
    text: str


def quoted_strings(text: str) -> list[str]:
    """The quoted strings of `text` (see the module docstring), in order."""
    return [m.group(m.lastgroup or 0) for m in _QUOTED_RE.finditer(text)]


def call_literals(name: str, text: str) -> list[Literal] | None:
    """The literal arguments of the first call `name(...)` in `text` that parses, or None."""
    if not name:
        return None
    for match in re.finditer(rf"(?<!\w){re.escape(name)}\(", text):
        literals = _parse_arguments(text, match.end())
        if literals:
            return literals
    return None


def _parse_arguments(text: str, pos: int) -> list[Literal] | None:
    literals: list[Literal] = []
    while True:
        match = _LITERAL_RE.match(text, pos)
        if match is None:
            # `f()` or a trailing comma (`f(3, )`) ends the list; anything else is no call.
            return literals if _CLOSE_RE.match(text, pos) else None
        literal = _literal(match)
        if literal is None:
            return None
        literals.append(literal)
        if match.group("sep") == ")":
            return literals
        pos = match.end()


def _literal(match: re.Match[str]) -> Literal | None:
    number = match.group("number")
    if number is not None:
        value = _parse_number(number)
        return None if value is None else Literal(value, number)
    for group, constant in (("true", True), ("false", False), ("null", None)):
        word = match.group(group)
        if word is not None:
            return Literal(constant, word)
    for group in ("single", "double"):
        raw = match.group(group)
        if raw is not None:
            string = _ESCAPE_RE.sub(r"\1", raw)
            return Literal(string, string)
    curly = match.group("curly")
    return Literal(curly, curly)


def _parse_number(text: str) -> int | float | None:
    """A number written in JSON / Python style (int when it has no point or exponent)."""
    if not _NUMBER_RE.fullmatch(text):
        return None
    if _INTEGER_RE.fullmatch(text):
        return int(text)
    value = float(text)
    return value if math.isfinite(value) else None


def _convert(literal: Literal, kind: str) -> Any:
    """`literal` as a value of JSON type `kind`, or `_NOTHING`."""
    value, text = literal
    if kind == "string":
        return _NOTHING if value is None else text
    if kind == "null":
        return None if value is None else _NOTHING
    if kind == "boolean":
        if isinstance(value, bool):
            return value
        lowered = text.lower() if isinstance(value, str) else ""
        return {"true": True, "false": False}.get(lowered, _NOTHING)
    if kind not in ("integer", "number") or value is None or isinstance(value, bool):
        return _NOTHING
    if isinstance(value, str):
        value = _parse_number(value.strip())
        if value is None:
            return _NOTHING
    if kind == "integer" and isinstance(value, float):
        return int(value) if value.is_integer() else _NOTHING
    return value


def _fit(literal: Literal, schema: Any, root: Any) -> Any:
    """The literal as a value `schema` accepts, or `_NOTHING`.

    Tried in turn: the value itself when the schema names its type (an integer passes for a
    number), its conversions to the types the schema names, in order, and, for schemas that
    name no type, the value itself.
    """
    kinds = declared_types(schema, root)
    value = literal.value
    own = json_type(value)
    candidates = [value] if own in kinds or (own == "integer" and "number" in kinds) else []
    candidates += [_convert(literal, kind) for kind in kinds]
    if not kinds:
        candidates.append(value)
    for candidate in candidates:
        if candidate is not _NOTHING and accepts(schema, candidate, root):
            return candidate
    return _NOTHING


def tool_arguments(name: str, parameters: Any, text: str) -> dict[str, Any]:
    """The parameters of tool `name` that `text` fills (see the module docstring).

    Only values that `parameters` (the tool's JSON Schema) accepts are returned, keyed by
    parameter name in declaration order; the caller generates the rest.
    """
    props = parameters.get("properties") if isinstance(parameters, Mapping) else None
    if not isinstance(props, Mapping) or not props or not text:
        return {}
    filled: dict[str, Any] = {}
    literals = call_literals(name, text)
    if literals:
        for (param, schema), literal in zip(props.items(), literals, strict=False):
            value = _fit(literal, schema, parameters)
            if value is not _NOTHING:
                filled[param] = value
        return filled
    quoted = next((q for q in quoted_strings(text) if q != name), None)
    if quoted is None:
        return filled
    for param, schema in props.items():
        if "string" in declared_types(schema, parameters):
            if accepts(schema, quoted, parameters):
                filled[param] = quoted
            break
    return filled


def name_words(name: str) -> list[str]:
    """The meaningful words of a tool's name, lower-cased (see the module docstring)."""
    words = _NAME_SPLIT_RE.split(_CAMEL_RE.sub(" ", name).lower())
    return [w for w in dict.fromkeys(words) if len(w) >= 4 and w not in GENERIC_WORDS]


def mentions_name(name: str, text: str) -> bool:
    """Whether `text` contains the whole name, or the name with `_` / `-` read as spaces."""
    lowered, wanted = text.lower(), name.lower()
    return bool(wanted) and (wanted in lowered or wanted.replace("_", " ").replace("-", " ") in lowered)


def mentions_word(name: str, text: str) -> bool:
    """Whether a meaningful word of the name appears in `text` as a whole word."""
    words = name_words(name)
    return bool(words) and not set(words).isdisjoint(_WORD_RE.findall(text.lower()))


def _name_spans(name: str, lowered: str) -> set[tuple[int, int]]:
    """Where the name (or the name with `_` / `-` read as spaces) occurs in lower-cased text."""
    wanted = name.lower()
    spans: set[tuple[int, int]] = set()
    if not wanted:
        return spans
    for variant in {wanted, wanted.replace("_", " ").replace("-", " ")}:
        spans.update(m.span() for m in re.finditer(re.escape(variant), lowered))
    return spans


def mentioned_tools(names: Sequence[str], text: str) -> list[int]:
    """The indices in `names` of the tools `text` mentions, in the order of their first
    mention (see the module docstring)."""
    lowered = text.lower()
    words: dict[str, list[tuple[int, int]]] = {}
    for match in _WORD_RE.finditer(lowered):
        words.setdefault(match.group(), []).append(match.span())
    candidates: list[tuple[int, int, int, int]] = []  # (strength, tool, start, end)
    for tool, name in enumerate(names):
        candidates += [(0, tool, start, end) for start, end in _name_spans(name, lowered)]
        for word in name_words(name):
            candidates += [(1, tool, start, end) for start, end in words.get(word, ())]
    starts: list[int] = []  # the attributed occurrences, disjoint, sorted by start
    ends: list[int] = []
    first: dict[int, int] = {}
    for _, tool, start, end in sorted(candidates):
        i = bisect.bisect_right(starts, start)
        if (i and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
            continue
        starts.insert(i, start)
        ends.insert(i, end)
        first[tool] = min(start, first.get(tool, start))
    return sorted(first, key=lambda tool: (first[tool], tool))


def json_keys(text: str) -> list[str]:
    """The keys a message names for a JSON object (see the module docstring)."""
    keys = [q for q in quoted_strings(text) if len(q) <= _MAX_KEY and not any(c.isspace() for c in q)]
    return list(dict.fromkeys(keys))
