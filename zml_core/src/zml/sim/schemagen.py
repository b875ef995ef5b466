"""Generate a JSON value that validates against a JSON Schema, deterministically.

The simulated node answers tool calls and structured-output requests with values built here,
so clients, agents and their parsers meet realistic, *valid* payloads: typed fields, enums,
bounds, nested objects and arrays, local `$ref`s.

Supported: `type` (a name or a list: the first non-"null" wins), `const`, `enum`, `$ref` to
local pointers (`#/$defs/...`, `#/definitions/...`, `#`), `allOf` (merged), `anyOf` /
`oneOf` (the first branch; a "null" branch once nesting is deep), object `properties` /
`required` / `additionalProperties` / `minProperties`, array `items` / `prefixItems` (and the
draft-4 list form) / `minItems` / `maxItems` / `uniqueItems` (best effort), string
`minLength` / `maxLength` and a few `format`s, integer and number bounds (inclusive, and
exclusive in both the draft-4 and the later form) and `multipleOf`. Not honoured: `pattern`,
`not`, `if`/`then`/`else`, `contains`, `dependencies`.

Optional properties appear about half of the time; past depth 6 only what is required is
generated, so recursive schemas terminate. A value is at most :data:`MAX_SIZE` units large (one
per value, one per character of text): a schema that demands more (``minLength``, ``minItems``,
``minProperties`` in the millions, or nested ones that multiply) raises
:class:`SchemaGenerationError` after bounded work, instead of keeping the node busy.

`accepts` checks a *scalar* (a string, number, boolean or null, e.g. a tool argument read from
the prompt) against a schema, exactly: `type`, `const`, `enum`, number bounds and `multipleOf`,
string `minLength` / `maxLength`, `pattern` (Python's `re`; a pattern it cannot compile
rejects) and the `format`s generated here, `allOf` / `anyOf` / `oneOf` / `not` /
`if`-`then`-`else` and local `$ref`s. Object and array keywords do not apply to scalars.
`declared_types` lists the JSON types a schema names, so a value can be converted to one.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import re
from collections.abc import Mapping
from typing import Any

from zml.sim.textgen import WORDS

__all__ = ["MAX_SIZE", "SchemaGenerationError", "accepts", "declared_types", "generate_json",
           "json_type"]

_SOFT_DEPTH = 6
_HARD_DEPTH = 40
MAX_SIZE = 200_000
"""The largest value generated, in values plus characters of text (about 200 KB of JSON)."""
_NON_SCHEMA_KEYS = ("allOf", "anyOf", "oneOf", "$ref")


class SchemaGenerationError(ValueError):
    """The schema cannot be satisfied by this generator (e.g. `false`, or a bad `$ref`)."""


def generate_json(schema: Any, rng: random.Random) -> Any:
    """Return a value valid against `schema` (a JSON Schema as decoded JSON)."""
    return _Generator(schema, rng).value(schema, 0)


class _Generator:
    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self.left = MAX_SIZE

    def spend(self, size: int) -> None:
        """Count ``size`` units of the value being built against :data:`MAX_SIZE`."""
        self.left -= size
        if self.left < 0:
            raise SchemaGenerationError(
                f"the schema demands a value larger than {MAX_SIZE:,} values and characters")

    def value(self, schema: Any, depth: int) -> Any:
        if depth > _HARD_DEPTH:
            raise SchemaGenerationError("schema nests too deep (an unavoidable recursion?)")
        self.spend(1)
        if schema is True or schema is None:
            return self.string({})
        if schema is False:
            raise SchemaGenerationError("the schema `false` accepts no value")
        if not isinstance(schema, Mapping):
            raise SchemaGenerationError(f"not a schema: {schema!r}")
        schema = self.flatten(schema, depth)
        if "const" in schema:
            return copy.deepcopy(schema["const"])
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            return copy.deepcopy(enum[self.rng.randrange(len(enum))])
        kind = self.kind(schema)
        if kind == "object":
            return self.object(schema, depth)
        if kind == "array":
            return self.array(schema, depth)
        if kind == "integer":
            return self.integer(schema)
        if kind == "number":
            return self.number(schema)
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self.string(schema)

    def flatten(self, schema: Mapping[str, Any], depth: int) -> Mapping[str, Any]:
        """Resolve `$ref`, merge `allOf`, pick an `anyOf` / `oneOf` branch."""
        for _ in range(_HARD_DEPTH):
            if not any(key in schema for key in _NON_SCHEMA_KEYS):
                return schema
            rest = {k: v for k, v in schema.items() if k not in _NON_SCHEMA_KEYS}
            if "$ref" in schema:
                schema = _merge(rest, self.resolve(schema["$ref"]))
                continue
            if "allOf" in schema:
                merged: Mapping[str, Any] = rest
                for part in schema["allOf"]:
                    if isinstance(part, Mapping):
                        merged = _merge(merged, self.flatten(part, depth))
                if "anyOf" in schema:
                    merged = {**merged, "anyOf": schema["anyOf"]}
                if "oneOf" in schema:
                    merged = {**merged, "oneOf": schema["oneOf"]}
                schema = merged
                continue
            branches = schema.get("anyOf") or schema.get("oneOf") or [{}]
            branch = branches[0]
            if depth >= _SOFT_DEPTH:
                for candidate in branches:
                    if isinstance(candidate, Mapping) and candidate.get("type") == "null":
                        branch = candidate
                        break
            if branch is True:
                branch = {}
            if not isinstance(branch, Mapping):
                raise SchemaGenerationError(f"unusable anyOf/oneOf branch: {branch!r}")
            schema = _merge(rest, branch)
        raise SchemaGenerationError("$ref / allOf chain does not end")

    def resolve(self, ref: Any) -> Mapping[str, Any]:
        return _resolve(self.root, ref)

    @staticmethod
    def kind(schema: Mapping[str, Any]) -> str:
        declared = schema.get("type")
        if isinstance(declared, list):
            named = [t for t in declared if t != "null"]
            declared = named[0] if named else ("null" if declared else None)
        if isinstance(declared, str):
            return declared
        if any(k in schema for k in ("properties", "required", "additionalProperties")):
            return "object"
        if any(k in schema for k in ("items", "prefixItems", "minItems", "maxItems")):
            return "array"
        if any(k in schema for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
            return "number"
        return "string"

    def object(self, schema: Mapping[str, Any], depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = [r for r in schema.get("required", ()) if isinstance(r, str)]
        extra = schema.get("additionalProperties", True)
        out: dict[str, Any] = {}
        skipped: list[str] = []
        for name, sub in props.items():
            if name in required or (depth < _SOFT_DEPTH and self.rng.random() < 0.5):
                out[name] = self.value(sub, depth + 1)
            else:
                skipped.append(name)
        for name in required:
            if name not in out:
                out[name] = self.value(extra if isinstance(extra, Mapping) else {}, depth + 1)
        min_props = schema.get("minProperties", 0)
        for name in skipped:
            if len(out) >= min_props:
                break
            out[name] = self.value(props[name], depth + 1)
        index = 0
        while len(out) < min_props and extra is not False:
            key = f"extra_{index}"
            index += 1
            if key not in out:
                out[key] = self.value(extra if isinstance(extra, Mapping) else {}, depth + 1)
        return out

    def array(self, schema: Mapping[str, Any], depth: int) -> list[Any]:
        prefix = schema.get("prefixItems")
        items = schema.get("items", {})
        if isinstance(items, list):
            prefix, items = items, schema.get("additionalItems", {})
        prefix = prefix if isinstance(prefix, list) else []
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        if low > self.left:
            self.spend(low)  # raises: no room for that many items, whatever they are
        count = low if depth >= _SOFT_DEPTH else max(low, self.rng.randint(1, 3))
        if items is False:
            count = min(count, len(prefix))
        if isinstance(high, int):
            count = min(count, high)
        unique = bool(schema.get("uniqueItems"))
        out: list[Any] = []
        for i in range(count):
            sub = prefix[i] if i < len(prefix) else items
            value = self.value(sub, depth + 1)
            for _ in range(8):
                if not unique or value not in out:
                    break
                value = self.value(sub, depth + 1)
            out.append(value)
        return out

    def string(self, schema: Mapping[str, Any]) -> str:
        rng = self.rng
        fmt = schema.get("format")
        if fmt == "date-time":
            text = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
        elif fmt == "date":
            text = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif fmt == "time":
            text = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
        elif fmt == "email":
            text = f"user{rng.randint(1, 999)}@example.com"
        elif fmt in ("uri", "url"):
            text = f"https://example.com/{WORDS[rng.randrange(20)]}"
        elif fmt == "uuid":
            h = f"{rng.getrandbits(128):032x}"
            text = f"{h[:8]}-{h[8:12]}-4{h[13:16]}-a{h[17:20]}-{h[20:]}"
        else:
            text = " ".join(WORDS[rng.randrange(len(WORDS))] for _ in range(rng.randint(1, 3)))
        low = schema.get("minLength", 0)
        if isinstance(low, (int, float)) and len(text) < low:
            self.spend(int(min(low, MAX_SIZE + 1)))  # before any work: at most MAX_SIZE more
            parts = [text]
            size = len(text)
            while size < low:
                word = WORDS[rng.randrange(len(WORDS))]
                parts.append(word)
                size += len(word) + 1
            text = " ".join(parts)
        else:
            self.spend(len(text))
        high = schema.get("maxLength")
        if isinstance(high, int) and len(text) > high:
            text = text[:high]
        return text

    def integer(self, schema: Mapping[str, Any]) -> int:
        low, high = _bounds(schema)
        lo = -math.inf if low is None else (math.floor(low[0]) + 1 if low[1] else math.ceil(low[0]))
        hi = math.inf if high is None else (math.ceil(high[0]) - 1 if high[1] else math.floor(high[0]))
        lo, hi = _finite_range(lo, hi, 100)
        if lo > hi:
            raise SchemaGenerationError(f"no integer within the bounds of {dict(schema)!r}")
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0:
            first, last = math.ceil(lo / step), math.floor(hi / step)
            for k in self._candidates(first, last):
                value = k * step
                if float(value).is_integer() and lo <= value <= hi:
                    return int(value)
            raise SchemaGenerationError(f"no multiple of {step} within the bounds")
        return self.rng.randint(int(lo), int(hi))

    def number(self, schema: Mapping[str, Any]) -> float | int:
        low, high = _bounds(schema)
        lo = -math.inf if low is None else low[0]
        hi = math.inf if high is None else high[0]
        lo, hi = _finite_range(lo, hi, 100.0)
        step = schema.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0:
            for k in self._candidates(math.ceil(lo / step), math.floor(hi / step)):
                value = k * step
                if _inside(value, low, high) and (value / step).is_integer():
                    return value
            raise SchemaGenerationError(f"no multiple of {step} within the bounds")
        if lo == hi:
            if _inside(lo, low, high):
                return lo
            raise SchemaGenerationError(f"no number within the bounds of {dict(schema)!r}")
        value = lo + (hi - lo) * self.rng.uniform(0.25, 0.75)
        rounded = round(value, 2)
        return rounded if _inside(rounded, low, high) else value

    def _candidates(self, first: int, last: int) -> list[int]:
        if first > last:
            return []
        if last - first < 16:
            picks = list(range(first, last + 1))
            self.rng.shuffle(picks)
            return picks
        return [self.rng.randint(first, last) for _ in range(8)] + [first, last]


def _resolve(root: Any, ref: Any) -> Mapping[str, Any]:
    """The schema a local `$ref` points at within `root`."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaGenerationError(f"only local $ref are supported, got {ref!r}")
    node: Any = root
    for raw in ref[1:].split("/"):
        if not raw:
            continue
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise SchemaGenerationError(f"unresolvable $ref {ref!r}")
    if node is True:
        return {}
    if not isinstance(node, Mapping):
        raise SchemaGenerationError(f"$ref {ref!r} does not point at a schema")
    return node


def _merge(base: Mapping[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Combine two schemas that must both hold (properties and required are unioned)."""
    merged = dict(other)
    for key, value in base.items():
        if key == "properties" and isinstance(merged.get("properties"), Mapping):
            merged["properties"] = {**merged["properties"], **value}
        elif key == "required" and isinstance(merged.get("required"), list):
            merged["required"] = list(dict.fromkeys([*merged["required"], *value]))
        elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties") and isinstance(merged.get(key), (int, float)) and not isinstance(value, bool):
            merged[key] = max(merged[key], value)
        elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems") and isinstance(merged.get(key), (int, float)) and not isinstance(value, bool):
            merged[key] = min(merged[key], value)
        else:
            merged[key] = value
    return merged


def _bounds(
    schema: Mapping[str, Any],
) -> tuple[tuple[float, bool] | None, tuple[float, bool] | None]:
    """((low, exclusive) | None, (high, exclusive) | None) in either JSON Schema dialect."""
    low: tuple[float, bool] | None = None
    high: tuple[float, bool] | None = None
    minimum, maximum = _number(schema.get("minimum")), _number(schema.get("maximum"))
    ex_min, ex_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    ex_min_value, ex_max_value = _number(ex_min), _number(ex_max)
    if minimum is not None:
        low = (minimum, ex_min is True)
    if ex_min_value is not None and (low is None or ex_min_value >= low[0]):
        low = (ex_min_value, True)
    if maximum is not None:
        high = (maximum, ex_max is True)
    if ex_max_value is not None and (high is None or ex_max_value <= high[0]):
        high = (ex_max_value, True)
    return low, high


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _finite_range(lo: float, hi: float, span: float) -> tuple[float, float]:
    if math.isinf(lo) and math.isinf(hi):
        return 0, span
    if math.isinf(lo):
        return hi - span, hi
    if math.isinf(hi):
        return lo, lo + span
    return lo, hi


def _inside(
    value: float, low: tuple[float, bool] | None, high: tuple[float, bool] | None
) -> bool:
    if low is not None and (value < low[0] or (low[1] and value == low[0])):
        return False
    return not (high is not None and (value > high[0] or (high[1] and value == high[0])))


# -- checking scalars -------------------------------------------------------------------------

_FORMATS: dict[str, re.Pattern[str]] = {
    "date-time": re.compile(
        r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)"
        r"(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
    ),
    "date": re.compile(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    "time": re.compile(r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"),
    "email": re.compile(r"[^@\s]+@[^@\s]+"),
    "uri": re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S+"),
    "url": re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:\S+"),
    "uuid": re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"),
}
"""The formats `accepts` checks (those the generator produces); others are not checked."""


def accepts(schema: Any, value: Any, root: Any = None) -> bool:
    """Whether the scalar `value` is valid against `schema` (see the module docstring).

    `$ref`s resolve against `root` (by default `schema` itself). Lists, dicts and non-finite
    floats are never accepted.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if value is not None and not isinstance(value, (str, int, float)):
        return False
    return _accepts(schema, value, schema if root is None else root, 0)


def _accepts(schema: Any, value: Any, root: Any, depth: int) -> bool:
    if schema is True:
        return True
    if depth > _HARD_DEPTH or not isinstance(schema, Mapping):
        return False
    declared = schema.get("type")
    if declared is not None:
        names = declared if isinstance(declared, list) else [declared]
        if not any(_is_type(value, name) for name in names):
            return False
    if "const" in schema and not _json_equal(schema["const"], value):
        return False
    enum = schema.get("enum")
    if isinstance(enum, list) and not any(_json_equal(member, value) for member in enum):
        return False
    if _number(value) is not None and not _number_fits(schema, value):
        return False
    if isinstance(value, str) and not _string_fits(schema, value):
        return False
    if "$ref" in schema:
        try:
            target = _resolve(root, schema["$ref"])
        except SchemaGenerationError:
            return False
        if not _accepts(target, value, root, depth + 1):
            return False
    return _combinators_accept(schema, value, root, depth)


def _combinators_accept(schema: Mapping[str, Any], value: Any, root: Any, depth: int) -> bool:
    all_of, any_of, one_of = schema.get("allOf"), schema.get("anyOf"), schema.get("oneOf")
    if isinstance(all_of, list) and not all(_accepts(s, value, root, depth + 1) for s in all_of):
        return False
    if isinstance(any_of, list) and not any(_accepts(s, value, root, depth + 1) for s in any_of):
        return False
    if isinstance(one_of, list) and sum(_accepts(s, value, root, depth + 1) for s in one_of) != 1:
        return False
    if "not" in schema and _accepts(schema["not"], value, root, depth + 1):
        return False
    if "if" in schema:
        branch = "then" if _accepts(schema["if"], value, root, depth + 1) else "else"
        if branch in schema and not _accepts(schema[branch], value, root, depth + 1):
            return False
    return True


def _number_fits(schema: Mapping[str, Any], value: float) -> bool:
    low, high = _bounds(schema)
    if not _inside(value, low, high):
        return False
    step = _number(schema.get("multipleOf"))
    if step is None or step <= 0:
        return True
    if isinstance(value, int) and isinstance(step, int):
        return value % step == 0
    quotient = value / step
    return math.isfinite(quotient) and quotient.is_integer()


def _string_fits(schema: Mapping[str, Any], value: str) -> bool:
    low, high = _number(schema.get("minLength")), _number(schema.get("maxLength"))
    if (low is not None and len(value) < low) or (high is not None and len(value) > high):
        return False
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        try:
            if re.search(pattern, value) is None:
                return False
        except re.error:
            return False
    fmt = schema.get("format")
    checker = _FORMATS.get(fmt) if isinstance(fmt, str) else None
    return checker is None or checker.fullmatch(value) is not None


def _is_type(value: Any, name: Any) -> bool:
    if name == "string":
        return isinstance(value, str)
    if name == "null":
        return value is None
    if name == "boolean":
        return isinstance(value, bool)
    number = _number(value)
    if name == "number":
        return number is not None
    if name == "integer":
        return number is not None and float(number).is_integer()
    return False


def _json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values (booleans are not numbers; 1 equals 1.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if _number(a) is not None and _number(b) is not None:
        return bool(a == b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value ("integer" for ints, "number" for floats)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return "null"


def declared_types(schema: Any, root: Any = None) -> list[str]:
    """The JSON type names `schema` admits, in order of appearance, without repeats.

    Read from `type`, from the values of `const` / `enum`, and through local `$ref`s, `allOf`,
    `anyOf` and `oneOf`. Empty when nothing names a type (the schema may accept anything).
    """
    found: list[str] = []
    _collect_types(schema, schema if root is None else root, found, 0)
    return found


def _collect_types(schema: Any, root: Any, found: list[str], depth: int) -> None:
    if depth > _HARD_DEPTH or not isinstance(schema, Mapping):
        return
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared]
    values = [schema["const"]] if "const" in schema else []
    enum = schema.get("enum")
    if isinstance(enum, list):
        values += enum
    for name in [*names, *(json_type(v) for v in values)]:
        if isinstance(name, str) and name not in found:
            found.append(name)
    if "$ref" in schema:
        with contextlib.suppress(SchemaGenerationError):
            _collect_types(_resolve(root, schema["$ref"]), root, found, depth + 1)
    for key in ("allOf", "anyOf", "oneOf"):
        parts = schema.get(key)
        if isinstance(parts, list):
            for part in parts:
                _collect_types(part, root, found, depth + 1)
