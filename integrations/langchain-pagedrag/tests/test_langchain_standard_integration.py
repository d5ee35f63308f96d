"""langchain-tests' standard integration suite for ChatPagedRAG, on the embedded
SmolLM2-135M-Instruct in process."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage
from langchain_pagedrag import ChatPagedRAG
from langchain_tests.integration_tests import ChatModelIntegrationTests
from testing_support import ENGINE_KWARGS

CACHED_PROMPT = "Name three colors of the rainbow."


class TestChatPagedRAGIntegration(ChatModelIntegrationTests):
    """The suite as published. Tools, tool choice and structured output are on (a forced
    choice and a schema are grammars in the engine); images, audio, PDF and video inputs
    are off (text only). Three tests are expected to fail, for the reasons they give: what
    they check is left to the model there, and a 135M model does not do it."""

    @property
    def chat_model_class(self) -> type[ChatPagedRAG]:
        return ChatPagedRAG

    @property
    def chat_model_params(self) -> dict:
        """max_tokens 64: the suite's forced calls take at most 49 tokens here."""
        return {"engine_kwargs": ENGINE_KWARGS, "max_tokens": 64}

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        """The default method (json_schema), with the tokens a joke's JSON takes here (about
        40): replies that ramble on are cut sooner, and still parse as partial JSON."""
        return {"max_tokens": 48}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A reply to a prompt asked just before, so its prefix is read from the cache."""
        model = ChatPagedRAG(**{**self.chat_model_params, "max_tokens": 1})
        model.invoke(CACHED_PROMPT)
        if not stream:
            return model.invoke(CACHED_PROMPT)
        chunks = list(model.stream(CACHED_PROMPT))
        return sum(chunks[1:], chunks[0])

    @pytest.mark.xfail(strict=True, reason=(
        "JSON mode constrains a reply to JSON, not to the keys the prompt asks for: SmolLM2-135M-Instruct replies "
        "[1, \"setup\", 2, \"punchline\"] (pagedrag's json_object grammar admits any JSON value, not only an "
        "object), and constrained to an object it nests {\"setup\": {\"setup\": ...; it never writes both keys as "
        "strings. test_langchain_tools.py runs json_mode with a prompt this model follows"))
    def test_json_mode(self, model) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(strict=True, reason=(
        "With no tool_choice ('auto') a call is the model's own choice, and SmolLM2-135M-Instruct answers 'What is "
        "the weather in San Francisco, CA?' in prose instead of writing a <tool_call>. Forced calls pass "
        "(test_tool_calling, test_tool_choice), and so do tool results sent back "
        "(test_tool_message_histories_*)"))
    def test_agent_loop(self, model) -> None:
        super().test_agent_loop(model)

    @pytest.mark.xfail(strict=True, reason=(
        "Forced to call unicode_customer for the Chinese prompt, SmolLM2-135M-Instruct writes customer_name "
        "'你好啊集团' intact, then copies the tool's docstring into description over and over (still open after 400 "
        "tokens), so the call never closes and comes back as text. For the Japanese prompt it closes the call in 49 "
        "tokens with 'こんにちは株式会社' intact; test_langchain_tools.py checks unicode arguments both ways"))
    def test_unicode_tool_call_integration(self, model, *, tool_choice=None, force_tool_call=True) -> None:
        super().test_unicode_tool_call_integration(model, tool_choice=tool_choice, force_tool_call=force_tool_call)
