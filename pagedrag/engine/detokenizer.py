"""Streaming token ids to text, and stop strings.

IncrementalDetokenizer turns a sequence's new token ids into newly final text; it
decodes only a short window (the last emitted chunk as left context, plus pending
tokens) and takes the difference, so each call costs O(new tokens), and leading
spaces (SentencePiece "▁", byte-level "Ġ") and multi-byte characters split over
tokens come out right. StopChecker finds stop strings in that text and says how
much of it may be streamed without leaking the start of a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

# How many prompt tokens give the first output tokens their left context (as vLLM).
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, a few tokens at a time.

    Invariants:
    - ``_context`` are the tokens of the last emitted chunk (at first, the prompt's
      last few tokens): their text is final and only gives left context.
      ``_pending`` are later tokens whose text is held back.
    - Text is emitted only when the window's decoding does not end in U+FFFD, so a
      multi-byte character split over tokens is never emitted in halves.
    - After ``flush()``, ``text == tokenizer.decode(output ids, skip_special_tokens=...,
      clean_up_tokenization_spaces=False)`` for tokenizers whose decoding is
      concatenative (byte-level BPE, SentencePiece); clean-up of spaces is never
      applied, as it cannot be applied to a stream.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._pending: list[int] = []
        self.text = ""

    def append(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text they finalised (maybe "")."""
        self._pending.extend(token_ids)
        new_text = self._pending_text()
        if not new_text or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes to U+FFFD).

        Call once when the sequence finishes so ``text`` covers every token.
        """
        return self._emit(self._pending_text())

    def _pending_text(self) -> str:
        """The text the pending tokens add after their left context."""
        context_text = self._decode(self._context)
        return self._decode(self._context + self._pending)[len(context_text):]

    def _emit(self, new_text: str) -> str:
        """Record the pending tokens' text and make them the next left context."""
        if self._pending:
            self._context, self._pending = self._pending, []
        self.text += new_text
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


@dataclass
class StopMatch:
    """A stop string found in the output."""

    stop: str  # the stop string that matched
    text: str  # the output truncated before it (or after it, if included)


class StopChecker:
    """Finds the first stop string in a growing output text.

    Invariants: ``check`` is called after every append with the cumulative text and
    the number of characters just added, and generation ends at the first match, so
    any new match must end inside the new characters and only that tail is searched.
    When several stop strings match, the one that starts first wins. The text only grows
    (the detokenizer's emitted text), so ``streamable_length`` reads each character once.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._partials = [_PartialMatch(s) for s in self.stop if s] if not include_stop_str_in_output else []
        self._read = ""  # the text the partial matches have read

    def check(self, text: str, num_new_chars: int) -> StopMatch | None:
        """The earliest stop string that the last ``num_new_chars`` completed, if any."""
        matches = []
        for stop in self.stop:
            start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if start != -1:
                matches.append((start, stop))
        if not matches:
            return None
        start, stop = min(matches)
        end = start + len(stop) if self.include_stop_str_in_output else start
        return StopMatch(stop, text[:end])

    def streamable_length(self, text: str) -> int:
        """How many leading characters of ``text`` may be streamed now.

        Holds back the longest tail of ``text`` that is a proper prefix of some stop
        string, so a stop string that may still complete is never streamed. Nothing is
        held back when stop strings are included in the output. Costs O(new characters)
        a stop string when ``text`` extends the text of the previous call (as the
        detokenizer's does); any other text is read from its start.
        """
        if not text.startswith(self._read):
            for partial in self._partials:
                partial.matched = 0
            self._read = ""
        new = text[len(self._read):]
        self._read = text
        held = 0
        for partial in self._partials:
            held = max(held, partial.read(new))
        return len(text) - held


class _PartialMatch:
    """The longest tail of a growing text that is a proper prefix of one stop string,
    kept up to date character by character (Knuth-Morris-Pratt: amortised O(1) a character)."""

    def __init__(self, stop: str):
        self.stop = stop
        self.fallback = _prefix_function(stop)
        self.matched = 0  # the longest tail of the text read so far that is a prefix of stop

    def read(self, text: str) -> int:
        """Read ``text`` (what the text gained); the proper-prefix match now."""
        stop, fallback, matched = self.stop, self.fallback, self.matched
        for character in text:
            if matched == len(stop):
                matched = fallback[matched - 1]
            while matched and stop[matched] != character:
                matched = fallback[matched - 1]
            if stop[matched] == character:
                matched += 1
        self.matched = matched
        return fallback[matched - 1] if matched == len(stop) else matched


def _prefix_function(text: str) -> list[int]:
    """For each i, the length of the longest proper prefix of text[:i + 1] that is also its suffix."""
    result = [0] * len(text)
    for index in range(1, len(text)):
        length = result[index - 1]
        while length and text[index] != text[length]:
            length = result[length - 1]
        result[index] = length + (text[index] == text[length])
    return result
