"""The JSON Schema value generator: every generated value validates, for hand-picked schemas and
for random ones drawn by hypothesis."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st

from zml.sim.schemagen import SchemaGenerationError, generate_json

jsonschema = pytest.importorskip("jsonschema")


def _check(schema, seeds=range(20)):
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    values = []
    for seed in seeds:
        value = generate_json(schema, random.Random(seed))
        errors = list(validator.iter_errors(value))
        assert not errors, (value, [e.message for e in errors])
        values.append(value)
    return values


def test_recursive_ref_terminates_and_validates():
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["label"],
            }
        },
        "$ref": "#/$defs/node",
    }
    values = _check(tree)
    assert any(v.get("children") for v in values)


def test_definitions_and_root_refs():
    schema = {
        "definitions": {"pos": {"type": "integer", "minimum": 1}},
        "type": "object",
        "properties": {"n": {"$ref": "#/definitions/pos"}, "self": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}},
        "required": ["n"],
    }
    _check(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 5},
        {"type": "integer", "minimum": 3.5, "maximum": 4.5},
        {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 0.001},
        {"type": "number", "minimum": 2, "maximum": 2},
        {"type": "integer", "multipleOf": 7, "minimum": 1, "maximum": 20},
        {"type": "number", "multipleOf": 0.5, "minimum": 1, "maximum": 3},
        {"type": "integer", "maximum": -1000},
        {"type": "string", "minLength": 30, "maxLength": 32},
        {"type": "string", "maxLength": 0},
        {"type": "string", "format": "date-time"},
        {"type": "string", "format": "date"},
        {"type": "string", "format": "uuid"},
        {"type": "string", "format": "email"},
        {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2, "uniqueItems": True},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 0},
        {"type": "object", "minProperties": 3},
        {"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1, "additionalProperties": False},
        {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                   {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
        {"oneOf": [{"type": "integer", "minimum": 10}, {"type": "string"}]},
        {"type": ["null", "integer"], "minimum": 5},
        {"enum": [1, "two", None, {"three": 3}]},
        {"const": {"fixed": [1, 2]}},
        {"type": "null"},
        {},
        True,
    ],
)
def test_keywords_are_honoured(schema):
    _check(schema)


def test_unicode_appears_in_strings():
    values = _check({"type": "string"}, seeds=range(300))
    assert any(not v.isascii() for v in values)


def test_same_seed_same_value():
    schema = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "number"}}}
    assert generate_json(schema, random.Random(3)) == generate_json(schema, random.Random(3))


@pytest.mark.parametrize(
    "schema",
    [False, {"$ref": "http://example.com/remote"}, {"$ref": "#/$defs/missing"}, {"$ref": "#"},
     {"type": "integer", "minimum": 5, "maximum": 4}],
)
def test_unsatisfiable_schemas_raise(schema):
    with pytest.raises(SchemaGenerationError):
        generate_json(schema, random.Random(0))


# -- random schemas ----------------------------------------------------------------------

_names = st.text("abcdefgh_", min_size=1, max_size=6)


@st.composite
def _strings(draw):
    schema = {"type": "string"}
    low = draw(st.none() | st.integers(0, 20))
    high = draw(st.none() | st.integers(low or 0, 40))
    if low is not None:
        schema["minLength"] = low
    if high is not None:
        schema["maxLength"] = high
    if draw(st.booleans()) and draw(st.booleans()):
        return {"type": "string", "enum": draw(st.lists(st.text(max_size=5), min_size=1, max_size=4, unique=True))}
    return schema


@st.composite
def _numbers(draw):
    kind = draw(st.sampled_from(["integer", "number"]))
    schema = {"type": kind}
    low = draw(st.none() | st.integers(-1000, 1000))
    high = draw(st.none() | st.integers(-1000, 1000))
    if low is not None and high is not None and low > high:
        low, high = high, low
    exclusive = draw(st.booleans()) and low is not None and high is not None and high - low >= 2
    if low is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = low
    if high is not None:
        schema["exclusiveMaximum" if exclusive else "maximum"] = high
    return schema


_leaves = st.one_of(
    _strings(),
    _numbers(),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda v: {"const": v}, st.integers() | st.text(max_size=4)),
)


def _extend(children):
    @st.composite
    def objects(draw):
        props = draw(st.dictionaries(_names, children, max_size=4))
        required = draw(st.lists(st.sampled_from(sorted(props)), unique=True)) if props else []
        schema = {"type": "object", "properties": props, "required": required}
        if draw(st.booleans()):
            schema["additionalProperties"] = False
        return schema

    @st.composite
    def arrays(draw):
        low = draw(st.integers(0, 3))
        high = draw(st.none() | st.integers(low, 5))
        schema = {"type": "array", "items": draw(children), "minItems": low}
        if high is not None:
            schema["maxItems"] = high
        return schema

    return st.one_of(
        objects(),
        arrays(),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
        st.builds(lambda a: {"oneOf": [a, {"type": "null"}]}, st.one_of(_strings(), _numbers())),
    )


_schemas = st.recursive(_leaves, _extend, max_leaves=12)


@st.composite
def _with_defs(draw):
    inner = draw(_schemas)
    if draw(st.booleans()):
        return {"$defs": {"thing": inner}, "type": "object",
                "properties": {"a": {"$ref": "#/$defs/thing"}, "b": {"type": "array", "items": {"$ref": "#/$defs/thing"}}},
                "required": ["a", "b"]}
    return inner


@settings(max_examples=100, deadline=None)
@given(schema=_with_defs(), seed=st.integers(0, 2**32))
def test_random_schemas_validate(schema, seed):
    _check(schema, seeds=[seed])


@pytest.mark.parametrize("schema", [
    {"type": "string", "minLength": 3_000_000},
    {"type": "array", "minItems": 10**9},
    {"type": "object", "minProperties": 10**9},
    # each bound alone is small; nested, they multiply
    {"type": "array", "minItems": 1000, "items": {"type": "array", "minItems": 1000}},
])
def test_a_schema_demanding_a_huge_value_fails_after_bounded_work(schema: dict[str, Any]) -> None:
    """A structured-output request with ``minLength: 3000000`` took the simulated node minutes
    (the text grew by concatenation) and froze every node of the process meanwhile."""
    with pytest.raises(SchemaGenerationError, match="larger than 200,000"):
        generate_json(schema, random.Random(0))


def test_a_long_min_length_is_met_exactly_as_before() -> None:
    text = generate_json({"type": "string", "minLength": 5000}, random.Random(3))
    assert 5000 <= len(text) < 5100 and "  " not in text
