"""CanonicalDocuments, format_documents and the RAG prompt, including the bad input the
canonicalizer defines: no retrieved chunks, chunks larger than the context window,
non-string content."""

from __future__ import annotations

import itertools

import pytest
from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda, RunnablePassthrough
from langchain_pagedrag import PAGEDRAG_RAG_PROMPT, CanonicalDocuments, ChatPagedRAG, format_documents
from testing_support import ENGINE_KWARGS, rag_documents


@pytest.fixture
def documents() -> list[Document]:
    """Four retrieved documents, ranked."""
    return [Document(doc.text, metadata={"source": doc.source_id}) for doc in rag_documents()[:4]]


def test_stable_order_does_not_depend_on_the_ranking(documents):
    canonical = CanonicalDocuments()
    orders = {tuple(d.page_content for d in canonical.invoke(list(p))) for p in itertools.permutations(documents)}
    assert len(orders) == 1


def test_relevance_keeps_the_ranking_and_repeats_are_dropped(documents):
    repeated = documents + [documents[0].model_copy()]
    assert CanonicalDocuments(order="relevance").invoke(repeated) == documents
    assert len(CanonicalDocuments().invoke(repeated)) == len(documents)


def test_cache_aware_puts_first_the_documents_the_engine_holds(documents):
    chat = ChatPagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=1, cache_salt="cache-aware documents")
    cache_aware = CanonicalDocuments(order="cache_aware", llm=chat)
    stable = CanonicalDocuments().invoke(documents)
    assert cache_aware.invoke(documents) == stable  # nothing cached under this salt yet
    earlier = {"context": format_documents([stable[2], stable[0]]), "question": "An earlier question?"}
    chat.invoke(PAGEDRAG_RAG_PROMPT.invoke(earlier))
    assert cache_aware.invoke(documents[::-1]) == [stable[2], stable[0], stable[1], stable[3]]


def test_cache_aware_needs_an_in_process_engine_to_ask(documents):
    with pytest.raises(ValueError, match="llm="):
        CanonicalDocuments(order="cache_aware")
    remote = ChatPagedRAG(base_url="http://127.0.0.1:9")  # never reached: the order is refused first
    with pytest.raises(NotImplementedError, match="in-process"):
        CanonicalDocuments(order="cache_aware", llm=remote).invoke(documents)


def test_format_documents_renders_one_block_per_document(documents):
    text = format_documents(documents)
    assert text.count("<document ") == len(documents) and not text.endswith("\n")
    assert text.startswith(f'<document index="1" source="{documents[0].metadata["source"]}">\n')


def test_prompt_puts_instructions_then_context_then_question():
    messages = PAGEDRAG_RAG_PROMPT.invoke({"context": "CONTEXT", "question": "QUESTION"}).to_messages()
    assert [m.type for m in messages] == ["system", "human"]
    assert messages[1].content.index("CONTEXT") < messages[1].content.index("QUESTION")


def test_no_retrieved_documents_is_a_valid_prompt(chat):
    nothing = RunnableLambda(lambda _: [])
    chain = ({"context": nothing | CanonicalDocuments() | format_documents, "question": RunnablePassthrough()}
             | PAGEDRAG_RAG_PROMPT | chat)
    reply = chain.invoke("What does json.dumps do?")
    assert reply.content and reply.response_metadata["finish_reason"] in ("stop", "length")


def test_documents_larger_than_the_context_window(documents, chat):
    """Without a budget the engine refuses the prompt; with one, the documents are kept
    while they fit, the next is cut and the rest dropped."""
    huge = [Document(" ".join(d.page_content for d in documents) * 10, metadata={"source": "huge"})] + documents
    question = "What does json.dumps do?"
    unbounded = PAGEDRAG_RAG_PROMPT.invoke({"context": format_documents(huge), "question": question})
    with pytest.raises(ValueError, match="max_model_len"):
        chat.invoke(unbounded)
    tokenizer = chat.client.shared.tokenizer
    budget = ENGINE_KWARGS["max_model_len"] // 2
    fitted = CanonicalDocuments(max_context_tokens=budget, tokenizer=tokenizer).invoke(huge)
    assert len(fitted) < len(huge)
    assert len(tokenizer.encode(format_documents(fitted), add_special_tokens=False)) <= budget
    prompt = PAGEDRAG_RAG_PROMPT.invoke({"context": format_documents(fitted), "question": question})
    assert chat.invoke(prompt).content


def test_non_documents_are_a_type_error_naming_the_item(documents):
    with pytest.raises(TypeError, match=r"chunks\[1\]"):
        CanonicalDocuments().invoke([documents[0], {"page_content": 3}])
