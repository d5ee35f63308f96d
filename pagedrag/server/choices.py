"""What one choice of a response has sent so far, and what it may send next.

The engine's outputs are cumulative; a response (streamed or whole) is a series of
deltas per choice. Streaming holds back a tail of text that may still turn out to
be the start of a stop string, so text once sent is never taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..detokenizer import StopChecker
from ..outputs import CompletionOutput


@dataclass
class ChoiceDelta:
    """New text and tokens of one choice since its previous delta."""

    index: int  # the choice's index in the response
    text: str
    text_start: int  # characters of this choice's text sent before this delta
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one entry per token in token_ids
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChoiceCursor:
    """Invariants: ``sent_chars`` only grows and the sent text is a prefix of the final
    text; every token is in exactly one delta; the finishing delta is the last."""

    def __init__(self, index: int, stops: StopChecker):
        self.index = index
        self.stops = stops
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def advance(self, completion: CompletionOutput, wants_logprobs: bool) -> ChoiceDelta | None:
        """The delta up to ``completion`` (cumulative), or None when there is nothing to send."""
        if self.finished:
            return None
        self.finished = completion.finished()
        text = completion.text
        visible = len(text) if self.finished else max(self.sent_chars, self.stops.streamable_length(text))
        num_tokens = len(completion.token_ids)
        new_text = text[self.sent_chars:visible]
        new_tokens = completion.token_ids[self.sent_tokens:num_tokens]
        if not (new_text or self.finished or (wants_logprobs and new_tokens)):
            return None
        logprobs = None if completion.logprobs is None else completion.logprobs[self.sent_tokens:num_tokens]
        delta = ChoiceDelta(self.index, new_text, self.sent_chars, new_tokens, logprobs,
                            completion.finish_reason if self.finished else None,
                            completion.stop_reason if self.finished else None)
        self.sent_chars, self.sent_tokens = visible, num_tokens
        return delta
