"""Token logprobs in the two shapes OpenAI uses: completions' (parallel lists) and chat's.

The engine gives, per generated token, a dict token id -> Logprob holding the
sampled token and the top-k alternatives; the sampled token's logprob is looked up
in it (None if absent), the top-k are the k best entries.
"""

from __future__ import annotations

from itertools import accumulate

from pagedrag.deltas import ChoiceDelta
from pagedrag.outputs import Logprob
from pagedrag.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class LogprobFormatter:
    """Renders a delta's logprobs with a tokenizer the engine thread does not use."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _entry(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def completion(self, delta: ChoiceDelta, top: int) -> CompletionLogprobs:
        tokens = [self.token_text(token_id) for token_id in delta.token_ids]
        offsets = accumulate((len(token) for token in tokens[:-1]), initial=delta.text_start)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[entry[token_id].logprob if token_id in entry else None
                            for token_id, entry in zip(delta.token_ids, delta.logprobs)],
            top_logprobs=[{self.token_text(t): lp for t, lp in _best(entry, top)} for entry in delta.logprobs],
            text_offset=list(offsets) if tokens else [])

    def chat(self, delta: ChoiceDelta, top: int) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs):
            sampled = self._entry(token_id, entry[token_id].logprob if token_id in entry else float("-inf"))
            content.append(TokenLogprob(**sampled.model_dump(),
                                        top_logprobs=[self._entry(t, lp) for t, lp in _best(entry, top)]))
        return ChatLogprobs(content=content)


def _best(entry: dict[int, Logprob], top: int) -> list[tuple[int, float]]:
    return sorted(((token, lp.logprob) for token, lp in entry.items()), key=lambda item: -item[1])[:top]
