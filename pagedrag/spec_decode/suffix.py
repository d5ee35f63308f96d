"""SuffixDecoding (vLLM's ``suffix``, after Arctic Inference): draft from the request's own
tokens and from a bounded global index over the finished requests the engine has seen
(their prompts, with the retrieved chunks, and their answers), preferring the continuations
seen most, with a draft as long as the match allows.

Both indexes are ``ContinuationCounts``: for every context of 1 to ``max_match`` tokens, how
often each token followed it. Counts are position-free, so an answer that copies a chunk
drafts from that chunk wherever it sat in an earlier prompt. Every counted output token was
verified by the target model: the counts of answers are counts of accepted continuations.

Differences from vLLM's suffix trees, for bounded Python work: a context is at most
``max_match`` tokens (MAX_MATCH, below ``suffix_decoding_max_tree_depth`` when that is
smaller), and a draft follows one path (the most frequent token each step), not a tree.
"""

from __future__ import annotations

from collections import Counter, deque

from pagedrag.core.request import Request

MAX_MATCH = 8  # longest context counted: entries per token grow with it
# The global index also forgets its oldest requests beyond this many tokens: each token costs
# MAX_MATCH dict entries (~2 KiB in CPython), so this bounds it near 100 MiB whatever
# suffix_decoding_max_cached_requests says.
MAX_GLOBAL_TOKENS = 50_000


class ContinuationCounts:
    """Invariant: ``counts[context][token]`` is how many times ``token`` followed ``context``
    (1 <= len(context) <= max_match) in the sequences added and not removed; no count is 0."""

    __slots__ = ("max_match", "counts")

    def __init__(self, max_match: int):
        self.max_match = max_match
        self.counts: dict[tuple[int, ...], Counter] = {}

    def add(self, token_ids: list[int], start: int = 0, sign: int = 1) -> None:
        """Count (sign 1) or uncount (sign -1) the tokens from ``start`` on after their contexts."""
        for position in range(max(start, 1), len(token_ids)):
            token = token_ids[position]
            for n in range(1, min(self.max_match, position) + 1):
                context = tuple(token_ids[position - n:position])
                self._bump(context, token, sign)

    def _bump(self, context: tuple[int, ...], token: int, sign: int) -> None:
        followers = self.counts.setdefault(context, Counter())
        followers[token] += sign
        if followers[token] <= 0:
            del followers[token]
            if not followers:
                del self.counts[context]

    def followers(self, tail: list[int], n: int) -> Counter | None:
        """What followed the last ``n`` tokens of ``tail`` (None: never seen)."""
        return self.counts.get(tuple(tail[len(tail) - n:]))


class GlobalIndex:
    """The counts of the last finished requests: at most ``max_requests`` of them and
    ``max_tokens`` tokens (the oldest are forgotten first; the newest is always kept)."""

    def __init__(self, max_match: int, max_requests: int, max_tokens: int = MAX_GLOBAL_TOKENS):
        self.counts = ContinuationCounts(max_match)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.documents: deque[list[int]] = deque()
        self.num_tokens = 0

    def add(self, token_ids: list[int]) -> None:
        if self.max_requests == 0:
            return
        self.documents.append(token_ids)
        self.num_tokens += len(token_ids)
        self.counts.add(token_ids)
        while len(self.documents) > 1 and (len(self.documents) > self.max_requests
                                           or self.num_tokens > self.max_tokens):
            oldest = self.documents.popleft()
            self.num_tokens -= len(oldest)
            self.counts.add(oldest, sign=-1)


class SuffixProposer:
    """Drafts from the request's own ContinuationCounts plus the GlobalIndex.

    A draft starts from the longest context (up to max_match tokens) that either index has
    seen; it may hold ``max_spec_factor`` tokens per token of that match (at least one, at
    most the caller's limit), and it stops at a token whose share of its context's
    followers is below ``min_token_prob``.
    """

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float):
        self.max_match = min(MAX_MATCH, max_tree_depth)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_index = GlobalIndex(self.max_match, max_cached_requests)
        self.own: dict[str, tuple[ContinuationCounts, list[int]]] = {}  # counts, tokens counted

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        own = self._own_counts(request)
        tail = request.token_ids[-self.max_match:]
        match = self._longest_match(own, tail)
        budget = min(max_tokens, max(1, int(self.max_spec_factor * match)))
        draft: list[int] = []
        while match and len(draft) < budget:
            token = self._likely_next(own, tail, match)
            if token is None:
                break
            draft.append(token)
            tail = (tail + [token])[-self.max_match:]
            match = self._longest_match(own, tail)
        return draft

    def finish(self, request: Request) -> None:
        """The request's tokens join the global index (it ended: every token is verified)."""
        self.own.pop(request.request_id, None)
        self.global_index.add(list(request.token_ids))

    def _own_counts(self, request: Request) -> ContinuationCounts:
        counts, counted = self.own.setdefault(request.request_id, (ContinuationCounts(self.max_match), []))
        start = len(counted)
        counted.extend(request.token_ids[start:])
        counts.add(counted, start)
        return counts

    def _longest_match(self, own: ContinuationCounts, tail: list[int]) -> int:
        for n in range(len(tail), 0, -1):
            if own.followers(tail, n) is not None or self.global_index.counts.followers(tail, n) is not None:
                return n
        return 0

    def _likely_next(self, own: ContinuationCounts, tail: list[int], n: int) -> int | None:
        """The token that most often followed the last ``n`` tokens in both indexes, if its
        share reaches min_token_prob."""
        followers = (own.followers(tail, n) or Counter()) + (self.global_index.counts.followers(tail, n) or Counter())
        token, count = followers.most_common(1)[0]
        return token if count / followers.total() >= self.min_token_prob else None
