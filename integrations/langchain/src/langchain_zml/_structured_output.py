"""Tool binding and structured output: the request fields and the parsers for each method.

Nodes speak the OpenAI protocol, so tools are OpenAI function tools, a forced call is
``tool_choice`` ``"required"`` or a named function, and structured output is either a forced
call of one function (``function_calling``) or ``response_format`` (``json_schema``,
``json_mode``). What LangChain code passes in (pydantic classes, TypedDicts, JSON schemas,
functions, tools) is normalised by LangChain's ``convert_to_openai_tool``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import LanguageModelInput
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import (
    BaseOutputParser,
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

__all__ = [
    "StructuredOutputMethod",
    "output_parser",
    "structured_request",
    "tool_choice_param",
    "with_parser",
]

StructuredOutputMethod = Literal["function_calling", "json_schema", "json_mode"]


def tool_choice_param(choice: Any, tools: Sequence[Mapping[str, Any]]) -> Any:
    """The OpenAI ``tool_choice`` for LangChain's: "any"/True force a call, a name that tool.

    Returns None for "no preference" (None or False): the node decides.
    """
    if choice is None or choice is False:
        return None
    if choice is True or choice in ("any", "required"):
        return "required"
    if choice in ("auto", "none"):
        return choice
    if isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if choice not in names:
            raise ValueError(f"tool_choice={choice!r} names no bound tool; the tools are {names}")
        return {"type": "function", "function": {"name": choice}}
    if isinstance(choice, Mapping):
        return dict(choice)
    raise ValueError(
        f"tool_choice must be 'auto', 'any', 'required', 'none', a tool name, a bool or an "
        f"OpenAI tool_choice dict, got {choice!r}"
    )


def structured_request(
    schema: Any, method: StructuredOutputMethod, strict: bool | None
) -> dict[str, Any]:
    """The request fields that make the node answer in ``schema`` (bind them to the model).

    ``ls_structured_output_format`` is for LangChain's tracing; the model drops it before
    sending.
    """
    trace = {
        "ls_structured_output_format": {
            "kwargs": {"method": method, "strict": strict},
            "schema": schema,
        }
    }
    if method == "json_mode":
        fields: dict[str, Any] = {"response_format": {"type": "json_object"}}
        return {**fields, **trace} if schema is not None else fields
    if schema is None:
        raise ValueError(f"method={method!r} needs a schema; only json_mode can go without")
    tool = convert_to_openai_tool(schema, strict=strict)
    function = tool["function"]
    if method == "function_calling":
        return {
            "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": function["name"]}},
            **trace,
        }
    if method == "json_schema":
        spec: dict[str, Any] = {"name": function["name"], "schema": function["parameters"]}
        if function.get("description"):
            spec["description"] = function["description"]
        if strict is not None:
            spec["strict"] = strict
        return {"response_format": {"type": "json_schema", "json_schema": spec}, **trace}
    raise ValueError(
        f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}"
    )


def output_parser(
    schema: Any, method: StructuredOutputMethod
) -> BaseOutputParser[Any] | Runnable[AIMessage, Any]:
    """The parser of the answer: a pydantic instance for a pydantic class, else a dict."""
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    if method == "function_calling":
        if is_pydantic:
            return PydanticToolsParser(tools=[schema], first_tool_only=True)
        name = convert_to_openai_tool(schema)["function"]["name"]
        return JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    if is_pydantic:
        return PydanticOutputParser(pydantic_object=schema)
    return JsonOutputParser()


def with_parser(
    llm: Runnable[LanguageModelInput, AIMessage],
    parser: Runnable[AIMessage, Any],
    include_raw: bool,
) -> Runnable[LanguageModelInput, Any]:
    """``llm | parser``, or with ``include_raw`` a dict of raw, parsed and parsing_error."""
    if not include_raw:
        return llm | parser
    parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    )
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")
