"""ChatOpenAI's constructor fields on ChatZML, and what they bring back, against the simulated
fleet on loopback: logprobs (plain and streamed), n choices, usage details, ids, fingerprints,
callbacks' invocation_params."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.load import dumpd
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    HumanMessage,
    SystemMessage,
)
from pydantic import ValidationError

from langchain_zml import ChatZML

from .conftest import MODEL, POLICY

HISTORY = [
    SystemMessage("You explain inference fleets. " * 8),
    HumanMessage("What is an accelerator family?"),
    AIMessage("A group of nodes with the same kind of accelerator."),
    HumanMessage("And a routing policy?"),
]
FIELDS: dict[str, Any] = {
    "top_p": 0.9,
    "seed": 11,
    "n": 1,
    "logprobs": True,
    "top_logprobs": 2,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "logit_bias": {42: -5},
    "reasoning_effort": "low",
    "stop": ["\n\n\n"],
    "extra_body": {"min_tokens": 4},
}


def make(zml_config: Path, **fields: Any) -> ChatZML:
    return ChatZML(model=MODEL, policy=POLICY, config=zml_config, **fields)


def merged(llm: ChatZML, messages: list[BaseMessage] | str, **kwargs: Any) -> AIMessageChunk:
    full: Any = None
    for chunk in llm.stream(messages, **kwargs):
        full = chunk if full is None else full + chunk
    assert isinstance(full, AIMessageChunk)
    return full


def check_logprobs(message: AIMessage, top: int) -> None:
    entries = message.response_metadata["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == message.content
    assert all(len(e["top_logprobs"]) == top and e["logprob"] <= 0 for e in entries)


def test_chatopenai_fields_are_accepted_and_sent() -> None:
    llm = ChatZML(model=MODEL, max_completion_tokens=50, **FIELDS)
    assert llm.max_tokens == 50
    request = llm._request([HumanMessage("Hi")], None, {"extra_body": {"top_k": 5}}, stream=False)
    for name, value in FIELDS.items():
        if name != "extra_body":
            assert request[name] == value, name
    assert request["max_tokens"] == 50
    assert request["extra_body"] == {"min_tokens": 4, "top_k": 5}  # per call adds, key by key


def test_a_field_cannot_also_come_in_model_kwargs() -> None:
    assert ChatZML(model=MODEL, model_kwargs={"seed": 1})._request(
        [HumanMessage("Hi")], None, {}, stream=False
    )["seed"] == 1
    with pytest.raises(ValidationError, match="both as fields and in model_kwargs"):
        ChatZML(model=MODEL, seed=2, model_kwargs={"seed": 1})


def test_unknown_option_is_refused_and_the_key_never_shows() -> None:
    with pytest.raises(ValidationError, match="top_pp"):
        ChatZML(model=MODEL, top_pp=0.9)
    llm = ChatZML(model=MODEL, api_key="sk-hidden-key")
    for text in (repr(llm), str(llm), llm.model_dump_json(), json.dumps(dumpd(llm))):
        assert "sk-hidden-key" not in text
    assert llm.api_key is not None and llm.api_key.get_secret_value() == "sk-hidden-key"


def test_the_fields_reach_the_node(zml_config: Path) -> None:
    llm = make(zml_config, **FIELDS)
    message = llm.invoke(HISTORY)
    check_logprobs(message, 2)
    usage = message.usage_metadata
    assert usage is not None
    assert usage["input_token_details"]["cache_read"] > 0
    assert usage["output_token_details"]["reasoning"] == 8  # reasoning_effort="low"
    again = llm.invoke(HISTORY)
    assert again.content == message.content  # the seed makes the node repeat itself
    fixed = make(zml_config, max_tokens=5, extra_body={"ignore_eos": True}).invoke("Hello")
    assert fixed.response_metadata["finish_reason"] == "length"
    assert fixed.usage_metadata is not None and fixed.usage_metadata["output_tokens"] == 5


def test_streams_keep_logprobs_usage_details_id_and_fingerprint(zml_config: Path) -> None:
    llm = make(zml_config, logprobs=True, top_logprobs=3, reasoning_effort="medium", seed=4)
    full = merged(llm, HISTORY)
    check_logprobs(full, 3)
    usage = full.usage_metadata
    assert usage is not None
    assert usage["input_token_details"]["cache_read"] > 0
    assert usage["output_token_details"]["reasoning"] == 16
    meta = full.response_metadata
    assert meta["id"].startswith("chatcmpl-") and full.id == meta["id"]
    assert meta["system_fingerprint"].startswith("fp_")
    plain = llm.invoke(HISTORY)
    assert plain.content == full.content
    assert plain.response_metadata["logprobs"] == meta["logprobs"]
    assert plain.response_metadata["system_fingerprint"] == meta["system_fingerprint"]
    assert plain.usage_metadata == usage


async def test_astream_keeps_logprobs_and_usage_details(zml_config: Path) -> None:
    llm = make(zml_config, logprobs=True, top_logprobs=1)
    full: Any = None
    async for chunk in llm.astream(HISTORY):
        full = chunk if full is None else full + chunk
    check_logprobs(full, 1)
    assert full.usage_metadata["input_token_details"]["cache_read"] > 0
    assert full.response_metadata["id"].startswith("chatcmpl-")
    await llm.aclose()


def test_invoke_has_the_id_and_fingerprint(zml_config: Path) -> None:
    message = make(zml_config).invoke("Hello")
    assert message.response_metadata["id"] == message.id
    assert message.response_metadata["id"].startswith("chatcmpl-")
    assert message.response_metadata["system_fingerprint"].startswith("fp_")
    assert "logprobs" not in message.response_metadata  # not asked for


def test_n_choices_are_n_generations_and_are_never_streamed(zml_config: Path) -> None:
    llm = make(zml_config, n=3, seed=2)
    result = llm.generate([[HumanMessage("Hello")]])
    [generations] = result.generations
    texts = [g.text for g in generations]
    assert len(texts) == 3 and len(set(texts)) == 3
    first = llm.invoke("Hello")
    assert first.content == texts[0]  # invoke returns the first choice
    [whole] = list(llm.stream("Hello"))  # not streamed: the first choice, in one chunk
    assert whole.content == texts[0]
    with pytest.raises(ValidationError, match="n must be 1 when streaming"):
        make(zml_config, n=2, streaming=True)


class Recorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.params.append(kwargs["invocation_params"])


def test_callbacks_see_temperature_and_max_tokens(zml_config: Path) -> None:
    recorder = Recorder()
    llm = make(zml_config, temperature=0.3, max_tokens=20, seed=1)
    llm.invoke("Hello", config={"callbacks": [recorder]})
    merged(llm, "Hello", config={"callbacks": [recorder]}, top_p=0.5)
    plain, streamed = recorder.params
    for params in (plain, streamed):
        assert params["temperature"] == 0.3
        assert params["max_tokens"] == 20
        assert params["seed"] == 1
        assert params["model"] == MODEL
    assert streamed["top_p"] == 0.5  # per-call options too


def test_callbacks_see_the_stop_sequences_sent(zml_config: Path) -> None:
    """The model's own stop when the call gives none (LangChain's default reports None), the
    call's when it gives one."""
    recorder = Recorder()
    llm = make(zml_config, stop=["policy"])
    llm.invoke("Hello", config={"callbacks": [recorder]})
    llm.invoke("Hello", stop=["\n"], config={"callbacks": [recorder]})
    assert [params["stop"] for params in recorder.params] == [["policy"], ["\n"]]
