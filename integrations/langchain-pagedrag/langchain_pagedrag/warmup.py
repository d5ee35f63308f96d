"""PagedRAGWarmup: a document transformer that computes each document's KV before the first question."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import BaseDocumentTransformer, Document
from langchain_core.prompts import BasePromptTemplate

from pagedrag.client import Prompt
from pagedrag.rag.canonical import normalize_text
from pagedrag.rag.warmup import DEFAULT_BATCH_SIZE, awarm_chunks, check_warm_options, warm_chunks

from .chat_models import ChatPagedRAG
from .documents import context_prompt, format_reusable_documents
from .llms import PagedRAGLLM
from .prompts import PAGEDRAG_RAG_PROMPT


class PagedRAGWarmup(BaseDocumentTransformer):
    """Warms ``llm``'s engine with every document of an indexing flow, and returns the
    documents unchanged::

        chunks = PagedRAGWarmup(chat).transform_documents(splitter.split_documents(documents))
        store = FAISS.from_documents(chunks, embeddings)
        context = store.as_retriever() | CanonicalDocuments(llm=chat) | format_documents

    Each document is warmed under the canonical layout, as ``prompt`` (PAGEDRAG_RAG_PROMPT unless
    told otherwise) holds it when it is the first of the retrieved documents, rendered as
    CanonicalDocuments renders documents for ``llm`` (``documents.context_prompt``): with prefix
    caching, the system prompt and the document are then cached for every question that
    retrieves it first (canonical order); with chunk reuse (``chunk_reuse_possible``) its
    ``format_reusable_documents`` block also goes as a retrieved chunk, so its own KV is stored
    for reuse wherever it lands. With KV tiers (``kv_disk_path``) the warm-up outlives the
    process. ``batch_size`` documents go to the engine at a time; a progress bar counts them
    unless ``show_progress`` is False. Blank documents are skipped.
    """

    def __init__(self, llm: ChatPagedRAG | PagedRAGLLM, prompt: BasePromptTemplate = PAGEDRAG_RAG_PROMPT,
                 batch_size: int = DEFAULT_BATCH_SIZE, show_progress: bool = True) -> None:
        check_warm_options(batch_size, show_progress)
        self.llm, self.prompt, self.batch_size, self.show_progress = llm, prompt, batch_size, show_progress

    def transform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        warm_chunks(self.llm, *self._prompts(documents), self.batch_size, self.show_progress)
        return documents

    async def atransform_documents(self, documents: Sequence[Document], **kwargs: Any) -> Sequence[Document]:
        await awarm_chunks(self.llm, *self._prompts(documents), self.batch_size, self.show_progress)
        return documents

    def _prompts(self, documents: Sequence[Document]) -> tuple[list[Prompt], list[str]]:
        """(prompt, reusable block) of each document that has text."""
        for index, document in enumerate(documents):
            if not isinstance(document, Document):
                raise TypeError(f"documents[{index}] must be a langchain Document, got {type(document).__name__}")
        kept = [document for document in documents if normalize_text(document.page_content)]
        return ([context_prompt(self.llm, self.prompt, [document]) for document in kept],
                [format_reusable_documents([document]) for document in kept])
