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
    When several stop strings match, the one that starts first wins.
    """

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output

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
        held back when stop strings are included in the output.
        """
        if self.include_stop_str_in_output:
            return len(text)
        held = max((_partial_match_length(text, stop) for stop in self.stop), default=0)
        return len(text) - held


def _partial_match_length(text: str, stop: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``stop``."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0
