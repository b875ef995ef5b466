"""LangChain's standard unit tests for ChatZML (no network: the zml clients are built lazily)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.language_models import BaseChatModel
from langchain_tests.unit_tests import ChatModelUnitTests
from syrupy.assertion import SnapshotAssertion

from langchain_zml import ChatZML

MODEL = "meta-llama/llama-3-8b-instruct"


class TestChatZMLUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatZML]:
        return ChatZML

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": MODEL, "policy": "llama3-production"}

    @property
    def init_from_env_params(self) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
        return (
            {"ZML_API_KEY": "api_key"},
            {"model": MODEL, "policy": "llama3-production"},
            {"api_key": "api_key"},
        )

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_anthropic_inputs(self) -> bool:
        return True

    @pytest.mark.xfail(
        reason=(
            "dumpd() matches the snapshot, but langchain-core's load(allowed_objects='all') "
            "admits only the classes listed in langchain_core.load.mapping, which a "
            "third-party package cannot join; the round trip with an explicit allowlist is "
            "tested in test_chat_models.py::test_serialization_round_trip"
        ),
        raises=ValueError,
        strict=True,
    )
    def test_serdes(self, model: BaseChatModel, snapshot: SnapshotAssertion) -> None:
        super().test_serdes(model, snapshot)
