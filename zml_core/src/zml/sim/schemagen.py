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
generated, so recursive schemas terminate.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping
from typing import Any

from zml.sim.textgen import WORDS

__all__ = ["SchemaGenerationError", "generate_json"]

_SOFT_DEPTH = 6
_HARD_DEPTH = 40
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

    def value(self, schema: Any, depth: int) -> Any:
        if depth > _HARD_DEPTH:
            raise SchemaGenerationError("schema nests too deep (an unavoidable recursion?)")
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
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaGenerationError(f"only local $ref are supported, got {ref!r}")
        node: Any = self.root
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
        while len(text) < low:
            text += " " + WORDS[rng.randrange(len(WORDS))]
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
