"""PagedRAGWarmup in an indexing flow: the documents come back unchanged, and a RAG chain's
question over them through the same engine finds its prompt's head (system prompt and first
document) cached, where the same question on a cold cache finds nothing; with chunk reuse its
other documents come from the chunk cache; a progress bar unless show_progress=False."""

from __future__ import annotations

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_pagedrag import (
    PAGEDRAG_RAG_PROMPT,
    CanonicalDocuments,
    ChatPagedRAG,
    PagedRAGWarmup,
    format_documents,
    format_reusable_documents,
)
from testing_support import CHUNK_REUSE_POOL_KWARGS, MAX_TOKENS, RAG_QUERIES, rag_documents


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [Document(page_content=doc.text, metadata={"source": doc.source_id}) for doc in rag_documents(3)]


def _ask(chat: ChatPagedRAG, documents: list[Document], format_context=format_documents):
    """The reply of a RAG chain over ``documents`` (all of them retrieved, in canonical order)."""
    context = RunnableLambda(lambda _: documents) | CanonicalDocuments(llm=chat) | format_context
    chain = {"context": context, "question": RunnablePassthrough()} | PAGEDRAG_RAG_PROMPT | chat
    return chain.invoke(RAG_QUERIES[0])


def test_a_question_after_the_warmup_hits_the_cache(chat, documents, capsys):
    chat.client.reset_prefix_cache()
    assert PagedRAGWarmup(chat, show_progress=False).transform_documents(documents) is documents
    assert "Warming chunks" not in capsys.readouterr().err
    warm = _ask(chat, documents)
    chat.client.reset_prefix_cache()
    cold = _ask(chat, documents)
    assert warm.usage_metadata["input_token_details"]["cache_read"] > 0
    assert cold.usage_metadata["input_token_details"]["cache_read"] == 0
    assert warm.usage_metadata["input_tokens"] == cold.usage_metadata["input_tokens"]


@pytest.mark.asyncio
async def test_with_chunk_reuse_the_other_documents_come_from_the_chunk_cache(documents, capsys):
    chat = ChatPagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, max_tokens=MAX_TOKENS)
    assert await PagedRAGWarmup(chat, batch_size=2).atransform_documents(documents) is documents
    assert "Warming chunks" in capsys.readouterr().err
    figures = _ask(chat, documents, format_reusable_documents).response_metadata
    assert figures["prefix_cache_hits"] > 0 and figures["chunk_cache_hits"] > 0


def test_blank_documents_are_skipped_and_a_bad_batch_size_refused(chat):
    assert PagedRAGWarmup(chat, show_progress=False).transform_documents([Document(page_content=" \n")])
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        PagedRAGWarmup(chat, batch_size=0)
    for bad, message in (({"batch_size": "2"}, "batch_size must be an int, got str"),
                         ({"batch_size": 1.5}, "batch_size must be an int, got float"),
                         ({"show_progress": "no"}, "show_progress must be True or False, got 'no'")):
        with pytest.raises(TypeError, match=message):
            PagedRAGWarmup(chat, **bad)
    with pytest.raises(TypeError, match=r"documents\[1\] must be a langchain Document, got str"):
        PagedRAGWarmup(chat, show_progress=False).transform_documents([Document(page_content="x"), "a text"])
    too_long = Document(page_content="word " * (2 * chat.client.info().max_model_len))
    with pytest.raises(ValueError, match="warming chunks 2-2 of 3"):
        PagedRAGWarmup(chat, batch_size=2, show_progress=False).transform_documents(
            [Document(page_content="a"), Document(page_content="b"), too_long])
