"""What a simulated reply carries besides its text, as vLLM / OpenAI send it: logprobs, n > 1
choices (plain and streamed), usage details (cached and reasoning tokens), system_fingerprint."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from zml.sim.textgen import WORDS

HISTORY = [
    {"role": "system", "content": "You answer questions about fleets, routing and accelerators. " * 4},
    {"role": "user", "content": "What is a routing policy, in a few words?"},
    {"role": "assistant", "content": "A named chain of accelerator families to try in order."},
    {"role": "user", "content": "And a fallback?"},
]


def _check_entry(entry: dict[str, Any], top: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["bytes"] == list(entry["token"].encode("utf-8"))
    assert entry["logprob"] <= 0
    alternatives = entry["top_logprobs"]
    assert len(alternatives) == top
    if top:
        assert alternatives[0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
        values = [a["logprob"] for a in alternatives]
        assert values == sorted(values, reverse=True) and len(set(values)) == top
        assert len({a["token"] for a in alternatives}) == top
        for alt in alternatives[1:]:
            assert alt["token"].strip() in WORDS
            assert alt["bytes"] == list(alt["token"].encode("utf-8"))


async def test_logprobs_one_entry_per_content_token(make_node, client_for, chat):
    client = client_for(make_node())
    body = (await chat(client, logprobs=True, top_logprobs=3)).json()
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == choice["message"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    for entry in content:
        _check_entry(entry, 3)


async def test_logprobs_leave_the_reply_unchanged_and_are_absent_unless_asked(make_node, client_for, chat):
    client = client_for(make_node())
    plain = (await chat(client, seed=7)).json()
    with_logprobs = (await chat(client, seed=7, logprobs=True)).json()
    assert plain["choices"][0]["logprobs"] is None
    assert with_logprobs["choices"][0]["message"] == plain["choices"][0]["message"]
    for entry in with_logprobs["choices"][0]["logprobs"]["content"]:
        _check_entry(entry, 0)


async def test_logprobs_of_a_tool_call_reply_are_empty(make_node, client_for, chat):
    client = client_for(make_node())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = (await chat(client, tools=tools, tool_choice="required", logprobs=True)).json()
    assert body["choices"][0]["message"]["tool_calls"]
    assert body["choices"][0]["logprobs"] == {"content": []}


async def test_streamed_logprobs_ride_on_their_content_chunks(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    chunks = tk.chunks(await stream(client, logprobs=True, top_logprobs=2, seed=3))
    entries = []
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                [entry] = choice["logprobs"]["content"]
                assert entry["token"] == choice["delta"]["content"]
                entries.append(entry)
            else:
                assert choice["logprobs"] is None
    plain = (await chat(client, logprobs=True, top_logprobs=2, seed=3)).json()
    assert entries == plain["choices"][0]["logprobs"]["content"]


async def test_n_choices_differ_and_the_first_is_the_n1_reply(make_node, client_for, chat):
    client = client_for(make_node())
    one = (await chat(client, seed=5)).json()
    three = (await chat(client, seed=5, n=3)).json()
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    contents = [c["message"]["content"] for c in three["choices"]]
    assert contents[0] == one["choices"][0]["message"]["content"]
    assert len(set(contents)) == 3
    assert all(c["finish_reason"] == "stop" for c in three["choices"])
    usage = three["usage"]
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == sum(len(text.split(" ")) for text in contents)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_n_choices_stream_one_choice_per_chunk_by_index(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    chunks = tk.chunks(await stream(client, n=2, seed=9, logprobs=True, stream_options={"include_usage": True}))
    texts: dict[int, str] = defaultdict(str)
    roles: dict[int, int] = defaultdict(int)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]  # exactly one choice per chunk
        delta = choice["delta"]
        roles[choice["index"]] += delta.get("role") == "assistant"
        texts[choice["index"]] += delta.get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]].append(choice["finish_reason"])
    assert dict(roles) == {0: 1, 1: 1}
    assert dict(finishes) == {0: ["stop"], 1: ["stop"]}
    plain = (await chat(client, n=2, seed=9)).json()
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in plain["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


async def test_n_tool_call_choices_each_call_with_its_own_id(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    body = (await chat(client, n=2, tools=tools, tool_choice="required")).json()
    calls = [c["message"]["tool_calls"] for c in body["choices"]]
    assert [len(c) for c in calls] == [1, 1]
    assert calls[0][0]["id"] != calls[1][0]["id"]
    streamed = tk.chunks(await stream(client, n=2, tools=tools, tool_choice="required"))
    ids = {c["choices"][0]["index"]: d["id"] for c in streamed if c["choices"]
           for d in c["choices"][0]["delta"].get("tool_calls") or () if d.get("id")}
    assert ids == {0: calls[0][0]["id"], 1: calls[1][0]["id"]}


async def test_cached_tokens_are_the_earlier_turns_in_whole_blocks(make_node, client_for, chat):
    client = client_for(make_node())
    single = (await chat(client)).json()["usage"]
    assert single["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "completion_tokens_details" not in single
    usage = (await chat(client, messages=HISTORY)).json()["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0
    assert cached <= usage["prompt_tokens"]
    earlier = (await chat(client, messages=HISTORY[:-1])).json()["usage"]["prompt_tokens"]
    assert earlier - 16 < cached <= earlier


async def test_reasoning_effort_counts_hidden_reasoning_tokens(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    plain = (await chat(client, seed=1)).json()
    thinking = (await chat(client, seed=1, reasoning_effort="low")).json()
    assert thinking["choices"][0]["message"] == plain["choices"][0]["message"]
    usage = thinking["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 8}
    assert usage["completion_tokens"] == plain["usage"]["completion_tokens"] + 8
    chunks = tk.chunks(await stream(client, seed=1, reasoning_effort="high", stream_options={"include_usage": True}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 32}


async def test_system_fingerprint_on_the_completion_and_every_chunk(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    fingerprint = (await chat(client)).json()["system_fingerprint"]
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13
    chunks = tk.chunks(await stream(client, stream_options={"include_usage": True}))
    assert {c["system_fingerprint"] for c in chunks} == {fingerprint}
