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
import bisect
import hashlib
import itertools
import re
import string
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from pagedrag.engine.literal_text import Piece, TemplateFrame, encode_literal, encode_with_offsets, has_special_text
from pagedrag.engine.literal_text import encode as encode_pieces
from pagedrag.text_checks import check_utf8

ORDERS = ("stable", "cache_aware", "relevance")
TEMPLATE_FIELDS = ("text", "source", "position", "index", "metadata")
"""Placeholders of a chunk template: {text}, {source} (source id or "unknown"), {position}
(or ""), {index} (1-based place in the prompt) and {metadata} (e.g. {metadata[title]}).
Leave scores out: they change with every query and would break the cache."""
DEFAULT_CHUNK_TEMPLATE = '<document index="{index}" source="{source}">\n{text}\n</document>'
REUSABLE_CHUNK_TEMPLATE = '<document source="{source}">\n{text}\n</document>'
"""For chunk reuse (``enable_chunk_reuse``): a chunk renders the same wherever it lands, so its
KV can be reused at any position ({index} would make every position a different text)."""

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
    """A retrieved chunk. Invariants: ``text`` is normalized (see ``normalize_text``); text
    and source id are valid UTF-8 (no lone surrogates).

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
        check_utf8("text", self.text)
        if self.source_id is not None:
            check_utf8("source_id", self.source_id)
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
    """(item, chunk) pairs; a TypeError or ValueError names the offending item, e.g.
    ``chunks[2]: text ...``."""
    return [(item, _naming(index, to_chunk, item)) for index, item in enumerate(items)]


def _naming(index: int, function: Callable[[Any], T], value: Any) -> T:
    """function(value), a TypeError or ValueError prefixed with ``chunks[index]: ``."""
    try:
        return function(value)
    except (TypeError, ValueError) as err:
        raise type(err)(f"chunks[{index}]: {err}") from None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stable_key(chunk: Chunk, identity: str | None = None) -> tuple:
    """Sort key of the stable order: source id, then position, then a hash of the text, then
    a hash of ``identity`` (what the prompt shows of the chunk; default its text).

    Chunks without a source id come after those with one, chunks without a position
    after those with one; the hashes make it a total order on distinct identities.
    """
    return (chunk.source_id is None, chunk.source_id or "",
            chunk.position is None, chunk.position or 0, _digest(chunk.text),
            _digest(chunk.text if identity is None else identity))


def _check_order(order: str) -> None:
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


class _Keyed(NamedTuple):
    item: Any
    chunk: Chunk
    identity: str  # what the prompt shows of the chunk: equal identities are duplicates


def _keyed(items: Iterable[T], to_chunk: Callable[[T], Chunk],
           identity: Callable[[Chunk], str] | None) -> list[_Keyed]:
    """The items with their chunks and identities; errors name the item (``chunks[i]: ...``)."""
    pairs = _chunk_pairs(items, to_chunk)
    if identity is None:
        return [_Keyed(item, chunk, chunk.text) for item, chunk in pairs]
    return [_Keyed(item, chunk, _naming(index, identity, chunk)) for index, (item, chunk) in enumerate(pairs)]


def _dedupe(keyed: list[_Keyed]) -> list[_Keyed]:
    """The items in order, without empty texts and without later repeats of an identity."""
    seen: set[str] = set()
    kept = []
    for entry in keyed:
        if entry.chunk.text and entry.identity not in seen:
            seen.add(entry.identity)
            kept.append(entry)
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
                    cached_len: Callable[[list[T]], int] | None = None,
                    identity: Callable[[Chunk], str] | None = None) -> list[T]:
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

    ``identity(chunk)`` is what the prompt shows of a chunk (``PromptCanonicalizer`` passes
    the chunk rendered by its template); by default the chunk's text. Items whose normalized
    text is empty or whose identity repeats an earlier item's are removed; of equal
    identities the first in the order is kept. For "stable", the sort key ends with a hash of
    the identity, so neither the order nor which duplicate is kept depends on the input order
    whenever equal identities render alike.
    """
    _check_order(order)
    keyed = _keyed(items, to_chunk, identity)
    if order != "relevance":
        keyed.sort(key=lambda entry: stable_key(entry.chunk, entry.identity))
    ordered = [entry.item for entry in _dedupe(keyed)]
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
    ("date", rf"\b\d{{4}}[-/.]\d{{1,2}}[-/.]\d{{1,2}}\b|\b\d{{1,2}}[/.]\d{{1,2}}[/.]\d{{2,4}}\b"
             rf"|\b{_MONTH} \d{{1,2}}(?:st|nd|rd|th)?,? \d{{4}}\b|\b\d{{1,2}} {_MONTH},? \d{{4}}\b"),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[ap]\.?m\b\.?)?"),
    ("timestamp", r"\b1\d{9}(?:\d{3})?\b"),  # Unix epoch seconds or milliseconds
    ("session_id", r"\b(?:session|sess|sid|conversation|request|trace)(?:[ _-]?id)?\s*[:=]\s*\S+"),
    ("user_id", r"\b(?:user[ _-]?(?:id|name)|uid|user(?==))\s*[:=]\s*\S+"
                r"|\buser:[ \t]*[\w.@+-]+(?=[ \t]*(?:\r?\n|\Z))"),  # "User: bob" alone on its line, not a turn
    ("hex_id", r"\b(?=[0-9a-f]*\d)[0-9a-f]{16,}\b"),
))


def detect_volatile(text: str) -> list[tuple[str, re.Match]]:
    """(kind, match) for each piece of text that likely changes between requests.

    Kinds: "timestamp", "date", "time", "uuid", "hex_id", "user_id", "session_id".
    Matches do not overlap (earlier patterns above win) and come in text order.
    """
    starts: list[int] = []  # the kept matches' starts, in text order (they never overlap)
    kept: list[tuple[str, re.Match]] = []
    for kind, pattern in _VOLATILE_PATTERNS:
        for match in pattern.finditer(text):
            place = bisect.bisect_right(starts, match.start())
            overlaps_before = place > 0 and kept[place - 1][1].end() > match.start()
            overlaps_after = place < len(starts) and starts[place] < match.end()
            if not (overlaps_before or overlaps_after):
                starts.insert(place, match.start())
                kept.insert(place, (kind, match))
    return kept


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
        name = "system_prompt" if isinstance(system_prompt, str) else f"system_prompt[{index}]"
        _require(part, str, name)
        check_utf8(name, part)
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
        check_utf8("a volatile key", key)
        _require(value, str, f"volatile[{key!r}]")
        check_utf8(f"volatile[{key!r}]", value)
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


Segment = list[Piece]
"""A segment of a prompt as the model sees it: template text and literal content (see
pagedrag.engine.literal_text)."""


class _Fit(NamedTuple):
    """What fitting chunks into the budget decided: ``kept`` (the last one cut short when
    ``truncated``) and ``dropped``; ``rejected`` is the smallest leading chunks + candidate
    found not to fit (None when everything fit)."""

    kept: list[Chunk]
    dropped: list[Chunk]
    truncated: bool
    rejected: list[Chunk] | None


class PromptCanonicalizer:
    """Builds cache-friendly RAG prompts (see the module docstring for the layout).

    - ``system_prompt``: one string or several (joined by a blank line); a warning
      (``VolatileSystemPromptWarning``, once per distinct prompt) flags dates and ids in it.
    - ``order``: "stable" (default), "cache_aware" (needs ``engine`` and ``tokenizer``) or
      "relevance"; see ``canonical_order``. Duplicates are chunks that render alike.
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

    Special tokens: only the chat template's own text yields special tokens (and BOS where the
    tokenizer adds one); a special-token string in the system prompt, a chunk, a volatile field
    or the query is encoded as literal text (pagedrag.engine.literal_text). Prompts without
    such strings are tokenized exactly as the tokenizer tokenizes their whole text.
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
        check_utf8("query", query)
        tail = _volatile_segment(volatile) + normalize_text(query)
        ordered = self.order_chunks(chunks, cache_salt)
        kept, dropped, truncated = (self._fit(ordered, tail)[:3] if self.max_prompt_tokens is not None
                                    else (ordered, [], False))
        content = self._content(kept, tail)
        token_ids = segments = None
        if self.tokenizer is not None:
            token_ids, segments = self._token_ids_and_segments(self._segments(kept, tail))
        return CanonicalPrompt(self._plain_head + content, self._messages(content),
                               kept, dropped, truncated, token_ids, segments)

    def order_chunks(self, chunks: Iterable[ChunkLike], cache_salt: str | None = None) -> list[Chunk]:
        """The chunks as Chunks, deduplicated (by how they render), in this canonicalizer's order.
        Raises ValueError naming the chunk (``chunks[i]``) that the chunk template cannot render."""
        as_chunks = [chunk for _, chunk in _chunk_pairs(chunks, as_chunk)]
        return canonical_order(as_chunks, self.order, identity=self._identity,
                               cached_len=lambda leading: self._cached_len(leading, cache_salt))

    # ---- layout ------------------------------------------------------------------------
    def _render_chunk(self, chunk: Chunk, index: int) -> str:
        """The chunk's segment; ValueError if the template asks for what the chunk lacks."""
        position = "" if chunk.position is None else chunk.position
        try:
            rendered = self.chunk_template.format(
                text=chunk.text, source=chunk.source_id or "unknown", position=position,
                index=index, metadata=chunk.metadata)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as err:
            raise ValueError(f"chunk_template {self.chunk_template!r} cannot render this chunk "
                             f"(source_id={chunk.source_id!r}): {type(err).__name__} {err}") from None
        check_utf8("the rendered chunk (its metadata)", rendered)
        return _segment(rendered)

    def _identity(self, chunk: Chunk) -> str:
        """What the prompt shows of a chunk wherever it lands: its rendering at index 0."""
        return self._render_chunk(chunk, 0)

    def _content(self, chunks: list[Chunk], tail: str) -> str:
        """The user part of the prompt: chunk segments, then ``tail`` (volatile fields, query)."""
        return "".join(self._render_chunk(chunk, index) for index, chunk in enumerate(chunks, 1)) + tail

    def _messages(self, content: str, system_prompt: str | None = None) -> list[dict[str, str]]:
        system_prompt = self.system_prompt if system_prompt is None else system_prompt
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return system + [{"role": "user", "content": content}]

    def _render_chat(self, content: str, system_prompt: str | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            self._messages(content, system_prompt), tokenize=False, add_generation_prompt=True)

    def _frame(self) -> tuple[Segment, str]:
        """(head, tail): what the model sees is head + user content + tail.

        Through a chat template, found by rendering a marker as the user content (and, to
        locate the system prompt in the head, as the system prompt too); as plain text, the
        system segment and nothing. Invariant: the head's literal pieces are exactly the
        system prompt's text. Raises ValueError if the template changes a system prompt that
        holds special-token strings (they could not be kept literal).
        """
        if not (self.chat and self.tokenizer is not None):
            return [Piece(self._plain_head, True)], ""
        head, tail = TemplateFrame.of(lambda slots: self._render_chat(slots[0]), 1).pieces
        if not self.system_prompt:
            return [Piece(head, False)], tail
        before, after, _ = TemplateFrame.of(lambda slots: self._render_chat(slots[1], slots[0]), 2).pieces
        if before + self.system_prompt + after == head:
            return [Piece(before, False), Piece(self.system_prompt, True), Piece(after, False)], tail
        if has_special_text(self.tokenizer, self.system_prompt):
            raise ValueError("the chat template changes the system prompt's text, so the special-token "
                             "strings in the system prompt cannot be kept literal; remove them")
        return [Piece(head, False)], tail

    def _segments(self, chunks: list[Chunk], tail: str) -> list[Segment]:
        """The prompt by segment: head, one per chunk, then volatile fields, query and template tail."""
        return ([self._head] + [self._chunk_segment(chunk, index) for index, chunk in enumerate(chunks, 1)]
                + [self._tail_segment(tail)])

    def _chunk_segment(self, chunk: Chunk, index: int) -> Segment:
        return [Piece(self._render_chunk(chunk, index), True)]

    def _tail_segment(self, tail: str) -> Segment:
        return [Piece(tail, True), Piece(self._tail, False)]

    # ---- tokens ------------------------------------------------------------------------
    def _ids(self, segments: Sequence[Segment], first: bool = True) -> list[int]:
        """Token ids of the segments' text as the model sees it (``first``: they start the
        prompt, so the tokenizer adds its BOS where it does; chat text has its own specials)."""
        pieces = [piece for segment in segments for piece in segment]
        return encode_pieces(self.tokenizer, pieces, add_special_tokens=first and not self.chat)

    def _token_ids_and_segments(self, segments: list[Segment]) -> tuple[list[int], list[dict] | None]:
        """The prompt's token ids, and the same split by segment (see ``_split``)."""
        if not getattr(self.tokenizer, "is_fast", False):  # no offsets to split by
            return self._ids(segments), None
        pieces = [piece for segment in segments for piece in segment]
        ids, offsets = encode_with_offsets(self.tokenizer, pieces, add_special_tokens=not self.chat)
        return ids, self._split(segments, ids, offsets)

    def _split(self, segments: list[Segment], ids: list[int], offsets: list[tuple[int, int]]) -> list[dict] | None:
        """The token ids by segment, {"token_ids", "reusable"} (chunk segments are reusable).

        Invariant (checked): each segment's ids are what encoding the prompt up to its end adds
        to the encoding up to its start, so a chunk's ids do not depend on what follows. The
        check is local, which keeps it linear: a segment's ids must be the last ids of the
        encoding of it and the segment before it alone (the boundary invariant of the module
        docstring makes this hold). None if a token spans two segments or the check fails.
        """
        ends = list(itertools.accumulate(sum(len(piece.text) for piece in segment) for segment in segments))
        cuts = _token_cuts(offsets, ends)
        if cuts is None:
            return None
        starts = [0] + cuts[:-1]
        for index in range(len(segments) - 1):
            window_start = starts[max(index - 1, 0)]
            expected = ids[window_start:cuts[index]]
            window = self._ids(segments[max(index - 1, 0):index + 1], first=index <= 1)
            own = cuts[index] - starts[index]
            if (window != expected) if index <= 1 else (window[len(window) - own:] != expected[len(expected) - own:]):
                return None
        return [{"token_ids": ids[start:end], "reusable": 0 < index < len(segments) - 1}
                for index, (start, end) in enumerate(zip(starts, cuts))]

    def _cached_len(self, leading: list[Chunk], cache_salt: str | None) -> int:
        """Cached tokens of a prompt that starts with these chunks, as the engine reports."""
        return self.engine.cached_prefix_len(self._ids([self._head, [Piece(self._content(leading, ""), True)]]),
                                             cache_salt)

    # ---- the budget ----------------------------------------------------------------------
    def _fit(self, chunks: list[Chunk], tail: str) -> _Fit:
        """(kept, dropped, truncated, rejected) under max_prompt_tokens, by the rule in the class
        docstring. Sizes come from encoding segment by segment (linear in the prompt); the
        decision is confirmed by encoding the result, and the smallest rejected prompt, whole,
        and remade with whole-prompt sizes (as ``_fit_exact``) if either disagrees."""
        fixed = len(self._ids(self._segments([], tail)))
        self._check_fixed(fixed, tail)
        fit = self._greedy(chunks, _SegmentSizes(self, tail))
        budget = self.max_prompt_tokens
        if len(self._ids(self._segments(fit.kept, tail))) <= budget and (
                fit.rejected is None or len(self._ids(self._segments(fit.rejected, tail))) > budget):
            return fit
        return self._fit_exact(chunks, tail)

    def _fit_exact(self, chunks: list[Chunk], tail: str) -> _Fit:
        """As ``_fit``, with every size from encoding the whole prompt (quadratic)."""
        self._check_fixed(len(self._ids(self._segments([], tail))), tail)
        return self._greedy(chunks, _WholeSizes(self, tail))

    def _check_fixed(self, fixed: int, tail: str) -> None:
        """Raise ValueError if the prompt without chunks (``fixed`` tokens) exceeds the budget."""
        budget = self.max_prompt_tokens
        if fixed > budget:
            frame = len(self._ids([self._head, self._tail_segment("")]))
            raise ValueError(
                f"the prompt without retrieved chunks takes {fixed} tokens (system prompt and template "
                f"{frame}, volatile fields and query {fixed - frame}), more than max_prompt_tokens={budget}")

    def _greedy(self, chunks: list[Chunk], sizes: "_WholeSizes") -> _Fit:
        """The budget rule, with sizes of the kept chunks plus one candidate from ``sizes``."""
        budget = self.max_prompt_tokens
        for index, chunk in enumerate(chunks):
            if sizes.with_candidate(chunk) <= budget:
                sizes.keep(chunk)
                continue
            part, failing = self._truncate(chunk, lambda candidate: sizes.with_candidate(candidate) <= budget)
            rejected = sizes.kept + [failing]
            if part is None:
                return _Fit(sizes.kept, chunks[index:], False, rejected)
            return _Fit(sizes.kept + [part], chunks[index + 1:], True, rejected)
        return _Fit(sizes.kept, [], False, None)

    def _truncate(self, chunk: Chunk, fits: Callable[[Chunk], bool]) -> tuple[Chunk | None, Chunk]:
        """(the chunk cut to its longest leading run of tokens that fits, or None if none
        does; the shortest cut found not to fit, or the whole chunk)."""
        ids = encode_literal(self.tokenizer, chunk.text)

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
        failing = cut(low + 1) if low + 1 < len(ids) else chunk
        return (part if low > 0 and part.text else None), failing


class _WholeSizes:
    """Token counts of the prompt with the kept chunks plus a candidate, each from encoding
    the whole prompt."""

    def __init__(self, canon: PromptCanonicalizer, tail: str) -> None:
        self.canon, self.tail, self.kept = canon, tail, []

    def with_candidate(self, candidate: Chunk) -> int:
        return len(self.canon._ids(self.canon._segments(self.kept + [candidate], self.tail)))

    def keep(self, chunk: Chunk) -> None:
        self.kept.append(chunk)


class _SegmentSizes(_WholeSizes):
    """As _WholeSizes, summed segment by segment: each segment's tokens are what encoding it
    after the segment before adds (the boundary invariant makes the sum the whole's count).
    Cost per call: the candidate, its predecessor and the tail, not the whole prompt."""

    def __init__(self, canon: PromptCanonicalizer, tail: str) -> None:
        super().__init__(canon, tail)
        self.last, self.total = canon._head, len(canon._ids([canon._head]))
        self.tail_segment = canon._tail_segment(tail)

    def _added(self, before: Segment, segment: Segment) -> int:
        first = before is self.canon._head
        return len(self.canon._ids([before, segment], first)) - len(self.canon._ids([before], first))

    def _chunk(self, chunk: Chunk) -> Segment:
        return self.canon._chunk_segment(chunk, len(self.kept) + 1)

    def with_candidate(self, candidate: Chunk) -> int:
        segment = self._chunk(candidate)
        return self.total + self._added(self.last, segment) + self._added(segment, self.tail_segment)

    def keep(self, chunk: Chunk) -> None:
        segment = self._chunk(chunk)
        self.total += self._added(self.last, segment)
        self.last = segment
        super().keep(chunk)


def _token_cuts(offsets: list[tuple[int, int]], ends: list[int]) -> list[int] | None:
    """For each segment (ending at character ``ends[k]``), the index of the token after its
    last; tokens with empty spans (added BOS/EOS) stay with the token before. None if a token
    spans two segments."""
    cuts, segment = [], 0
    for index, (start, end) in enumerate(offsets):
        if start == end:
            continue
        while segment < len(ends) - 1 and start >= ends[segment]:
            cuts.append(index)
            segment += 1
        if end > ends[segment]:
            return None
    return cuts + [len(offsets)] * (len(ends) - len(cuts))
