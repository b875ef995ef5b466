"""Streaming on real loopback sockets: OpenAI chunk shape, routing metadata, usage, tool calls.

Both clients: the sync ``Client.infer_stream`` returns a stream already dispatched
(``stream.routing`` set on return); the async one dispatches on first iteration and every
chunk carries ``routing``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import PROD, fleet_fixture, run_client, settled, two_family_nodes

MSGS = [{"role": "user", "content": "Tell me about tensor parallelism"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


setup = fleet_fixture(two_family_nodes(), {"prod": PROD}, 0.05)


def check_stream(chunks: list[zml.ChatCompletionChunk], text: str, routing: Any) -> None:
    """The OpenAI chunk sequence: role first, content deltas, finish_reason, usage last."""
    assert len(chunks) >= 4
    for c in chunks:
        assert isinstance(c, zml.ChatCompletionChunk)
        assert c.object == "chat.completion.chunk"
        assert c.id.startswith("chatcmpl-") and c.id == chunks[0].id
        assert c.model == MODEL
        assert c.routing is routing  # routing metadata on every chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text and len(text.split()) >= 8
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens >= 8
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    dumped = last.model_dump()
    assert dumped["object"] == "chat.completion.chunk" and dumped["routing"]["node_id"]


def test_sync_stream_is_dispatched_on_return(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        stream = client.infer_stream(MODEL, MSGS, policy="prod")
        routing = stream.routing
        assert routing is not None  # dispatched before the first iteration
        assert (routing.node_id, routing.accelerator, routing.policy) == ("h100-a", "H100", "prod")
        assert routing.attempts == [] and routing.server_address.startswith("127.0.0.1:")
        assert client.fleet.in_flight == 1
        chunks = list(stream)
        assert client.fleet.in_flight == 0
        check_stream(chunks, stream.text, routing)
        assert stream.finish_reason in ("stop", "length")
        assert stream.usage is not None and stream.usage == chunks[-1].usage
        assert list(stream) == []  # a finished stream yields nothing more
    stats = settled(setup.node("h100-a"))
    assert (stats.requests_total, stats.completed_total, stats.aborted_total) == (1, 1, 0)


def test_sync_stream_as_context_manager(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        with client.infer_stream(MODEL, MSGS, accelerator="MI300X", max_tokens=12) as stream:
            assert stream.routing is not None and stream.routing.node_id == "mi-a"
            assert stream.routing.policy is None
            chunks = [c for c in stream]
        check_stream(chunks, stream.text, stream.routing)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 12
        stream.close()  # closing a finished stream is harmless
        assert client.fleet.in_flight == 0
    assert settled(setup.node("mi-a")).completed_total == 1


def test_with_n_choices_the_stream_text_is_the_first_choice_s(setup: Any) -> None:
    """As ``response.choices[0].message.content``: it was every choice's tokens, interleaved."""
    with zml.Client(config=setup.path) as client:
        stream = client.infer_stream(MODEL, MSGS, accelerator="MI300X", max_tokens=8, n=2)
        per_choice: dict[int, str] = {}
        halfway = ""
        for i, chunk in enumerate(stream):
            for choice in chunk.choices:
                per_choice[choice.index] = per_choice.get(choice.index, "") + (
                    choice.delta.content or "")
            if i == 3:
                halfway = stream.text
                assert halfway == per_choice.get(0, "")  # delivered so far, choice 0 only
        assert sorted(per_choice) == [0, 1] and per_choice[0] != per_choice[1]
        assert stream.text == per_choice[0]


def test_async_stream_routing_on_each_chunk(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            stream = client.infer_stream(MODEL, MSGS, policy="prod")
            assert stream.routing is None  # dispatched on first iteration
            assert client.fleet.in_flight == 0
            chunks = [c async for c in stream]
            assert stream.routing is not None and stream.routing.node_id == "h100-a"
            check_stream(chunks, stream.text, stream.routing)
            assert stream.usage is not None and stream.usage.total_tokens > 0
            assert client.fleet.in_flight == 0

            async with client.infer_stream(MODEL, MSGS, accelerator="MI300X") as s2:
                assert s2.routing is not None and s2.routing.accelerator == "MI300X"
                chunks2 = [c async for c in s2]
            check_stream(chunks2, s2.text, s2.routing)
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    assert settled(setup.node("h100-a")).completed_total == 1
    assert settled(setup.node("mi-a")).completed_total == 1


def read_stream(kind: str, setup: Any, messages: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
    """Stream one ``prod`` request to its end on a client of ``kind``: (the stream, its chunks)."""

    def sync_body(client: zml.Client) -> tuple[Any, list[Any]]:
        s = client.infer_stream(MODEL, messages, policy="prod", **kwargs)
        return s, list(s)

    async def async_body(client: zml.AsyncClient) -> tuple[Any, list[Any]]:
        s = client.infer_stream(MODEL, messages, policy="prod", **kwargs)
        return s, [c async for c in s]

    done: tuple[Any, list[Any]] = run_client(kind, setup,
                                             sync_body if kind == "sync" else async_body)
    return done


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_usage_can_be_turned_off(setup: Any, kind: str) -> None:
    stream, chunks = read_stream(kind, setup, MSGS, stream_options={"include_usage": False})
    assert stream.usage is None and all(c.usage is None for c in chunks)
    assert stream.finish_reason in ("stop", "length") and stream.text


def merge_tool_calls(chunks: list[zml.ChatCompletionChunk]) -> dict[int, dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for c in chunks:
        for choice in c.choices:
            for tc in choice.delta.tool_calls or ():
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    call["id"] = tc.id
                if tc.function is not None:
                    if tc.function.name:
                        call["name"] = tc.function.name
                    call["arguments"] += tc.function.arguments or ""
    return calls


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_tool_call_deltas(setup: Any, kind: str) -> None:
    msgs = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
    stream, chunks = read_stream(kind, setup, msgs, tools=TOOLS, tool_choice="required")
    assert stream.finish_reason == "tool_calls"
    assert stream.text == ""
    fragments = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(fragments) >= 3  # the head (id, name) and the argument fragments
    head = fragments[0].choices[0].delta.tool_calls
    assert head is not None and head[0].id and head[0].type == "function"
    calls = merge_tool_calls(chunks)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = json.loads(calls[0]["arguments"])
    assert isinstance(args["city"], str) and isinstance(args["days"], int)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 2
    assert all(c.routing.node_id == "h100-a" for c in chunks)


def test_stream_and_infer_agree_on_the_same_seed(setup: Any) -> None:
    """A seeded request answers the same text streamed or not (the sim is deterministic)."""
    with zml.Client(config=setup.path) as client:
        full = client.infer(MODEL, MSGS, policy="prod", seed=11)
        stream = client.infer_stream(MODEL, MSGS, policy="prod", seed=11)
        for _ in stream:
            pass
    assert stream.text == full.choices[0].message.content
    assert stream.usage is not None and full.usage is not None
    assert stream.usage.completion_tokens == full.usage.completion_tokens


# --- streams are Python iterators -----------------------------------------------------------


def test_sync_next_then_for_continues_where_next_stopped(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        full = list(client.infer_stream(MODEL, MSGS, policy="prod", seed=5))
        stream = client.infer_stream(MODEL, MSGS, policy="prod", seed=5)
        assert iter(stream) is stream
        first, second = next(stream), next(stream)
        rest = [c for c in stream]
        assert len(rest) == len(full) - 2
        shape = {"id", "created", "routing"}
        assert [c.model_dump(exclude=shape) for c in [first, second, *rest]] == \
            [c.model_dump(exclude=shape) for c in full]
        with pytest.raises(StopIteration):
            next(stream)
        assert client.fleet.in_flight == 0


def test_async_stream_is_an_async_iterator(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            full = [c async for c in client.infer_stream(MODEL, MSGS, policy="prod", seed=5)]
            stream = client.infer_stream(MODEL, MSGS, policy="prod", seed=5)
            assert stream.__aiter__() is stream
            first = await anext(stream)  # dispatches
            assert first.routing is stream.routing and stream.routing is not None
            second = await stream.__anext__()
            async for c in stream:  # continues from the third chunk
                assert c.routing is stream.routing
                break
            rest = [c async for c in stream]
            assert len(rest) + 3 == len(full)
            assert await anext(stream, None) is None
            assert first.choices[0].delta.role == "assistant" and second.choices
            assert stream.text == "".join(c.choices[0].delta.content or ""
                                          for c in full if c.choices)
            assert client.fleet.in_flight == 0
            await stream.aclose()  # harmless once ended

    asyncio.run(main())


@pytest.mark.parametrize("second", ["anext", "aenter"])
def test_a_stream_opened_by_two_tasks_at_once_is_sent_once(setup: Any, second: str) -> None:
    """One call, one dispatch: a second task starting the same fresh stream is refused (as a
    second reader of any async iterator), and nothing is left held."""
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            stream = client.infer_stream(MODEL, MSGS, policy="prod", seed=5)
            other = anext(stream) if second == "anext" else stream.__aenter__()
            first, refused = await asyncio.gather(anext(stream), other,
                                                  return_exceptions=True)
            assert isinstance(first, zml.ChatCompletionChunk), first
            assert isinstance(refused, zml.InvalidRequestError), refused
            assert "being opened by another task" in str(refused)
            assert client.fleet.in_flight == 1  # the one request sent
            rest = [c async for c in stream]
            assert rest and client.fleet.in_flight == 0
            await stream.aclose()
            assert client.fleet.in_flight == 0

    asyncio.run(main())
