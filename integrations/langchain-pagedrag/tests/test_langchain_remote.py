"""ChatPagedRAG and PagedRAGLLM against a real `pagedrag serve` on loopback (base_url mode)."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_pagedrag import ChatPagedRAG, PagedRAGLLM
from pydantic import BaseModel, Field
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
    assert again.response_metadata["tier_cache_hits"] == {"host": 0, "disk": 0}  # the server has no KV tiers
    assert again.usage_metadata["input_token_details"]["cache_read_by_tier"] == {"host": 0, "disk": 0}


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


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class City(BaseModel):
    """A city the text names."""

    name: str = Field(max_length=20)


def test_remote_tool_calls_and_structured_output(server):
    """Tools reach the server and calls come back, whole or streamed; a schema reaches it
    as structured_outputs."""
    remote = ChatPagedRAG(base_url=server, max_tokens=32)
    forced = remote.bind_tools([add], tool_choice="add")
    reply = forced.invoke("What is 2 plus 3?")
    assert reply.response_metadata["finish_reason"] == "tool_calls" and reply.tool_calls[0]["name"] == "add"
    assert set(reply.tool_calls[0]["args"]) == {"a", "b"}
    chunks = list(forced.stream("What is 2 plus 3?"))
    assert sum(chunks[1:], chunks[0]).tool_calls[0]["args"] == reply.tool_calls[0]["args"]
    assert isinstance(remote.with_structured_output(City).invoke("I live in Paris."), City)


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
