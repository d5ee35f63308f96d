"""Retrieved items (LlamaIndex nodes, LangChain documents) in canonical order, for both
integrations: every order the canonicalizer has, and an optional token budget.

The items stay the framework's own objects; ``to_chunk`` shows each to the canonicalizer
(``pagedrag.rag.canonical.canonical_order``) and ``with_text`` makes the copy of an item that
the budget cut short.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

from pagedrag.rag.canonical import Chunk, PromptCanonicalizer, canonical_order

from pagedrag.rag.tokenizer import load_tokenizer

T = TypeVar("T")
ChunkOrder = Literal["stable", "cache_aware", "relevance"]
"""The orders of ``pagedrag.rag.canonical.ORDERS``, as a type the integrations' fields declare."""


def check_cache_aware(order: str, engine: Any) -> None:
    """Raise ValueError when ``order`` is "cache_aware" and there is no ``engine`` to ask."""
    if order == "cache_aware" and engine is None:
        raise ValueError("order='cache_aware' asks the engine what it has cached: pass llm=, "
                         "the pagedrag model whose prompts these items go into")


def canonical_items(items: Sequence[T], to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T],
                    order: str = "stable", *, max_tokens: int | None = None, tokenizer: Any = None,
                    chunk_template: str = "{text}",
                    cached_len: Callable[[list[T]], int] | None = None,
                    identity: Callable[[Chunk], str] | None = None) -> list[T]:
    """The items deduplicated and in canonical order (see ``canonical_order``).

    "cache_aware" needs ``cached_len(leading_items)``: how many tokens of the prompt the
    pipeline would build from items that start with ``leading_items`` the engine holds
    now (``EngineSettings.cached_prefix_len`` of that prompt). ``identity(chunk)``: what
    the prompt shows of an item (default its text; see ``canonical_order``).

    With ``max_tokens``, the ordered items are also fitted into that many tokens of
    ``tokenizer`` (default: the embedded model's), each rendered with ``chunk_template``
    on a line of its own, by the canonicalizer's rule: items are kept while they fit, the
    first that does not is cut at a token boundary (``with_text(item, text)`` makes the
    cut copy), the rest are dropped.
    """
    ordered = canonical_order(items, order, to_chunk=to_chunk, cached_len=cached_len, identity=identity)
    if max_tokens is None:
        return ordered
    return _fit(ordered, to_chunk, with_text, max_tokens, tokenizer or load_tokenizer(), chunk_template)


def _fit(ordered: list[T], to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T],
         max_tokens: int, tokenizer: Any, chunk_template: str) -> list[T]:
    """The items that fit ``max_tokens``, in their order, the last possibly cut."""
    chunks = [dataclasses.replace(to_chunk(item), metadata={"item": item}) for item in ordered]
    canonicalizer = PromptCanonicalizer(order="relevance", tokenizer=tokenizer, max_prompt_tokens=max_tokens,
                                        chunk_template=chunk_template, chat=False)
    kept = canonicalizer.build("", chunks).chunks
    return [_with_chunk_text(chunk.metadata["item"], chunk.text, to_chunk, with_text) for chunk in kept]


def _with_chunk_text(item: T, text: str, to_chunk: Callable[[T], Chunk], with_text: Callable[[T, str], T]) -> T:
    """The item itself, or a copy holding ``text`` if the budget cut it."""
    return item if to_chunk(item).text == text else with_text(item, text)
