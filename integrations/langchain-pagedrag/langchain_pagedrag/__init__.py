"""pagedrag for LangChain: chat and completion models, canonical document order, a RAG prompt."""

from .chat_models import ChatPagedRAG
from .documents import CanonicalDocuments, format_documents, format_reusable_documents
from .llms import PagedRAGLLM
from .prompts import PAGEDRAG_RAG_PROMPT

__all__ = ["PAGEDRAG_RAG_PROMPT", "CanonicalDocuments", "ChatPagedRAG", "PagedRAGLLM", "format_documents",
           "format_reusable_documents"]
