"""Chunk reuse through LangChain: the flag, the retrieved documents passed to the engine as
chunks, and the figures a reply reports.

Two questions whose retrieved documents overlap in another order: with chunk reuse the second
prompt's shared documents come from the chunk cache; without it, none do.
"""

from __future__ import annotations

import pytest
from langchain_core.runnables import RunnablePassthrough
from langchain_pagedrag import (
    PAGEDRAG_RAG_PROMPT,
    CanonicalDocuments,
    ChatPagedRAG,
    PagedRAGLLM,
    format_reusable_documents,
)
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
def reuse_chat() -> ChatPagedRAG:
    return ChatPagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, max_tokens=MAX_TOKENS)


def ask_both(retriever, chat: ChatPagedRAG) -> list[tuple]:
    """Both questions through an LCEL RAG chain in retrieval order, on a cold cache: for
    each, (the retrieved documents, the prompt, the reply)."""
    top_k = retriever.vectorstore.as_retriever(search_kwargs={"k": CHUNK_REUSE_TOP_K})
    documents = top_k | CanonicalDocuments(order="relevance", llm=chat)
    context = documents | format_reusable_documents
    prompts = {"context": context, "question": RunnablePassthrough()} | PAGEDRAG_RAG_PROMPT
    chat.client.reset_prefix_cache()
    answers = []
    for query in CHUNK_REUSE_QUERIES:
        prompt = prompts.invoke(query)
        answers.append((top_k.invoke(query), prompt, chat.invoke(prompt)))
    assert overlap_in_another_order(*([d.page_content for d in documents] for documents, _, _ in answers))
    return answers


def test_the_flag_is_an_engine_argument():
    flagged = {**CHUNK_REUSE_POOL_KWARGS, "enable_chunk_reuse": True, "chunk_recompute_fraction": 0.25}
    own = ChatPagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, chunk_recompute_fraction=0.25)
    assert own.engine_kwargs == ChatPagedRAG(engine_kwargs=flagged).engine_kwargs == flagged
    assert own.model_kwargs == {}  # not taken for a sampling field
    assert PagedRAGLLM(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True).chunk_reuse_possible
    with pytest.raises(ValueError, match="different values"):
        ChatPagedRAG(engine_kwargs={"enable_chunk_reuse": False}, enable_chunk_reuse=True)
    with pytest.raises(ValueError, match="pagedrag serve --enable-chunk-reuse"):
        ChatPagedRAG(base_url="http://127.0.0.1:9", enable_chunk_reuse=True)  # never reached: the server decides


def test_overlapping_documents_in_another_order_come_from_the_chunk_cache(retriever, reuse_chat):
    (_, _, first), (documents, prompt, second) = ask_both(retriever, reuse_chat)
    exact = [format_reusable_documents([document]) for document in documents]  # each whole block
    assert reuse_chat.call_chunks(reuse_chat.engine_prompt(prompt)) == exact
    figures, usage = second.response_metadata, second.usage_metadata
    assert second.content and figures["chunk_cache_hits"] > 0
    assert first.response_metadata["chunk_cache_hits"] == 0  # a cold cache
    assert usage["input_token_details"]["cache_read"] == figures["prefix_cache_hits"] + figures["chunk_cache_hits"]
    assert usage["input_tokens"] == usage["input_token_details"]["cache_read"] + figures["prompt_tokens_computed"]


def test_without_the_flag_nothing_comes_from_the_chunk_cache(retriever, chat):
    (_, prompt, first), (_, _, second) = ask_both(retriever, chat)
    assert chat.call_chunks(chat.engine_prompt(prompt)) is None  # nothing to tell an engine without chunk reuse
    assert second.content
    for reply in (first, second):
        assert set(CHUNK_FIGURES) <= set(reply.response_metadata)
        assert reply.response_metadata["chunk_cache_hits"] == reply.response_metadata["chunk_tokens_recomputed"] == 0
        assert reply.usage_metadata["input_token_details"]["cache_read"] == reply.response_metadata["cached_tokens"]


def test_the_completion_model_passes_a_calls_chunks():
    """``chunks=`` per call, here to PagedRAGLLM (its own engine's pool: the chat model's)."""
    llm = PagedRAGLLM(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, max_tokens=1)
    a, b, c = (doc.text for doc in rag_documents()[10:13])

    def generate(chunks: list[str]) -> dict:
        prompt = "Context:\n" + "\n".join(chunks) + "\nQuestion: which functions are these?\nAnswer:"
        return llm.generate([prompt], chunks=chunks).generations[0][0].generation_info

    llm.client.reset_prefix_cache()
    assert generate([a, b])["chunk_cache_hits"] == 0
    assert generate([c, b, a])["chunk_cache_hits"] > 0
