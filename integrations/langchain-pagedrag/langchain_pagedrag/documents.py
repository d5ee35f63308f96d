"""CanonicalDocuments: retrieved documents in canonical order, between a retriever and a prompt."""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import Field, model_validator

from pagedrag.client import Prompt
from pagedrag.rag.canonical import (
    DEFAULT_CHUNK_TEMPLATE,
    REUSABLE_CHUNK_TEMPLATE,
    Chunk,
    PromptCanonicalizer,
    normalize_text,
)
from pagedrag.rag.ordering import ChunkOrder, canonical_items, check_cache_aware

from .chat_models import ChatPagedRAG
from .llms import PagedRAGLLM
from .prompts import PAGEDRAG_RAG_PROMPT


class CanonicalDocuments(RunnableSerializable[list[Document], list[Document]]):
    """Puts retrieved documents into an order that does not depend on the retriever's ranking.

    Two questions that retrieve the same documents (or sets that start with the same
    documents) then build prompts with the same leading tokens, which the prefix cache
    serves::

        context = retriever | CanonicalDocuments() | format_documents
        context = retriever | CanonicalDocuments(order="cache_aware", llm=chat) | format_documents

    Orders (see ``pagedrag.rag.canonical.canonical_order``): "stable" sorts by
    ``metadata["source"]`` (else the document id), then ``metadata["start_index"]``, then a
    hash of the text; "cache_aware" starts from that and greedily puts first the documents
    that extend the prefix ``llm``'s engine holds for its ``cache_salt``, probing the prompt
    as ``prompt`` renders it (``format_documents`` in its "context", its other variables
    empty); "relevance" keeps the retriever's order. Documents with empty or repeated text
    are removed.

    With ``max_context_tokens``, the documents are also fitted into that many tokens of
    ``tokenizer`` (default: the embedded model's), counted as ``format_documents`` renders
    them, by the canonicalizer's rule: documents are kept while they fit, the first that
    does not is cut at a token boundary, the rest are dropped.

    With ``llm`` and chunk reuse (``llm.chunk_reuse_possible``), the documents are told to
    ``llm`` as retrieved chunks (``expect_chunks``): each one as ``format_reusable_documents``
    renders it, and its text alone (as ``format_documents`` holds it). The model's calls then
    pass the ones their prompt holds as ``chunks=``, so the engine cuts the prompt exactly
    around each document, wherever it lands. Render them with ``format_reusable_documents``
    (no index: a document renders the same at any position); budgets and cache-aware
    probes then count that rendering::

        context = retriever | CanonicalDocuments(llm=chat) | format_reusable_documents
    """

    order: ChunkOrder = "stable"
    max_context_tokens: int | None = Field(default=None, gt=0)
    tokenizer: Any = Field(default=None, exclude=True, description="A Hugging Face tokenizer.")
    llm: ChatPagedRAG | PagedRAGLLM | None = Field(default=None, exclude=True,
                                                   description="The model whose cache 'cache_aware' asks, and "
                                                               "which is told of the documents (chunk reuse).")
    prompt: BasePromptTemplate = Field(default=PAGEDRAG_RAG_PROMPT, exclude=True,
                                       description="The prompt the documents go into, as its 'context'.")

    @model_validator(mode="after")
    def _needs_llm_for_cache_aware(self) -> CanonicalDocuments:
        check_cache_aware(self.order, self.llm)
        return self

    def invoke(self, input: list[Document], config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._order, input, config)

    def _order(self, documents: list[Document]) -> list[Document]:
        ordered = canonical_items(documents, _chunk, _with_text, self.order, max_tokens=self.max_context_tokens,
                                  tokenizer=self.tokenizer, chunk_template=self._chunk_template,
                                  cached_len=self._cached_len)
        if self._reusable:
            self.llm.expect_chunks(text for document in ordered for text in _chunk_texts(document))
        return ordered

    @property
    def _reusable(self) -> bool:
        """Whether the documents go to a model that may reuse chunks."""
        return _reuses_chunks(self.llm)

    @property
    def _chunk_template(self) -> str:
        return chunk_template(self.llm)

    def _cached_len(self, leading: list[Document]) -> int:
        """Cached tokens of the prompt whose context starts with these documents."""
        return self.llm.cached_prefix_len(context_prompt(self.llm, self.prompt, leading))


def chunk_template(llm: ChatPagedRAG | PagedRAGLLM | None) -> str:
    """How a document is rendered in a prompt to ``llm``: ``format_reusable_documents``' block
    when it may reuse chunks, else ``format_documents``'."""
    return REUSABLE_CHUNK_TEMPLATE if _reuses_chunks(llm) else DEFAULT_CHUNK_TEMPLATE


def context_prompt(llm: ChatPagedRAG | PagedRAGLLM, prompt: BasePromptTemplate, documents: list[Document]) -> Prompt:
    """The engine's prompt of ``prompt`` whose "context" is ``documents`` rendered as a prompt to
    ``llm`` holds them (``chunk_template``), its other variables empty."""
    fields = dict.fromkeys(prompt.input_variables, "")
    rendered = prompt.invoke({**fields, "context": _format(documents, chunk_template(llm))})
    return llm.engine_prompt(rendered)


def _reuses_chunks(llm: ChatPagedRAG | PagedRAGLLM | None) -> bool:
    return llm is not None and llm.chunk_reuse_possible


def format_documents(documents: list[Document]) -> str:
    """The documents as the canonicalizer renders chunks, in the order given: one
    ``<document index=.. source=..>`` block each, on lines of their own (a prompt template
    adds the newline after the last)."""
    return _format(documents, DEFAULT_CHUNK_TEMPLATE)


def format_reusable_documents(documents: list[Document]) -> str:
    """``format_documents`` without the index: one ``<document source=..>`` block each
    (``REUSABLE_CHUNK_TEMPLATE``), so that a document renders the same at any position, as
    chunk reuse wants."""
    return _format(documents, REUSABLE_CHUNK_TEMPLATE)


def _format(documents: list[Document], chunk_template: str) -> str:
    rendered = PromptCanonicalizer(order="relevance", chunk_template=chunk_template).build(
        "", [_chunk(d) for d in documents]).text
    return rendered.removesuffix("\n")


def _chunk_texts(document: Document) -> tuple[str, str]:
    """The texts of a document a prompt may hold verbatim: its ``format_reusable_documents``
    block, and its text (normalized, as both formats hold it)."""
    return format_reusable_documents([document]), normalize_text(document.page_content)


def _chunk(document: Document) -> Chunk:
    """The document as the canonicalizer sees it: its text, source and start offset."""
    if not isinstance(document, Document):
        raise TypeError(f"expected a langchain Document, got {type(document).__name__}")
    source = document.metadata.get("source")
    if source is None:
        source = document.id
    position = document.metadata.get("start_index")
    return Chunk(document.page_content, None if source is None else str(source),
                 position if isinstance(position, int) else None)


def _with_text(document: Document, text: str) -> Document:
    return document.model_copy(update={"page_content": text})
