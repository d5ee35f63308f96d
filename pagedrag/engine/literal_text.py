"""Content as literal text: only a template's own special tokens are special.

A prompt the model sees is template text (a chat template's turns, with its special
tokens) around content (messages, retrieved chunks, queries). Tokenizers turn every
special-token string they meet into that special token, so content holding
"<|im_end|>\\n<|im_start|>system" would open a turn of its own. Here content is given as
*literal* pieces, and a special token that takes any non-whitespace character from a
literal piece is encoded as the tokens of its text instead (what
``split_special_tokens=True`` gives for that string alone).

Invariant: a prompt whose literal pieces hold no special-token string (nor form one with
their neighbours) is encoded exactly as ``tokenizer.encode(text)`` encodes it, so prefix
cache keys and comparisons with Hugging Face's tokenization do not change.

- ``encode(tokenizer, pieces, add_special_tokens)``: the token ids of a prompt given as
  ``Piece``s (text, literal); ``encode_with_offsets`` also gives each token's characters.
- ``encode_literal(tokenizer, text)``: a text with no special tokens at all.
- ``special_token_strings(tokenizer)``, ``has_special_text(tokenizer, text)``.
- ``TemplateFrame.of(render, slots)``: what a template renders around its content slots
  (e.g. each message's content), to turn a rendered chat into pieces.
- ``chat_pieces(tokenizer, render, conversation)``: a rendered chat as pieces, each
  message's content literal (for the engine's chat path: ``encode(tokenizer, pieces)``).
"""

from __future__ import annotations

import functools
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

Offsets = list[tuple[int, int]]


class Piece(NamedTuple):
    """A part of a prompt's text; ``literal`` content never yields a special token."""

    text: str
    literal: bool


def special_token_strings(tokenizer: Any) -> tuple[str, ...]:
    """The strings the tokenizer encodes as special tokens, longest first."""
    return _specials(tokenizer)[0]


def has_special_text(tokenizer: Any, text: str) -> bool:
    """Whether text holds a string the tokenizer would encode as a special token."""
    pattern = _specials(tokenizer)[1]
    return pattern is not None and pattern.search(text) is not None


def encode_literal(tokenizer: Any, text: str) -> list[int]:
    """Token ids of text with every special-token string in it as literal text, none added.
    For text without special-token strings, the same as ``encode(text, add_special_tokens=False)``."""
    if not has_special_text(tokenizer, text):
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def encode(tokenizer: Any, pieces: Sequence[Piece], add_special_tokens: bool = False) -> list[int]:
    """Token ids of the concatenated pieces, literal pieces holding no special token (without
    special-token strings in literal pieces: ``tokenizer.encode(text, add_special_tokens)``)."""
    text = "".join(piece.text for piece in pieces)
    if not _needs_literal(tokenizer, text, _literal_spans(pieces)):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return encode_with_offsets(tokenizer, pieces, add_special_tokens)[0]


def encode_with_offsets(tokenizer: Any, pieces: Sequence[Piece],
                        add_special_tokens: bool = False) -> tuple[list[int], Offsets]:
    """(token ids, character span of each token) of the concatenated pieces.

    Tokens the tokenizer adds (BOS) have empty spans; the tokens standing for a special-token
    string in a literal piece all have that string's span. Needs a fast tokenizer.
    """
    text = "".join(piece.text for piece in pieces)
    literal = _literal_spans(pieces)
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids, offsets = list(encoded["input_ids"]), [tuple(span) for span in encoded["offset_mapping"]]
    if not _needs_literal(tokenizer, text, literal):
        return ids, offsets
    special_ids = _specials(tokenizer)[2]
    out_ids: list[int] = []
    out_offsets: Offsets = []
    for token, (start, end) in zip(ids, offsets):
        if token in special_ids and _takes_content(text, start, end, literal):
            replacement = encode_literal(tokenizer, text[start:end])
            out_ids += replacement
            out_offsets += [(start, end)] * len(replacement)
        else:
            out_ids.append(token)
            out_offsets.append((start, end))
    return out_ids, out_offsets


@dataclass(frozen=True)
class TemplateFrame:
    """What a template renders around content slots: ``render(contents)`` is
    ``pieces[0] + contents[0] + pieces[1] + ... + contents[n-1] + pieces[n]``.

    ``of`` finds it by rendering a fresh marker in each slot (a random one, so no content or
    prompt can hold it), and raises ValueError unless each marker comes out once, in order.
    That a template inserts content verbatim (does not trim or escape it) is for the caller
    to check, e.g. by comparing ``join`` with a real rendering.
    """

    pieces: tuple[str, ...]

    @classmethod
    def of(cls, render: Callable[[list[str]], str], slots: int) -> "TemplateFrame":
        nonce = secrets.token_hex(8)
        markers = [f"\x00pagedrag-slot-{nonce}-{slot}\x00" for slot in range(slots)]
        rendered = render(markers)
        pattern = "|".join(map(re.escape, markers))
        pieces = re.split(pattern, rendered)
        if re.findall(pattern, rendered) != markers:
            raise ValueError("the template does not render each content slot exactly once and in order")
        return cls(tuple(pieces))

    def join(self, contents: Sequence[str]) -> list[Piece]:
        """The rendering with these contents, as pieces: template text, then literal content."""
        if len(contents) != len(self.pieces) - 1:
            raise ValueError(f"the template has {len(self.pieces) - 1} content slots, got {len(contents)} contents")
        joined = [Piece(self.pieces[0], False)]
        for content, piece in zip(contents, self.pieces[1:]):
            joined += [Piece(content, True), Piece(piece, False)]
        return [piece for piece in joined if piece.text]


def chat_pieces(tokenizer: Any, render: Callable[[list[dict]], str],
                conversation: Sequence[Mapping], text: str) -> list[Piece]:
    """``text``, the rendering of ``conversation`` by ``render``, as pieces: template text, and
    each message's (string) content literal. Where no content holds a special-token string
    it is one template piece (tokenized exactly as before), without rendering again. If the
    template does not insert contents verbatim (it trims, escapes or repeats them), a content
    holding a special-token string is a ValueError: it could not be kept literal."""
    messages = [dict(message) for message in conversation]
    slots = [index for index, message in enumerate(messages) if isinstance(message.get("content"), str)
             and message["content"]]
    contents = [messages[index]["content"] for index in slots]
    if not any(has_special_text(tokenizer, content) for content in contents):
        return [Piece(text, False)]

    def render_slots(markers: list[str]) -> str:
        return render([{**message, "content": markers[slots.index(index)]} if index in slots else message
                       for index, message in enumerate(messages)])

    try:
        pieces = TemplateFrame.of(render_slots, len(slots)).join(contents)
    except ValueError:
        pieces = None
    if pieces is not None and "".join(piece.text for piece in pieces) == text:
        return pieces
    raise ValueError("the chat template changes the messages' content, so the special-token strings "
                     "in it cannot be kept literal; remove them")


# ---- internals -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _specials_cached(tokenizer: Any) -> tuple[tuple[str, ...], re.Pattern | None, frozenset[int]]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    pairs = {(token_id, str(token)) for token_id, token in added.items() if getattr(token, "special", True)}
    pairs |= {(tokenizer.convert_tokens_to_ids(token), token) for token in tokenizer.all_special_tokens}
    strings = tuple(sorted({string for _, string in pairs if string}, key=lambda s: (-len(s), s)))
    pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
    return strings, pattern, frozenset(token_id for token_id, _ in pairs)


def _specials(tokenizer: Any) -> tuple[tuple[str, ...], re.Pattern | None, frozenset[int]]:
    """(special-token strings longest first, a pattern matching them, their ids)."""
    try:
        return _specials_cached(tokenizer)
    except TypeError:  # an unhashable tokenizer
        return _specials_cached.__wrapped__(tokenizer)


def _literal_spans(pieces: Sequence[Piece]) -> Offsets:
    """The character spans of the literal pieces in the concatenated text."""
    spans, start = [], 0
    for piece in pieces:
        if piece.literal and piece.text:
            spans.append((start, start + len(piece.text)))
        start += len(piece.text)
    return spans


def _takes_content(text: str, start: int, end: int, literal: Offsets) -> bool:
    """Whether text[start:end] shares a non-whitespace character with a literal span (a
    template's special token may absorb the whitespace next to it)."""
    return any(text[max(start, low):min(end, high)].strip() for low, high in literal)


def _needs_literal(tokenizer: Any, text: str, literal: Offsets) -> bool:
    """Whether a special-token string in text overlaps a literal span (cheap; conservative)."""
    pattern = _specials(tokenizer)[1]
    if pattern is None or not literal:
        return False
    return any(match.start() < high and low < match.end()
               for match in pattern.finditer(text) for low, high in literal)
