"""``zml.sse.StreamDecoder``: SSE payloads in, chunk objects and integrity checks out.

Pure: no sockets, no clock. The stream layers (sync and async) rely on exactly these rules:
``[DONE]`` ends a stream, a finish_reason without ``[DONE]`` is complete when the connection
then closes, anything else is an IncompleteStreamError carrying what was received.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import zml
from zml.sse import MAX_EVENT_BYTES, EventSplitter, StreamDecoder


def chunk(content: str | None = None, *, finish: str | None = None, role: str | None = None,
          tool_args: str | None = None, usage: dict[str, int] | None = None) -> str:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if tool_args is not None:
        delta["tool_calls"] = [{"index": 0, "function": {"arguments": tool_args}}]
    data: dict[str, Any] = {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [] if usage is not None else [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        ],
    }
    if usage is not None:
        data["usage"] = usage
    return json.dumps(data)


def test_done_ends_the_stream_and_text_accumulates() -> None:
    d = StreamDecoder("n1")
    events = [chunk("", role="assistant"), chunk("Hello"), chunk(", "), chunk("world"),
              chunk(finish="stop"), chunk(usage={"prompt_tokens": 1, "completion_tokens": 3,
                                                 "total_tokens": 4})]
    out = [d.feed(e) for e in events]
    assert all(isinstance(o, zml.ChatCompletionChunk) for o in out)
    assert out[1] is not None and out[1].choices[0].delta.content == "Hello"
    assert d.text == "Hello, world"
    assert d.chunks == len(events)
    assert d.finish_reason == "stop"
    assert not d.done
    assert d.feed("[DONE]") is None
    assert d.done
    assert d.chunks == len(events)  # [DONE] is not a chunk
    d.finish()  # complete: does not raise


def test_done_without_finish_reason_is_complete() -> None:
    d = StreamDecoder("n1")
    d.feed(chunk("a"))
    d.feed("[DONE]")
    d.finish()
    assert d.finish_reason is None and d.text == "a"


def test_finish_reason_without_done_is_complete_on_close() -> None:
    d = StreamDecoder("n1")
    d.feed(chunk("x"))
    d.feed(chunk(finish="length"))
    assert not d.done
    d.finish()
    assert d.finish_reason == "length"


def test_stream_cut_short_is_incomplete_with_what_was_received() -> None:
    d = StreamDecoder("node-7")
    d.feed(chunk("", role="assistant"))
    d.feed(chunk("partial "))
    d.feed(chunk("answer"))
    with pytest.raises(zml.IncompleteStreamError) as info:
        d.finish()
    err = info.value
    assert isinstance(err, zml.NodeProtocolError) and isinstance(err, zml.NodeError)
    assert err.text == "partial answer"
    assert err.chunks == 3
    assert err.node_id == "node-7"
    assert not err.retryable
    assert err.kind == "incomplete_stream"
    assert "node-7" in str(err) and "3 chunks" in str(err)


def test_incomplete_builds_the_error_without_raising() -> None:
    d = StreamDecoder("n1")
    d.feed(chunk("abc"))
    err = d.incomplete("idle timeout")
    assert isinstance(err, zml.IncompleteStreamError)
    assert "idle timeout" in str(err)
    assert (err.text, err.chunks, err.node_id) == ("abc", 1, "n1")
    fresh = StreamDecoder("n2").incomplete("connection reset")
    assert (fresh.text, fresh.chunks) == ("", 0)


def test_empty_stream_is_incomplete() -> None:
    with pytest.raises(zml.IncompleteStreamError) as info:
        StreamDecoder("n1").finish()
    assert info.value.chunks == 0 and info.value.text == ""


@pytest.mark.parametrize("data", ['{"choices": [', "not json", '{"content": "unterminated\n'])
def test_malformed_json_is_a_protocol_error(data: str) -> None:
    d = StreamDecoder("n1")
    d.feed(chunk("ok"))
    with pytest.raises(zml.NodeProtocolError) as info:
        d.feed(data)
    assert not isinstance(info.value, zml.IncompleteStreamError)
    assert info.value.node_id == "n1"
    assert "malformed" in str(info.value) and "after 1 chunks" in str(info.value)
    assert d.chunks == 1 and d.text == "ok"


@pytest.mark.parametrize("data", ["[1, 2]", '"text"', "42", "null"])
def test_event_that_is_not_an_object_is_a_protocol_error(data: str) -> None:
    with pytest.raises(zml.NodeProtocolError, match="not an object"):
        StreamDecoder("n1").feed(data)


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        ({"error": {"message": "CUDA out of memory", "type": "server_error"}},
         "CUDA out of memory"),
        ({"error": "engine died"}, "engine died"),
        ({"object": "error", "error": {"code": 500}}, "mid-stream"),
    ],
)
def test_error_events_are_protocol_errors(event: dict[str, Any], fragment: str) -> None:
    d = StreamDecoder("n1")
    d.feed(chunk("so far"))
    with pytest.raises(zml.NodeProtocolError) as info:
        d.feed(json.dumps(event))
    assert fragment in str(info.value)
    assert info.value.node_id == "n1"
    assert d.chunks == 1


def choices(*choices: tuple[int, str | None, str | None]) -> str:
    """A chunk of several choices, each ``(index, content, finish_reason)`` (``n > 1``)."""
    return json.dumps({
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": i, "delta": {} if text is None else {"content": text},
                     "finish_reason": finish} for i, text, finish in choices],
    })


def test_with_n_choices_every_choice_that_appeared_must_finish() -> None:
    d = StreamDecoder("n1")
    d.feed(choices((0, "a", None), (1, "b", None)))
    d.feed(choices((0, None, "stop")))
    d.feed(choices((1, "cut", None)))
    with pytest.raises(zml.IncompleteStreamError, match="a choice without its finish_reason") \
            as info:
        d.finish()  # choice 1 was cut off: not complete, however choice 0 ended
    assert info.value.text == "a"  # the first choice's, not "abcut" (every choice's tokens)
    d.feed(choices((1, None, "length")))
    d.finish()  # now both ended
    late = StreamDecoder("n1")  # choice 0 left unfinished, one chunk per choice
    late.feed(choices((0, "a", None)))
    late.feed(choices((1, "b", "stop")))
    with pytest.raises(zml.IncompleteStreamError):
        late.finish()
    done = StreamDecoder("n1")  # [DONE] completes a stream, whatever its choices say
    done.feed(choices((0, "a", None), (2, "b", None)))
    done.feed("[DONE]")
    done.finish()


def test_choices_that_never_appeared_are_not_waited_for() -> None:
    d = StreamDecoder("n1")
    d.feed(choices((1, "only", "stop")))  # a lone choice of index 1
    d.finish()
    assert d.finish_reason == "stop" and d.finished


@pytest.mark.parametrize(
    "event",
    [
        {"error": {"message": "upstream refused authorization: Bearer sk-LEAKED-123"}},
        {"error": "bad key x-api-key: sk-LEAKED-123 from http://bob:sk-LEAKED-123@h/"},
    ],
)
def test_node_text_in_error_events_is_redacted(event: dict[str, Any]) -> None:
    with pytest.raises(zml.NodeProtocolError) as info:
        StreamDecoder("n1").feed(json.dumps(event))
    assert "sk-LEAKED-123" not in str(info.value) and "[redacted]" in str(info.value)


@pytest.mark.parametrize("data", ["not json, echoing authorization: Bearer sk-LEAKED-123",
                                  '["authorization: Bearer sk-LEAKED-123"]',
                                  b"x-api-key: sk-LEAKED-123\n{"])
def test_node_text_in_bad_events_is_redacted(data: str | bytes) -> None:
    with pytest.raises(zml.NodeProtocolError) as info:
        StreamDecoder("n1").feed(data)
    assert "sk-LEAKED-123" not in str(info.value) and "redacted" in str(info.value)
    assert "\n" not in str(info.value)


def test_tool_call_deltas_are_chunks_but_not_text() -> None:
    d = StreamDecoder("n1")
    d.feed(chunk(role="assistant"))
    d.feed(chunk(tool_args='{"city": '))
    d.feed(chunk(tool_args='"Paris"}'))
    d.feed(chunk(finish="tool_calls"))
    d.feed("[DONE]")
    d.finish()
    assert d.text == ""
    assert d.chunks == 4
    assert d.finish_reason == "tool_calls"


def test_null_and_missing_fields_are_tolerated() -> None:
    d = StreamDecoder("n1")
    d.feed(json.dumps({"choices": [{"index": 0, "delta": {"content": None}}]}))
    d.feed(json.dumps({"choices": [{"index": 0, "delta": None, "finish_reason": None}]}))
    d.feed(json.dumps({"choices": []}))
    d.feed(json.dumps({"id": "x", "choices": [], "usage": None}))
    assert d.chunks == 4 and d.text == "" and d.finish_reason is None
    assert not d.progressed


@pytest.mark.parametrize(
    ("event", "fragment"),
    [
        ({"choices": "abc"}, "choices is str 'abc', expected a list"),
        ({}, "no 'choices'"),
        ({"choices": None}, "choices is null, expected a list"),
        ({"choices": [5]}, "choices[0] is int"),
        ({"choices": [{"delta": "x"}]}, "choices[0].delta is str"),
        ({"choices": [{"delta": {"content": 5}}]}, "choices[0].delta.content is int"),
        ({"choices": [{"delta": {"role": []}}]}, "choices[0].delta.role is list"),
        ({"choices": [], "usage": [1]}, "usage is list"),
        ({"choices": [], "usage": {"total_tokens": "3"}}, "usage.total_tokens is str"),
        ({"choices": [{"delta": {"tool_calls": "zz"}}]}, "tool_calls is str"),
        ({"choices": [{"delta": {"tool_calls": [1]}}]}, "tool_calls[0] is int"),
        ({"choices": [{"delta": {"tool_calls": [{"function": "f"}]}}]}, ".function is str"),
        ({"choices": [{"delta": {"tool_calls": [{"function": {"arguments": 1}}]}}]},
         ".function.arguments is int"),
        ({"choices": [{"delta": {}, "finish_reason": 1}]}, "finish_reason is int"),
        ({"choices": [{"delta": {}, "index": "0"}]}, "choices[0].index is str"),
        ({"choices": [], "id": 7}, "id is int"),
        ({"choices": [], "model": None}, "model is null"),
        ({"choices": [], "created": 1.5}, "created is float"),
    ],
)
def test_hostile_shapes_are_protocol_errors_naming_the_node(event: Any, fragment: str) -> None:
    d = StreamDecoder("evil")
    d.feed(chunk("ok"))
    with pytest.raises(zml.NodeProtocolError) as info:
        d.feed(json.dumps(event))
    assert not isinstance(info.value, zml.IncompleteStreamError)
    assert info.value.node_id == "evil" and "'evil'" in str(info.value)
    assert fragment in str(info.value), str(info.value)
    assert d.chunks == 1


@pytest.mark.parametrize("data", ["[5]", "[" * 100_000 + "]" * 100_000,
                                  '{"choices": ' + "[" * 5000 + "]" * 5000 + "}"])
def test_arrays_and_deep_nesting_are_protocol_errors(data: str) -> None:
    with pytest.raises(zml.NodeProtocolError) as info:
        StreamDecoder("n1").feed(data)
    assert info.value.node_id == "n1"


def test_bytes_payloads_and_invalid_utf8() -> None:
    d = StreamDecoder("n1")
    out = d.feed(chunk("héllo").encode())
    assert out is not None and out.choices[0].delta.content == "héllo"
    assert d.feed(b"[DONE]") is None and d.done
    with pytest.raises(zml.NodeProtocolError, match="malformed"):
        StreamDecoder("n1").feed(b'{"choices": [], "id": "' + b"\xff" + b'"}')


def test_extra_fields_are_kept_and_reasoning_counts_as_progress() -> None:
    d = StreamDecoder("n1")
    c = d.feed(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""}}],
                           "system_fingerprint": "fp"}))
    assert c is not None and not d.progressed  # a role chunk is not a token
    assert c.model_dump()["system_fingerprint"] == "fp"
    c = d.feed(json.dumps({"choices": [{"index": 0, "stop_reason": None,
                                        "delta": {"reasoning_content": "hmm"}}]}))
    assert c is not None and d.progressed
    assert c.choices[0].delta.reasoning_content == "hmm"  # type: ignore[attr-defined]
    assert c.choices[0].model_dump()["stop_reason"] is None


# --- zml.sse.EventSplitter: bytes in, event data out -----------------------------------------


def split_all(pieces: list[bytes]) -> list[bytes]:
    s = EventSplitter("n1")
    out: list[bytes] = []
    for piece in pieces:
        out += s.feed(piece)
    return out


STREAM = (b": keep-alive\n\ndata: {\"a\": 1}\n\nevent: message\nid: 7\ndata: first\ndata: second"
          b"\n\nretry: 10\n\ndata:no-space\n\ndata\n\ndata: [DONE]\n\n")
EXPECTED = [b'{"a": 1}', b"first\nsecond", b"no-space", b"", b"[DONE]"]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_splitter_follows_the_event_stream_rules(newline: bytes) -> None:
    data = STREAM.replace(b"\n", newline)
    assert split_all([data]) == EXPECTED
    assert split_all([data[i:i + 1] for i in range(len(data))]) == EXPECTED  # byte by byte
    assert split_all([data[i:i + 7] for i in range(0, len(data), 7)]) == EXPECTED


def test_splitter_keeps_unicode_line_separators_inside_json() -> None:
    payload = json.dumps({"choices": [{"delta": {"content": "a\u2028b\x85c"}}]},
                         ensure_ascii=False).encode()
    assert split_all([b"data: " + payload + b"\n\n"]) == [payload]


def test_splitter_drops_an_unterminated_event_and_bounds_sizes() -> None:
    assert split_all([b"data: {}\n\ndata: cut"]) == [b"{}"]
    s = EventSplitter("big")
    s.feed(b"data: ")
    with pytest.raises(zml.NodeProtocolError, match="larger than") as info:
        for _ in range(MAX_EVENT_BYTES // 65536 + 2):
            s.feed(b"x" * 65536)  # one endless line
    assert info.value.node_id == "big"
    s = EventSplitter("big")
    with pytest.raises(zml.NodeProtocolError, match="larger than"):
        for _ in range(MAX_EVENT_BYTES // 60000 + 2):
            s.feed(b"data: " + b"y" * 60000 + b"\n")  # many data lines, never dispatched


@pytest.mark.parametrize("line", [b"data:\n", b"data: \n", b"data\n"])
def test_empty_data_lines_count_against_the_event_limit(line: bytes) -> None:
    s = EventSplitter("big")
    block = line * 65536
    with pytest.raises(zml.NodeProtocolError, match="larger than") as info:
        for _ in range(MAX_EVENT_BYTES // 65536 + 2):
            s.feed(block)  # an event of nothing but empty lines, never dispatched
    assert info.value.node_id == "big"
    ok = EventSplitter("ok")  # just below the limit, counting the joining line feeds
    half = MAX_EVENT_BYTES // 2
    assert ok.feed(b"data: " + b"a" * (half - 1) + b"\ndata: " + b"b" * (half - 1)
                   + b"\n\n") == [b"a" * (half - 1) + b"\n" + b"b" * (half - 1)]


@pytest.mark.parametrize("done", ["[DONE] ", " [DONE]", b"[DONE]\r", b" [DONE] "])
def test_done_with_spaces_around_ends_the_stream_as_openai_python_reads_it(
        done: str | bytes) -> None:
    """It was taken for a malformed chunk (a NodeProtocolError), where openai-python ends the
    stream."""
    d = StreamDecoder("n1")
    d.feed(json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                       "choices": [{"index": 0, "delta": {"content": "a"},
                                    "finish_reason": "stop"}]}))
    assert d.feed(done) is None and d.done
    d.finish()
    assert d.text == "a"
