"""ChatPagedRAG in process: every call form, usage and response metadata, one-batch
submission, stats and the shared engine."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, SystemMessage
from langchain_pagedrag import ChatPagedRAG
from pagedrag.client import RemoteError
from testing_support import ENGINE_KWARGS, TIERED_REPLY, answering_with

MESSAGES = [SystemMessage("You answer in one short sentence."), HumanMessage("What is the capital of France?")]
FIGURES = {"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_hit_rate", "model_name",
           "tier_cache_hits", "prefix_cache_hits", "chunk_cache_hits", "chunk_tokens_recomputed",
           "prompt_tokens_computed"}


def test_invoke_reports_usage_and_cache_figures(chat):
    chat.invoke(MESSAGES)
    reply = chat.invoke(MESSAGES)
    usage = reply.usage_metadata
    assert reply.content and set(reply.response_metadata) == FIGURES
    assert usage["input_tokens"] == reply.response_metadata["prompt_tokens"]
    assert usage["output_tokens"] == reply.response_metadata["completion_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_token_details"]["cache_read"] == reply.response_metadata["cached_tokens"] > 0
    assert reply.response_metadata["prefix_cache_hits"] == reply.response_metadata["cached_tokens"]
    assert reply.response_metadata["chunk_cache_hits"] == 0  # chunk reuse is off
    assert reply.response_metadata["tier_cache_hits"] == {"host": 0, "disk": 0}  # and so are KV tiers
    assert usage["input_token_details"]["cache_read_by_tier"] == {"host": 0, "disk": 0}
    computed = usage["input_tokens"] - usage["input_token_details"]["cache_read"]
    assert reply.response_metadata["prompt_tokens_computed"] == computed
    assert reply.response_metadata["model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_tier_hits_sit_next_to_cache_read():
    """A reply whose cache hits came from the KV tiers reports each tier's share next to
    ``cache_read`` (in a dict, outside the int details that LangChain's standard tests take
    for disjoint parts of input_tokens) and in response_metadata, whole and streamed."""
    chat = answering_with(ChatPagedRAG(), TIERED_REPLY)
    chunks = list(chat.stream(MESSAGES))
    for reply in (chat.invoke(MESSAGES), sum(chunks[1:], chunks[0])):
        details = reply.usage_metadata["input_token_details"]
        assert details == {"cache_read": 32, "cache_read_by_tier": {"host": 16, "disk": 16}}
        assert reply.usage_metadata["input_tokens"] >= sum(v for v in details.values() if isinstance(v, int))
        assert reply.response_metadata["tier_cache_hits"] == {"host": 16, "disk": 16}


def test_stream_adds_up_to_invoke(chat):
    reply = chat.invoke(MESSAGES)
    chunks = list(chat.stream(MESSAGES))
    total = sum(chunks[1:], chunks[0])
    assert isinstance(total, AIMessageChunk) and total.content == reply.content
    assert total.usage_metadata["input_tokens"] == reply.usage_metadata["input_tokens"]
    assert total.response_metadata["finish_reason"] == reply.response_metadata["finish_reason"]


@pytest.mark.asyncio
async def test_async_forms_match_the_sync_ones(chat):
    reply = chat.invoke(MESSAGES)
    assert (await chat.ainvoke(MESSAGES)).content == reply.content
    chunks = [chunk async for chunk in chat.astream(MESSAGES)]
    assert "".join(chunk.content for chunk in chunks) == reply.content
    assert chunks[-1].usage_metadata["input_token_details"]["cache_read"] > 0


def test_batch_is_one_engine_batch(chat, monkeypatch):
    """Every request is in the engine before its first step, and the answers are the
    ones invoke gives."""
    questions = [f"What is {n} plus {n}?" for n in range(1, 6)]
    engine = chat.client.shared.engine.engine
    events = []
    add_request, step = engine.add_request, engine.step
    monkeypatch.setattr(engine, "add_request", lambda *a, **k: events.append("add") or add_request(*a, **k))
    monkeypatch.setattr(engine, "step", lambda: events.append("step") or step())
    replies = chat.batch(questions)
    assert events[:len(questions)] == ["add"] * len(questions) and "add" not in events[len(questions):]
    monkeypatch.undo()
    assert [r.content for r in replies] == [chat.invoke(q).content for q in questions]


@pytest.mark.asyncio
async def test_abatch_matches_batch(chat):
    questions = ["What is one plus one?", "Name a color."]
    assert [r.content for r in await chat.abatch(questions)] == [r.content for r in chat.batch(questions)]


def test_a_failed_batch_cancels_the_other_inputs(chat, monkeypatch):
    """Without return_exceptions the first error is raised once the other inputs are cancelled
    (which aborts their engine requests), not left generating behind the caller's back."""
    import asyncio

    cancelled = []

    async def ainvoke(self, one, config=None, **kwargs):
        if one == "bad":
            raise ValueError("a bad input")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(one)
            raise

    monkeypatch.setattr(ChatPagedRAG, "ainvoke", ainvoke)
    with pytest.raises(ValueError, match="a bad input"):
        chat.batch(["a", "bad", "b"])
    assert sorted(cancelled) == ["a", "b"]


def test_copies_connect_afresh_and_a_used_model_pickles(chat):
    """A copy may name another engine or server: it connects on its first use; a model used
    already copies and pickles (the engine client is left behind, and found again)."""
    import copy
    import pickle

    answer = chat.invoke(MESSAGES).content
    elsewhere = chat.model_copy(update={"base_url": "http://127.0.0.1:9", "engine_kwargs": {}, "max_retries": 0})
    with pytest.raises(RemoteError, match="Connection error"):
        elsewhere.invoke(MESSAGES)
    for again in (pickle.loads(pickle.dumps(chat)), copy.deepcopy(chat)):
        assert again.invoke(MESSAGES).content == answer and again.client.shared is chat.client.shared


def test_none_per_call_means_the_models_setting_and_tokens_are_the_engines(chat):
    assert chat.invoke(MESSAGES, temperature=None, top_p=None, n=None).content == chat.invoke(MESSAGES).content
    text = "Paged attention stores the KV cache in blocks."
    assert chat.get_token_ids(text) == chat.client.shared.tokenizer.encode(text, add_special_tokens=False)
    assert chat.get_num_tokens(text) == len(chat.get_token_ids(text))


def test_call_time_stop_and_max_tokens(chat):
    reply = chat.invoke("Count from one to ten in words, separated by commas.", max_tokens=3)
    assert reply.response_metadata["completion_tokens"] == 3
    assert reply.response_metadata["finish_reason"] == "length"
    stopped = chat.invoke(MESSAGES, stop=[" of"])
    assert stopped.content == "The capital" and stopped.response_metadata["finish_reason"] == "stop"


def test_stats_and_the_shared_engine(chat):
    chat.invoke(MESSAGES)
    stats = chat.stats()
    assert stats["prefix_cache_queries"] > 0 and stats["max_model_len"] == ENGINE_KWARGS["max_model_len"]
    same = ChatPagedRAG(engine_kwargs={**ENGINE_KWARGS, "block_size": 16}, temperature=0.7)
    assert same.client.shared is chat.client.shared


def test_non_text_content_is_refused(chat):
    image = HumanMessage(content=[{"type": "text", "text": "What is this?"},
                                  {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}])
    with pytest.raises(TypeError, match="image_url"):
        chat.invoke([image])


def test_text_blocks_are_text(chat):
    blocks = HumanMessage(content=[{"type": "text", "text": "What is the capital"}, "of France?"])
    assert chat.invoke([blocks]).content == chat.invoke("What is the capital\nof France?").content


def test_a_prompt_longer_than_the_context_window_is_a_value_error(chat):
    with pytest.raises(ValueError, match="max_model_len"):
        chat.invoke("word " * (ENGINE_KWARGS["max_model_len"] + 10))


def test_leaving_a_stream_early_aborts_the_request(chat):
    stream = chat.stream("Count from one to a hundred.", max_tokens=200)
    next(stream)
    stream.close()
    stats = chat.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def test_truncate_prompt_tokens_rescues_a_too_long_prompt():
    """vLLM's truncate_prompt_tokens (a model_kwargs field) keeps the last tokens before the
    prompt's length (over max_model_len, 2048) is checked."""
    chat = ChatPagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=2, model_kwargs={"truncate_prompt_tokens": 100})
    assert chat.invoke("hello " * 2100).usage_metadata["input_tokens"] == 100
