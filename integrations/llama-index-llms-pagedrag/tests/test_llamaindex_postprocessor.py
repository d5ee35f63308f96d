"""CanonicalNodePostprocessor and the templates, including the bad input the canonicalizer
defines: no retrieved chunks, chunks larger than the context window, repeats."""

from __future__ import annotations

import itertools

import pytest
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.schema import NodeWithScore, TextNode
from llama_index.llms.pagedrag import (
    PAGEDRAG_QA_TEMPLATE,
    PAGEDRAG_REFINE_TEMPLATE,
    CanonicalNodePostprocessor,
    PagedRAG,
    canonical_query_engine_kwargs,
)
from testing_support import ENGINE_KWARGS, rag_documents


@pytest.fixture
def nodes() -> list[NodeWithScore]:
    """Four retrieved nodes, ranked by score (their source is their id)."""
    return [NodeWithScore(node=TextNode(text=doc.text, id_=doc.source_id), score=1.0 - i / 10)
            for i, doc in enumerate(rag_documents()[:4])]


def texts(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.get_content() for n in nodes]


def test_stable_order_does_not_depend_on_the_ranking(nodes):
    postprocessor = CanonicalNodePostprocessor()
    orders = {tuple(texts(postprocessor.postprocess_nodes(list(p)))) for p in itertools.permutations(nodes)}
    assert len(orders) == 1


def test_nodes_of_one_text_and_other_metadata_order_alike_whatever_the_ranking():
    """Repeated boilerplate on two pages of one document: the packed context (text and LLM
    metadata) is the same whichever the retriever ranked first."""
    from llama_index.llms.pagedrag.postprocessor import packed_text

    boilerplate = [NodeWithScore(node=TextNode(text="Contact us at the desk.", id_=f"p{page}",
                                               metadata={"page_label": str(page)}), score=0.5) for page in (3, 7)]
    other = NodeWithScore(node=TextNode(text="Another page.", id_="p9"), score=0.4)
    packed = {tuple(packed_text(n.node) for n in CanonicalNodePostprocessor().postprocess_nodes(list(order)))
              for order in itertools.permutations([*boilerplate, other])}
    assert len(packed) == 1


def test_relevance_keeps_the_ranking_and_repeats_are_dropped(nodes):
    repeated = nodes + [NodeWithScore(node=nodes[0].node, score=0.1)]
    assert texts(CanonicalNodePostprocessor(order="relevance").postprocess_nodes(repeated)) == texts(nodes)
    assert len(CanonicalNodePostprocessor().postprocess_nodes(repeated)) == len(nodes)


def test_no_retrieved_nodes_is_no_context():
    assert CanonicalNodePostprocessor().postprocess_nodes([]) == []


def test_budget_keeps_nodes_cuts_one_and_drops_the_rest(nodes, llm):
    tokenizer = llm.client.shared.tokenizer
    ordered = CanonicalNodePostprocessor().postprocess_nodes(nodes)
    first_two = sum(len(tokenizer.encode(t + "\n", add_special_tokens=False)) for t in texts(ordered[:2]))
    budgeted = CanonicalNodePostprocessor(max_context_tokens=first_two + 20, tokenizer=tokenizer)
    fitted = budgeted.postprocess_nodes(nodes)
    assert texts(fitted[:2]) == texts(ordered[:2])
    assert len(fitted) == 3 and ordered[2].node.get_content().startswith(fitted[2].node.get_content())
    assert len(fitted[2].node.get_content()) < len(ordered[2].node.get_content())  # a copy was cut


def test_only_orders_it_can_honour_are_accepted():
    with pytest.raises(ValueError, match="llm="):
        CanonicalNodePostprocessor(order="cache_aware")  # no engine to ask
    with pytest.raises(ValueError):
        CanonicalNodePostprocessor(order="random")


def test_cache_aware_puts_first_the_nodes_the_engine_holds(nodes):
    llm = PagedRAG(engine_kwargs=ENGINE_KWARGS, max_tokens=1, cache_salt="cache-aware nodes")
    cache_aware = CanonicalNodePostprocessor(order="cache_aware", llm=llm)
    stable = CanonicalNodePostprocessor().postprocess_nodes(nodes)
    assert texts(cache_aware.postprocess_nodes(nodes)) == texts(stable)  # nothing cached under this salt yet
    earlier = "\n\n".join(text.strip() for text in texts([stable[2], stable[0]]))
    llm.chat(PAGEDRAG_QA_TEMPLATE.format_messages(context_str=earlier, query_str="An earlier question?"))
    ordered = texts(cache_aware.postprocess_nodes(list(reversed(nodes))))
    assert ordered == texts([stable[2], stable[0], stable[1], stable[3]])  # the cached run, then stable


def test_templates_put_instructions_then_context_then_query():
    qa = PAGEDRAG_QA_TEMPLATE.format_messages(context_str="CONTEXT", query_str="QUERY")
    refine = PAGEDRAG_REFINE_TEMPLATE.format_messages(context_msg="CONTEXT", query_str="QUERY",
                                                      existing_answer="ANSWER")
    for messages in (qa, refine):
        assert [m.role.value for m in messages] == ["system", "user"]
        assert "CONTEXT" not in messages[0].content and "QUERY" not in messages[0].content
        user = messages[1].content
        assert user.index("CONTEXT") < user.index("QUERY")
    assert refine[1].content.index("QUERY") < refine[1].content.index("ANSWER")


def test_a_query_with_nothing_retrieved(embed_model, llm):
    import faiss
    from llama_index.vector_stores.faiss import FaissVectorStore

    store = FaissVectorStore(faiss_index=faiss.IndexFlatL2(384))
    empty = VectorStoreIndex([], embed_model=embed_model,
                             storage_context=StorageContext.from_defaults(vector_store=store))
    response = empty.as_query_engine(llm=llm, **canonical_query_engine_kwargs()).query("What does json.dumps do?")
    assert response.source_nodes == []
    assert str(response) == "Empty Response"  # LlamaIndex answers this without calling the LLM


def test_a_document_larger_than_the_context_window(embed_model, recorder):
    """With a budget the node is cut to fit one call; without one, LlamaIndex splits it
    across calls that refine the answer (its compact synthesizer keeps 500 tokens spare)."""
    llm = PagedRAG(engine_kwargs={**ENGINE_KWARGS, "max_model_len": 1024}, max_tokens=4)
    tokenizer = llm.client.shared.tokenizer
    text = " ".join(doc.text for doc in rag_documents(max_chars=1200)[:10])
    assert len(tokenizer.encode(text)) > 1024
    index = VectorStoreIndex.from_documents([Document(text=text, id_="all")], embed_model=embed_model,
                                            transformations=[])
    budget = canonical_query_engine_kwargs(max_context_tokens=256, tokenizer=tokenizer)
    response = index.as_query_engine(llm=llm, **budget).query("What does json.dumps do?")
    assert len(recorder.chats) == 1 and response.response
    assert len(tokenizer.encode(response.source_nodes[0].node.get_content())) <= 256

    recorder.chats.clear()
    response = index.as_query_engine(llm=llm, **canonical_query_engine_kwargs()).query("What does json.dumps do?")
    assert len(recorder.chats) > 1 and response.response
    assert all(chat.additional_kwargs["prompt_tokens"] < 1024 for _, chat in recorder.chats)
