"""A real RAG pipeline: PagedRAG as Settings.llm over a faiss VectorStoreIndex with MiniLM
embeddings; the questions of RAG_STREAM (all 32; 16 with
PAGEDRAG_STREAM=short), whose top-5 retrieved sets overlap.

The canonical node order must at least double the prefix-cache hit rate, and the answers (a
sample of them: REFERENCE_SAMPLE) must equal those of the same prompts run with prefix caching
off (greedy decoding).
"""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core import Settings
from llama_index.llms.pagedrag import PAGEDRAG_QA_TEMPLATE, PagedRAG, canonical_query_engine_kwargs
from testing_support import (
    ENGINE_KWARGS,
    MAX_TOKENS,
    NO_CACHE_ENGINE_KWARGS,
    RAG_STREAM,
    REFERENCE_SAMPLE,
    TOP_K,
    hit_rate,
)


@pytest.fixture
def settings(embed_model):
    """LlamaIndex's global Settings, with MiniLM embeddings; restored afterwards."""
    saved = Settings._llm, Settings._embed_model
    Settings.embed_model = embed_model
    yield Settings
    Settings._llm, Settings._embed_model = saved


def hit_rate_of_run(index, llm: PagedRAG, answered: PagedRAG | None = None, **query_engine_kwargs) -> float:
    """Ask every question, one after the other, on a cold prefix cache; the hit rate over the
    run. With ``answered``, the questions of REFERENCE_SAMPLE go to it and the others to ``llm``
    (both on one engine: one prefix cache), each as Settings.llm."""
    def query_engine(model: PagedRAG):
        Settings.llm = model
        return index.as_query_engine(similarity_top_k=TOP_K, **query_engine_kwargs)

    sampled = set(range(len(RAG_STREAM))[REFERENCE_SAMPLE]) if answered is not None else set()
    short = query_engine(llm)
    full = query_engine(answered) if answered is not None else short
    llm.client.reset_prefix_cache()
    before = llm.stats()
    for number, query in enumerate(RAG_STREAM):
        (full if number in sampled else short).query(query)
    return hit_rate(before, llm.stats())


def test_canonical_order_doubles_the_hit_rate_and_keeps_the_answers(index, llm, settings, recorder):
    # the hits of a prompt do not depend on the answers before it (they are not part of the
    # prompts), so only the answers compared below are MAX_TOKENS long; the rest are one token
    one_token = PagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=1)
    retriever_order = hit_rate_of_run(index, one_token, text_qa_template=PAGEDRAG_QA_TEMPLATE)
    recorder.chats.clear()
    canonical = hit_rate_of_run(index, one_token, answered=llm, **canonical_query_engine_kwargs())
    print(f"\nLlamaIndex prefix-cache hit rate: retriever order {retriever_order:.1%}, "
          f"canonical order {canonical:.1%} ({canonical / retriever_order:.2f}x)")
    assert canonical >= 2 * retriever_order

    assert len(recorder.chats) == len(RAG_STREAM)
    chats = recorder.chats[REFERENCE_SAMPLE]
    assert len(chats) >= 4
    reference = PagedRAG(engine_kwargs=NO_CACHE_ENGINE_KWARGS, max_tokens=MAX_TOKENS)

    async def answer_all():  # submitted together: one engine batch
        return await asyncio.gather(*(reference.achat(messages) for messages, _ in chats))

    expected = asyncio.run(answer_all())
    assert [response.message.content for _, response in chats] == [r.message.content for r in expected]
    assert all(r.additional_kwargs["cached_tokens"] == 0 for r in expected)


def test_llamaindex_default_templates_with_the_canonical_order(index, llm):
    """LlamaIndex's own chat QA template already puts the context before the query, so
    the canonical node order works with it too."""
    postprocessors = canonical_query_engine_kwargs()["node_postprocessors"]
    engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K, node_postprocessors=postprocessors)
    response = engine.query(RAG_STREAM[0])
    assert response.response and len(response.source_nodes) == TOP_K
