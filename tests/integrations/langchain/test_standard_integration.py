"""LangChain's standard integration tests for ChatZML, against simulated nodes on loopback.

Feature flags are set to what ChatZML supports: tool calling with tool_choice, structured output
(function calling, json_schema, json_mode), usage in streams with cached-input and reasoning
token details, Anthropic-style inputs (tool_use / thinking blocks, Anthropic tool schemas),
per-call model override. Image, PDF and audio inputs are off (those tests fetch files from the
internet).

The simulated node's content is synthetic, but it follows the prompt where these tests need it
(see zml.sim.protocol): tool arguments from a call or a quoted string in the last user
message, tool_choice "auto" on a meaningful word of a tool's name, and json_object keys named
in quotes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_zml import ChatZML

from .conftest import MODEL, OTHER_MODEL, POLICY


class TestChatZMLIntegration(ChatModelIntegrationTests):
    config_path: Path

    @pytest.fixture(autouse=True)
    def _fleet(self, zml_config: Path) -> None:
        self.config_path = zml_config

    @property
    def chat_model_class(self) -> type[ChatZML]:
        return ChatZML

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": MODEL, "policy": POLICY, "config": str(self.config_path)}

    @property
    def model_override_value(self) -> str:
        return OTHER_MODEL

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict[str, list[Any]]:
        details = ["cache_read_input", "reasoning_output"]
        return {"invoke": details, "stream": details}

    def _invoke(self, stream: bool, messages: list[Any], **kwargs: Any) -> AIMessage:
        model = ChatZML(**self.chat_model_params, **kwargs)
        if not stream:
            return model.invoke(messages)
        full: Any = None
        for chunk in model.stream(messages):
            full = chunk if full is None else full + chunk
        assert isinstance(full, AIMessage)
        return full

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        # The simulated node's prefix cache holds the earlier turns (whole 16-token blocks).
        history = [
            SystemMessage("You explain inference fleets. " * 8),
            HumanMessage("What is an accelerator family?"),
            AIMessage("A group of nodes with the same kind of accelerator."),
            HumanMessage("And a routing policy?"),
        ]
        message = self._invoke(stream, history)
        details = (message.usage_metadata or {}).get("input_token_details") or {}
        assert details.get("cache_read", 0) > 0  # the flag claims a real count, not a zero
        return message

    def invoke_with_reasoning_output(self, *, stream: bool = False) -> AIMessage:
        message = self._invoke(stream, [HumanMessage("Think, then answer.")], reasoning_effort="low")
        details = (message.usage_metadata or {}).get("output_token_details") or {}
        assert details.get("reasoning", 0) > 0
        return message
