"""Prompt lookup (vLLM's ``ngram``): draft what followed the last place where the context's
longest suffix n-gram (n in [min_n, max_n]) occurred before.

The index is incremental: each new token adds max_n - min_n + 1 entries, so drafting costs
bounded work a step however long the context is (vLLM rescans it with KMP).
"""

from __future__ import annotations

from pagedrag.core.request import Request


class NgramIndex:
    """Where each n-gram of a token sequence last ended.

    Invariant: ``last_end`` maps every n-gram (min_n <= n <= max_n) that ends at a position
    e <= len(tokens) - 2 to the largest such e. N-grams ending at the last token are left
    out, so a lookup of the sequence's own suffix finds an earlier occurrence, never itself.
    """

    __slots__ = ("min_n", "max_n", "tokens", "last_end")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        for token in token_ids:
            self._index_ending_at(len(self.tokens) - 1)
            self.tokens.append(token)

    def _index_ending_at(self, end: int) -> None:
        for n in range(self.min_n, min(self.max_n, end + 1) + 1):
            self.last_end[tuple(self.tokens[end - n + 1:end + 1])] = end

    def continuation(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the latest earlier occurrence of the
        sequence's longest matching suffix ([] when no suffix of min_n tokens recurs).

        A continuation that runs into the end of the sequence goes on with its own drafted
        tokens (a period repeats), as if they were appended and the lookup made again."""
        length = len(self.tokens)
        for n in range(min(self.max_n, length), self.min_n - 1, -1):
            end = self.last_end.get(tuple(self.tokens[length - n:]))
            if end is not None:
                draft: list[int] = []
                for position in range(end + 1, end + 1 + max_tokens):
                    draft.append(self.tokens[position] if position < length else draft[position - length])
                return draft
        return []


class NgramProposer:
    """Drafts from each request's own prompt and output (one NgramIndex per live request)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        index = self.indexes.setdefault(request.request_id, NgramIndex(self.min_n, self.max_n))
        index.extend(request.token_ids[len(index.tokens):])
        return index.continuation(max_tokens)

    def finish(self, request: Request) -> None:
        self.indexes.pop(request.request_id, None)
