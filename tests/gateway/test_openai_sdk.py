"""The official openai Python SDK against the gateway: sync, async, streaming, raw headers,
and its exception classes for the gateway's errors."""

from __future__ import annotations

import json
from collections.abc import Callable

import openai
import pytest

import zml
from tests.conftest import MODEL

from .conftest import GATEWAY_KEY, GatewayServer
from .test_completions import metric_samples

MSGS = [{"role": "user", "content": "hello"}]
FAMILIES = {"H100": {"cost_per_hour": 4.0}, "MI300X": {"cost_per_hour": 3.0}}
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4},
         {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100", "MI300X"], "cost_priority": "cost"},
            "amd": {"accelerator_chain": ["MI300X"]}}
GATEWAY = f"""[gateway]
default_policy = "prod"
api_keys_env = "GW_KEYS"
[gateway.aliases]
"chat" = {{ model = "{MODEL}", policy = "amd" }}
"""


@pytest.fixture
def gw(serve_gateway: Callable[..., GatewayServer]) -> GatewayServer:
    return serve_gateway(NODES, POLICIES, families=FAMILIES, gateway=GATEWAY,
                         environ={"GW_KEYS": GATEWAY_KEY})


def client(gw: GatewayServer, key: str = GATEWAY_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base_url, api_key=key, max_retries=0, timeout=30)


def test_sync_completion_with_zml_routing_in_the_body(gw: GatewayServer) -> None:
    with client(gw) as oa:
        r = oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5)
        assert r.choices[0].message.content
        assert r.usage is not None and r.usage.completion_tokens == 5
        routing = zml.RoutingInfo.model_validate(r.model_extra["zml_routing"])
        assert routing.node_id == "h100-1" and routing.policy == "prod"
        listed = {m.id for m in oa.models.list()}
        assert listed == {MODEL, "chat"}


def test_with_raw_response_exposes_the_routing_headers(gw: GatewayServer) -> None:
    with client(gw) as oa:
        raw = oa.chat.completions.with_raw_response.create(
            model="chat", messages=MSGS, max_tokens=2)
        assert raw.headers["x-zml-node-id"] == "mi300x-1"
        assert raw.headers["x-zml-accelerator"] == "MI300X"
        assert raw.headers["x-zml-policy"] == "amd"
        assert raw.headers["x-zml-attempts"] == "1"
        assert raw.parse().choices[0].finish_reason == "length"


def test_sync_streaming_with_usage_and_extra_headers(gw: GatewayServer) -> None:
    with client(gw) as oa:
        stream = oa.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_headers={"x-zml-policy": "amd"},
            extra_body={"ignore_eos": True})
        chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].model_extra["zml_routing"]["node_id"] == "mi300x-1"


async def test_async_completion_and_stream(gw: GatewayServer) -> None:
    async with openai.AsyncOpenAI(base_url=gw.base_url, api_key=GATEWAY_KEY, max_retries=0,
                                  timeout=30) as oa:
        r = await oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3)
        assert r.model_extra["zml_routing"]["accelerator"] == "H100"
        stream = await oa.chat.completions.create(model="chat", messages=MSGS, max_tokens=4,
                                                  stream=True)
        chunks = [c async for c in stream]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].model_extra["zml_routing"]["policy"] == "amd"
        raw = await oa.chat.completions.with_raw_response.create(
            model=MODEL, messages=MSGS, max_tokens=2)
        assert raw.headers["x-zml-node-id"] == "h100-1"


def test_the_sdk_raises_its_own_classes_for_gateway_errors(
        serve_gateway: Callable[..., GatewayServer]) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 503}}},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 2}]
    gw = serve_gateway(nodes, {"nvidia": {"accelerator_chain": ["H100"]}}, families=FAMILIES,
                       gateway='[gateway]\ndefault_policy = "nvidia"\napi_keys_env = "GW_KEYS"',
                       environ={"GW_KEYS": GATEWAY_KEY})
    with client(gw) as oa:
        with pytest.raises(openai.InternalServerError) as routing:
            oa.chat.completions.create(model=MODEL, messages=MSGS)
        assert routing.value.status_code == 503
        body = routing.value.body
        assert isinstance(body, dict) and body["type"] == "routing_error"
        assert body["routing_context"]["policy"] == "nvidia"
        with pytest.raises(openai.BadRequestError) as bad:
            oa.chat.completions.create(model="gpt-4o", messages=MSGS)
        assert bad.value.param == "model"
        assert bad.value.code == "model_not_found"
    with client(gw, key="not-a-key") as oa, pytest.raises(openai.AuthenticationError):
        oa.chat.completions.create(model=MODEL, messages=MSGS)


def test_a_broken_stream_raises_in_the_sdk(serve_gateway: Callable[..., GatewayServer]) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"drop_rate": 1.0}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100"]}},
                       gateway='[gateway]\ndefault_policy = "p"\napi_keys_env = "GW_KEYS"',
                       environ={"GW_KEYS": GATEWAY_KEY})
    got: list[str] = []
    with client(gw) as oa, pytest.raises(openai.APIError) as info:
        for chunk in oa.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=50,
                                                stream=True, extra_body={"ignore_eos": True}):
            got.append(chunk.choices[0].delta.content or "")
    assert got  # the stream had begun, then it failed loudly
    assert "h100-1" in info.value.message
    assert json.dumps(info.value.body).find("incomplete_stream") >= 0


def test_the_sdk_does_not_retry_a_503_that_waiting_cannot_mend(
        serve_gateway: Callable[..., GatewayServer]) -> None:
    # No node of the chain serves the model: the gateway says x-should-retry: false, so an SDK
    # left at its default retries raises after one request, not three.
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2, "models": ["other"]},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 2}]
    gw = serve_gateway(nodes, {"nvidia": {"accelerator_chain": ["H100"]}}, families=FAMILIES,
                       gateway='[gateway]\ndefault_policy = "nvidia"\napi_keys_env = "GW_KEYS"',
                       environ={"GW_KEYS": GATEWAY_KEY})
    with openai.OpenAI(base_url=gw.base_url, api_key=GATEWAY_KEY, max_retries=2,
                       timeout=30) as oa, pytest.raises(openai.InternalServerError) as info:
        oa.chat.completions.create(model=MODEL, messages=MSGS)
    assert info.value.status_code == 503
    assert info.value.response.headers["x-should-retry"] == "false"
    served = sum(s.value for s in metric_samples(gw)["zml_gateway_requests_total"])
    assert served == 1


def test_the_sdk_stream_helper_assembles_a_streamed_tool_call(gw: GatewayServer) -> None:
    # openai-python's stream helper copies every field a delta carries: an explicit
    # "type": null in a later fragment of a tool call broke it (AssertionError).
    import pydantic

    class Joke(pydantic.BaseModel):
        setup: str

    tools = [openai.pydantic_function_tool(Joke, name="make_joke")]
    with client(gw) as oa, oa.chat.completions.stream(
            model=MODEL, messages=[{"role": "user", "content": "call make_joke"}],
            tools=tools) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "make_joke"
    assert isinstance(calls[0].function.parsed_arguments, Joke)
