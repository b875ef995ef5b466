"""LangChain's standard integration tests for ChatZML, against simulated nodes on loopback.

Feature flags are set to what ChatZML supports: tool calling with tool_choice, structured output
(function calling, json_schema, json_mode), usage in streams, per-call model override. Image,
PDF and audio inputs are off (those tests fetch files from the internet).

The overrides below are marked xfail because the *simulated node* does not yet produce what
the test asserts (ChatZML sends the right request; the node's reply is random but
schema-valid); each reason names the missing sim feature. Remove them once zml.sim has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_zml import ChatZML

from .conftest import MODEL, OTHER_MODEL, POLICY

SIM_ARGS_FROM_PROMPT = (
    "zml.sim lacks tool-call arguments taken from the prompt: it answers "
    "'What is the value of magic_function(3)?' with a random schema-valid input, not 3"
)
SIM_QUOTED_ARGS = (
    "zml.sim lacks tool-call arguments taken from the prompt: a quoted name "
    "('你好啊集团') should fill the string argument customer_name"
)
SIM_AUTO_TOOL_WORDS = (
    "zml.sim's tool_choice 'auto' calls a tool only when its whole name appears in the last "
    "message; 'What is the weather in San Francisco, CA?' does not call get_weather"
)
SIM_JSON_OBJECT_KEYS = (
    "zml.sim answers response_format json_object with {'answer', 'confidence'} whatever the "
    "prompt asks; the test asks for 'setup' and 'punchline' keys"
)


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

    @pytest.mark.xfail(reason=SIM_ARGS_FROM_PROMPT, raises=AssertionError)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_tool_calling(self, model: BaseChatModel) -> None:
        super().test_tool_calling(model)

    @pytest.mark.xfail(reason=SIM_ARGS_FROM_PROMPT, raises=AssertionError)
    async def test_tool_calling_async(self, model: BaseChatModel) -> None:
        await super().test_tool_calling_async(model)

    @pytest.mark.xfail(reason=SIM_QUOTED_ARGS, raises=AssertionError)
    def test_unicode_tool_call_integration(
        self,
        model: BaseChatModel,
        *,
        tool_choice: str | None = None,
        force_tool_call: bool = True,
    ) -> None:
        super().test_unicode_tool_call_integration(
            model, tool_choice=tool_choice, force_tool_call=force_tool_call
        )

    @pytest.mark.xfail(reason=SIM_AUTO_TOOL_WORDS, raises=AssertionError)
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: BaseChatModel) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(reason=SIM_JSON_OBJECT_KEYS)
    def test_json_mode(self, model: BaseChatModel) -> None:
        super().test_json_mode(model)
