"""Where a prompt's reusable chunks are, for chunk reuse (core.chunk_cache), when the caller
did not say it with ``prompt_segments``.

- Given the retrieved chunks' texts (in any order), the prompt is cut around each one found in it.
- Otherwise paragraphs are the chunks: the prompt is cut after each blank line, the way
  RAG templates (LlamaIndex's context_str, LangChain's format_docs) join documents.

A text prompt's head (segment 0) is its first piece; a chat's head is everything the template
renders before the last user message's content (system prompt, earlier turns). The piece
that holds the end of the prompt (the question) is never reusable.

The pieces come back as ``TextCuts``: the text is tokenized whole, exactly as without chunk
reuse (the same token ids, hence the same answers), and each cut moves to the first token
boundary at or after it (``token_segments``). A chunk therefore has the same tokens wherever
it lands only as far as the tokenizer lets it: tokens that merge across a cut stay whole.
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


class TextCuts(list):
    """Segments (``Segment`` dicts) that are pieces of one text, the text being their
    concatenation: unlike ``prompt_segments`` given by a caller (each tokenized on its own),
    the text is tokenized whole and the pieces only say where to cut its tokens
    (``token_segments``)."""


def _segments(head: str, pieces: list[tuple[str, bool]], tail: str) -> TextCuts:
    """head, the pieces, and the last piece joined to the tail, never reusable."""
    last, _ = pieces.pop() if pieces else ("", False)
    return TextCuts([{"text": head, "reusable": False}]
                    + [{"text": piece, "reusable": reusable} for piece, reusable in pieces]
                    + [{"text": last + tail, "reusable": False}])


def token_segments(offsets: Sequence[tuple[int, int]], cuts: Sequence[Segment]) -> list[tuple[int, int, bool]]:
    """(start, end, reusable) token ranges of ``cuts``, the pieces of a text whose tokens have
    these character ``offsets`` (a fast tokenizer's offset mapping).

    Each piece starts at the first clean token boundary (``_boundaries``) at or after its first
    character; the first starts at token 0 and the last ends at the last token. A piece that gets
    no tokens that way (no boundary fits between its cuts) is merged into the range before it,
    which is then reusable only if both are; an empty first piece is left out, so the first
    range is the head. Invariant: the ranges are non-empty and cover the tokens, in order."""
    positions, indices = _boundaries(offsets, sum(len(cut["text"]) for cut in cuts))
    starts, character = [], 0
    for cut in cuts:
        starts.append(indices[bisect.bisect_left(positions, character)] if starts else 0)
        character += len(cut["text"])
    ranges: list[list] = []
    for cut, start, end in zip(cuts, starts, starts[1:] + [len(offsets)]):
        if start < end:
            ranges.append([start, end, cut["reusable"]])
        elif ranges:
            ranges[-1][2] = ranges[-1][2] and cut["reusable"]
    return [(start, end, reusable) for start, end, reusable in ranges]


def _boundaries(offsets: Sequence[tuple[int, int]], length: int) -> tuple[list[int], list[int]]:
    """The clean token boundaries of a text of ``length`` characters: (character positions,
    token indices), both ascending. The boundary before token i is where the tokens from i on
    begin (``length`` past the last token; 0 before the first); it is clean when no token
    before it reaches past that position (a token split inside a character overlaps the next
    one). Zero-width tokens (special tokens the tokenizer added) count for neither side."""
    count = len(offsets)
    begins = [length] * (count + 1)  # begins[i]: the first character of the tokens from i on
    for index in range(count - 1, -1, -1):
        begin, end = offsets[index]
        begins[index] = min(begins[index + 1], begin) if end > begin else begins[index + 1]
    positions, indices, reach = [0], [0], 0  # reach: the last character of the tokens before i
    for index in range(1, count + 1):
        begin, end = offsets[index - 1]
        reach = max(reach, end) if end > begin else reach
        if reach <= begins[index]:
            positions.append(begins[index])
            indices.append(index)
    return positions, indices


def text_segments(text: str, chunks: Sequence[str] | None = None) -> TextCuts:
    """Segments of a text prompt: with ``chunks``, the text before the first one is the head;
    otherwise the first paragraph is."""
    pieces = chunk_pieces(text, chunks) if chunks else paragraph_pieces(text)
    head = pieces.pop(0)[0] if pieces and not (chunks and pieces[0][1]) else ""
    return _segments(head, pieces, "")


def chat_segments(render: Callable[[list[dict]], str], conversation: list[dict], rendered: str,
                  chunks: Sequence[str] | None = None) -> TextCuts | None:
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
