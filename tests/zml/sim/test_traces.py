"""Trace readers: the three formats, streaming with a limit, rate scaling, and clear errors."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from zml.errors import InvalidRequestError, ZMLError
from zml.sim.traces import TraceError, detect_format, read_trace, scale_rate

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
AZURE = FIXTURES / "azure-conv-300.csv"
MOONCAKE = FIXTURES / "mooncake-conv-300.jsonl"
ZML = FIXTURES / "zml-sample.jsonl"


def test_azure_csv():
    rows = list(read_trace(AZURE))
    assert len(rows) == 300 and detect_format(AZURE) == "azure"
    first, second = rows[0], rows[1]
    assert (first.arrival_s, first.prompt_tokens, first.output_tokens) == (0.0, 374, 44)
    assert second.arrival_s == pytest.approx(50.9951690 - 46.6805900)
    assert (second.prompt_tokens, second.output_tokens, second.blocks) == (396, 109, ())
    assert [r.index for r in rows[:3]] == [0, 1, 2]
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(rows))


def test_mooncake_jsonl_keeps_the_block_hashes():
    rows = list(read_trace(MOONCAKE))
    assert len(rows) == 300 and detect_format(MOONCAKE) == "mooncake"
    assert (rows[0].arrival_s, rows[0].prompt_tokens, rows[0].output_tokens) == (0.0, 6758, 500)
    assert rows[0].blocks == tuple(range(14))
    assert rows[1].blocks[0] == 0  # the shared first block of the conversation trace


def test_zml_jsonl(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"arrival_ms": 0, "prompt_tokens": 10, "output_tokens": 2}\n\n'
        '{"arrival_ms": 1500.5, "prompt_tokens": 700, "output_tokens": 1, '
        '"prefix_blocks": ["a", 7], "model": "m2", "policy": "fast"}\n'
    )
    a, b = read_trace(path)
    assert detect_format(path) == "zml"
    assert (a.arrival_s, a.prompt_tokens, a.output_tokens, a.model, a.policy) == (0.0, 10, 2, None, None)
    assert (b.arrival_s, b.blocks, b.model, b.policy) == (1.5005, ("a", 7), "m2", "fast")
    assert len(list(read_trace(ZML))) == 200


def test_limit_and_rate_scale():
    rows = list(read_trace(AZURE, limit=10))
    assert len(rows) == 10
    faster = list(scale_rate(rows, 2.0))
    assert [f.arrival_s for f in faster] == pytest.approx([r.arrival_s / 2 for r in rows])
    with pytest.raises(InvalidRequestError):
        list(scale_rate(rows, 0))
    with pytest.raises(InvalidRequestError):
        list(scale_rate(rows, -1))


@pytest.mark.parametrize(
    ("name", "text", "line", "field"),
    [
        ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3\n"
         "2023-11-16 18:15:47.00,twelve,3\n", 3, "ContextTokens"),
        ("b.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", 2, "TIMESTAMP"),
        ("c.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,12\n", 1, "GeneratedTokens"),
        ("d.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,-1\n", 2,
         "GeneratedTokens"),
        ("e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.00,12,3\n"
         "2023-11-16 18:15:46.00,12,3\n", 3, "arrival"),
        ("f.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
         '{"timestamp": 9, "output_length": 1}\n', 2, "input_length"),
        ("g.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": "x"}\n',
         1, "hash_ids"),
        ("h.jsonl", '{"arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 1}\n{oops\n', 2, None),
        ("i.jsonl", '{"arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 1, "promt": 3}\n', 1,
         "promt"),
        ("j.jsonl", '{"arrival_ms": "soon", "prompt_tokens": 5, "output_tokens": 1}\n', 1,
         "arrival_ms"),
        ("k.jsonl", '{"arrival_ms": 0, "prompt_tokens": 0, "output_tokens": 1}\n', 1,
         "prompt_tokens"),
        # a time that never comes: replayed, it crashed, dropped a request or never ended
        ("l.jsonl", '{"arrival_ms": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
         '{"arrival_ms": Infinity, "prompt_tokens": 5, "output_tokens": 1}\n', 2, "arrival_ms"),
        ("m.jsonl", '{"timestamp": 1e400, "input_length": 5, "output_length": 1}\n', 1,
         "timestamp"),
        ("o.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,3,9\n",
         2, None),
        ("n.jsonl", '{"arrival_ms": 1' + "0" * 400 + ', "prompt_tokens": 5, '
         '"output_tokens": 1}\n', 1, "arrival_ms"),
    ],
)
def test_a_malformed_row_names_file_line_and_field(tmp_path, name, text, line, field):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        list(read_trace(path))
    error = info.value
    assert isinstance(error, ZMLError) and isinstance(error, InvalidRequestError)
    assert (error.path, error.line, error.field) == (str(path), line, field)
    assert str(path) in str(error) and f"line {line}" in str(error)
    if field:
        assert repr(field) in str(error)


def test_a_missing_or_empty_file_is_a_clear_error(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        read_trace(tmp_path / "missing.csv")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(TraceError, match="empty"):
        read_trace(empty)


@pytest.mark.parametrize("name", ["t.csv", "t.jsonl"])
def test_a_trace_that_is_not_utf8_is_one_trace_error(tmp_path, name):
    path = tmp_path / name
    head = b"TIMESTAMP,ContextTokens,GeneratedTokens\n" if name.endswith(".csv") else b""
    path.write_bytes(head + b'{"arrival_ms": 1, "x": "\xff"}\n')
    with pytest.raises(TraceError, match="not UTF-8 text"):
        list(read_trace(path))
