"""PagedRAG against a real `pagedrag serve` on loopback (base_url mode)."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.tools import FunctionTool
from llama_index.llms.pagedrag import PagedRAG
from testing_support import ENGINE_KWARGS, MAX_TOKENS

MESSAGES = [ChatMessage(role=MessageRole.SYSTEM, content="You answer in one short sentence."),
            ChatMessage(role=MessageRole.USER, content="What is the capital of France?")]


@pytest.fixture
def remote(server) -> PagedRAG:
    return PagedRAG(base_url=server, max_tokens=MAX_TOKENS)


def test_remote_answers_equal_in_process_answers(remote, llm):
    assert remote.chat(MESSAGES).message.content == llm.chat(MESSAGES).message.content
    assert remote.complete("The capital of France is").text == llm.complete("The capital of France is").text


def test_remote_reports_cached_tokens_from_usage(remote):
    remote.chat(MESSAGES)
    again = remote.chat(MESSAGES)
    assert again.additional_kwargs["cached_tokens"] > 0
    assert again.additional_kwargs["tier_cache_hits"] == {"host": 0, "disk": 0}  # the server has no KV tiers
    assert again.additional_kwargs["finish_reason"] in ("stop", "length")


def test_remote_streams(remote):
    whole = remote.chat(MESSAGES)
    pieces = list(remote.stream_chat(MESSAGES))
    assert pieces[-1].message.content == whole.message.content
    assert pieces[-1].additional_kwargs["prompt_tokens"] == whole.additional_kwargs["prompt_tokens"]
    assert "".join(p.delta for p in remote.stream_complete("One, two,")) == remote.complete("One, two,").text


@pytest.mark.asyncio
async def test_remote_async_forms(remote):
    whole = await remote.achat(MESSAGES)
    pieces = [piece async for piece in await remote.astream_chat(MESSAGES)]
    assert pieces[-1].message.content == whole.message.content
    assert (await remote.acomplete("One, two,")).text == remote.complete("One, two,").text


def test_remote_metadata_and_stats(remote):
    assert remote.metadata.context_window == ENGINE_KWARGS["max_model_len"]
    assert remote.metadata.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    remote.chat(MESSAGES)
    stats = remote.stats()
    assert stats["prefix_cache_queries"] > 0 and 0 <= stats["prefix_cache_hit_rate"] <= 1


def test_remote_bad_input_is_a_value_error(remote):
    with pytest.raises(ValueError, match="max_model_len"):
        remote.complete("word " * (ENGINE_KWARGS["max_model_len"] + 10))


def add(a: int, b: int) -> int:
    """Add two integers and return their sum."""
    return a + b


def test_remote_tool_calls_equal_in_process_ones(remote, llm):
    tool = FunctionTool.from_defaults(fn=add)
    forced = {"user_msg": "What is 2 plus 3?", "tool_required": True, "max_tokens": 48}

    def calls(response) -> list[tuple[str, dict]]:
        return [(s.tool_name, s.tool_kwargs) for s in remote.get_tool_calls_from_response(response)]

    over_http = remote.chat_with_tools([tool], **forced)
    streamed = list(remote.stream_chat_with_tools([tool], **forced))
    assert calls(over_http) == calls(streamed[-1]) == calls(llm.chat_with_tools([tool], **forced))
    assert over_http.message.additional_kwargs["tool_calls"][0]["function"]["name"] == "add"
