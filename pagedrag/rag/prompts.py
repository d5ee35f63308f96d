"""RAG prompt pieces both integrations share: the QA system prompt and template messages
in the canonical layout."""

from __future__ import annotations

from pagedrag.rag.canonical import PromptCanonicalizer

RAG_SYSTEM_PROMPT = ("You are an expert Q&A system. Answer the question using only the context given "
                     "before it, not prior knowledge. Never refer to the context directly in your answer.")


def canonical_template_messages(system_prompt: str, context_placeholder: str,
                                query_placeholder: str) -> list[dict]:
    """Chat messages of a prompt template in the canonical layout (system prompt, then
    the context, then the query), with the framework's placeholders left in them."""
    canonicalizer = PromptCanonicalizer(system_prompt, order="relevance", chunk_template="{text}")
    return canonicalizer.build(query_placeholder, [context_placeholder]).messages
