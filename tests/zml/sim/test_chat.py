"""Chat completions of one simulated node, in-process: response shapes, streaming, limits,
determinism, validation and auth."""

from __future__ import annotations

import json

import pytest


async def test_non_stream_shape(make_node, client_for, chat, tk):
    client = client_for(make_node())
    r = await chat(client, messages=[{"role": "user", "content": "Hello, world!"}])
    assert r.status_code == 200
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert body["model"] == "m1"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    # 4 framing tokens + "Hello" "," "world" "!"
    assert usage["prompt_tokens"] == 8
    assert 16 <= usage["completion_tokens"] <= 48
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # one token per word: the word count matches the token count
    assert len(choice["message"]["content"].split(" ")) == usage["completion_tokens"]


async def test_prompt_tokens_count_every_message_and_tools(make_node, client_for, chat):
    client = client_for(make_node())
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "two words"}]},
    ]
    r = await chat(client, messages=messages)
    assert r.json()["usage"]["prompt_tokens"] == (4 + 3) + (4 + 2)
    tools = [{"type": "function", "function": {"name": "f"}}]
    r2 = await chat(client, messages=messages, tools=tools, tool_choice="none")
    assert r2.json()["usage"]["prompt_tokens"] > r.json()["usage"]["prompt_tokens"]


async def test_stream_shape_with_usage(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    events = await stream(client, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = tk.chunks(events)
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "m1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    *body, final, usage_chunk = chunks
    content_deltas = [c["choices"][0]["delta"]["content"] for c in body[1:]]
    assert all(isinstance(d, str) and d for d in content_deltas)
    assert all(c["choices"][0]["finish_reason"] is None for c in body)
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["choices"][0]["delta"] == {}
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == len(content_deltas)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # streaming and not streaming give the same reply
    plain = (await chat(client)).json()
    assert "".join(content_deltas) == plain["choices"][0]["message"]["content"]
    assert plain["usage"] == usage


async def test_stream_without_include_usage_has_no_usage_chunk(make_node, client_for, stream, tk):
    client = client_for(make_node())
    chunks = tk.chunks(await stream(client))
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
async def test_max_tokens_cuts_with_length(make_node, client_for, chat, stream, tk, key):
    client = client_for(make_node())
    full = (await chat(client)).json()["choices"][0]["message"]["content"]
    r = (await chat(client, **{key: 3})).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 3
    content = r["choices"][0]["message"]["content"]
    assert full.startswith(content) and len(content.split(" ")) == 3
    chunks = tk.chunks(await stream(client, **{key: 3}))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert tk.streamed_content(await stream(client, **{key: 3})) == content


async def test_max_tokens_larger_than_reply_is_a_normal_stop(make_node, client_for, chat):
    client = client_for(make_node())
    r = (await chat(client, max_tokens=1000)).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] <= 48


async def test_ignore_eos_runs_to_max_tokens(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    r = (await chat(client, max_tokens=120, ignore_eos=True)).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 120
    assert len(r["choices"][0]["message"]["content"].split(" ")) == 120
    chunks = tk.chunks(await stream(client, max_tokens=32, ignore_eos=True))
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) == 32
    # without a cap, ignore_eos keeps the natural length
    r = (await chat(client, ignore_eos=True)).json()
    assert r["choices"][0]["finish_reason"] == "stop"


async def test_min_tokens_lengthens_the_reply(make_node, client_for, chat):
    client = client_for(make_node())
    r = (await chat(client, min_tokens=100)).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == 100
    assert r["choices"][0]["message"]["content"].endswith(".")


async def test_stop_sequence_truncates(make_node, client_for, chat, stream, tk):
    client = client_for(make_node())
    full = (await chat(client)).json()["choices"][0]["message"]["content"]
    words = full.split(" ")
    stop = " " + words[3]
    expected = full[: full.index(stop)]
    for stop_param in (stop, ["never-appears", stop]):
        r = (await chat(client, stop=stop_param)).json()
        assert r["choices"][0]["message"]["content"] == expected
        assert r["choices"][0]["finish_reason"] == "stop"
        assert stop not in r["choices"][0]["message"]["content"]
    events = await stream(client, stop=stop)
    assert tk.streamed_content(events) == expected
    assert tk.chunks(events)[-1]["choices"][0]["finish_reason"] == "stop"


async def test_stop_inside_a_word_cuts_the_token(make_node, client_for, chat):
    client = client_for(make_node())
    full = (await chat(client)).json()["choices"][0]["message"]["content"]
    second = full.split(" ")[1]
    stop = second[1:] or second
    r = (await chat(client, stop=stop)).json()
    content = r["choices"][0]["message"]["content"]
    assert content == full[: full.index(stop)]
    assert r["usage"]["completion_tokens"] == len(content.split(" "))


async def test_same_request_same_reply_and_seed_changes_it(make_node, client_for, chat):
    node_a, node_b = make_node(), make_node(id="other")
    a, b = client_for(node_a), client_for(node_b)

    async def content(client, **body):
        return (await chat(client, **body)).json()["choices"][0]["message"]["content"]

    first = await content(a, seed=7)
    assert await content(a, seed=7) == first
    assert await content(b, seed=7) == first  # independent of the node
    others = {await content(a, seed=s) for s in range(1, 6)}
    assert len(others | {first}) > 1
    assert await content(a, seed=7, messages=_user("something else")) != first
    # sampling parameters are accepted and do not change the text
    assert await content(a, seed=7, temperature=0.3, top_p=0.9, user="u", logprobs=True,
                         parallel_tool_calls=False, n=1) == first


def _user(text):
    return [{"role": "user", "content": text, "name": "alice"}]


async def test_default_length_range(make_node, client_for, chat):
    client = client_for(make_node())
    lengths = set()
    for i in range(20):
        r = (await chat(client, messages=_user(f"prompt number {i}"))).json()
        lengths.add(r["usage"]["completion_tokens"])
    assert all(16 <= n <= 48 for n in lengths)
    assert len(lengths) > 3


async def test_unknown_model_is_404_with_openai_error(make_node, client_for, chat):
    client = client_for(make_node())
    r = await chat(client, model="nope")
    assert r.status_code == 404
    error = r.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert "nope" in error["message"]
    assert error["code"] == "model_not_found"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"n": 0},
        {"n": 17},
        {"logprobs": "yes"},
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"reasoning_effort": "extreme"},
        {"max_tokens": 0},
        {"max_tokens": "ten"},
        {"stop": 5},
        {"stream": "yes"},
        {"tools": [{"type": "function"}]},
        {"tool_choice": {"type": "function", "function": {"name": "missing"}}},
        {"response_format": {"type": "xml"}},
        {"ignore_eos": "yes"},
        {"parallel_tool_calls": "yes"},
        {"min_tokens": -1},
        {"model": None},
        {"temperature": "hot"},
        {"temperature": -0.5},
        {"temperature": True},
        {"top_p": 0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"presence_penalty": 2.5},
        {"frequency_penalty": "-1"},
        {"repetition_penalty": 0},
        {"top_k": -2},
        {"top_k": 1.5},
    ],
)
async def test_bad_requests_are_400(make_node, client_for, chat, body):
    node = make_node()
    client = client_for(node)
    r = await chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"]
    assert node.stats.rejected_total == 1


async def test_sampling_parameters_in_range_are_accepted(make_node, client_for, chat):
    client = client_for(make_node())
    r = await chat(client, temperature=0, top_p=1, min_p=0.05, top_k=-1, presence_penalty=-2,
                   frequency_penalty=2, repetition_penalty=1.1)
    assert r.status_code == 200, r.text
    r = await chat(client, temperature=1.7, top_p=0.9, top_k=40)
    assert r.status_code == 200, r.text


async def test_a_bad_sampling_parameter_names_itself(make_node, client_for, chat):
    r = await chat(client_for(make_node()), temperature="hot")
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "temperature"
    assert error["message"] == "temperature must be a number, got 'hot'"
    r = await chat(client_for(make_node()), top_p=0)
    assert r.json()["error"]["message"] == "top_p must be in (0, 1], got 0"


async def test_body_that_is_not_json_is_400(make_node, client_for):
    client = client_for(make_node())
    r = await client.post("/v1/chat/completions", content=b"{nope")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_api_key_required_when_set(make_node, client_for, chat):
    client = client_for(make_node(api_key="sekret"))
    assert (await chat(client)).status_code == 401
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "m1", "messages": _user("hi")},
        headers={"Authorization": "Bearer wrong"},
    )
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "m1", "messages": _user("hi")},
        headers={"Authorization": "Bearer sekret"},
    )
    assert r.status_code == 200


async def test_any_authorization_accepted_without_api_key(make_node, client_for):
    client = client_for(make_node())
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "m1", "messages": _user("hi")},
        headers={"Authorization": "Bearer whatever"},
    )
    assert r.status_code == 200


async def test_health_models_and_unknown_paths(make_node, client_for):
    client = client_for(make_node(models=("m1", "m2")))
    r = await client.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["m1", "m2"]
    assert all(m["object"] == "model" for m in models["data"])
    assert (await client.get("/nope")).status_code == 404
    assert (await client.get("/v1/chat/completions")).status_code == 405


async def test_second_model_is_served_and_echoed(make_node, client_for, chat):
    client = client_for(make_node(models=("m1", "m2")))
    r = await chat(client, model="m2")
    assert r.status_code == 200 and r.json()["model"] == "m2"


async def test_reply_json_is_plain_json(make_node, client_for, chat):
    client = client_for(make_node())
    r = await chat(client)
    assert json.loads(r.content) == r.json()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": 10**9, "ignore_eos": True}, "max_tokens"),
        ({"max_tokens": 500_001, "ignore_eos": True}, "max_tokens"),
        ({"max_tokens": 40_000, "ignore_eos": True, "n": 16}, "max_tokens"),
        ({"max_tokens": 30_000, "ignore_eos": True, "logprobs": True, "top_logprobs": 20},
         "max_tokens"),
        ({"min_tokens": 10**9}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ],
)
async def test_a_reply_too_large_to_plan_is_400_at_once(make_node, client_for, chat, body, param):
    """A reply is planned whole before its first token, on the loop every node of a process
    shares: `max_tokens=10**9` with `ignore_eos` built a billion tokens (minutes, and memory
    to match) before it was refused for the KV cache; `min_tokens` had no bound at all."""
    node = make_node()
    r = await chat(client_for(node), **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "lower max_tokens, min_tokens, n or top_logprobs" in error["message"] or (
        error["message"] == "min_tokens must be less than or equal to max_tokens=8, got 9.")
    assert node.stats.rejected_total == 1


async def test_the_largest_reply_is_planned_off_the_event_loop(
    make_node, client_for, chat, monkeypatch: pytest.MonkeyPatch
):
    """So that the other nodes of the process (their /health, their requests) are answered
    while it is built."""
    import threading

    from zml.sim import node as node_module
    from zml.sim.protocol import MAX_REPLY_UNITS

    planned_on: list[str] = []
    real = node_module.plan_reply

    def plan(request):
        planned_on.append(threading.current_thread().name)
        return real(request)

    monkeypatch.setattr(node_module, "plan_reply", plan)
    node = make_node(family="MI300X")  # a KV cache large enough for it
    client = client_for(node)
    r = await chat(client, max_tokens=MAX_REPLY_UNITS, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == MAX_REPLY_UNITS
    small = await chat(client, max_tokens=8, ignore_eos=True)
    assert small.json()["usage"]["completion_tokens"] == 8
    loop_thread = threading.current_thread().name
    assert planned_on[0] != loop_thread and planned_on[1] == loop_thread
