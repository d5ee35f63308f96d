"""RAG prompt helpers that both integrations share: the QA system prompt, template
messages in the canonical layout, and the token-budget rule for retrieved chunks.

These are RAG tools, not part of talking to an engine; they live here until they move
to ``pagedrag.rag``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..canonical import Chunk, PromptCanonicalizer, canonical_order
from .types import Messages

T = TypeVar("T")

RAG_SYSTEM_PROMPT = ("You are an expert Q&A system. Answer the question using only the context given "
                     "before it, not prior knowledge. Never refer to the context directly in your answer.")


def canonical_template_messages(system_prompt: str, context_placeholder: str,
                                query_placeholder: str) -> Messages:
    """Chat messages of a prompt template in the canonical layout (system prompt, then
    the context, then the query), with the framework's placeholders left in them."""
    canonicalizer = PromptCanonicalizer(system_prompt, order="relevance", chunk_template="{text}")
    return canonicalizer.build(query_placeholder, [context_placeholder]).messages


def canonical_items(items: Sequence[T], to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T],
                    order: str = "stable", max_tokens: int | None = None, tokenizer: Any = None,
                    chunk_template: str = "{text}") -> list[T]:
    """Retrieved items (LlamaIndex nodes, LangChain documents) deduplicated and in canonical
    order (see ``pagedrag.canonical.canonical_order``).

    With ``max_tokens``, they are also fitted into that many tokens of ``tokenizer``
    (default: the embedded model's), each rendered with ``chunk_template`` on a line of its
    own, by the canonicalizer's rule: items are kept while they fit, the first that does
    not is cut at a token boundary (``with_text(item, text)`` makes the cut copy), the rest
    are dropped.
    """
    ordered = canonical_order(items, order, to_chunk=to_chunk)
    if max_tokens is None:
        return ordered
    if tokenizer is None:
        from ..models.loader import load_tokenizer

        tokenizer = load_tokenizer()
    chunks = [dataclasses.replace(to_chunk(item), metadata={"item": item}) for item in ordered]
    canonicalizer = PromptCanonicalizer(order="relevance", tokenizer=tokenizer, max_prompt_tokens=max_tokens,
                                        chunk_template=chunk_template, chat=False)
    kept = canonicalizer.build("", chunks).chunks
    return [_with_chunk_text(chunk.metadata["item"], chunk.text, to_chunk, with_text) for chunk in kept]


def _with_chunk_text(item: T, text: str, to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T]) -> T:
    """The item itself, or a copy holding ``text`` if the budget cut it."""
    return item if to_chunk(item).text == text else with_text(item, text)
