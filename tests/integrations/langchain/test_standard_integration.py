"""LangChain's standard integration tests for ChatZML, against simulated nodes on loopback.

Feature flags are set to what ChatZML supports: tool calling with tool_choice, structured output
(function calling, json_schema, json_mode), usage in streams, per-call model override. Image,
PDF and audio inputs are off (those tests fetch files from the internet).

The simulated node's content is synthetic, but it follows the prompt where these tests need it
(see zml.sim.protocol): tool arguments from a call or a quoted string in the last user
message, tool_choice "auto" on a meaningful word of a tool's name, and json_object keys named
in quotes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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
