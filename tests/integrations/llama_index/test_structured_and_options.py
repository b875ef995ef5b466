"""Structured streaming (objects filled while the tool-call arguments arrive), logprobs, and
the options shared with langchain-zml (max_retries, no unknown option, a secret key), against
the simulated fleet on loopback."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core.base.llms.types import ChatMessage, LogProb
from llama_index.core.prompts import PromptTemplate
from pydantic import BaseModel, ValidationError

from llama_index.llms.zml import ZML

PROMPT = PromptTemplate("Suggest a song by 'Nina Simone' for {mood}.")


class Song(BaseModel):
    """A song to listen to."""

    artist: str
    name: str


def check_song_stream(objects: list[Any]) -> None:
    """Every partial object is a Song so far; the last one is complete."""
    assert len(objects) > 2  # streamed in pieces, not one final object
    assert any(o.name is not None or o.artist is not None for o in objects[:-1])
    last = objects[-1]
    assert isinstance(last.name, str) and last.name
    assert last.artist == "Nina Simone"  # the quoted string of the prompt fills the first field
    for earlier in objects[:-1]:
        for field in ("name", "artist"):
            value = getattr(earlier, field)
            assert value is None or getattr(last, field).startswith(value)


def test_stream_structured_predict_yields_populated_objects(llm: ZML) -> None:
    check_song_stream(list(llm.stream_structured_predict(Song, PROMPT, mood="a rainy day")))


async def test_astream_structured_predict_yields_populated_objects(allm: ZML) -> None:
    stream = await allm.astream_structured_predict(Song, PROMPT, mood="a rainy day")
    check_song_stream([o async for o in stream])


def test_structured_llm_stream_chat_yields_populated_objects(llm: ZML) -> None:
    structured = llm.as_structured_llm(Song)
    message = ChatMessage(role="user", content="Suggest a song by 'Nina Simone'.")
    responses = list(structured.stream_chat([message]))
    check_song_stream([r.raw for r in responses])
    assert json.loads(responses[-1].message.content or "")["artist"] == "Nina Simone"


def test_streamed_tool_calls_accumulate_in_additional_kwargs(llm: ZML) -> None:
    from llama_index.core.tools import FunctionTool

    def get_weather(city: str) -> str:
        """Return the weather in a city."""
        return city

    tool = FunctionTool.from_defaults(fn=get_weather)
    responses = list(llm.stream_chat_with_tools([tool], user_msg="Weather in 'Oslo'?"))
    arguments = [r.message.additional_kwargs["tool_calls"][0]["function"]["arguments"]
                 for r in responses]
    assert all(b.startswith(a) for a, b in itertools.pairwise(arguments))
    [call] = responses[-1].message.additional_kwargs["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    plain = llm.chat_with_tools([tool], user_msg="Weather in 'Oslo'?")
    [plain_call] = plain.message.additional_kwargs["tool_calls"]
    assert json.loads(plain_call["function"]["arguments"]) == {"city": "Oslo"}


def test_structured_predict_still_parses(llm: ZML) -> None:
    song = llm.structured_predict(Song, PROMPT, mood="work")
    assert isinstance(song, Song) and song.artist == "Nina Simone"


def check_logprobs(logprobs: list[list[LogProb]] | None, text: str, top: int) -> None:
    assert logprobs is not None
    assert "".join(token[0].token for token in logprobs) == text
    for token in logprobs:
        assert len(token) == top
        assert all(lp.logprob <= 0 and lp.bytes == list(lp.token.encode()) for lp in token)


def test_logprobs_when_requested(make_llm: Callable[..., ZML]) -> None:
    messages = [ChatMessage(role="user", content="Hello")]
    plain = make_llm().chat(messages)
    assert plain.logprobs is None
    response = make_llm(logprobs=True, top_logprobs=3).chat(messages)
    check_logprobs(response.logprobs, response.message.content or "", 3)
    alone = make_llm(logprobs=True).chat(messages)  # no alternatives: the sampled token alone
    check_logprobs(alone.logprobs, alone.message.content or "", 1)
    per_call = make_llm().complete("Hello", logprobs=True, top_logprobs=2)
    check_logprobs(per_call.logprobs, per_call.text, 2)


def test_streamed_logprobs_accumulate(make_llm: Callable[..., ZML]) -> None:
    llm = make_llm(logprobs=True, top_logprobs=2, additional_kwargs={"seed": 3})
    messages = [ChatMessage(role="user", content="Hello")]
    responses = list(llm.stream_chat(messages))
    final = responses[-1]
    check_logprobs(final.logprobs, final.message.content or "", 2)
    assert final.logprobs == llm.chat(messages).logprobs
    sizes = [len(r.logprobs or ()) for r in responses]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_stream_usage_keeps_the_node_details(make_llm: Callable[..., ZML]) -> None:
    history = [
        ChatMessage(role="system", content="You explain inference fleets. " * 8),
        ChatMessage(role="user", content="What is a policy?"),
        ChatMessage(role="assistant", content="A chain of accelerator families."),
        ChatMessage(role="user", content="And a fallback?"),
    ]
    final = list(make_llm().stream_chat(history))[-1]
    assert final.raw["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_retries_is_the_option_and_maps_to_max_attempts() -> None:
    assert ZML(model="m").max_retries == 2
    assert ZML(model="m")._client_options()["max_attempts"] == 3
    assert ZML(model="m", max_retries=0)._client_options()["max_attempts"] == 1
    with pytest.raises(ValidationError, match="max_attempts is now max_retries"):
        ZML(model="m", max_attempts=3)
    with pytest.raises(ValidationError):
        ZML(model="m", max_retries=-1)


def test_unknown_options_are_refused() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        ZML(model="m", temprature=0.2)


def test_the_api_key_is_a_secret() -> None:
    llm = ZML(model="m", api_key="sk-hidden-key")
    assert llm.api_key is not None and llm.api_key.get_secret_value() == "sk-hidden-key"
    for text in (repr(llm), str(llm), llm.to_json(), json.dumps(llm.to_dict()),
                 llm.model_dump_json(), repr(llm.api_key)):
        assert "sk-hidden-key" not in text
    assert llm._client_options()["api_key"] == "sk-hidden-key"
