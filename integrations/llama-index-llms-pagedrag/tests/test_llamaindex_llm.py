"""PagedRAG as a LlamaIndex LLM, in process: every call form, its cache figures, metadata,
stats and the shared engine."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.llms.pagedrag import PagedRAG
from testing_support import ENGINE_KWARGS, TIERED_REPLY, answering_with

MESSAGES = [ChatMessage(role=MessageRole.SYSTEM, content="You answer in one short sentence."),
            ChatMessage(role=MessageRole.USER, content="What is the capital of France?")]
FIGURES = {"finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_hit_rate",
           "tier_cache_hits", "prefix_cache_hits", "chunk_cache_hits", "chunk_tokens_recomputed",
           "prompt_tokens_computed"}


def test_metadata_describes_the_engine(llm):
    metadata = llm.metadata
    assert metadata.context_window == ENGINE_KWARGS["max_model_len"]
    assert metadata.num_output == llm.max_tokens
    assert metadata.is_chat_model
    assert metadata.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_chat_reports_cache_figures_and_hits_on_a_repeat(llm):
    first = llm.chat(MESSAGES)
    second = llm.chat(MESSAGES)
    assert first.message.role == MessageRole.ASSISTANT and first.message.content
    assert second.message.content == first.message.content
    assert set(second.additional_kwargs) == FIGURES
    assert second.raw["usage"]["prompt_tokens_details"]["cached_tokens"] == second.additional_kwargs["cached_tokens"]
    assert second.additional_kwargs["prompt_tokens"] == first.additional_kwargs["prompt_tokens"]
    assert second.additional_kwargs["cached_tokens"] == second.additional_kwargs["prefix_cache_hits"] > 0
    assert second.additional_kwargs["chunk_cache_hits"] == 0  # chunk reuse is off
    tier_hits = second.raw["usage"]["prompt_tokens_details"]["tier_cache_hits"]
    assert second.additional_kwargs["tier_cache_hits"] == tier_hits == {"host": 0, "disk": 0}  # no KV tiers either
    assert second.additional_kwargs["cache_hit_rate"] == pytest.approx(
        second.additional_kwargs["cached_tokens"] / second.additional_kwargs["prompt_tokens"])


def test_tier_hits_go_where_cached_tokens_go():
    """A response whose cache hits came from the KV tiers reports each tier's share in
    additional_kwargs, raw and raw["usage"]["prompt_tokens_details"], whole and streamed."""
    llm = answering_with(PagedRAG(), TIERED_REPLY)
    for response in (llm.chat(MESSAGES), list(llm.stream_chat(MESSAGES))[-1], llm.complete("Paris is")):
        tier_hits = response.raw["usage"]["prompt_tokens_details"]["tier_cache_hits"]
        assert response.additional_kwargs["tier_cache_hits"] == response.raw["tier_cache_hits"] == tier_hits
        assert tier_hits == {"host": 16, "disk": 16}


def test_chat_goes_through_the_models_chat_template(llm):
    tokenizer = llm.client.shared.tokenizer
    conversation = [{"role": m.role.value, "content": m.content} for m in MESSAGES]
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou answer in one short sentence.")
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    assert llm.chat(MESSAGES).additional_kwargs["prompt_tokens"] == len(prompt_ids)


def test_stream_chat_pieces_add_up_to_the_chat(llm):
    whole = llm.chat(MESSAGES)
    pieces = list(llm.stream_chat(MESSAGES))
    assert "".join(piece.delta for piece in pieces) == whole.message.content == pieces[-1].message.content
    assert all(piece.additional_kwargs == {} for piece in pieces[:-1])
    assert pieces[-1].additional_kwargs["completion_tokens"] == whole.additional_kwargs["completion_tokens"]


def test_complete_and_stream_complete_send_the_text_as_is(llm):
    whole = llm.complete("The capital of France is")
    pieces = list(llm.stream_complete("The capital of France is"))
    assert whole.text == pieces[-1].text == "".join(piece.delta for piece in pieces)
    prompt_ids = llm.client.shared.tokenizer.encode("The capital of France is")
    assert whole.additional_kwargs["prompt_tokens"] == len(prompt_ids)
    assert whole.additional_kwargs["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_async_forms_match_the_sync_ones(llm):
    assert (await llm.achat(MESSAGES)).message.content == llm.chat(MESSAGES).message.content
    assert (await llm.acomplete("One, two,")).text == llm.complete("One, two,").text
    chat_pieces = [piece async for piece in await llm.astream_chat(MESSAGES)]
    assert chat_pieces[-1].message.content == llm.chat(MESSAGES).message.content
    assert set(chat_pieces[-1].additional_kwargs) == FIGURES
    complete_pieces = [piece async for piece in await llm.astream_complete("One, two,")]
    assert complete_pieces[-1].text == llm.complete("One, two,").text


def test_per_call_sampling_keywords_apply(llm):
    response = llm.complete("One, two, three,", max_tokens=2)
    assert response.additional_kwargs["completion_tokens"] == 2
    assert response.additional_kwargs["finish_reason"] == "length"


def test_stats_are_the_engine_stats(llm):
    llm.chat(MESSAGES)
    stats = llm.stats()
    assert {"prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "kv_cache_usage_perc",
            "num_preemptions", "num_gpu_blocks", "block_size", "max_model_len"} <= set(stats)
    assert stats["prefix_cache_queries"] > 0 and stats["max_model_len"] == ENGINE_KWARGS["max_model_len"]


def test_instances_with_the_same_engine_arguments_share_one_engine(llm):
    same = PagedRAG(engine_kwargs={**ENGINE_KWARGS, "block_size": 16}, temperature=0.5)
    other = PagedRAG(engine_kwargs={**ENGINE_KWARGS, "block_size": 32})
    assert same.client.shared is llm.client.shared
    assert other.engine_kwargs != llm.engine_kwargs  # a different engine, loaded lazily (not here)


def test_the_default_is_the_embedded_model():
    llm = PagedRAG()
    assert llm.model is None and llm.base_url is None
    assert llm.metadata.model_name == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_non_text_content_is_refused(llm):
    image = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="What is this?"),
                                                       ImageBlock(url="http://example.com/a.png")])
    with pytest.raises(TypeError, match="ImageBlock"):
        llm.chat([image])


def test_a_prompt_longer_than_the_context_window_is_a_value_error(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.complete("word " * (ENGINE_KWARGS["max_model_len"] + 10))


def test_truncate_prompt_tokens_rescues_a_too_long_prompt(llm):
    """vLLM's truncate_prompt_tokens keeps the last tokens before the prompt's length (over
    max_model_len, 2048) is checked: in complete() and chat() alike."""
    text = "hello " * 2100
    assert llm.complete(text, truncate_prompt_tokens=100).additional_kwargs["prompt_tokens"] == 100
    chat = llm.chat([ChatMessage(role=MessageRole.USER, content=text)], truncate_prompt_tokens=100)
    assert chat.additional_kwargs["prompt_tokens"] == 100
