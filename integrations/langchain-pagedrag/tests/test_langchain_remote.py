"""ChatPagedRAG and PagedRAGLLM against a real `pagedrag serve` on loopback (base_url mode)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_pagedrag import ChatPagedRAG, PagedRAGLLM
from testing_support import ENGINE_KWARGS, MAX_TOKENS

MESSAGES = [SystemMessage("You answer in one short sentence."), HumanMessage("What is the capital of France?")]


@pytest.fixture
def remote(server) -> ChatPagedRAG:
    return ChatPagedRAG(base_url=server, max_tokens=MAX_TOKENS)


def test_remote_answers_equal_in_process_answers(remote, chat):
    assert remote.invoke(MESSAGES).content == chat.invoke(MESSAGES).content


def test_remote_reports_cache_read_from_usage(remote):
    remote.invoke(MESSAGES)
    again = remote.invoke(MESSAGES)
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0
    assert again.response_metadata["cached_tokens"] == again.usage_metadata["input_token_details"]["cache_read"]


def test_remote_stream_batch_and_async(remote):
    reply = remote.invoke(MESSAGES)
    chunks = list(remote.stream(MESSAGES))
    assert "".join(c.content for c in chunks) == reply.content
    assert chunks[-1].usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert [r.content for r in remote.batch([MESSAGES, MESSAGES])] == [reply.content] * 2


@pytest.mark.asyncio
async def test_remote_async_forms(remote):
    reply = await remote.ainvoke(MESSAGES)
    assert "".join([c.content async for c in remote.astream(MESSAGES)]) == reply.content


def test_remote_completion_model(server):
    llm = PagedRAGLLM(base_url=server, max_tokens=MAX_TOKENS)
    result = llm.generate(["The capital of France is"])
    assert result.generations[0][0].text == llm.invoke("The capital of France is")
    assert result.generations[0][0].generation_info["prompt_tokens"] > 0


def test_remote_stats_and_bad_input(remote):
    remote.invoke(MESSAGES)
    assert remote.stats()["prefix_cache_queries"] > 0
    with pytest.raises(ValueError, match="max_model_len"):
        remote.invoke("word " * (ENGINE_KWARGS["max_model_len"] + 10))
