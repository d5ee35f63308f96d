"""pagedrag for LangChain: chat and completion models, canonical document order, a RAG prompt,
and a document transformer that warms the engine at indexing (PagedRAGWarmup)."""

from .chat_models import ChatPagedRAG
from .documents import CanonicalDocuments, format_documents, format_reusable_documents
from .llms import PagedRAGLLM
from .prompts import PAGEDRAG_RAG_PROMPT
from .warmup import PagedRAGWarmup

__all__ = ["PAGEDRAG_RAG_PROMPT", "CanonicalDocuments", "ChatPagedRAG", "PagedRAGLLM", "PagedRAGWarmup",
           "format_documents", "format_reusable_documents"]
