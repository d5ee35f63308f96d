"""PagedRAGLLM, the completion model: prompts go to the engine as they are."""

from __future__ import annotations

import pytest
from langchain_pagedrag import PagedRAGLLM
from testing_support import ENGINE_KWARGS, MAX_TOKENS, TIERED_REPLY, answering_with

PROMPTS = ["Python's json module turns Python objects into JSON text and back again. The function that "
           "returns a JSON string is called", "One, two, three,"]


@pytest.fixture
def llm() -> PagedRAGLLM:
    return PagedRAGLLM(engine_kwargs=ENGINE_KWARGS, max_tokens=MAX_TOKENS)


def test_generate_reports_cache_figures_per_prompt_and_in_total(llm):
    llm.invoke(PROMPTS[0])
    result = llm.generate(PROMPTS)
    infos = [generations[0].generation_info for generations in result.generations]
    assert infos[0]["prompt_tokens"] > 16 and infos[0]["cached_tokens"] >= 16  # the repeat hits its full blocks
    assert infos[0]["finish_reason"] == "length" and infos[0]["completion_tokens"] == MAX_TOKENS
    assert result.llm_output["token_usage"]["prompt_tokens"] == sum(info["prompt_tokens"] for info in infos)
    assert infos[0]["tier_cache_hits"] == result.llm_output["token_usage"]["tier_cache_hits"] == {"host": 0, "disk": 0}
    assert result.llm_output["model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_token_usage_adds_up_the_tier_hits_tier_by_tier():
    result = answering_with(PagedRAGLLM(), TIERED_REPLY).generate(PROMPTS)
    assert [g[0].generation_info["tier_cache_hits"] for g in result.generations] == [{"host": 16, "disk": 16}] * 2
    assert result.llm_output["token_usage"]["tier_cache_hits"] == {"host": 32, "disk": 32}


def test_invoke_batch_and_stream_agree(llm):
    whole = [llm.invoke(prompt) for prompt in PROMPTS]
    assert llm.batch(PROMPTS) == whole
    assert "".join(llm.stream(PROMPTS[0])) == whole[0]


@pytest.mark.asyncio
async def test_async_forms_agree(llm):
    assert await llm.ainvoke(PROMPTS[1]) == llm.invoke(PROMPTS[1])
    assert await llm.abatch(PROMPTS) == llm.batch(PROMPTS)
    assert "".join([piece async for piece in llm.astream(PROMPTS[1])]) == llm.invoke(PROMPTS[1])


def test_shares_the_engine_of_the_chat_model(llm, chat):
    assert llm.client.shared is chat.client.shared
    assert llm.stats() == chat.stats()


@pytest.mark.asyncio
async def test_batch_with_return_exceptions_fails_only_the_bad_prompt(llm):
    """As ChatPagedRAG's batch: a prompt too long for max_model_len fails alone."""
    prompts = [PROMPTS[1], "x " * 3000, PROMPTS[1]]
    for results in (llm.batch(prompts, return_exceptions=True), await llm.abatch(prompts, return_exceptions=True)):
        assert results[0] == results[2] == llm.invoke(PROMPTS[1])
        assert isinstance(results[1], ValueError) and "max_model_len" in str(results[1])


def test_batch_is_one_engine_batch(llm, monkeypatch):
    engine = llm.client.shared.engine.engine
    events = []
    add_request, step = engine.add_request, engine.step
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: events.append("add") or add_request(*a, **k))
    monkeypatch.setattr(engine, "step", lambda: events.append("step") or step())
    llm.batch(PROMPTS * 2)
    assert events[:4] == ["add"] * 4 and "add" not in events[4:]
