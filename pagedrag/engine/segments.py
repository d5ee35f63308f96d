"""Where a prompt's reusable chunks are, for chunk reuse (core.chunk_cache), when the caller
did not say it with ``prompt_segments``.

- Given the retrieved chunks' texts, the prompt is cut around each one found in it, in order.
- Otherwise paragraphs are the chunks: the prompt is cut after each blank line, the way
  RAG templates (LlamaIndex's context_str, LangChain's format_docs) join documents.

A text prompt's head (segment 0) is its first piece; a chat's head is everything the template
renders before the last user message's content (system prompt, earlier turns). The piece
that holds the end of the prompt (the question) is never reusable. Each piece is tokenized
on its own, so a chunk has the same tokens wherever it lands.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

Segment = dict  # {"text": str, "reusable": bool}, as prompt_segments takes them
_SENTINEL = "\x00pagedrag-user-content\x00"
_AFTER_BLANK_LINE = re.compile(r"(?<=\n\n)(?=[^\n])")


def paragraph_pieces(text: str) -> list[tuple[str, bool]]:
    """(piece, reusable): the text cut after every blank line."""
    return [(piece, True) for piece in _AFTER_BLANK_LINE.split(text) if piece]


def chunk_pieces(text: str, chunks: Sequence[str]) -> list[tuple[str, bool]]:
    """(piece, reusable): each chunk found in the text (in order) is a reusable piece; the
    text around them is not."""
    pieces, position = [], 0
    for chunk in chunks:
        start = text.find(chunk, position) if chunk else -1
        if start < 0:
            continue
        if start > position:
            pieces.append((text[position:start], False))
        pieces.append((chunk, True))
        position = start + len(chunk)
    if position < len(text):
        pieces.append((text[position:], False))
    return pieces


def _segments(head: str, pieces: list[tuple[str, bool]], tail: str) -> list[Segment]:
    """head, the pieces, and the last piece joined to the tail, never reusable."""
    last, _ = pieces.pop() if pieces else ("", False)
    return ([{"text": head, "reusable": False}]
            + [{"text": piece, "reusable": reusable} for piece, reusable in pieces]
            + [{"text": last + tail, "reusable": False}])


def text_segments(text: str, chunks: Sequence[str] | None = None) -> list[Segment]:
    """Segments of a text prompt: with ``chunks``, the text before the first one is the head;
    otherwise the first paragraph is."""
    pieces = chunk_pieces(text, chunks) if chunks else paragraph_pieces(text)
    head = pieces.pop(0)[0] if pieces and not (chunks and pieces[0][1]) else ""
    return _segments(head, pieces, "")


def chat_segments(render: Callable[[list[dict]], str], conversation: list[dict], rendered: str,
                  chunks: Sequence[str] | None = None) -> list[Segment] | None:
    """Segments of ``rendered`` (``render(conversation)``): the head, the last user message's
    content in pieces, the rest of the template. None when the content is not a plain text
    that the template renders verbatim (the prompt is then not segmented)."""
    users = [index for index, message in enumerate(conversation) if message.get("role") == "user"]
    if not users or not isinstance(conversation[users[-1]].get("content"), str):
        return None
    content = conversation[users[-1]]["content"]
    probe = [dict(message) for message in conversation]
    probe[users[-1]]["content"] = _SENTINEL
    frame = render(probe).split(_SENTINEL)
    if len(frame) != 2 or frame[0] + content + frame[1] != rendered:
        return None
    pieces = chunk_pieces(content, chunks) if chunks else paragraph_pieces(content)
    return _segments(frame[0], pieces, frame[1])
