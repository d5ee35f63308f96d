"""Where a prompt's reusable chunks are, for chunk reuse (core.chunk_cache), when the caller
did not say it with ``prompt_segments``.

- Given the retrieved chunks' texts (in any order), the prompt is cut around each one found in it.
- Otherwise paragraphs are the chunks: the prompt is cut after each blank line, the way
  RAG templates (LlamaIndex's context_str, LangChain's format_docs) join documents.

A text prompt's head (segment 0) is its first piece; a chat's head is everything the template
renders before the last user message's content (system prompt, earlier turns). The piece
that holds the end of the prompt (the question) is never reusable. Each piece is tokenized
on its own, so a chunk has the same tokens wherever it lands.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Sequence

Segment = dict  # {"text": str, "reusable": bool}, as prompt_segments takes them
_SENTINEL = "\x00pagedrag-user-content\x00"
_AFTER_BLANK_LINE = re.compile(r"(?<=\n\n)(?=[^\n])")


def paragraph_pieces(text: str) -> list[tuple[str, bool]]:
    """(piece, reusable): the text cut after every blank line."""
    return [(piece, True) for piece in _AFTER_BLANK_LINE.split(text) if piece]


def chunk_pieces(text: str, chunks: Sequence[str]) -> list[tuple[str, bool]]:
    """(piece, reusable): each chunk found in the text is a reusable piece; the text around
    them is not. The chunks may come in any order (a retriever's, not the prompt's): each
    takes its first place in the text that no chunk before it in ``chunks`` took (a chunk
    given twice takes two places), and one with no such place stays in the text around them."""
    taken: list[tuple[int, int]] = []  # sorted, disjoint
    for chunk in chunks:
        span = _free_place(text, chunk, taken)
        if span is not None:
            bisect.insort(taken, span)
    pieces, position = [], 0
    for start, end in taken:
        if start > position:
            pieces.append((text[position:start], False))
        pieces.append((text[start:end], True))
        position = end
    if position < len(text):
        pieces.append((text[position:], False))
    return pieces


def _free_place(text: str, chunk: str, taken: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first [start, end) of a non-empty ``chunk`` in ``text`` that overlaps no span of
    ``taken`` (sorted, disjoint). Each overlap moves the search past the span it hit, so the
    text is scanned once per chunk."""
    start = text.find(chunk) if chunk else -1
    while start >= 0:
        end = start + len(chunk)
        after = bisect.bisect_left(taken, (end, end))  # spans from here on begin at or after end
        if after == 0 or taken[after - 1][1] <= start:
            return start, end
        start = text.find(chunk, taken[after - 1][1])
    return None


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
