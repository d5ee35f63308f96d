"""A RAG prompt in the canonical layout: instructions, then context, then the question."""

from __future__ import annotations

from langchain_core.prompts import ChatPromptTemplate

from pagedrag.rag.prompts import RAG_SYSTEM_PROMPT, canonical_template_messages

PAGEDRAG_RAG_PROMPT = ChatPromptTemplate.from_messages(
    [(m["role"], m["content"]) for m in canonical_template_messages(RAG_SYSTEM_PROMPT, "Context:\n{context}",
                                                                     "Question: {question}")])
"""Variables: ``context`` (e.g. ``format_documents`` of canonically ordered documents) and
``question``. What never changes comes first and what changes with every question last,
so that prompts over the same documents share their leading tokens."""
