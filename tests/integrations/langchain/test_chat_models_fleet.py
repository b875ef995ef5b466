"""ChatZML against simulated nodes on loopback: routing metadata, fallback, errors.

The session fleet has one H100 node with a single slot ahead of two MI300X nodes in the
``llama3-production`` chain. Holding that slot with an open stream (zml reserves a slot when it
routes, and frees it when the stream ends or is closed) makes the fallback deterministic.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumps, loads
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessageChunk
from pydantic import BaseModel, Field

import zml
from langchain_zml import ChatZML

from .conftest import MODEL, OTHER_MODEL, POLICY

H100_ONLY = {"name": "h100-only", "accelerator_chain": ["H100"]}
LONG_PROMPT = "Tell me a long story about accelerators."


@pytest.fixture
def llm(zml_config: Path) -> Iterator[ChatZML]:
    model = ChatZML(model=MODEL, policy=POLICY, config=zml_config, temperature=0)
    yield model
    model.close()


def merge(chunks: Iterable[BaseMessageChunk]) -> AIMessageChunk:
    full: Any = None
    for chunk in chunks:
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk)
    return full


def assert_routed(
    message: AIMessage, accelerator: str, policy: str | None = POLICY
) -> dict[str, Any]:
    """Check the metadata every ChatZML message carries; return its zml_routing."""
    meta = message.response_metadata
    assert meta["model_provider"] == "zml"
    assert meta["model_name"] == MODEL
    assert meta["finish_reason"] in ("stop", "length", "tool_calls")
    usage = message.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    routing = meta["zml_routing"]
    assert routing["accelerator"] == accelerator
    assert routing["node_id"].startswith(accelerator.lower())
    assert routing["policy"] == policy
    assert isinstance(routing["queue_depth"], int)
    assert routing["attempts"] == []
    return routing


def over_capacity(routing: dict[str, Any]) -> bool:
    """Whether the decision trace shows H100 skipped because its node was full."""
    first = routing["evaluated"][0]
    return first["family"] == "H100" and first["rejected_reason"] == "all_nodes_over_capacity"


# --- metadata on every path --------------------------------------------------------------------


def test_invoke_carries_routing(llm: ChatZML) -> None:
    message = llm.invoke("Hello")
    assert isinstance(message, AIMessage)
    assert message.content
    routing = assert_routed(message, "H100")
    assert routing["node_id"] == "h100-1"
    assert routing["evaluated"] == [{"family": "H100", "nodes_checked": 1, "rejected_reason": None}]


async def test_ainvoke_carries_routing(llm: ChatZML) -> None:
    message = await llm.ainvoke("Hello")
    assert_routed(message, "H100")


def test_stream_puts_routing_and_usage_on_the_last_chunk_only(llm: ChatZML) -> None:
    chunks = list(llm.stream("Hello"))
    carrying = [c for c in chunks if "zml_routing" in c.response_metadata]
    with_usage = [c for c in chunks if c.usage_metadata]
    assert carrying == [chunks[-1]]
    assert with_usage == [chunks[-1]]
    assert chunks[-1].chunk_position == "last"
    full = merge(chunks)
    routing = assert_routed(full, "H100")
    assert routing == chunks[-1].response_metadata["zml_routing"]  # not summed or doubled


async def test_astream_puts_routing_and_usage_on_the_last_chunk_only(llm: ChatZML) -> None:
    chunks = [c async for c in llm.astream("Hello")]
    assert [c for c in chunks if "zml_routing" in c.response_metadata] == [chunks[-1]]
    assert [c for c in chunks if c.usage_metadata] == [chunks[-1]]
    assert_routed(merge(chunks), "H100")


def test_streaming_invoke_merges_to_one_routing(zml_config: Path) -> None:
    llm = ChatZML(model=MODEL, policy=POLICY, config=zml_config, streaming=True)
    tokens: list[str] = []

    class OnToken(BaseCallbackHandler):
        def on_llm_new_token(self, token: str, **kwargs: Any) -> None:
            tokens.append(token)

    message = llm.invoke("Hello", config={"callbacks": [OnToken()]})
    assert_routed(message, "H100")
    assert "".join(tokens) == message.content
    assert len(tokens) > 2


def test_model_override_routes_to_the_nodes_serving_it(llm: ChatZML) -> None:
    message = llm.invoke("Hello", model=OTHER_MODEL)
    assert message.response_metadata["model_name"] == OTHER_MODEL
    routing = message.response_metadata["zml_routing"]
    assert routing["accelerator"] == "MI300X"  # the H100 node does not serve it


def test_per_call_accelerator_pins_a_family(llm: ChatZML) -> None:
    message = llm.invoke("Hello", accelerator="MI300X")
    assert_routed(message, "MI300X", policy=None)


def test_tool_calls_carry_routing(llm: ChatZML) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    with_tools = llm.bind_tools([add], tool_choice="add")
    message = with_tools.invoke("What is 1 + 2?")
    assert isinstance(message, AIMessage)
    assert [c["name"] for c in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"}
    assert_routed(message, "H100")
    streamed = merge(with_tools.stream("What is 1 + 2?"))
    assert [c["name"] for c in streamed.tool_calls] == ["add"]
    assert streamed.response_metadata["finish_reason"] == "tool_calls"
    assert_routed(streamed, "H100")


class Joke(BaseModel):
    """A joke."""

    setup: str = Field(description="question to set up a joke")
    punchline: str = Field(description="answer to resolve the joke")


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output_include_raw(llm: ChatZML, method: Any) -> None:
    result = llm.with_structured_output(Joke, method=method, include_raw=True).invoke(
        "Tell me a joke about GPUs."
    )
    assert isinstance(result["parsed"], Joke)
    assert result["parsing_error"] is None
    assert_routed(result["raw"], "H100")


def test_unknown_parameter_is_refused_by_zml(llm: ChatZML) -> None:
    with pytest.raises(zml.InvalidRequestError, match="temprature"):
        llm.invoke("Hello", temprature=0.5)


def test_a_stop_string_stops_at_that_string(llm: ChatZML) -> None:
    """stop="word" is one sequence, as stop=["word"] (not one stop per character)."""
    baseline = llm.invoke("Say something")
    assert isinstance(baseline.content, str)
    word = baseline.content.split()[3]
    as_string = llm.invoke("Say something", stop=word)
    as_list = llm.invoke("Say something", stop=[word])
    assert as_list.response_metadata["finish_reason"] == "stop"
    assert as_string.content == as_list.content
    assert isinstance(as_list.content, str) and len(as_list.content.split()) >= 3
    assert word not in as_list.content


def test_new_event_loop_gets_its_own_async_client(llm: ChatZML) -> None:
    first = asyncio.run(llm.ainvoke("Hello"))
    second = asyncio.run(llm.ainvoke("Hello again"))
    assert_routed(first, "H100")
    assert_routed(second, "H100")


# --- fallback when the first family is saturated -----------------------------------------------


def test_fallback_while_h100_is_held_by_a_stream(llm: ChatZML) -> None:
    holder = llm.stream(LONG_PROMPT)
    first = next(holder)  # dispatched: the H100 node's only slot is taken until it ends
    fallback = llm.invoke("Hello")
    streamed_fallback = merge(llm.stream("Hello"))
    held = merge([first, *holder])

    assert_routed(held, "H100")
    for message in (fallback, streamed_fallback):
        routing = assert_routed(message, "MI300X")
        assert over_capacity(routing)
        assert routing["evaluated"][1] == {
            "family": "MI300X",
            "nodes_checked": 2,
            "rejected_reason": None,
        }
    assert_routed(llm.invoke("Hello"), "H100")  # the slot is free again


async def test_fallback_async(llm: ChatZML) -> None:
    holder = llm.astream(LONG_PROMPT)
    first = await anext(holder)
    fallback = await llm.ainvoke("Hello")
    streamed = merge([c async for c in llm.astream("Hello")])
    held = merge([first, *[c async for c in holder]])
    assert_routed(held, "H100")
    assert over_capacity(assert_routed(fallback, "MI300X"))
    assert over_capacity(assert_routed(streamed, "MI300X"))


async def test_concurrent_requests_spill_over(llm: ChatZML) -> None:
    messages = await asyncio.gather(*(llm.ainvoke(f"Question {i}") for i in range(3)))
    accelerators = [m.response_metadata["zml_routing"]["accelerator"] for m in messages]
    assert accelerators == ["H100", "MI300X", "MI300X"]
    assert all(over_capacity(m.response_metadata["zml_routing"]) for m in messages[1:])


def test_leaving_a_stream_early_frees_the_slot(llm: ChatZML) -> None:
    for _ in llm.stream(LONG_PROMPT):
        break
    assert_routed(llm.invoke("Hello"), "H100")


# --- errors propagate unchanged ----------------------------------------------------------------


def test_routing_error_from_invoke(llm: ChatZML) -> None:
    holder = llm.stream(LONG_PROMPT)
    next(holder)
    try:
        with pytest.raises(zml.RoutingError) as info:
            llm.invoke("Hello", policy=H100_ONLY)
        with pytest.raises(zml.RoutingError):
            list(llm.stream("Hello", policy=H100_ONLY))
    finally:
        holder.close()
    assert type(info.value) is zml.RoutingError
    context = info.value.routing_context
    assert context["policy"] == "h100-only"
    assert context["final_error"] == "no_viable_node"
    assert context["evaluated"] == [
        {"family": "H100", "nodes_checked": 1, "rejected_reason": "all_nodes_over_capacity"}
    ]


async def test_routing_error_from_ainvoke(zml_config: Path) -> None:
    llm = ChatZML(model=MODEL, policy=H100_ONLY, config=zml_config)
    holder: AsyncIterator[Any] = llm.astream(LONG_PROMPT)
    await anext(holder)
    try:
        with pytest.raises(zml.RoutingError) as info:
            await llm.ainvoke("Hello")
        with pytest.raises(zml.RoutingError):
            async for _ in llm.astream("Hello"):
                pass
    finally:
        await holder.aclose()  # type: ignore[attr-defined]
        await llm.aclose()
    assert type(info.value) is zml.RoutingError


async def test_policy_config_error_propagates(zml_config: Path) -> None:
    llm = ChatZML(model=MODEL, policy="llama3-prod", config=zml_config)
    with pytest.raises(zml.PolicyConfigError) as info:
        llm.invoke("Hello")
    assert type(info.value) is zml.PolicyConfigError
    assert info.value.suggestion == POLICY
    with pytest.raises(zml.PolicyConfigError):
        await llm.ainvoke("Hello")
    with pytest.raises(zml.PolicyConfigError):
        list(llm.stream("Hello"))


def test_policy_objects_and_dicts(zml_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_CONFIG", str(zml_config))  # what zml.Policy validates against
    policy = zml.Policy(name="amd-first", accelerator_chain=["MI300X", "H100"])
    for ref, name in (
        (policy, "amd-first"),
        ({"name": "dict-policy", "accelerator_chain": ["MI300X"]}, "dict-policy"),
    ):
        llm = ChatZML(model=MODEL, policy=ref, config=zml_config)
        assert llm._identifying_params["policy"] == (name if ref is policy else ref)
        assert_routed(llm.invoke("Hello"), "MI300X", policy=name)


@pytest.mark.filterwarnings("ignore:The function `loads` is in beta")
def test_a_policy_object_survives_dumps_and_loads(
    zml_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A zml.Policy is dumped as the dict of its fields, which policy= takes and routes alike."""
    monkeypatch.setenv("ZML_CONFIG", str(zml_config))  # what zml.Policy validates against
    policy = zml.Policy(name="amd-first", accelerator_chain=["MI300X", "H100"],
                        latency_target_ms=5000.0, cost_priority="latency", health_threshold=0.25)
    llm = ChatZML(model=MODEL, policy=policy, config=zml_config, temperature=0)
    text = dumps(llm)
    assert "not_implemented" not in text
    loaded = loads(text, valid_namespaces=["langchain_zml"], allowed_objects=[ChatZML])
    assert isinstance(loaded, ChatZML)
    try:
        assert loaded.policy == policy.model_dump(mode="json")
        assert loaded._sync_client().policy(loaded.policy) == policy  # the same Policy, rebuilt
        assert zml.Policy(**loaded.policy) == policy
        assert dumps(loaded) == text
        original = assert_routed(llm.invoke("Hello"), "MI300X", policy="amd-first")
        again = assert_routed(loaded.invoke("Hello"), "MI300X", policy="amd-first")
        assert [e["family"] for e in again["evaluated"]] == [
            e["family"] for e in original["evaluated"]
        ]
    finally:
        llm.close()
        loaded.close()
