"""The prompt canonicalizer: RAG prompts laid out so that they keep hitting the prefix cache.

A prompt is laid out as::

    static system prompt | retrieved chunks, in canonical order | volatile fields | query

so that everything that changes between requests (the date, the user, the session, the
query) comes after everything that does not, and the retrieved chunks come in an order
that does not depend on the retriever's ranking.

Boundary invariant (what makes the layout cache-friendly). The prompt is a concatenation
of segments -- the system prompt, one segment per chunk, one per volatile field, the
query -- and every segment but the query ends with exactly one newline that follows a
non-whitespace character, while every segment starts with a non-whitespace character
(chunk text, keys, values and the query are stripped). A byte-level BPE pre-tokenizer
(GPT-2, Llama 3, Qwen2 regexes) therefore always splits right after that newline, and
the newline's token is the same whether text follows or not, so the token ids of a
prompt's first k segments are a prefix of the whole prompt's token ids. A blank line
("\\n\\n") would not do: with SmolLM2's tokenizer "x\\n\\n" alone ends in the token "ĊĊ",
while "x\\n\\nWord" tokenizes as "Ċ", "Ċ", "Word".
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import string
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

ORDERS = ("stable", "cache_aware", "relevance")
TEMPLATE_FIELDS = ("text", "source", "position", "index", "metadata")
"""Placeholders of a chunk template: {text}, {source} (source id or "unknown"), {position}
(or ""), {index} (1-based place in the prompt) and {metadata} (e.g. {metadata[title]}).
Leave scores out: they change with every query and would break the cache."""
DEFAULT_CHUNK_TEMPLATE = '<document index="{index}" source="{source}">\n{text}\n</document>'
REUSABLE_CHUNK_TEMPLATE = '<document source="{source}">\n{text}\n</document>'
"""For chunk reuse (``enable_chunk_reuse``): a chunk renders the same wherever it lands, so its
KV can be reused at any position ({index} would make every position a different text)."""

_SENTINEL = "\x00pagedrag-user-content\x00"

T = TypeVar("T")


class CachedPrefixSource(Protocol):
    """What cache-aware ordering asks of the engine (``LLMEngine`` implements it)."""

    def cached_prefix_len(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading tokens of the prompt are in the prefix cache now."""


class VolatileSystemPromptWarning(UserWarning):
    """The system prompt holds content that changes between requests (dates, ids)."""


# ---- chunks ---------------------------------------------------------------------------

def normalize_text(text: str) -> str:
    """Text with CRLF line endings made LF and whitespace at both ends stripped."""
    return text.replace("\r\n", "\n").strip()


def _require(value: Any, types: type | tuple[type, ...], name: str, optional: bool = False) -> None:
    """Raise TypeError naming the field unless value is of the given type(s)."""
    if (value is None and optional) or isinstance(value, types):
        return
    expected = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
    raise TypeError(f"{name} must be {expected}{' or None' if optional else ''}, got {type(value).__name__}")


@dataclass(frozen=True)
class Chunk:
    """A retrieved chunk. Invariant: ``text`` is normalized (see ``normalize_text``).

    ``metadata`` is carried along (integrations keep their node or document there) but
    takes no part in equality, hashing or order.
    """

    text: str
    source_id: str | None = None
    position: int | None = None
    score: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _require(self.text, str, "text")
        _require(self.source_id, str, "source_id", optional=True)
        _require(self.position, int, "position", optional=True)
        _require(self.score, (int, float), "score", optional=True)
        _require(self.metadata, Mapping, "metadata")
        object.__setattr__(self, "text", normalize_text(self.text))


ChunkLike = Chunk | str | Mapping[str, Any] | Sequence[Any]
"""What ``as_chunk`` accepts: a Chunk, a text, a dict of Chunk fields or a tuple of them."""


def as_chunk(item: ChunkLike) -> Chunk:
    """A Chunk from a Chunk, a text, a dict of Chunk fields or a (text, source_id,
    position, score[, metadata]) tuple."""
    if isinstance(item, Chunk):
        return item
    if isinstance(item, str):
        return Chunk(item)
    if isinstance(item, Mapping):
        return Chunk(**item)
    if isinstance(item, Sequence):
        return Chunk(*item)
    raise TypeError(f"a chunk must be a Chunk, str, dict or tuple, got {type(item).__name__}")


def _chunk_pairs(items: Iterable[T], to_chunk: Callable[[T], Chunk]) -> list[tuple[T, Chunk]]:
    """(item, chunk) pairs; a TypeError names the offending item, e.g. ``chunks[2]: text ...``."""
    pairs = []
    for index, item in enumerate(items):
        try:
            pairs.append((item, to_chunk(item)))
        except TypeError as err:
            raise TypeError(f"chunks[{index}]: {err}") from None
    return pairs


def stable_key(chunk: Chunk) -> tuple:
    """Sort key of the stable order: source id, then position, then a hash of the text.

    Chunks without a source id come after those with one, chunks without a position
    after those with one; the content hash makes it a total order on distinct texts.
    """
    digest = hashlib.sha256(chunk.text.encode("utf-8")).hexdigest()
    return (chunk.source_id is None, chunk.source_id or "",
            chunk.position is None, chunk.position or 0, digest)


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def _dedupe(pairs: list[tuple[T, Chunk]]) -> list[tuple[T, Chunk]]:
    """The pairs in order, without empty texts and without later repeats of a text."""
    seen: set[str] = set()
    kept = []
    for item, chunk in pairs:
        if chunk.text and chunk.text not in seen:
            seen.add(chunk.text)
            kept.append((item, chunk))
    return kept


def _cache_aware(items: list[T], cached_len: Callable[[list[T]], int]) -> list[T]:
    """Greedy: repeatedly take the item that makes the longest cached run of tokens.

    ``items`` come in stable order, which breaks ties and orders the rest once no item
    extends the cached run.
    """
    chosen: list[T] = []
    rest = list(items)
    run = cached_len([])
    while rest:
        lengths = [cached_len(chosen + [item]) for item in rest]
        best = max(range(len(rest)), key=lengths.__getitem__)
        if lengths[best] <= run:
            break
        run = lengths[best]
        chosen.append(rest.pop(best))
    return chosen + rest


def canonical_order(items: Iterable[T], order: str = "stable", *,
                    to_chunk: Callable[[T], Chunk] = as_chunk,
                    cached_len: Callable[[list[T]], int] | None = None) -> list[T]:
    """The items themselves, deduplicated and put in canonical order.

    Items are anything ``to_chunk`` turns into a Chunk (by default Chunks, texts, dicts and
    (text, source_id, position, score) tuples; pass a converter for LlamaIndex nodes or
    LangChain documents). Orders:

    - "stable": by ``stable_key``; the result does not depend on the input order.
    - "relevance": as given (the retriever's ranking).
    - "cache_aware": starts from the stable order, then greedily moves first the items
      that extend the run of cached tokens the most. ``cached_len(leading_items)`` must
      return how many tokens of a prompt starting with those items are cached
      (``PromptCanonicalizer.order_chunks`` supplies it from its engine).

    Items whose normalized text is empty or repeats an earlier item's are removed; of
    equal texts the first in the order kept (for "stable", the one with the smallest key).
    """
    _check_order(order)
    pairs = _chunk_pairs(items, to_chunk)
    if order != "relevance":
        pairs.sort(key=lambda pair: stable_key(pair[1]))
    ordered = [item for item, _ in _dedupe(pairs)]
    if order != "cache_aware":
        return ordered
    if cached_len is None:
        raise ValueError("order='cache_aware' needs cached_len (or use PromptCanonicalizer with an engine)")
    return _cache_aware(ordered, cached_len)


# ---- volatile content -------------------------------------------------------------------

_MONTH = r"(?:jan|feb|mar|apr|may|jun|jul|aug|sep|oct|nov|dec)[a-z]*\.?"
_VOLATILE_PATTERNS = tuple((kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in (
    ("timestamp", r"\b\d{4}-\d{2}-\d{2}[T ]\d{1,2}:\d{2}(?::\d{2}(?:\.\d+)?)?(?:Z|[+-]\d{2}:?\d{2})?"),
    ("uuid", r"\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"),
    ("date", rf"\b\d{{4}}-\d{{2}}-\d{{2}}\b|\b\d{{1,2}}/\d{{1,2}}/\d{{2,4}}\b"
             rf"|\b{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b|\b\d{{1,2}} {_MONTH},? \d{{4}}\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[ap]\.?m\b\.?)?"),
    ("timestamp", r"\b1\d{9}(?:\d{3})?\b"),  # Unix epoch seconds or milliseconds
    ("session_id", r"\b(?:session|sess|sid|conversation|request|trace)(?:[ _-]?id)?\s*[:=]\s*\S+"),
    ("user_id", r"\b(?:user[ _-]?(?:id|name)|uid|user(?==))\s*[:=]\s*\S+"),
    ("hex_id", r"\b(?=[0-9a-f]*\d)[0-9a-f]{16,}\b"),
))


def detect_volatile(text: str) -> list[tuple[str, re.Match]]:
    """(kind, match) for each piece of text that likely changes between requests.

    Kinds: "timestamp", "date", "time", "uuid", "hex_id", "user_id", "session_id".
    Matches do not overlap (earlier patterns above win) and come in text order.
    """
    found: list[tuple[str, re.Match]] = []
    for kind, pattern in _VOLATILE_PATTERNS:
        for match in pattern.finditer(text):
            if not any(match.start() < other.end() and other.start() < match.end() for _, other in found):
                found.append((kind, match))
    return sorted(found, key=lambda pair: pair[1].start())


_warned_system_prompts: set[str] = set()


def _warn_if_volatile(system_prompt: str) -> None:
    """Warn, once per distinct system prompt in this process, about volatile content in it."""
    found = detect_volatile(system_prompt)
    digest = hashlib.sha256(system_prompt.encode("utf-8")).hexdigest()
    if not found or digest in _warned_system_prompts:
        return
    _warned_system_prompts.add(digest)
    listed = ", ".join(f"{kind} {match.group()!r}" for kind, match in found)
    warnings.warn(
        f"the system prompt holds content that changes between requests ({listed}); it changes "
        "the first tokens of every prompt and so defeats prefix caching for everything after it. "
        "Pass such values in build(volatile=...), which places them after the retrieved chunks.",
        VolatileSystemPromptWarning, stacklevel=3)


# ---- the canonicalizer ------------------------------------------------------------------

def _segment(text: str) -> str:
    """One segment of the layout: stripped text and one newline, or "" for blank text."""
    text = text.strip()
    return text + "\n" if text else ""


def _join_system_prompt(system_prompt: str | Sequence[str]) -> str:
    """The system prompt(s) as one normalized string, parts separated by a blank line."""
    parts = [system_prompt] if isinstance(system_prompt, str) else list(system_prompt)
    for index, part in enumerate(parts):
        _require(part, str, "system_prompt" if isinstance(system_prompt, str) else f"system_prompt[{index}]")
    return "\n\n".join(filter(None, map(normalize_text, parts)))


def _check_template(template: str) -> None:
    """Raise unless the chunk template uses {text} and only TEMPLATE_FIELDS."""
    _require(template, str, "chunk_template")
    names = {re.split(r"[.\[]", name)[0] for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    if "text" not in names or not names <= set(TEMPLATE_FIELDS):
        raise ValueError(f"chunk_template must use {{text}} and only the fields {TEMPLATE_FIELDS}, got {template!r}")


def _volatile_segment(volatile: Mapping[str, str] | None) -> str:
    """The volatile fields as "key: value" lines, sorted by key."""
    _require(volatile, Mapping, "volatile", optional=True)
    fields = list((volatile or {}).items())
    for key, value in fields:
        _require(key, str, "volatile keys")
        _require(value, str, f"volatile[{key!r}]")
    return "".join(_segment(f"{normalize_text(key)}: {normalize_text(value)}") for key, value in sorted(fields))


@dataclass(frozen=True)
class CanonicalPrompt:
    """A built prompt.

    ``text`` is the plain layout (system prompt, chunks, volatile fields, query);
    ``messages`` the same content as chat messages: a system message (if any) and one user
    message with chunks, volatile fields and query. ``token_ids`` (when the canonicalizer
    has a tokenizer) are what the engine should run: the chat template applied to
    ``messages`` with the generation prompt (``chat=True``), or ``text`` encoded.
    ``chunks`` are the chunks in the prompt, in order (the last one cut short when
    ``truncated``); ``dropped`` the chunks left out to fit ``max_prompt_tokens``.
    ``segments`` (with a tokenizer) split ``token_ids`` into the head, one segment per chunk
    (reusable), the volatile fields and the query: ``{"prompt_segments": segments}`` is the
    prompt for chunk reuse (``enable_chunk_reuse``), the same tokens as ``token_ids``.
    """

    text: str
    messages: list[dict[str, str]]
    chunks: list[Chunk]
    dropped: list[Chunk] = field(default_factory=list)
    truncated: bool = False
    token_ids: list[int] | None = None
    segments: list[dict] | None = None


class PromptCanonicalizer:
    """Builds cache-friendly RAG prompts (see the module docstring for the layout).

    - ``system_prompt``: one string or several (joined by a blank line); a warning
      (``VolatileSystemPromptWarning``, once per distinct prompt) flags dates and ids in it.
    - ``order``: "stable" (default), "cache_aware" (needs ``engine`` and ``tokenizer``) or
      "relevance"; see ``canonical_order``.
    - ``tokenizer``: a Hugging Face tokenizer; needed for token ids, cache-aware order and
      ``max_prompt_tokens``.
    - ``engine``: anything with ``cached_prefix_len(prompt_token_ids, cache_salt)``.
    - ``max_prompt_tokens``: the token budget of the whole prompt (max_model_len minus the
      tokens reserved for output). Rule: chunks are kept in canonical order while they fit,
      the first that does not fit is cut at a token boundary to fill the budget, the rest
      are dropped; the system prompt, volatile fields and query are never cut, and if they
      alone exceed the budget ``build`` raises ValueError.
    - ``chunk_template``: how a chunk is rendered (see ``DEFAULT_CHUNK_TEMPLATE``).
    - ``chat``: whether the model gets ``messages`` through the tokenizer's chat template
      (True) or ``text`` as is; decides how ``token_ids`` and cache probes are tokenized.
    """

    def __init__(self, system_prompt: str | Sequence[str] = "", order: str = "stable", *,
                 tokenizer: Any = None, engine: CachedPrefixSource | None = None,
                 max_prompt_tokens: int | None = None,
                 chunk_template: str = DEFAULT_CHUNK_TEMPLATE, chat: bool = True) -> None:
        _check_order(order)
        if order == "cache_aware" and (engine is None or tokenizer is None):
            raise ValueError("order='cache_aware' needs an engine and a tokenizer")
        if max_prompt_tokens is not None and tokenizer is None:
            raise ValueError("max_prompt_tokens needs a tokenizer to count tokens")
        _check_template(chunk_template)
        self.system_prompt = _join_system_prompt(system_prompt)
        self.order, self.tokenizer, self.engine = order, tokenizer, engine
        self.max_prompt_tokens, self.chunk_template, self.chat = max_prompt_tokens, chunk_template, chat
        _warn_if_volatile(self.system_prompt)
        self._plain_head = _segment(self.system_prompt)
        self._head, self._tail = self._frame()

    def build(self, query: str, chunks: Iterable[ChunkLike] = (),
              volatile: Mapping[str, str] | None = None, cache_salt: str | None = None) -> CanonicalPrompt:
        """The canonical prompt for a query, its retrieved chunks and its volatile fields."""
        _require(query, str, "query")
        tail = _volatile_segment(volatile) + normalize_text(query)
        ordered = self.order_chunks(chunks, cache_salt)
        kept, dropped, truncated = (self._fit(ordered, tail) if self.max_prompt_tokens is not None
                                    else (ordered, [], False))
        content = self._content(kept, tail)
        token_ids = self._ids(self._head + content + self._tail) if self.tokenizer is not None else None
        segments = self._segment_ids(kept, tail) if self.tokenizer is not None else None
        return CanonicalPrompt(self._plain_head + content, self._messages(content),
                               kept, dropped, truncated, token_ids, segments)

    def order_chunks(self, chunks: Iterable[ChunkLike], cache_salt: str | None = None) -> list[Chunk]:
        """The chunks as Chunks, deduplicated, in this canonicalizer's order."""
        as_chunks = [chunk for _, chunk in _chunk_pairs(chunks, as_chunk)]
        return canonical_order(as_chunks, self.order,
                               cached_len=lambda leading: self._cached_len(leading, cache_salt))

    # ---- layout ------------------------------------------------------------------------
    def _render_chunk(self, chunk: Chunk, index: int) -> str:
        position = "" if chunk.position is None else chunk.position
        return _segment(self.chunk_template.format(
            text=chunk.text, source=chunk.source_id or "unknown", position=position,
            index=index, metadata=chunk.metadata))

    def _content(self, chunks: list[Chunk], tail: str) -> str:
        """The user part of the prompt: chunk segments, then ``tail`` (volatile fields, query)."""
        return "".join(self._render_chunk(chunk, index) for index, chunk in enumerate(chunks, 1)) + tail

    def _messages(self, content: str) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": "user", "content": content}]

    def _frame(self) -> tuple[str, str]:
        """(head, tail): what the model sees is head + user content + tail.

        Through a chat template, found by rendering a sentinel as the user content; as plain
        text, the system segment and nothing.
        """
        if not (self.chat and self.tokenizer is not None):
            return self._plain_head, ""
        rendered = self.tokenizer.apply_chat_template(
            self._messages(_SENTINEL), tokenize=False, add_generation_prompt=True)
        head, tail = rendered.split(_SENTINEL)
        return head, tail

    # ---- tokens ------------------------------------------------------------------------
    def _ids(self, model_text: str) -> list[int]:
        """Token ids of text as the model sees it (a rendered chat template has its specials)."""
        return self.tokenizer.encode(model_text, add_special_tokens=not self.chat)

    def _segment_ids(self, chunks: list[Chunk], tail: str) -> list[dict] | None:
        """The prompt's token ids by segment: each segment's are what encoding the text up to its
        end adds to the encoding up to its start (a prefix of it, by the boundary invariant);
        None if a tokenizer breaks that."""
        pieces = [(self._head, False)]
        pieces += [(self._render_chunk(chunk, index), True) for index, chunk in enumerate(chunks, 1)]
        pieces.append((tail + self._tail, False))
        segments, done, text = [], [], ""
        for piece, reusable in pieces:
            text += piece
            ids = self._ids(text)
            if ids[:len(done)] != done:
                return None
            segments.append({"token_ids": ids[len(done):], "reusable": reusable})
            done = ids
        return segments

    def _cached_len(self, leading: list[Chunk], cache_salt: str | None) -> int:
        """Cached tokens of a prompt that starts with these chunks, as the engine reports."""
        return self.engine.cached_prefix_len(self._ids(self._head + self._content(leading, "")), cache_salt)

    def _fit(self, chunks: list[Chunk], tail: str) -> tuple[list[Chunk], list[Chunk], bool]:
        """(kept, dropped, truncated) under max_prompt_tokens, by the rule in the class docstring."""
        budget = self.max_prompt_tokens

        def size(kept: list[Chunk]) -> int:
            return len(self._ids(self._head + self._content(kept, tail) + self._tail))

        fixed = size([])
        if fixed > budget:
            frame = len(self._ids(self._head + self._tail))
            raise ValueError(
                f"the prompt without retrieved chunks takes {fixed} tokens (system prompt and template "
                f"{frame}, volatile fields and query {fixed - frame}), more than max_prompt_tokens={budget}")
        kept: list[Chunk] = []
        for index, chunk in enumerate(chunks):
            if size(kept + [chunk]) <= budget:
                kept.append(chunk)
                continue
            part = self._truncate(chunk, lambda candidate: size(kept + [candidate]) <= budget)
            if part is None:
                return kept, chunks[index:], False
            return kept + [part], chunks[index + 1:], True
        return kept, [], False

    def _truncate(self, chunk: Chunk, fits: Callable[[Chunk], bool]) -> Chunk | None:
        """The chunk cut to its longest leading run of tokens that fits, or None if none does."""
        ids = self.tokenizer.encode(chunk.text, add_special_tokens=False)

        def cut(count: int) -> Chunk:
            return dataclasses.replace(chunk, text=self.tokenizer.decode(ids[:count]).rstrip("\ufffd"))

        low, high = 0, len(ids) - 1  # invariant: cut(low) fits (or low == 0); cut(high + 1) does not
        while low < high:
            middle = (low + high + 1) // 2
            if fits(cut(middle)):
                low = middle
            else:
                high = middle - 1
        part = cut(low)
        return part if low > 0 and part.text else None
