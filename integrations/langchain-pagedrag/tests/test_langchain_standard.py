"""langchain-tests' standard unit suite for ChatPagedRAG."""

from __future__ import annotations

from langchain_pagedrag import ChatPagedRAG
from langchain_tests.unit_tests import ChatModelUnitTests


class TestChatPagedRAGStandard(ChatModelUnitTests):
    """Skipped by the suite itself: test_serdes, because ChatPagedRAG is not marked
    serializable. It could not pass if it were: langchain-core's ``load`` only revives
    classes on its built-in allowlist (langchain_core.load.mapping), which a third-party
    package is not on, so ``dumpd`` works but the round trip is refused."""

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

    @property
    def has_tool_calling(self) -> bool:
        """Not applicable: ChatPagedRAG does not implement tool calling (the server refuses
        `tools` too), so the tool-binding tests have nothing to bind."""
        return False

    @property
    def has_structured_output(self) -> bool:
        """Not applicable: no tool calling, JSON mode or schema-guided decoding to build it on."""
        return False
