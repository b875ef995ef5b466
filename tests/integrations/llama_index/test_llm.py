"""ZML against simulated nodes on loopback: the chat and completion methods, sync and async,
streamed or not; routing metadata; token counting; zml's errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    ImageBlock,
    TextBlock,
)
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler

import zml
from llama_index.llms.zml import ZML

MODEL = "meta-llama/llama-3-8b-instruct"  # as in conftest.py
POLICY = "llama3-production"
FAMILIES = {"H100", "MI300X"}
NODES = {"h100-a", "h100-b", "mi300x-a"}


def chat_messages(text: str = "Tell me about accelerators.") -> list[ChatMessage]:
    return [ChatMessage(role="system", content="You are brief."),
            ChatMessage(role="user", content=text)]


def assert_routed(response: ChatResponse | CompletionResponse, policy: str | None = POLICY) -> dict:
    routing = response.additional_kwargs["zml_routing"]
    assert isinstance(routing, dict)
    assert routing["node_id"] in NODES
    assert routing["accelerator"] in FAMILIES
    assert routing["policy"] == policy
    assert isinstance(response.raw, dict)
    assert response.raw["zml_routing"] == routing
    return routing


def assert_usage(response: ChatResponse | CompletionResponse) -> dict:
    usage = response.raw["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return usage


def test_chat(llm: ZML) -> None:
    response = llm.chat(chat_messages())
    assert response.message.role == "assistant"
    assert response.message.content
    assert_routed(response)
    usage = assert_usage(response)
    assert response.additional_kwargs["prompt_tokens"] == usage["prompt_tokens"]
    assert response.raw["model"] == MODEL
    assert response.raw["choices"][0]["finish_reason"] == "stop"
    # Routing rides on the response, never on the message (which is sent back next turn).
    assert "zml_routing" not in response.message.additional_kwargs


def test_chat_parameters_reach_the_node(make_llm: Callable[..., ZML]) -> None:
    llm = make_llm(max_tokens=3, temperature=0.0)
    response = llm.chat(chat_messages())
    assert response.raw["choices"][0]["finish_reason"] == "length"
    assert response.raw["usage"]["completion_tokens"] == 3
    # Per-call parameters too, and zml's own: a pinned family instead of the policy.
    pinned = llm.chat(chat_messages(), max_tokens=2, accelerator="MI300X")
    assert pinned.raw["usage"]["completion_tokens"] == 2
    assert assert_routed(pinned, policy=None)["accelerator"] == "MI300X"


def test_chat_with_an_image(llm: ZML) -> None:
    message = ChatMessage(role="user", blocks=[
        TextBlock(text="What is in this picture?"),
        ImageBlock(image=b"\x89PNG\r\n", image_mimetype="image/png"),
    ])
    assert llm.chat([message]).message.content


def test_unknown_parameter_is_an_error(llm: ZML) -> None:
    with pytest.raises(zml.InvalidRequestError, match="temprature"):
        llm.chat(chat_messages(), temprature=0.5)


def test_complete(llm: ZML) -> None:
    response = llm.complete("Say something.")
    assert response.text
    assert_routed(response)
    assert_usage(response)


def check_stream(responses: list[Any]) -> None:
    assert len(responses) >= 3
    for r in responses:
        assert_routed(r)
    *chunks, last = responses
    assert all(r.delta for r in chunks)
    assert last.delta == ""
    text = "".join(r.delta for r in chunks)
    final_text = last.message.content if isinstance(last, ChatResponse) else last.text
    assert final_text == text
    assert_usage(last)
    assert last.raw["finish_reason"] == "stop"
    if isinstance(last, ChatResponse):
        assert all("zml_routing" not in r.message.additional_kwargs for r in responses)


def test_stream_chat(llm: ZML) -> None:
    check_stream(list(llm.stream_chat(chat_messages())))


def test_stream_complete(llm: ZML) -> None:
    check_stream(list(llm.stream_complete("Say something.")))


def test_stream_stopped_early_releases_the_request(llm: ZML) -> None:
    stream = llm.stream_chat(chat_messages())
    next(stream)
    fleet = llm._get_client().fleet
    assert fleet.in_flight == 1
    stream.close()  # closes the zml stream, and with it the connection to the node
    assert fleet.in_flight == 0


@pytest.mark.parametrize("method", ["astream_chat", "astream_complete"])
async def test_async_stream_closed_early_frees_the_node_before_aclose_returns(
    one_slot_llm: ZML, method: str
) -> None:
    """LlamaIndex's callback wrapper never closes the generator it iterates: aclose() must
    still close the zml stream itself, or the node's only slot stays taken until Python
    finalizes the generator, and the next request finds the node full (RoutingError)."""
    llm = one_slot_llm
    if method == "astream_chat":
        stream: Any = await llm.astream_chat(chat_messages())
    else:
        stream = await llm.astream_complete("Say something.")
    async for response in stream:
        assert response.delta
        break
    fleet = llm._get_aclient().fleet
    assert fleet.in_flight == 1
    await stream.aclose()
    assert fleet.in_flight == 0
    followup = await llm.achat(chat_messages(), max_tokens=2)
    assert followup.raw["usage"]["completion_tokens"] == 2


async def test_achat(allm: ZML) -> None:
    response = await allm.achat(chat_messages())
    assert response.message.content
    assert_routed(response)
    assert_usage(response)


async def test_acomplete(allm: ZML) -> None:
    response = await allm.acomplete("Say something.")
    assert response.text
    assert_routed(response)


async def test_astream_chat(allm: ZML) -> None:
    check_stream([r async for r in await allm.astream_chat(chat_messages())])


async def test_astream_complete(allm: ZML) -> None:
    check_stream([r async for r in await allm.astream_complete("Say something.")])


def test_policy_object(zml_config: Path, make_llm: Callable[..., ZML]) -> None:
    with zml.Client(config=zml_config) as client:  # a Policy for this client's registry
        policy = client.policy({"name": "mi300x-only", "accelerator_chain": ["MI300X"]})
    routing = assert_routed(make_llm(policy=policy).chat(chat_messages()), policy="mi300x-only")
    assert routing["accelerator"] == "MI300X"


def test_token_counting_once_per_call(make_llm: Callable[..., ZML]) -> None:
    counter = TokenCountingHandler(tokenizer=str.split)
    llm = make_llm(callback_manager=CallbackManager([counter]))

    calls: list[Callable[[], Any]] = [
        lambda: llm.chat(chat_messages()),
        lambda: llm.complete("Say something."),
        lambda: list(llm.stream_chat(chat_messages()))[-1],
        lambda: list(llm.stream_complete("Say something."))[-1],
    ]
    for n, call in enumerate(calls, start=1):
        response = call()
        assert len(counter.llm_token_counts) == n
        event = counter.llm_token_counts[-1]
        usage = response.raw["usage"]
        # Counts come from the node's usage, not from a local tokenizer.
        assert event.prompt_token_count == usage["prompt_tokens"]
        assert event.completion_token_count == usage["completion_tokens"]
    assert counter.total_llm_token_count == sum(
        e.total_token_count for e in counter.llm_token_counts)


async def test_token_counting_once_per_async_call(zml_config: Path) -> None:
    counter = TokenCountingHandler(tokenizer=str.split)
    llm = ZML(model=MODEL, policy=POLICY, config=zml_config,
              callback_manager=CallbackManager([counter]))
    try:
        await llm.achat(chat_messages())
        await llm.acomplete("Say something.")
        [r async for r in await llm.astream_chat(chat_messages())]
        last = [r async for r in await llm.astream_complete("Say something.")][-1]
    finally:
        await llm.aclose()
    assert len(counter.llm_token_counts) == 4
    assert counter.llm_token_counts[-1].prompt_token_count == last.raw["usage"]["prompt_tokens"]


def test_routing_error_propagates(make_llm: Callable[..., ZML]) -> None:
    llm = make_llm(model="nobody/serves-this")
    with pytest.raises(zml.RoutingError) as info:
        llm.chat(chat_messages())
    assert info.value.routing_context["policy"] == POLICY
    assert info.value.routing_context["final_error"] == "no_viable_node"
    with pytest.raises(zml.RoutingError):
        llm.complete("hi")
    with pytest.raises(zml.RoutingError):
        next(llm.stream_chat(chat_messages()))


async def test_routing_error_propagates_async(zml_config: Path) -> None:
    llm = ZML(model="nobody/serves-this", policy=POLICY, config=zml_config)
    try:
        with pytest.raises(zml.RoutingError):
            await llm.achat(chat_messages())
        with pytest.raises(zml.RoutingError):
            [r async for r in await llm.astream_chat(chat_messages())]
    finally:
        await llm.aclose()


def test_policy_config_error_on_first_call(make_llm: Callable[..., ZML]) -> None:
    llm = make_llm(policy="no-such-policy")
    with pytest.raises(zml.PolicyConfigError):
        llm.chat(chat_messages())


@pytest.mark.filterwarnings("error::ResourceWarning")
def test_async_methods_from_successive_event_loops(llm: ZML) -> None:
    """Sync code that runs the async API with asyncio.run() more than once (a new loop each
    time): the async client, whose connections belong to a loop, is rebuilt for each, and the
    old loop's one is closed when that loop shuts down (no unclosed-socket warning)."""
    import asyncio

    async def achat() -> tuple[ChatResponse, object]:
        response = await llm.achat(chat_messages())
        return response, llm._get_aclient()

    first, first_client = asyncio.run(achat())
    second, second_client = asyncio.run(achat())
    assert first_client is not second_client
    assert llm._clients.loop_count == 0  # both loops are gone, and so are their clients
    assert_routed(first)
    assert_routed(second)
