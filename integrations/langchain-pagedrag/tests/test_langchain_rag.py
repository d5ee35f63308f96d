"""A real LCEL RAG chain: a faiss retriever with MiniLM embeddings, CanonicalDocuments, the
canonical prompt and ChatPagedRAG; the questions of RAG_STREAM (all 32; 16 with
PAGEDRAG_STREAM=short), whose top-5 retrieved sets overlap.

The canonical document order must at least double the prefix-cache hit rate, and the
answers (a sample of them: REFERENCE_SAMPLE) must equal those of the same prompts run with
prefix caching off (greedy decoding).
"""

from __future__ import annotations

from langchain_core.output_parsers import StrOutputParser
from langchain_core.runnables import RunnablePassthrough
from langchain_pagedrag import PAGEDRAG_RAG_PROMPT, CanonicalDocuments, ChatPagedRAG, format_documents
from testing_support import ENGINE_KWARGS, MAX_TOKENS, NO_CACHE_ENGINE_KWARGS, RAG_STREAM, REFERENCE_SAMPLE, hit_rate


def prompt_chain(retriever, canonical: bool):
    documents = retriever | CanonicalDocuments() if canonical else retriever
    return {"context": documents | format_documents, "question": RunnablePassthrough()} | PAGEDRAG_RAG_PROMPT


def run_chain(prompts, chat: ChatPagedRAG, answered: ChatPagedRAG | None = None) -> tuple[float, list[str]]:
    """Ask every question, one after the other, on a cold prefix cache: (hit rate, answers).
    With ``answered``, the questions of REFERENCE_SAMPLE go to it and the others to ``chat``
    (both on one engine: one prefix cache)."""
    sampled = set(range(len(RAG_STREAM))[REFERENCE_SAMPLE]) if answered is not None else set()
    short, full = (prompts | model | StrOutputParser() for model in (chat, answered or chat))
    chat.client.reset_prefix_cache()
    before = chat.stats()
    answers = [(full if index in sampled else short).invoke(query) for index, query in enumerate(RAG_STREAM)]
    return hit_rate(before, chat.stats()), answers


def test_canonical_order_doubles_the_hit_rate_and_keeps_the_answers(retriever, chat):
    # the hits of a prompt do not depend on the answers before it (they are not part of the
    # prompts), so only the answers compared below are MAX_TOKENS long; the rest are one token
    one_token = ChatPagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=1)
    retriever_order, _ = run_chain(prompt_chain(retriever, canonical=False), one_token)
    canonical_prompts = prompt_chain(retriever, canonical=True)
    canonical, answers = run_chain(canonical_prompts, one_token, answered=chat)
    print(f"\nLangChain prefix-cache hit rate: retriever order {retriever_order:.1%}, "
          f"canonical order {canonical:.1%} ({canonical / retriever_order:.2f}x)")
    assert canonical >= 2 * retriever_order

    reference = ChatPagedRAG(engine_kwargs=NO_CACHE_ENGINE_KWARGS, max_tokens=MAX_TOKENS)
    sample = list(RAG_STREAM[REFERENCE_SAMPLE])
    expected = reference.batch(canonical_prompts.batch(sample))  # submitted together: one engine batch
    assert answers[REFERENCE_SAMPLE] == [message.content for message in expected] and len(sample) >= 4
    assert all(message.usage_metadata["input_token_details"]["cache_read"] == 0 for message in expected)
