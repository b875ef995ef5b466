"""Streamed answers on the wire: SSE framing, chunk decoding and the stream's integrity rules.

Pure (no I/O, no clock): the stream layers in :mod:`zml.streaming` feed the body's bytes to an
:class:`EventSplitter` and each event's data to a :class:`StreamDecoder`, which returns the
chunk objects the caller receives.

Why not httpx2's ``EventSource`` or ``aiter_lines``: both decode the body to text first, and
``aiter_lines`` splits on every Unicode line break (U+2028 may appear raw in JSON strings,
and would cut an event in two). SSE lines end only at CR, LF or CRLF, and the data is UTF-8,
so the splitter works on bytes and hands each event's data to the JSON parser as is: one
split per read and one parse per event, no text decoding, no per-line object. The parser is
pydantic-core's ``from_json`` (already a dependency, about three times faster than ``json``),
whose depth limit turns absurdly nested JSON into an error rather than a ``RecursionError``.

Limits: one event (its data lines, each counted with the line feed that joins it to the next,
or a line still waiting for its end) may hold at most :data:`MAX_EVENT_BYTES`, so that even
empty ``data:`` lines cannot pile up without bound; JSON nested deeper than pydantic-core's limit (about 200 levels) is
refused. Both raise :class:`~zml.errors.NodeProtocolError` naming the node.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import from_json

from .errors import IncompleteStreamError, NodeProtocolError, safe_detail
from .types import ChatCompletionChunk, MalformedChunk, RoutingInfo, Usage, build_chunk

__all__ = ["MAX_EVENT_BYTES", "EventSplitter", "StreamDecoder"]

MAX_EVENT_BYTES = 1024 * 1024
"""The largest SSE event (or unterminated line) accepted from a node, as httpx2's default."""

_DONE = b"[DONE]"
_NO_EVENTS: list[bytes] = []


class EventSplitter:
    """Splits a byte stream into the data of its SSE events (the ``data:`` fields, joined).

    Follows the WHATWG event-stream rules: lines end at CRLF, LF or CR; a blank line
    dispatches the event; ``:`` starts a comment (keep-alives); fields other than ``data``
    (``event``, ``id``, ``retry``) are ignored, as OpenAI-style clients do; an event the
    stream ends in the middle of is dropped. Feed it each read's bytes with :meth:`feed`.
    """

    __slots__ = ("_cr", "_data", "_held", "_parts", "_size", "node_id")

    def __init__(self, node_id: str) -> None:
        self.node_id: str = node_id
        self._parts: list[bytes] = []  # the start of a line whose end has not arrived
        self._data: list[bytes] = []  # the data lines of the event being received
        self._size = 0  # bytes in _data, plus one per line (the line feeds joining them)
        self._held = 0  # bytes in _parts
        self._cr = False  # the last read ended with CR (its LF may start the next one)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data of every event completed by ``chunk`` (often none or one)."""
        if self._cr:
            self._cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if b"\r" in chunk:
            if chunk[-1:] == b"\r":
                self._cr = True
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        parts = self._parts
        if b"\n" not in chunk:
            if chunk:
                parts.append(chunk)
                self._held += len(chunk)
                if self._held + self._size > MAX_EVENT_BYTES:
                    raise self._too_big()
            return _NO_EVENTS
        lines = chunk.split(b"\n")
        if parts:
            parts.append(lines[0])
            lines[0] = b"".join(parts)
            parts.clear()
            self._held = 0
        tail = lines.pop()
        out: list[bytes] | None = None
        data = self._data
        for line in lines:
            if not line:
                if data:
                    if out is None:
                        out = []
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
                    self._size = 0
            elif line.startswith(b"data:"):
                value = line[5:]
                if value[:1] == b" ":
                    value = value[1:]
                data.append(value)
                self._size += len(value) + 1
                if self._size > MAX_EVENT_BYTES:
                    raise self._too_big()
            elif line == b"data":
                data.append(b"")
                self._size += 1
                if self._size > MAX_EVENT_BYTES:
                    raise self._too_big()
            # comments (":" keep-alives) and the other fields are ignored
        if tail:
            parts.append(tail)
            self._held = len(tail)
            if self._held + self._size > MAX_EVENT_BYTES:
                raise self._too_big()
        return _NO_EVENTS if out is None else out

    def _too_big(self) -> NodeProtocolError:
        return NodeProtocolError(
            f"node {self.node_id!r} sent a stream event larger than {MAX_EVENT_BYTES} bytes",
            node_id=self.node_id,
        )


class StreamDecoder:
    """Turns SSE event data into :class:`~zml.types.ChatCompletionChunk` objects and checks the
    stream's integrity.

    Pure: feed it each event's data with :meth:`feed`; call :meth:`finish` when the connection
    ends. A stream is complete only when ``[DONE]`` arrived, or every choice that appeared (by
    ``index``: one, or ``n`` of them) got a ``finish_reason`` and the connection then closed
    normally; anything else raises :class:`IncompleteStreamError`.
    Every event is parsed once and checked while its chunk is built: an event that is not a
    chunk (bad JSON, a shape that is not OpenAI's, wrong types) raises
    :class:`NodeProtocolError` naming the node and what was wrong.

    ``progressed`` says whether a chunk carried progress: content, a tool call, a refusal or
    any other non-empty delta field (reasoning), a ``finish_reason`` or usage. A role-only
    or empty delta is not progress: the first-token timeout waits for progress.
    """

    __slots__ = ("_choices", "_zero", "_zero_reason", "chunks", "done", "finish_reason", "last",
                 "node_id", "parts", "progressed", "routing", "usage")

    def __init__(self, node_id: str, routing: RoutingInfo | None = None) -> None:
        self.node_id: str = node_id
        self.routing: RoutingInfo | None = routing
        self.chunks: int = 0
        self.done: bool = False
        self.progressed: bool = False
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.last: ChatCompletionChunk | None = None
        self.parts: list[str] = []
        self._zero = 0  # the choice of index 0: 0 not seen, 1 seen, 2 finished
        self._zero_reason: str | None = None
        self._choices: dict[int, str | None] | None = None  # the others: each one's reason

    @property
    def text(self) -> str:
        """The content received so far: the first choice's (index 0), as
        ``response.choices[0].message.content`` is; with ``n`` > 1 the others' content is in
        the chunks (it was interleaved into this text)."""
        return "".join(self.parts)

    def feed(self, data: bytes | str) -> ChatCompletionChunk | None:
        """One event's data: its chunk, or None for ``[DONE]`` (after which nothing counts)."""
        if data == _DONE or data == "[DONE]":
            self.done = True
            return None
        try:
            obj = from_json(data)
        except ValueError as exc:
            if data.strip() == (_DONE if isinstance(data, bytes) else "[DONE]"):
                self.done = True  # with spaces around: the end all the same (openai-python's)
                return None
            raise self._malformed(data, exc) from None
        if type(obj) is not dict:
            raise NodeProtocolError(
                f"node {self.node_id!r} sent a stream event that is not an object: "
                f"{_show(data)}",
                node_id=self.node_id,
            )
        if "error" in obj and "choices" not in obj:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise NodeProtocolError(
                f"node {self.node_id!r} reported an error mid-stream: "
                f"{safe_detail(str(msg), 300)}",
                node_id=self.node_id,
            )
        try:
            chunk = build_chunk(obj, self.routing)  # type: ignore[arg-type]
        except MalformedChunk as exc:
            raise NodeProtocolError(
                f"node {self.node_id!r} sent a chunk that is not a chat.completion.chunk "
                f"after {self.chunks} chunks: {exc}",
                node_id=self.node_id,
            ) from None
        self.chunks += 1
        for choice in chunk.choices:
            content = choice.delta.content
            if content and not choice.index:
                self.parts.append(content)
            reason = choice.finish_reason
            if reason:
                self.finish_reason = reason
            index = choice.index
            if index:  # n > 1 (rare): the other choices are followed one by one
                self._other(index, reason)
            elif reason:
                self._zero = 2
                self._zero_reason = reason
            elif not self._zero:
                self._zero = 1
        if chunk.usage is not None:
            self.usage = chunk.usage
        if not self.progressed:
            self.progressed = _progress(obj)
        self.last = chunk
        return chunk

    def _other(self, index: int, reason: str | None) -> None:
        choices = self._choices
        if choices is None:
            choices = self._choices = {}
        choices[index] = reason or choices.get(index)

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        """Each choice's finish_reason so far, in index order (the choices that got one)."""
        reasons = [] if self._zero_reason is None else [self._zero_reason]
        if self._choices:
            reasons.extend(r for _, r in sorted(self._choices.items()) if r)
        return tuple(reasons)

    @property
    def finished(self) -> bool:
        """Whether every choice that appeared (by index) has a finish_reason; with one choice,
        whether a finish_reason arrived."""
        choices = self._choices
        if choices is None:
            return self.finish_reason is not None
        return self._zero != 1 and all(choices.values())

    def _malformed(self, data: bytes | str, exc: ValueError) -> NodeProtocolError:
        why = "nested too deeply" if "recursion" in str(exc) else "malformed"
        return NodeProtocolError(
            f"node {self.node_id!r} sent a {why} stream event after {self.chunks} chunks: "
            f"{_show(data)}",
            node_id=self.node_id,
        )

    def incomplete(self, why: str) -> IncompleteStreamError:
        """The error for a stream that broke off, carrying what was received."""
        return IncompleteStreamError(
            f"stream from node {self.node_id!r} ended early ({why}) after {self.chunks} chunks "
            f"and {len(self.text)} characters; the answer is incomplete",
            text=self.text,
            chunks=self.chunks,
            node_id=self.node_id,
        )

    def finish(self) -> None:
        """The connection ended: raise if the stream is not complete."""
        if not self.done and not self.finished:
            why = "no [DONE] and no finish_reason" if self.finish_reason is None \
                else "no [DONE], and a choice without its finish_reason"
            raise self.incomplete(why)


def _progress(obj: dict[str, Any]) -> bool:
    """Whether a (well-formed) chunk's JSON carries progress (see :class:`StreamDecoder`)."""
    if obj.get("usage"):
        return True
    for choice in obj["choices"]:
        if choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if delta and any(value for key, value in delta.items() if key != "role"):
            return True
    return False


def _show(data: bytes | str) -> str:
    """The start of a node's event, fit for a message (:func:`~zml.errors.safe_detail`)."""
    text = data[:400].decode(errors="replace") if isinstance(data, bytes) else data[:400]
    return safe_detail(repr(text[:200]), 300)
