"""Cumulative engine outputs turned into per-choice deltas (what is new since last time).

The engine's CompletionOutputs are cumulative, and their ``text`` is always safe to send:
the output processor holds back any tail that may still start a stop string, so text once
shown is never taken back. A response (streamed or whole, over HTTP or in process) is a
series of deltas per choice; this module only takes differences, it holds nothing back.
The server and the in-process client share it, so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedrag.outputs import CompletionOutput


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
    """What one choice has sent so far.

    Invariants: ``sent_chars`` only grows and the sent text is a prefix of the final text
    (the output processor guarantees that every output's text is a prefix of the next);
    every token is in exactly one delta; the finishing delta is the last.
    """

    def __init__(self, index: int):
        self.index = index
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False

    def advance(self, completion: CompletionOutput, wants_logprobs: bool) -> ChoiceDelta | None:
        """The delta up to ``completion`` (cumulative), or None when there is nothing to send."""
        if self.finished:
            return None
        self.finished = completion.finished()
        num_chars, num_tokens = len(completion.text), len(completion.token_ids)
        new_text = completion.text[self.sent_chars:]
        new_tokens = completion.token_ids[self.sent_tokens:]
        if not (new_text or self.finished or (wants_logprobs and new_tokens)):
            return None
        logprobs = None if completion.logprobs is None else completion.logprobs[self.sent_tokens:num_tokens]
        delta = ChoiceDelta(self.index, new_text, self.sent_chars, new_tokens, logprobs,
                            completion.finish_reason if self.finished else None,
                            completion.stop_reason if self.finished else None)
        self.sent_chars, self.sent_tokens = num_chars, num_tokens
        return delta
