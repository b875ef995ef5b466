"""What the simulated node reads in the prompt (zml.sim.cues), and the scalar checks it relies on
(schemagen.accepts, cross-checked against jsonschema)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from zml.sim.cues import (
    call_literals,
    json_keys,
    mentioned_tools,
    mentions_name,
    mentions_word,
    name_words,
    quoted_strings,
    tool_arguments,
)
from zml.sim.schemagen import accepts, declared_types

jsonschema = pytest.importorskip("jsonschema")

MAGIC = {
    "type": "object",
    "properties": {"input": {"type": "integer", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000}},
    "required": ["input"],
}
CUSTOMER = {
    "type": "object",
    "properties": {"customer_name": {"type": "string"}, "description": {"type": "string"}},
    "required": ["customer_name", "description"],
}
MIXED = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "label": {"type": "string", "maxLength": 10},
        "ratio": {"type": "number"},
        "flag": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
}


# -- quoted strings and calls --------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a customer named '你好啊集团' (Hello Group)", ["你好啊集团"]),
        ("with 'setup' and 'punchline' keys", ["setup", "punchline"]),
        ('say "hello there" and “bonjour”', ["hello there", "bonjour"]),
        ("What's the players' 'score'?", ["score"]),  # apostrophes are not quotes
        ("it's 'O'Brien' I guess", []),  # an inner apostrophe: no clean closing quote
        ("a ' spaced ' quote and '' nothing", []),
        ("'first\nline'", []),  # one line only
        ("no quotes at all", []),
    ],
)
def test_quoted_strings(text, expected):
    assert quoted_strings(text) == expected


def test_call_literals_parse_every_literal_kind():
    literals = call_literals("f", """f(3, -2.5e1, 'it\\'s', "x", “y”, true, False, null, None, )""")
    assert [lit.value for lit in literals] == [3, -25.0, "it's", "x", "y", True, False, None, None]
    assert [lit.text for lit in literals][:2] == ["3", "-2.5e1"]


@pytest.mark.parametrize(
    "text",
    ["f()", "f(x)", "f(3", "f (3)", "g_f(3)", "f(3; 4)", "f([1])", "f(1e999)", "call f please"],
)
def test_what_is_not_a_call(text):
    assert call_literals("f", text) is None


def test_the_first_call_that_parses_counts():
    assert [lit.value for lit in call_literals("f", "f(x) then f(2) then f(5)")] == [2]
    assert call_literals("magic_function", "magic_function_no_args(3)") is None


# -- tool arguments --------------------------------------------------------------------------


def test_call_fills_parameters_in_declaration_order_with_conversion():
    assert tool_arguments("magic_function", MAGIC, "What is the value of magic_function(3)? Use the tool.") == {
        "input": 3
    }
    assert tool_arguments("f", MIXED, "f(7.0, 42, '0.5', False)") == {
        "count": 7, "label": "42", "ratio": 0.5, "flag": False,
    }
    assert tool_arguments("f", MIXED, 'f("5", true, 1, None, "extra", 9)') == {
        "count": 5, "label": "true", "ratio": 1, "flag": None,
    }


def test_values_the_schema_rejects_are_left_to_the_generator():
    assert tool_arguments("magic_function", MAGIC, "magic_function(1000)") == {}
    assert tool_arguments("magic_function", MAGIC, "magic_function(2.5)") == {}
    assert tool_arguments("magic_function", MAGIC, "magic_function(true)") == {}
    assert tool_arguments("f", MIXED, "f(-1, 'far too long a label', 'x', 'maybe')") == {}


def test_quoted_string_fills_the_first_string_parameter():
    text = "Create a customer named '你好啊集团' (Hello Group) - a Chinese technology company"
    assert tool_arguments("unicode_customer", CUSTOMER, text) == {"customer_name": "你好啊集团"}
    assert tool_arguments("f", MIXED, 'label it "short"') == {"label": "short"}
    # only the first string parameter, and only when it fits
    assert tool_arguments("f", MIXED, 'label it "much too long for it"') == {}
    # the tool's own name in quotes is not an argument
    assert tool_arguments("lookup", CUSTOMER, "use 'lookup' for 'ACME'") == {"customer_name": "ACME"}


def test_a_call_wins_over_quoted_strings():
    assert tool_arguments("f", MIXED, "f(3) for 'someone'") == {"count": 3}


@pytest.mark.parametrize(
    "parameters",
    [None, True, {}, {"type": "object"}, {"type": "object", "properties": {}}, {"type": "string"}],
)
def test_nothing_to_fill(parameters):
    assert tool_arguments("f", parameters, "f(3) 'x'") == {}


def test_refs_are_followed_for_types_and_checks():
    schema = {
        "$defs": {"small": {"type": "integer", "maximum": 5}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/small"}},
    }
    assert tool_arguments("f", schema, "f('4')") == {"n": 4}
    assert tool_arguments("f", schema, "f(6)") == {}


# -- mentions and keys -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("get_weather", ["weather"]),
        ("getCurrentWeather", ["current", "weather"]),
        ("fetch-stock-price", ["stock", "price"]),
        ("create_list", []),
        ("run_job", []),
        ("magic_function", ["magic"]),
    ],
)
def test_name_words(name, words):
    assert name_words(name) == words


def test_mentions():
    assert mentions_name("book_trip", "Please Book Trip for us")
    assert mentions_name("get_weather", "use GET_WEATHER")
    assert not mentions_name("get_weather", "What is the weather in San Francisco, CA?")
    assert mentions_word("get_weather", "What is the weather in San Francisco, CA?")
    assert mentions_word("getCurrentWeather", "WEATHER, please")
    assert not mentions_word("get_weather", "weathering the storm")  # whole words only
    assert not mentions_word("run_job", "run the job")  # no meaningful word


@pytest.mark.parametrize(
    ("names", "text", "expected"),
    [
        # whole names, in the order of the text, not of the list
        (["get_weather", "book_trip", "magic_function"], "magic_function(3), then get_weather", [2, 0]),
        (["get_weather", "book_trip"], "Book Trip first; then GET_WEATHER", [1, 0]),
        # words count too, each occurrence for one tool only
        (["get_weather", "book_trip"], "What's the weather? Then book it.", [0, 1]),
        (["get_weather", "weather_alerts"], "Any weather alerts today?", [1]),  # inside a name
        (["weather_alerts", "get_weather"], "check the weather", [0]),  # one word, the first tool
        (["get_weather", "weather_alerts"], "the weather, and weather alerts", [0, 1]),
        # a tool is placed at its first attributed occurrence
        (["get_weather", "book_trip"], "Is the weather ok? Book trip, then get_weather", [0, 1]),
        (["get_weather", "get_weather_alerts"], "use get_weather_alerts", [0]),  # first listed wins
        (["get_weather", "book_trip"], "nothing relevant", []),
        (["get_weather", "get_weather"], "get_weather twice", [0]),
        ([], "get_weather", []),
    ],
)
def test_mentioned_tools(names, text, expected):
    assert mentioned_tools(names, text) == expected


@given(st.lists(st.sampled_from(["get_weather", "book_trip", "weather_alerts", "ping", "a-b"]), max_size=4),
       st.text(alphabet=st.sampled_from(list("weathr bookip_alsng-AW")), max_size=40))
@settings(max_examples=200, deadline=None)
def test_mentioned_tools_contains_the_single_pick(names, text):
    """The tool the one-call rule picks (first by name, else first by word) is always mentioned."""
    order = mentioned_tools(names, text)
    assert len(set(order)) == len(order)
    single = next((i for i, n in enumerate(names) if mentions_name(n, text)), None)
    if single is None:
        single = next((i for i, n in enumerate(names) if mentions_word(n, text)), None)
    assert (single is None) == (not order)
    if single is not None:
        assert single in order
    assert all(mentions_name(names[i], text) or mentions_word(names[i], text) for i in order)


def test_json_keys():
    text = "Return the result as a JSON with 'setup' and 'punchline' keys, 'setup' first."
    assert json_keys(text) == ["setup", "punchline"]
    assert json_keys('Summarise "War and Peace" as JSON with a "summary" key') == ["summary"]
    assert json_keys("Tell me a joke as JSON") == []


# -- schemagen.accepts -----------------------------------------------------------------------

SCALAR_SCHEMAS = [
    {"type": "integer", "exclusiveMinimum": -1000, "exclusiveMaximum": 1000},
    {"type": "integer", "minimum": 0, "multipleOf": 3},
    {"type": "number", "minimum": 0.5, "maximum": 2},
    {"type": "number", "multipleOf": 0.5},
    {"type": ["string", "null"], "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[a-z]+$"},
    {"type": "boolean"},
    {"enum": [1, "one", True, None]},
    {"const": 0},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]},
    {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
    {"allOf": [{"type": "number"}, {"maximum": 10}], "not": {"const": 5}},
    {"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}},
    {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s"},
    {"type": "object"},
    {"type": "array"},
    {},
]
SCALARS = [0, 1, 3, 5, 6, -7, 999, 1000, 1.0, 1.5, 2.5, 12.0, True, False, None, "", "a", "ab", "abcde", "AB", "one"]


@pytest.mark.parametrize("schema", SCALAR_SCHEMAS)
def test_accepts_agrees_with_jsonschema(schema):
    validator = jsonschema.Draft202012Validator(schema)
    for value in SCALARS:
        assert accepts(schema, value) == validator.is_valid(value), value


@settings(max_examples=300, deadline=None)
@given(
    schema=st.sampled_from(SCALAR_SCHEMAS),
    value=st.one_of(
        st.none(), st.booleans(), st.integers(-2000, 2000), st.floats(-50, 50), st.text(max_size=6)
    ),
)
def test_accepts_agrees_with_jsonschema_on_random_values(schema, value):
    assert accepts(schema, value) == jsonschema.Draft202012Validator(schema).is_valid(value)


def test_accepts_checks_generated_formats_and_rejects_non_scalars():
    assert accepts({"format": "date"}, "2024-05-01") and not accepts({"format": "date"}, "May 1st")
    assert accepts({"format": "email"}, "a@b.example") and not accepts({"format": "email"}, "nobody")
    assert accepts({"format": "uuid"}, "123e4567-e89b-42d3-a456-426614174000")
    assert accepts({"format": "date-time"}, "2024-05-01T10:00:00Z")
    assert accepts({"format": "no-such-format"}, "anything")
    assert not accepts({"pattern": "("}, "x")  # a pattern Python cannot compile rejects
    assert not accepts({}, [1]) and not accepts({}, {"a": 1}) and not accepts({}, float("nan"))


def test_declared_types():
    assert declared_types({"type": ["integer", "null"]}) == ["integer", "null"]
    assert declared_types({"anyOf": [{"type": "string"}, {"$ref": "#/$defs/n"}], "$defs": {"n": {"type": "null"}}}) == [
        "string", "null",
    ]
    assert declared_types({"enum": ["a", 1, True]}) == ["string", "integer", "boolean"]
    assert declared_types({"description": "anything"}) == []
