"""``zml.transport.StreamDecoder``: SSE payloads in, chunk dicts and integrity checks out.

Pure: no sockets, no clock. The stream layers (sync and async) rely on exactly these rules:
``[DONE]`` ends a stream, a finish_reason without ``[DONE]`` is complete when the connection
then closes, anything else is an IncompleteStreamError carrying what was received.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

import zml
from zml.transport import StreamDecoder


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
    assert all(isinstance(o, dict) for o in out)
    assert out[1] is not None and out[1]["choices"][0]["delta"]["content"] == "Hello"
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
    d.feed(json.dumps({"choices": None}))
    d.feed(json.dumps({"id": "x"}))
    assert d.chunks == 4 and d.text == "" and d.finish_reason is None
