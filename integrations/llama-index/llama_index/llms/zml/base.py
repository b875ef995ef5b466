"""``ZML``: a LlamaIndex function-calling LLM whose requests zml routes across a fleet.

The four chat methods talk to zml natively. The completion methods are the same private chat
methods, their responses converted by LlamaIndex's ``chat_response_to_completion_response``
(plus the logprobs, which it drops), so each public call runs exactly one
callback/instrumentation wrapper: one LLM event, one token count (the async streams run theirs
through :mod:`llama_index.llms.zml.streams`, so that ``aclose()`` closes the zml stream at
once). The zml clients are built on first use (a ``zml.toml`` is read then, not at
construction) by ``zml.LoopClients``, the adapters' shared toolkit: one sync client, and one
async client per event loop (its connections belong to the loop that opened them), closed when
that loop shuts down.

Option names are LangChain's and LlamaIndex's own where they exist (``max_retries``), the same
as langchain-zml's; an unknown constructor argument is refused rather than ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import chat_response_to_completion_response
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    field_serializer,
    model_validator,
)
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from pydantic import InstanceOf

import zml
from llama_index.llms.zml.messages import to_zml_messages
from llama_index.llms.zml.responses import StreamAccumulator, from_completion, parse_arguments
from llama_index.llms.zml.streams import callback_stream

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["ZML"]

DEFAULT_TIMEOUT = 600.0


class ZML(FunctionCallingLLM):
    """Chat completions through zml: each request goes to the node that a policy picks.

    Routing policy lives in configuration (a ``zml.toml``), so the same code serves a laptop
    and a fleet. Every response says where it went, in
    ``response.additional_kwargs["zml_routing"]`` (also ``response.raw["zml_routing"]``, and
    on every streamed chunk)::

        from llama_index.core import Settings
        from llama_index.llms.zml import ZML

        Settings.llm = ZML(model="meta-llama/llama-3-8b-instruct", policy="llama3-production")
        response = Settings.llm.complete("Hello")
        response.additional_kwargs["zml_routing"]["accelerator"]

    Per-call keyword arguments are OpenAI chat parameters (``top_p``, ``seed``, ``stop``, ...)
    or zml's own ``policy``, ``accelerator``, ``timeout`` and ``metadata``; unknown names raise
    ``zml.InvalidRequestError`` rather than being dropped. zml's errors (``zml.RoutingError``
    with its ``routing_context``, ``zml.NodeError`` subclasses, ...) propagate unchanged.
    ``policy`` and ``accelerator`` together raise ``zml.InvalidRequestError`` at
    construction, as they do on a call.

    Token log-probabilities: ``logprobs=True`` (and ``top_logprobs=k``) fill
    ``response.logprobs``, one list of ``LogProb`` per generated token, streamed too.

    Closing a stream early (``close()``, or ``await stream.aclose()`` for the async ones)
    cancels the request and frees the node's slot before it returns.

    Each event loop gets its own async client, closed when the loop shuts down
    (``asyncio.run`` per call works); ``await llm.aclose()`` closes the running loop's one
    sooner.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str = Field(description="The model name, as the fleet's nodes serve it.", min_length=1)
    policy: str | InstanceOf[zml.Policy] | dict[str, Any] | None = Field(
        default=None,
        description=(
            "A routing policy: the name of a [policies.NAME] table of the configuration, a dict "
            "of zml.Policy fields, or a zml.Policy. None: any healthy node serving the model."
        ),
    )
    accelerator: str | None = Field(
        default=None,
        description="Pin one accelerator family instead of a policy (the zml 0.2 style).",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="Bearer token for the nodes (default: $ZML_API_KEY). Never serialized.",
        exclude=True,
        repr=False,
    )
    config: str | Path | zml.Registry | None = Field(
        default=None,
        description="A zml.toml path or a zml.Registry (default: $ZML_CONFIG, else ./zml.toml).",
    )
    temperature: float | None = Field(
        default=None, ge=0.0, description="Sampling temperature (None: the node's default)."
    )
    max_tokens: int | None = Field(
        default=None, gt=0, description="Tokens to generate at most (None: the node's limit)."
    )
    timeout: float | None = Field(
        default=DEFAULT_TIMEOUT,
        gt=0,
        description="Overall deadline of a request in seconds, failovers included (None: none).",
    )
    max_retries: int = Field(
        default=2,
        ge=0,
        description=(
            "Failover attempts after the first dispatch: zml's max_attempts is max_retries + 1 "
            "(the default 2 gives 3 dispatches at most)."
        ),
    )
    logprobs: bool | None = Field(
        default=None, description="Return token log-probabilities in response.logprobs."
    )
    top_logprobs: int | None = Field(
        default=None, ge=0, le=20, description="Alternatives per token, with logprobs=True."
    )
    context_window: int = Field(
        default=DEFAULT_CONTEXT_WINDOW, gt=0, description="The model's context window, in tokens."
    )
    zml_metadata: dict[str, Any] | None = Field(
        default=None,
        description="Labels (team, service) passed to zml's plugin hooks and echoed in routing.",
    )
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="More OpenAI chat parameters sent with every request (top_p, seed, stop...).",
    )

    _clients: zml.LoopClients = PrivateAttr(default_factory=zml.LoopClients)

    def __copy__(self) -> ZML:
        """A copy (``model_copy``, ``copy.copy``) with zml clients of its own, built on its
        first call from its own fields: pydantic's copy shares private attributes, so a copy
        made with ``update={"api_key": ...}`` (or another config) would otherwise send the
        original's key to the original's fleet, or lend it its own."""
        copied = super().__copy__()
        copied._clients = zml.LoopClients()
        return copied

    def __init__(self, **data: Any) -> None:
        super().__init__(**data)
        # Here rather than in a validator: pydantic would wrap zml.InvalidRequestError (a
        # ValueError) in a ValidationError, and the caller is owed the error a call raises.
        _check_routing_mode(self.policy, self.accelerator)

    @model_validator(mode="before")
    @classmethod
    def _renamed_options(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_attempts" in data:
            raise ValueError(
                "max_attempts is now max_retries (failovers after the first dispatch): "
                f"max_attempts={data['max_attempts']!r} is max_retries={data['max_attempts']!r} - 1"
            )
        return data

    @classmethod
    def class_name(cls) -> str:
        return "ZML"

    @field_serializer("config")
    def _serialize_config(self, config: str | Path | zml.Registry | None) -> str | None:
        if isinstance(config, zml.Registry):
            return config.source
        return None if config is None else str(config)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model,
        )

    # -- clients ------------------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        return {
            "api_key": self.api_key.get_secret_value() if self.api_key is not None else None,
            "config": self.config,
            "timeout": self.timeout,
            "max_attempts": self.max_retries + 1,
        }

    def _get_client(self) -> zml.Client:
        return self._clients.sync(self._client_options)

    def _get_aclient(self) -> zml.AsyncClient:
        return self._clients.for_running_loop(self._client_options)

    def close(self) -> None:
        """Close the sync client's connections (a later call opens new ones)."""
        self._clients.close()

    async def aclose(self) -> None:
        """Close the running event loop's async client, and the sync client."""
        await self._clients.aclose()
        self.close()

    # -- request ------------------------------------------------------------------------------

    def _request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
        """The model, messages and keyword arguments of one ``infer`` call."""
        params: dict[str, Any] = {}
        # A per-call policy or accelerator replaces the configured one (zml takes one of them).
        if "policy" not in kwargs and "accelerator" not in kwargs:
            if self.policy is not None:
                params["policy"] = self.policy
            if self.accelerator is not None:
                params["accelerator"] = self.accelerator
        if self.zml_metadata:
            params["metadata"] = self.zml_metadata
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.max_tokens is not None:
            params["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
        if self.top_logprobs is not None:
            params["top_logprobs"] = self.top_logprobs
        params.update(self.additional_kwargs)
        params.update(kwargs)
        model = params.pop("model", self.model)
        return model, to_zml_messages(messages), params

    # -- chat ---------------------------------------------------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, **kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, **kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, **kwargs)

    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        # Not decorated: callback_stream runs llm_chat_callback's event, and makes aclose()
        # close the zml stream too (the decorator's generator never closes ours).
        return await callback_stream(
            llm_chat_callback(), self, messages, kwargs, self._astream_chat
        )

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        model, zml_messages, params = self._request(messages, kwargs)
        return from_completion(self._get_client().infer(model, zml_messages, **params))

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        model, zml_messages, params = self._request(messages, kwargs)
        client = self._get_client()

        def gen() -> ChatResponseGen:
            with client.infer_stream(model, zml_messages, **params) as stream:
                assert stream.routing is not None
                acc = StreamAccumulator(stream.routing)
                for chunk in stream:
                    response = acc.add(chunk)
                    if response is not None:
                        yield response
            yield acc.final()

        return gen()

    async def _achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        model, zml_messages, params = self._request(messages, kwargs)
        completion = await self._get_aclient().infer(model, zml_messages, **params)
        return from_completion(completion)

    async def _astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        model, zml_messages, params = self._request(messages, kwargs)
        client = self._get_aclient()

        async def gen() -> ChatResponseAsyncGen:
            async with client.infer_stream(model, zml_messages, **params) as stream:
                assert stream.routing is not None
                acc = StreamAccumulator(stream.routing)
                async for chunk in stream:
                    response = acc.add(chunk)
                    if response is not None:
                        yield response
            yield acc.final()

        return gen()

    # -- completion (derived from the private chat methods) ----------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _completion(self._chat(_prompt(prompt), **kwargs))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        responses = self._stream_chat(_prompt(prompt), **kwargs)
        return (_completion(response) for response in responses)

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return _completion(await self._achat(_prompt(prompt), **kwargs))

    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        return await callback_stream(
            llm_completion_callback(), self, prompt, kwargs, self._astream_complete
        )

    async def _astream_complete(self, prompt: str, **kwargs: Any) -> CompletionResponseAsyncGen:
        responses = await self._astream_chat(_prompt(prompt), **kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            try:
                async for response in responses:
                    yield _completion(response)
            finally:
                await responses.aclose()

        return gen()

    # -- function calling ---------------------------------------------------------------------

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The ``chat`` arguments for a turn with tools.

        ``tool_choice`` (``"auto"``, ``"none"``, ``"required"``, a tool's name or an OpenAI
        named-function dict) wins over ``tool_required``, which asks for ``"required"``.
        ``strict=True`` asks the node to follow each tool's parameter schema exactly (OpenAI's
        structured outputs: every function is sent ``"strict": true``, its parameters closed
        to other properties), as llama-index's OpenAI LLM does.
        """
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            messages.append(user_msg)
        request: dict[str, Any] = {"messages": messages, **kwargs}
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        if strict:
            for spec in specs:
                function = spec.get("function")
                if spec.get("type") == "function" and isinstance(function, dict):
                    function["strict"] = True
                    parameters = function.get("parameters")
                    if isinstance(parameters, dict):
                        parameters["additionalProperties"] = False
        if specs:
            request["tools"] = specs
            request["tool_choice"] = _resolve_tool_choice(tool_choice, tool_required)
            if not allow_parallel_tool_calls:
                request["parallel_tool_calls"] = False
        return request

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """Keep only the first tool call when parallel calls were not allowed."""
        if not allow_parallel_tool_calls:
            blocks = response.message.blocks
            calls = [b for b in blocks if isinstance(b, ToolCallBlock)]
            if len(calls) > 1:
                response.message.blocks = [
                    b for b in blocks if not isinstance(b, ToolCallBlock) or b is calls[0]
                ]
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        """The tool calls of a response, or of a streamed chunk so far (partial JSON is read
        as far as it goes)."""
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call, got 0 ({response.message!s})")
        return [
            ToolSelection(
                tool_id=call.tool_call_id or "",
                tool_name=call.tool_name,
                tool_kwargs=parse_arguments(call.tool_kwargs),
            )
            for call in calls
        ]


def _check_routing_mode(policy: object, accelerator: str | None) -> None:
    """Refuse a policy and an accelerator together, with the error ``infer`` raises for them."""
    if policy is not None and accelerator is not None:
        raise zml.InvalidRequestError(
            "pass either policy= or accelerator=, not both: accelerator= pins one family "
            "(the 0.2 style), a policy gives a chain",
            param="accelerator",
        )


def _resolve_tool_choice(
    tool_choice: str | dict[str, Any] | None, tool_required: bool
) -> str | dict[str, Any]:
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": tool_choice}}
    return tool_choice


def _prompt(prompt: str) -> list[ChatMessage]:
    return [ChatMessage(role=MessageRole.USER, content=prompt)]


def _completion(response: ChatResponse) -> CompletionResponse:
    """A chat response as a completion response: LlamaIndex's conversion, with the delta and
    the logprobs kept."""
    completion = chat_response_to_completion_response(response)
    completion.delta = response.delta
    completion.logprobs = response.logprobs
    return completion
