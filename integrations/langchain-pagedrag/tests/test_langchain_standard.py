"""langchain-tests' standard unit suite for ChatPagedRAG."""

from __future__ import annotations

import pytest
from langchain_pagedrag import ChatPagedRAG
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatPagedRAGStandard(ChatModelUnitTests):
    """The suite as published (tool calling and structured output detected from bind_tools and
    with_structured_output); test_serdes is expected to fail for the reason it gives."""

    @pytest.mark.xfail(strict=True, reason=(
        "load(allowed_objects='all') revives only classes on langchain-core's built-in allowlist "
        "(langchain_core.load.mapping), which no third-party class is on; the same round trip with "
        "allowed_objects=[ChatPagedRAG] passes (test_langchain_dropin.py)"))
    def test_serdes(self, model, snapshot) -> None:
        super().test_serdes(model, snapshot)

    @property
    def chat_model_class(self) -> type[ChatPagedRAG]:
        return ChatPagedRAG

    @property
    def chat_model_params(self) -> dict:
        return {"model": "HuggingFaceTB/SmolLM2-135M-Instruct"}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return ({"PAGEDRAG_BASE_URL": "http://127.0.0.1:8000", "PAGEDRAG_API_KEY": "secret"}, {},
                {"base_url": "http://127.0.0.1:8000", "api_key": "secret"})
