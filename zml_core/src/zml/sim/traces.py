"""Readers for request traces: what arrives when, how large, sharing which prefix.

Replay (``zml sim replay``) drives a fleet with a real arrival process and real request sizes,
so the trace readers stream rows one at a time (a trace can be large), validate each, and stop
at the first malformed row with a :class:`TraceError` naming the file, the line and the field.
Three formats, chosen by :func:`detect_format` (extension, then the first row's keys):

``azure`` (CSV, the Azure LLM inference trace 2023)
    columns ``TIMESTAMP`` (``2023-11-16 18:15:46.6805900``), ``ContextTokens`` (prompt
    tokens), ``GeneratedTokens`` (completion tokens). Arrival times count from the first row.
``mooncake`` (JSON lines, the Mooncake FAST'25 traces)
    ``timestamp`` (ms from the trace's start), ``input_length``, ``output_length``,
    ``hash_ids`` (ids of the prompt's 512-token blocks; equal leading ids = shared prefix).
``zml`` (JSON lines, documented here and in docs/concepts/traces.md)
    ``arrival_ms`` (number, ms from the trace's start), ``prompt_tokens`` (int >= 1),
    ``output_tokens`` (int >= 1), optional ``prefix_blocks`` (list of ints or strings: ids of
    the prompt's 512-token blocks), optional ``model`` and ``policy`` (strings; the request's
    model and the policy to replay it under). Unknown keys are an error (a typo would
    otherwise be ignored silently).

Every format: rows must be in arrival order (non-decreasing times); token counts are integers
(``output`` of 0 is read as 1: a request always yields at least one token).
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from zml.errors import InvalidRequestError

__all__ = [
    "FORMATS",
    "Arrival",
    "TraceError",
    "TraceFormat",
    "detect_format",
    "read_trace",
    "scale_rate",
]

TraceFormat = Literal["azure", "mooncake", "zml"]
FORMATS: tuple[str, ...] = ("azure", "mooncake", "zml")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_ZML_KEYS = frozenset({"arrival_ms", "prompt_tokens", "output_tokens", "prefix_blocks", "model",
                       "policy"})


class TraceError(InvalidRequestError):
    """A trace file is missing, unreadable or has a malformed row.

    ``path``, ``line`` (1-based, None for the file as a whole) and ``field`` say where.
    """

    def __init__(self, message: str, *, path: str, line: int | None = None,
                 field: str | None = None) -> None:
        super().__init__(message, param=field)
        self.path = path
        self.line = line
        self.field = field


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of a trace."""

    index: int
    """Position in the trace (0-based, in arrival order)."""
    arrival_s: float
    """Arrival time in seconds from the trace's start."""
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int | str, ...] = ()
    """Ids of the prompt's 512-token blocks (empty when the trace has none)."""
    model: str | None = None
    policy: str | None = None


def _fail(path: str, line: int | None, field: str | None, problem: str) -> TraceError:
    where = f"{path}, line {line}" if line is not None else path
    what = f"field {field!r}: " if field else ""
    return TraceError(f"{where}: {what}{problem}", path=path, line=line, field=field)


def detect_format(path: str | os.PathLike[str]) -> TraceFormat:
    """The format of a trace file: ``.csv`` is azure; JSON lines are zml when the first row
    has ``arrival_ms``, else mooncake."""
    p = str(path)
    if p.lower().endswith(".csv"):
        return "azure"
    try:
        with open(p, encoding="utf-8") as f:
            for raw in f:
                if raw.strip():
                    try:
                        first = json.loads(raw)
                    except ValueError:
                        raise _fail(p, 1, None, "not a JSON object (expected JSON lines, or a "
                                    ".csv file in the Azure format)") from None
                    return "zml" if isinstance(first, dict) and "arrival_ms" in first else "mooncake"
    except OSError as exc:
        raise _fail(p, None, None, f"cannot read the trace ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise _not_utf8(p, exc) from None
    raise _fail(p, None, None, "the trace is empty")


def _not_utf8(path: str, exc: UnicodeDecodeError) -> TraceError:
    return _fail(path, None, None, f"not UTF-8 text (byte 0x{exc.object[exc.start]:02x} cannot "
                 "be decoded); a trace must be UTF-8 CSV or JSON lines: re-save it as UTF-8")


def read_trace(
    path: str | os.PathLike[str],
    *,
    format: TraceFormat | None = None,
    limit: int | None = None,
) -> Iterator[Arrival]:
    """Stream the requests of a trace file, at most ``limit`` of them.

    Raises :class:`TraceError` (when the generator is first advanced for a missing file, at
    the row for a malformed one).
    """
    p = str(path)
    if limit is not None and limit < 0:
        raise TraceError(f"limit must be >= 0, got {limit!r}", path=p, field="limit")
    _check_file(p)
    fmt = format or detect_format(p)
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; expected one of {', '.join(FORMATS)}",
                         path=p, field="format")
    rows = _azure(p) if fmt == "azure" else _jsonl(p, fmt)
    return _checked(p, rows, limit)


def _check_file(path: str) -> None:
    """Refuse a path that is not a trace file: missing, a directory, or not a regular file."""
    expected = "pass the path of a .csv (Azure) or .jsonl (Mooncake or zml) trace"
    try:
        target = Path(path)
        if target.is_file():
            return
        if target.is_dir():
            problem = f"is a directory, not a trace file; {expected} in it"
        elif target.exists():
            problem = f"is not a regular file; {expected}"
        else:
            problem = f"no such trace file; {expected}"
    except (OSError, ValueError) as exc:  # a name too long, a NUL character...
        problem = f"is not a usable path ({getattr(exc, 'strerror', None) or exc}); {expected}"
    raise _fail(path, None, None, problem)


def _checked(path: str, rows: Iterator[tuple[int, Arrival]], limit: int | None) -> Iterator[Arrival]:
    last = 0.0
    try:
        for count, (line, arrival) in enumerate(rows):
            if limit is not None and count >= limit:
                return
            if arrival.arrival_s < last:
                raise _fail(path, line, "arrival", f"time {arrival.arrival_s:.3f} s goes back "
                            f"before the previous row's {last:.3f} s; rows must be in arrival "
                            "order")
            last = arrival.arrival_s
            yield replace(arrival, index=count)
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc) from None


def _int(path: str, line: int, field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise _fail(path, line, field, f"expected an integer, got {value!r}")
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise _fail(path, line, field, f"expected an integer, got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int):
        raise _fail(path, line, field, f"expected an integer, got {value!r}")
    if value < minimum:
        raise _fail(path, line, field, f"must be >= {minimum}, got {value}")
    return value


def _time(path: str, line: int, field: str, value: Any) -> float:
    seconds = math.nan
    if not isinstance(value, bool) and isinstance(value, (int, float)):
        with contextlib.suppress(OverflowError):  # an int too large for a float
            seconds = float(value) / 1000.0
    if not math.isfinite(seconds):  # NaN and infinity too: a time that never comes
        shown = repr(value)
        raise _fail(path, line, field, "expected a finite number of milliseconds, got "
                    + (shown if len(shown) <= 40 else shown[:37] + "..."))
    if seconds < 0:
        raise _fail(path, line, field, f"must be >= 0, got {value}")
    return seconds


def _timestamp(path: str, line: int, value: str) -> float:
    """Seconds since the epoch of ``2023-11-16 18:15:46.6805900`` (any number of decimals)."""
    text = value.strip()
    base, _, fraction = text.partition(".")
    try:
        moment = _dt.datetime.strptime(base, "%Y-%m-%d %H:%M:%S").replace(tzinfo=_dt.timezone.utc)
        extra = float("0." + fraction) if fraction else 0.0
        if fraction and not fraction.isdigit():
            raise ValueError
    except ValueError:
        raise _fail(path, line, "TIMESTAMP", f"expected a time like '2023-11-16 18:15:46.68', "
                    f"got {value!r}") from None
    return moment.timestamp() + extra


def _azure(path: str) -> Iterator[tuple[int, Arrival]]:
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise _fail(path, None, None, "the trace is empty")
        names = [h.strip() for h in header]
        missing = [c for c in _AZURE_COLUMNS if c not in names]
        if missing:
            raise _fail(path, 1, missing[0], f"missing column (the Azure format has columns "
                        f"{', '.join(_AZURE_COLUMNS)})")
        at = [names.index(c) for c in _AZURE_COLUMNS]
        width = max(at) + 1
        start: float | None = None
        for row in reader:
            line = reader.line_num
            if not row or not any(cell.strip() for cell in row):
                continue
            if len(row) < width:
                field = _AZURE_COLUMNS[[i >= len(row) for i in at].index(True)]
                raise _fail(path, line, field, "missing value")
            if len(row) > len(names):  # a value in no column: the row is not what it seems
                raise _fail(path, line, None, f"has {len(row)} values but the header names "
                            f"{len(names)} columns (a comma inside a value must be quoted)")
            t = _timestamp(path, line, row[at[0]])
            if start is None:
                start = t
            prompt = _int(path, line, "ContextTokens", row[at[1]], 1)
            output = _int(path, line, "GeneratedTokens", row[at[2]], 0)
            yield line, Arrival(0, t - start, prompt, max(1, output))


def _blocks(path: str, line: int, field: str, value: Any) -> tuple[int | str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(b, (int, str)) and not isinstance(b, bool) for b in value
    ):
        raise _fail(path, line, field, "expected a list of block ids (integers or strings)")
    return tuple(value)


def _jsonl(path: str, fmt: str) -> Iterator[tuple[int, Arrival]]:
    with open(path, encoding="utf-8") as f:
        for line, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _fail(path, line, None, f"not valid JSON ({exc.msg})") from None
            except ValueError as exc:
                raise _fail(path, line, None, f"not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise _fail(path, line, None, "expected a JSON object")
            yield line, (_mooncake_row(path, line, row) if fmt == "mooncake"
                         else _zml_row(path, line, row))


def _need(path: str, line: int, row: dict[str, Any], key: str) -> Any:
    if key not in row:
        raise _fail(path, line, key, "missing")
    return row[key]


def _mooncake_row(path: str, line: int, row: dict[str, Any]) -> Arrival:
    t = _time(path, line, "timestamp", _need(path, line, row, "timestamp"))
    prompt = _int(path, line, "input_length", _need(path, line, row, "input_length"), 1)
    output = _int(path, line, "output_length", _need(path, line, row, "output_length"), 0)
    blocks = _blocks(path, line, "hash_ids", row.get("hash_ids", []))
    return Arrival(0, t, prompt, max(1, output), blocks)


def _zml_row(path: str, line: int, row: dict[str, Any]) -> Arrival:
    unknown = sorted(set(row) - _ZML_KEYS)
    if unknown:
        raise _fail(path, line, unknown[0], "unknown key; the zml format has arrival_ms, "
                    "prompt_tokens, output_tokens, prefix_blocks, model, policy")
    t = _time(path, line, "arrival_ms", _need(path, line, row, "arrival_ms"))
    prompt = _int(path, line, "prompt_tokens", _need(path, line, row, "prompt_tokens"), 1)
    output = _int(path, line, "output_tokens", _need(path, line, row, "output_tokens"), 1)
    blocks = _blocks(path, line, "prefix_blocks", row.get("prefix_blocks", []))
    names: list[str | None] = []
    for key in ("model", "policy"):
        value = row.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise _fail(path, line, key, f"expected a non-empty string, got {value!r}")
        names.append(value)
    return Arrival(0, t, prompt, output, blocks, names[0], names[1])


def scale_rate(arrivals: Iterable[Arrival], factor: float) -> Iterator[Arrival]:
    """The arrivals ``factor`` times as fast (2.0: the trace replayed in half the time)."""
    if not factor > 0 or factor != factor or factor == float("inf"):
        raise InvalidRequestError(f"rate scale must be a number > 0, got {factor!r}",
                                  param="rate_scale")
    if factor == 1.0:
        yield from arrivals
        return
    for a in arrivals:
        yield replace(a, arrival_s=a.arrival_s / factor)
