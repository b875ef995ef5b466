"""``ChatZML``: a LangChain chat model whose requests zml routes across an inference fleet.

The model is a thin shell over ``zml.Client`` / ``zml.AsyncClient``: it turns LangChain
messages and options into one ``infer`` request (:meth:`ChatZML._request`, shared by the four
entry points), and the answer back into LangChain messages (:mod:`langchain_zml._responses`).
Routing, failover, timeouts and policy validation are zml's; its errors (``RoutingError``,
``PolicyConfigError``, ``InvalidRequestError``, node errors) reach the caller unchanged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from langchain_core.utils import secret_from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import (
    ConfigDict,
    Field,
    InstanceOf,
    PrivateAttr,
    SecretStr,
    field_validator,
    model_validator,
)

import zml

from ._messages import to_openai_messages
from ._responses import PROVIDER, ChunkConverter, chat_result
from ._structured_output import (
    StructuredOutputMethod,
    output_parser,
    structured_request,
    tool_choice_param,
    with_parser,
)

__all__ = ["ChatZML"]

_ROUTING_KWARGS = ("policy", "accelerator")
_RESERVED_MODEL_KWARGS = frozenset(
    {"model", "messages", "policy", "accelerator", "metadata", "timeout", "stream"}
    | {"temperature", "max_tokens", "stop", "extra_body"}
)
# OpenAI chat parameters that are ChatZML fields, sent when set (not None). They may also come
# in model_kwargs (the 0.1 way), but not both ways at once.
_PARAM_FIELDS = (
    "temperature",
    "max_tokens",
    "top_p",
    "seed",
    "n",
    "logprobs",
    "top_logprobs",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "reasoning_effort",
)


class ChatZML(BaseChatModel):
    """Chat model served by a zml fleet: each request goes to the node a routing policy picks.

    Setup:
        Install ``langchain-zml`` and describe the fleet in a ``zml.toml`` (accelerator
        families, nodes, named policies); zml finds it through ``config=``, ``$ZML_CONFIG`` or
        ``./zml.toml``. ``$ZML_API_KEY`` is sent to nodes as a Bearer token.

    Instantiate:
        ```python
        from langchain_zml import ChatZML

        llm = ChatZML(
            model="meta-llama/llama-3-8b-instruct",
            policy="llama3-production",  # a [policies.NAME] of zml.toml, a zml.Policy or a dict
            temperature=0,
            max_tokens=256,
        )
        ```

    Invoke:
        ```python
        msg = llm.invoke("Why route by accelerator family?")
        msg.response_metadata["zml_routing"]
        # {'node_id': 'h100-a', 'accelerator': 'H100', 'policy': 'llama3-production',
        #  'queue_depth': 0, 'attempts': [], 'evaluated': [...], ...}
        ```

    Stream (routing and usage arrive once, on the final chunk):
        ```python
        full = None
        for chunk in llm.stream("Hello"):
            full = chunk if full is None else full + chunk
        full.response_metadata["zml_routing"], full.usage_metadata
        ```

    Async: ``await llm.ainvoke(...)``, ``async for chunk in llm.astream(...)``.

    Tool calling: ``llm.bind_tools([tool, ...], tool_choice="any")`` (OpenAI function tools;
    "any"/True force a call, a tool's name forces that tool).

    Structured output: ``llm.with_structured_output(Schema, method=...)`` with
    ``"function_calling"`` (the default), ``"json_schema"`` or ``"json_mode"``.

    Sampling and output options are ChatOpenAI's constructor fields (``top_p``, ``seed``,
    ``n``, ``logprobs``, ``top_logprobs``, ``frequency_penalty``, ``presence_penalty``,
    ``logit_bias``, ``reasoning_effort``, ``stop``, ``extra_body``...); a misspelled field is
    refused. Logprobs arrive in ``response_metadata["logprobs"]``, streamed too.

    Per-call options: ``model=``, ``policy=``, ``accelerator=``, ``zml_metadata=``,
    ``stream_usage=`` and any OpenAI chat parameter (``seed``, ``top_p``, ...); zml refuses
    unknown parameter names with ``zml.InvalidRequestError``.

    Errors: ``zml.RoutingError`` (no node could take the request; ``.routing_context`` says
    why), ``zml.PolicyConfigError`` (a bad policy or zml.toml) and the other ``zml.ZMLError``
    subclasses propagate unchanged. ``policy=`` and ``accelerator=`` together raise
    ``zml.InvalidRequestError`` at construction, as they do on a call.

    Serialization: ``dumps``/``loads`` carry a ``zml.Policy`` as the dict of its fields,
    which ``policy=`` takes and routes the same.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", protected_namespaces=())

    model: str = Field(alias="model_name")
    """The model name, as the fleet's nodes serve it."""
    policy: str | InstanceOf[zml.Policy] | dict[str, Any] | None = None
    """The routing policy: a ``[policies.NAME]`` of zml.toml, a ``zml.Policy`` or a dict of
    Policy fields. None: any healthy node serving the model. Resolved on the first call."""
    accelerator: str | None = None
    """Pin one accelerator family instead of a policy (zml 0.2 style)."""
    api_key: SecretStr | None = Field(default_factory=secret_from_env("ZML_API_KEY", default=None))
    """Bearer token for the nodes (default: ``$ZML_API_KEY``)."""
    config: str | Path | InstanceOf[zml.Registry] | None = None
    """A zml.toml path or a ``zml.Registry`` (default: ``$ZML_CONFIG``, else ``./zml.toml``)."""
    temperature: float | None = None
    """Sampling temperature."""
    max_tokens: int | None = Field(default=None, ge=1, alias="max_completion_tokens")
    """Most tokens to generate (alias ``max_completion_tokens``, as in ChatOpenAI)."""
    top_p: float | None = Field(default=None, ge=0, le=1)
    """Nucleus sampling: the probability mass to sample from."""
    seed: int | None = None
    """Sampling seed, for reproducible answers where the node supports it."""
    n: int | None = Field(default=None, ge=1)
    """Choices to generate per prompt: ``generate``/``batch`` results hold one generation each;
    ``invoke`` returns the first, and ``stream`` yields it whole (n > 1 is never streamed)."""
    logprobs: bool | None = None
    """Return token log-probabilities (in ``response_metadata["logprobs"]``)."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """Most likely alternatives per token, with ``logprobs=True``."""
    frequency_penalty: float | None = None
    """Penalise tokens by how often they already appeared."""
    presence_penalty: float | None = None
    """Penalise tokens that already appeared."""
    logit_bias: dict[int, int] | None = None
    """Token id to bias (-100 to 100) added to its logit."""
    reasoning_effort: str | None = None
    """For reasoning models: ``"minimal"``, ``"low"``, ``"medium"`` or ``"high"``."""
    extra_body: dict[str, Any] | None = None
    """Node-specific fields merged into every request body (vLLM's ``top_k``,
    ``repetition_penalty``, ...); a per-call ``extra_body`` adds to it, key by key."""
    timeout: float | InstanceOf[zml.Timeouts] | None = None
    """Overall deadline per request, in seconds, or a ``zml.Timeouts`` (None: zml's default)."""
    max_retries: int = Field(default=2, ge=0)
    """Failover attempts after the first dispatch: zml's ``max_attempts`` is
    ``max_retries + 1`` (the default 2 gives 3 dispatches at most)."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Default stop sequences (None or ``[]``: none); one string is one sequence."""
    streaming: bool = False
    """Stream from the node even on ``invoke`` (callbacks then see each token)."""
    stream_usage: bool = True
    """Ask the node for token usage at the end of a stream."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other OpenAI chat parameters sent with every request (``seed``, ``top_p``, ...)."""
    zml_metadata: dict[str, Any] | None = None
    """Labels (team, service...) passed to zml's plugins and echoed in the routing info."""

    _clients: zml.LoopClients = PrivateAttr(default_factory=zml.LoopClients)

    def __copy__(self) -> ChatZML:
        """A copy (``model_copy``, ``copy.copy``) with zml clients of its own, built on its
        first call from its own fields: pydantic's copy shares private attributes, so a copy
        made with ``update={"api_key": ...}`` (or another config) would otherwise send the
        original's key to the original's fleet, or lend it its own."""
        copied = super().__copy__()
        copied._clients = zml.LoopClients()
        return copied

    @property
    def model_name(self) -> str:
        """``model``, under ChatOpenAI's attribute name (also accepted as an argument)."""
        return self.model

    @field_validator("config", mode="before")
    @classmethod
    def _config_path_as_text(cls, value: Any) -> Any:
        # A path is kept as its text, which dumps()/loads() can carry (a Path they cannot).
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("timeout", mode="before")
    @classmethod
    def _timeouts_from_their_fields(cls, value: Any) -> Any:
        # The mapping dumps() writes for a zml.Timeouts (see lc_attributes), read back.
        if isinstance(value, dict):
            return zml.Timeouts(**value)
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("model_kwargs")
    @classmethod
    def _no_reserved_model_kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        reserved = sorted(set(value) & _RESERVED_MODEL_KWARGS)
        if reserved:
            raise ValueError(
                f"model_kwargs may not set {reserved}: pass them as ChatZML fields (or per call)"
            )
        return value

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Here rather than in a validator: pydantic would wrap zml.InvalidRequestError (a
        # ValueError) in a ValidationError, and the caller is owed the error a call raises.
        if self.policy is not None and self.accelerator is not None:
            raise zml.InvalidRequestError(
                "pass either policy= or accelerator=, not both: accelerator= pins one family "
                "(the 0.2 style), a policy gives a chain",
                param="accelerator",
            )

    @model_validator(mode="after")
    def _fields_given_once(self) -> ChatZML:
        twice = sorted(
            k for k in self.model_kwargs if k in _PARAM_FIELDS and getattr(self, k) is not None
        )
        if twice:
            raise ValueError(f"{twice} given both as fields and in model_kwargs; pass them once")
        if self.n is not None and self.n > 1 and self.streaming:
            raise ValueError("n must be 1 when streaming=True (a stream yields one message)")
        return self

    # --- LangChain's model description -----------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "zml-chat"

    @property
    def _default_params(self) -> dict[str, Any]:
        """The OpenAI chat parameters this model sends with every request."""
        params: dict[str, Any] = dict(self.model_kwargs)
        for name in _PARAM_FIELDS:
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        if self.stop:
            params["stop"] = list(self.stop)
        if self.extra_body:
            params["extra_body"] = dict(self.extra_body)
        return params

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Model, policy and the request parameters: what callbacks see as
        ``invocation_params`` (with the per-call ones) and what caches key on."""
        policy = self.policy.name if isinstance(self.policy, zml.Policy) else self.policy
        return {"model": self.model, "policy": policy, **self._default_params}

    def _get_invocation_params(self, stop: list[str] | None = None,
                               **kwargs: Any) -> dict[str, Any]:
        # LangChain's sets "stop" to the per-call one, None when the call gives none; the
        # model's own stop sequences are sent then, so callbacks and caches see those.
        params = super()._get_invocation_params(stop=stop, **kwargs)
        if params.get("stop") is None and self.stop:
            params["stop"] = list(self.stop)
        return params

    def _should_stream(self, *, async_api: bool, **kwargs: Any) -> bool:
        # n > 1 gives several messages, which a stream cannot: stream() then yields the first
        # choice whole, as invoke() returns it (generate() returns them all).
        if self._choices(kwargs) > 1:
            return False
        return super()._should_stream(async_api=async_api, **kwargs)

    def _choices(self, kwargs: Mapping[str, Any]) -> int:
        n = kwargs.get("n", self.model_kwargs.get("n", self.n))
        return n if isinstance(n, int) else 1

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @property
    def lc_secrets(self) -> dict[str, str]:
        return {"api_key": "ZML_API_KEY"}

    @property
    def lc_attributes(self) -> dict[str, Any]:
        # dumps() would write a zml.Policy, zml.Timeouts or zml.Registry (not LangChain
        # Serializables) as "not_implemented", which loads() refuses; they go as plain data:
        # a Policy as its dict of fields (a policy= too: the client builds the same Policy
        # from it, against its own registry), Timeouts as its fields (read back by the
        # timeout validator), a Registry read from a file as that file's path.
        out: dict[str, Any] = {}
        if isinstance(self.policy, zml.Policy):
            out["policy"] = self.policy.model_dump(mode="json")
        if isinstance(self.timeout, zml.Timeouts):
            out["timeout"] = dataclasses.asdict(self.timeout)
        if isinstance(self.config, zml.Registry) and self.config.source is not None:
            out["config"] = self.config.source
        return out

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        model = kwargs.get("model")
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=model if isinstance(model, str) and model else self.model,
            ls_model_type="chat",
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        # Tracing metadata only: a malformed stop is refused by _request, inside the run.
        try:
            stop_sequences = _stop_list(stop) or _stop_list(kwargs.get("stop")) or self.stop
        except zml.InvalidRequestError:
            stop_sequences = self.stop
        if stop_sequences:
            params["ls_stop"] = list(stop_sequences)
        return params

    # --- the zml clients -------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "api_key": self.api_key.get_secret_value() if self.api_key is not None else None,
            "config": self.config,
            "max_attempts": self.max_retries + 1,
        }
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return options

    def _sync_client(self) -> zml.Client:
        return self._clients.sync(self._client_options)

    def _aclient(self) -> zml.AsyncClient:
        return self._clients.for_running_loop(self._client_options)

    def close(self) -> None:
        """Close the sync client's connections (a later call opens new ones)."""
        self._clients.close()

    async def aclose(self) -> None:
        """Close the async client's connections, if it belongs to the running event loop."""
        await self._clients.aclose()

    # --- one request, four ways --------------------------------------------------------------

    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: Mapping[str, Any],
        *,
        stream: bool,
    ) -> dict[str, Any]:
        """The arguments of ``infer`` / ``infer_stream`` for one call.

        Per-call values win over the model's; a per-call ``policy`` or ``accelerator``
        replaces the model's routing mode. Other keyword arguments are OpenAI chat
        parameters, passed through for zml to check.
        """
        call = dict(kwargs)
        call.pop("ls_structured_output_format", None)
        call.pop("stream", None)
        stream_usage = call.pop("stream_usage", self.stream_usage)
        if any(k in call for k in _ROUTING_KWARGS):
            routing = {
                "policy": call.pop("policy", None),
                "accelerator": call.pop("accelerator", None),
            }
        else:
            routing = {"policy": self.policy, "accelerator": self.accelerator}
        model = call.pop("model", None) or self.model
        metadata = call.pop("zml_metadata", self.zml_metadata)
        params = self._default_params
        params.pop("stop", None)
        stop_sequences = _stop_list(stop) if stop is not None else self.stop
        if stop_sequences:
            params["stop"] = stop_sequences
        if stream and "stream_options" not in call:
            params["stream_options"] = {"include_usage": bool(stream_usage)}
        extra_body = call.pop("extra_body", None)
        params.update(call)
        if extra_body:
            params["extra_body"] = {**params.get("extra_body", {}), **extra_body}
        return {
            "model": model,
            "messages": to_openai_messages(messages),
            **routing,
            "metadata": metadata,
            **params,
        }

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs, stream=False)
        return chat_result(self._sync_client().infer(**request))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        request = self._request(messages, stop, kwargs, stream=False)
        return chat_result(await self._aclient().infer(**request))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs, stream=True)
        converter = ChunkConverter()
        with self._sync_client().infer_stream(**request) as stream:
            for chunk in stream:
                generation = converter.chunk(chunk)
                if generation is not None:
                    if run_manager is not None:
                        run_manager.on_llm_new_token(generation.text, chunk=generation)
                    yield generation
        last = converter.last()
        if run_manager is not None:
            run_manager.on_llm_new_token("", chunk=last)
        yield last

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        request = self._request(messages, stop, kwargs, stream=True)
        converter = ChunkConverter()
        async with self._aclient().infer_stream(**request) as stream:
            async for chunk in stream:
                generation = converter.chunk(chunk)
                if generation is not None:
                    if run_manager is not None:
                        await run_manager.on_llm_new_token(generation.text, chunk=generation)
                    yield generation
        last = converter.last()
        if run_manager is not None:
            await run_manager.on_llm_new_token("", chunk=last)
        yield last

    # --- tools and structured output ---------------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[Mapping[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | bool | Mapping[str, Any] | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` accepts) to the model.

        Args:
            tools: the tools the model may call.
            tool_choice: None/"auto" lets the model decide; "any", "required" or True force a
                call; a tool's name forces that tool; "none" forbids calls.
            strict: ask the node to hold the arguments to the schemas exactly.
            parallel_tool_calls: whether the model may call several tools at once.
            **kwargs: other request parameters to bind.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        choice = tool_choice_param(tool_choice, formatted)
        if choice is not None:
            kwargs["tool_choice"] = choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: Mapping[str, Any] | type | None = None,
        *,
        method: StructuredOutputMethod = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """A runnable that answers in ``schema`` (pydantic class, TypedDict or JSON schema).

        Args:
            schema: the output schema; a pydantic class gives instances, anything else dicts.
                Optional for ``json_mode`` only.
            method: ``"function_calling"`` (a forced call of one tool), ``"json_schema"``
                (``response_format`` with the schema) or ``"json_mode"`` (any JSON object;
                say in the prompt which keys you want).
            include_raw: return ``{"raw", "parsed", "parsing_error"}`` instead of raising on a
                parse error.
            strict: ask the node to hold to the schema exactly (function_calling, json_schema).
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        llm = self.bind(**structured_request(schema, method, strict))
        return with_parser(llm, output_parser(schema, method), include_raw)


def _stop_list(stop: Any) -> list[str] | None:
    """A per-call ``stop`` as a list: one string is one sequence (as in openai-python)."""
    if stop is None:
        return None
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return list(stop)
    shown = repr(stop)
    if len(shown) > 60:
        shown = f"a {type(stop).__name__}"
    raise zml.InvalidRequestError(
        f"stop must be a string or a list of strings, got {shown}: pass stop='END' or "
        "stop=['END', '###']",
        param="stop",
    )
