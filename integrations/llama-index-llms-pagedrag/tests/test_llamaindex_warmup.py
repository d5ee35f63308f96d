"""PagedRAGWarmup in an IngestionPipeline: the nodes come back unchanged, and a query over them
through the same engine finds its prompt's head (system prompt and first node) cached, where the
same query on a cold cache finds nothing; with chunk reuse its other nodes come from the chunk
cache; against a server, through POST /v1/warm."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
from llama_index.core import Document, SummaryIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.llms.pagedrag import PagedRAG, PagedRAGWarmup, canonical_query_engine_kwargs
from testing_support import CHUNK_REUSE_POOL_KWARGS, MAX_TOKENS, RAG_QUERIES, rag_documents


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [Document(text=doc.text, id_=doc.source_id) for doc in rag_documents(3)]


def _warm(llm: PagedRAG, documents: list[Document]) -> list:
    """The documents through a pipeline that warms ``llm``'s engine, on a cold cache."""
    if llm.base_url is None:
        llm.client.reset_prefix_cache()
    nodes = _pipeline(llm).run(documents=documents)
    assert [node.get_content() for node in nodes] == [document.get_content() for document in documents]
    return nodes


def _pipeline(llm: PagedRAG) -> IngestionPipeline:
    """Documents (of one node each) split into nodes, then the warm-up."""
    return IngestionPipeline(transformations=[SentenceSplitter(chunk_size=512),
                                              PagedRAGWarmup(llm=llm, show_progress=False)], disable_cache=True)


def _query_figures(llm: PagedRAG, nodes: list, recorder) -> dict:
    """The figures of the one chat a query over all the nodes makes."""
    recorder.chats.clear()
    SummaryIndex(nodes).as_query_engine(llm=llm, **canonical_query_engine_kwargs(llm=llm)).query(RAG_QUERIES[0])
    [(_, reply)] = recorder.chats
    return reply.additional_kwargs


def test_a_query_after_the_warmup_hits_the_cache(llm, documents, recorder):
    nodes = _warm(llm, documents)
    warm = _query_figures(llm, nodes, recorder)
    llm.client.reset_prefix_cache()
    cold = _query_figures(llm, nodes, recorder)
    assert warm["cached_tokens"] > 0 and cold["cached_tokens"] == 0
    assert warm["prompt_tokens"] == cold["prompt_tokens"]


def test_with_chunk_reuse_the_other_nodes_come_from_the_chunk_cache(documents, recorder):
    llm = PagedRAG(engine_kwargs=CHUNK_REUSE_POOL_KWARGS, enable_chunk_reuse=True, max_tokens=MAX_TOKENS)
    figures = _query_figures(llm, _warm(llm, documents), recorder)
    assert figures["prefix_cache_hits"] > 0 and figures["chunk_cache_hits"] > 0


def test_a_copy_in_another_process_refuses_rather_than_warm_an_engine_of_its_own(llm, documents):
    """IngestionPipeline.run(num_workers=N) pickles its transformations into worker processes,
    as this pool does (forked: the worker needs no imports of its own)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as workers:
        with pytest.raises(RuntimeError, match="another process than its in-process engine"):
            workers.submit(PagedRAGWarmup(llm=llm, show_progress=False), documents).result(timeout=120)


@pytest.mark.asyncio
async def test_the_async_pipeline_warms_a_server(server, recorder):
    """The server's cache holds the system prompt from other tests: the warm-up adds the first node."""
    llm = PagedRAG(base_url=server, max_tokens=MAX_TOKENS)
    served = [Document(text=doc.text + " (served)", id_=doc.source_id) for doc in rag_documents(6)]
    unwarmed = _query_figures(llm, SentenceSplitter(chunk_size=512)(served[3:]), recorder)["cached_tokens"]
    nodes = await _pipeline(llm).arun(documents=served[:3])
    assert _query_figures(llm, nodes, recorder)["cached_tokens"] > unwarmed
