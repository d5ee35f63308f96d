"""Chunk reuse through LlamaIndex: the flag, the retrieved nodes passed to the engine as
chunks, and the figures a response reports.

Two questions whose retrieved nodes overlap in another order: with chunk reuse the second
prompt's shared nodes come from the chunk cache; without it, none do.
"""

from __future__ import annotations

import pytest
from llama_index.core.schema import MetadataMode
from llama_index.llms.pagedrag import PagedRAG, canonical_query_engine_kwargs
from llama_index.llms.pagedrag.messages import engine_messages
from testing_support import (
    CHUNK_REUSE_POOL_KWARGS,
    CHUNK_REUSE_QUERIES,
    CHUNK_REUSE_TOP_K,
    MAX_TOKENS,
    overlap_in_another_order,
    rag_documents,
)

CHUNK_FIGURES = ("prefix_cache_hits", "chunk_cache_hits", "chunk_tokens_recomputed", "prompt_tokens_computed")


@pytest.fixture(scope="module")
def reuse_llm() -> PagedRAG:
    return PagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, max_tokens=MAX_TOKENS)


def ask_both(index, llm: PagedRAG, recorder) -> list[tuple]:
    """Both questions through a query engine in retrieval order, on a cold cache: for each,
    (the response, the node texts as packed into the prompt, the LLM's chat messages and reply)."""
    llm.client.reset_prefix_cache()
    engine = index.as_query_engine(llm=llm, similarity_top_k=CHUNK_REUSE_TOP_K,
                                   **canonical_query_engine_kwargs(order="relevance", llm=llm))
    answers = []
    for query in CHUNK_REUSE_QUERIES:
        recorder.chats.clear()
        response = engine.query(query)
        [(messages, reply)] = recorder.chats
        texts = [node.node.get_content(metadata_mode=MetadataMode.LLM).strip() for node in response.source_nodes]
        answers.append((response, texts, messages, reply))
    assert overlap_in_another_order(answers[0][1], answers[1][1])
    return answers


def test_the_flag_is_an_engine_argument():
    flagged = {**CHUNK_REUSE_POOL_KWARGS, "enable_chunk_reuse": True, "chunk_recompute_fraction": 0.25}
    own = PagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, chunk_recompute_fraction=0.25)
    assert own.engine_kwargs == PagedRAG(vllm_kwargs=flagged).engine_kwargs == flagged
    assert own.chunk_reuse_possible and not PagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS).chunk_reuse_possible
    with pytest.raises(ValueError, match="different values"):
        PagedRAG(engine_kwargs={"enable_chunk_reuse": False}, enable_chunk_reuse=True)
    with pytest.raises(ValueError, match="pagedrag serve --enable-chunk-reuse"):
        PagedRAG(base_url="http://127.0.0.1:9", enable_chunk_reuse=True)  # never reached: the server decides


def test_overlapping_nodes_in_another_order_come_from_the_chunk_cache(index, reuse_llm, recorder):
    (_, _, _, first), (response, texts, messages, second) = ask_both(index, reuse_llm, recorder)
    assert reuse_llm.call_chunks(engine_messages(messages)) == texts  # the nodes, cut exactly
    figures = second.additional_kwargs
    assert response.response and figures["chunk_cache_hits"] > 0
    assert first.additional_kwargs["chunk_cache_hits"] == 0  # a cold cache
    assert figures["prompt_tokens"] == (figures["prefix_cache_hits"] + figures["chunk_cache_hits"]
                                        + figures["prompt_tokens_computed"])
    assert second.raw["usage"]["prompt_tokens_details"]["chunk_cache_hits"] == figures["chunk_cache_hits"]


def test_without_the_flag_nothing_comes_from_the_chunk_cache(index, llm, recorder):
    (_, _, messages, first), (response, _, _, second) = ask_both(index, llm, recorder)
    assert llm.call_chunks(engine_messages(messages)) is None  # nothing to tell an engine without chunk reuse
    assert response.response
    for reply in (first, second):
        assert set(CHUNK_FIGURES) <= set(reply.additional_kwargs)
        assert reply.additional_kwargs["chunk_cache_hits"] == reply.additional_kwargs["chunk_tokens_recomputed"] == 0


def test_a_completion_passes_its_own_chunks(reuse_llm):
    """``chunks=`` per call: the caller's texts are the chunks, here of a text prompt."""
    a, b, c = (doc.text for doc in rag_documents()[10:13])

    def complete(chunks: list[str]):
        prompt = "Context:\n" + "\n".join(chunks) + "\nQuestion: which functions are these?\nAnswer:"
        return reuse_llm.complete(prompt, chunks=chunks, max_tokens=1).additional_kwargs

    reuse_llm.client.reset_prefix_cache()
    assert complete([a, b])["chunk_cache_hits"] == 0
    assert complete([c, b, a])["chunk_cache_hits"] > 0
