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
    """Renders a delta's logprobs with a tokenizer the engine thread does not use. With
    ``as_token_ids`` (vLLM's return_tokens_as_token_ids) a token is named "token_id:<id>"."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_text(self, token_id: int, as_token_ids: bool = False) -> str:
        return f"token_id:{token_id}" if as_token_ids else self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _entry(self, token_id: int, logprob: float, as_token_ids: bool) -> TopLogprob:
        text = self.token_text(token_id, as_token_ids)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def completion(self, delta: ChoiceDelta, top: int, as_token_ids: bool = False) -> CompletionLogprobs:
        tokens = [self.token_text(token_id, as_token_ids) for token_id in delta.token_ids]
        offsets = accumulate((len(token) for token in tokens[:-1]), initial=delta.text_start)
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=[entry[token_id].logprob if token_id in entry else None
                            for token_id, entry in zip(delta.token_ids, delta.logprobs)],
            top_logprobs=[{self.token_text(t, as_token_ids): lp for t, lp in _best(entry, top)}
                          for entry in delta.logprobs],
            text_offset=list(offsets) if tokens else [])

    def chat(self, delta: ChoiceDelta, top: int, as_token_ids: bool = False) -> ChatLogprobs:
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs):
            sampled = self._entry(token_id, entry[token_id].logprob if token_id in entry else float("-inf"),
                                  as_token_ids)
            content.append(TokenLogprob(**sampled.model_dump(),
                                        top_logprobs=[self._entry(t, lp, as_token_ids) for t, lp in _best(entry, top)]))
        return ChatLogprobs(content=content)


def _best(entry: dict[int, Logprob], top: int) -> list[tuple[int, float]]:
    return sorted(((token, lp.logprob) for token, lp in entry.items()), key=lambda item: -item[1])[:top]
