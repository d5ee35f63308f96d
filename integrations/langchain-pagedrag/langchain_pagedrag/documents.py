"""CanonicalDocuments: retrieved documents in canonical order, between a retriever and a prompt."""

from __future__ import annotations

from typing import Any, Literal

from langchain_core.documents import Document
from langchain_core.runnables import RunnableConfig, RunnableSerializable
from pydantic import Field

from pagedrag.canonical import DEFAULT_CHUNK_TEMPLATE, Chunk, PromptCanonicalizer
from pagedrag.client import canonical_items


class CanonicalDocuments(RunnableSerializable[list[Document], list[Document]]):
    """Puts retrieved documents into an order that does not depend on the retriever's ranking.

    Two questions that retrieve the same documents (or sets that start with the same
    documents) then build prompts with the same leading tokens, which the prefix cache
    serves::

        context = retriever | CanonicalDocuments() | format_documents

    Orders (see ``pagedrag.canonical.canonical_order``): "stable" sorts by
    ``metadata["source"]`` (else the document id), then ``metadata["start_index"]``, then a
    hash of the text; "relevance" keeps the retriever's order. Either way documents with
    empty or repeated text are removed.

    With ``max_context_tokens``, the documents are also fitted into that many tokens of
    ``tokenizer`` (default: the embedded model's), counted as ``format_documents`` renders
    them, by the canonicalizer's rule: documents are kept while they fit, the first that
    does not is cut at a token boundary, the rest are dropped.
    """

    order: Literal["stable", "relevance"] = "stable"
    max_context_tokens: int | None = Field(default=None, gt=0)
    tokenizer: Any = Field(default=None, exclude=True, description="A Hugging Face tokenizer.")

    def invoke(self, input: list[Document], config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._order, input, config)

    def _order(self, documents: list[Document]) -> list[Document]:
        return canonical_items(documents, _chunk, _with_text, self.order, self.max_context_tokens, self.tokenizer,
                               DEFAULT_CHUNK_TEMPLATE)


def format_documents(documents: list[Document]) -> str:
    """The documents as the canonicalizer renders chunks, in the order given: one
    ``<document index=.. source=..>`` block each, on lines of their own (a prompt template
    adds the newline after the last)."""
    rendered = PromptCanonicalizer(order="relevance", chunk_template=DEFAULT_CHUNK_TEMPLATE).build(
        "", [_chunk(d) for d in documents]).text
    return rendered.removesuffix("\n")


def _chunk(document: Document) -> Chunk:
    """The document as the canonicalizer sees it: its text, source and start offset."""
    if not isinstance(document, Document):
        raise TypeError(f"expected a langchain Document, got {type(document).__name__}")
    source = document.metadata.get("source", document.id)
    position = document.metadata.get("start_index")
    return Chunk(document.page_content, None if source is None else str(source),
                 position if isinstance(position, int) else None)


def _with_text(document: Document, text: str) -> Document:
    return document.model_copy(update={"page_content": text})
