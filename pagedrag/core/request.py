"""A request's tokens, how many of them have KV in the cache, its block hashes and state.

One Request is one sequence. A prompt sampled with n > 1 becomes n Requests
after its prefill: the first keeps the prompt's blocks, the others fork them
(copy-on-write); ``group_id`` and ``index`` tie them back to the caller's request.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field

import torch

from pagedrag.core.block_hash import BlockHash, extend_block_hashes
from pagedrag.outputs import Logprob, RequestMetrics, SpecDecodeCounts
from pagedrag.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class PromptSegment:
    """Prompt positions [start, end) that came as one segment (see core.chunk_cache): the
    first segment of a prompt is its head; a later one is a reusable chunk when ``reusable``."""

    start: int
    end: int
    reusable: bool = True


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    """Invariant: 0 <= num_computed_tokens <= num_tokens; the KV of the first
    num_computed_tokens tokens is in this request's blocks.

    With asynchronous scheduling a sampled token can still be on the device when
    the next step is scheduled: it counts in ``num_tokens`` (so the scheduler gives
    the request its decode) but is not yet in ``token_ids``; ``num_inflight_tokens``
    (0 or 1) says so, and ``append_token`` resolves it.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_size: int
    cache_salt: str | None = None
    group_id: str = ""
    index: int = 0
    prompt: str | None = None
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until scheduled
    status: RequestStatus = RequestStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # by prompt position (see worker.prompt_logprobs)
    num_inflight_tokens: int = 0  # sampled on the device, not yet read back (async scheduling)
    pending_forks: int = 0  # siblings to fork off once the prompt is computed (n > 1)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # SamplingParams.bad_words, tokenized
    grammar: object | None = None  # xgrammar GrammarMatcher of structured outputs: has accepted every output token
    segments: tuple[PromptSegment, ...] = ()  # the prompt's segments, when it came as prompt_segments
    # Chunk reuse (core.chunk_cache): KV is exact below exact_prefix_len (None: everywhere).
    exact_prefix_len: int | None = None
    imported_segments: set[int] = field(default_factory=set)
    copied_blocks: set[int] = field(default_factory=set)  # blocks holding KV copied from chunks (core.prefix_keys)
    head_hash: bytes | None = None  # of segment 0, which every chunk key includes
    chunk_hashes: dict[int, list[BlockHash]] = field(default_factory=dict)  # by segment index
    num_chunk_hit_tokens: int = 0  # prompt tokens whose KV came from the chunk cache (first scheduling)
    num_recomputed_tokens: int = 0  # tokens of imported chunks computed again (first scheduling)
    # KV tiers (core.tier_loads): looked up below the pool once; prompt tokens loaded from each tier
    tier_queried: bool = False
    num_tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    spec_decode: SpecDecodeCounts | None = None  # speculative decoding's drafts and acceptances (spec_decode)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @functools.cached_property
    def prompt_id_tensor(self) -> torch.Tensor:
        """The prompt's token ids as an int64 host tensor, made once: the penalties read them at
        every step (worker.sampler)."""
        return torch.tensor(self.prompt_token_ids, dtype=torch.int64)

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.update_block_hashes()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the one still on the device, if any."""
        return len(self.token_ids) + self.num_inflight_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        """Add a sampled token (resolving the in-flight one, if there is one)."""
        self.token_ids.append(token_id)
        self.num_inflight_tokens = max(self.num_inflight_tokens - 1, 0)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        extend_block_hashes(self.block_hashes, self.token_ids, self.block_size, self.cache_salt)

    def fork(self, request_id: str, index: int, generator: torch.Generator | None) -> "Request":
        """A sibling with the same tokens and computed count (the caller shares the blocks)."""
        child = Request(request_id, self.prompt_token_ids, self.params, self.block_size,
                        self.cache_salt, self.group_id, index, self.prompt, generator)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.bad_words_token_ids = self.bad_words_token_ids
        child.grammar = None if self.grammar is None else self.grammar.fork()
        child.exact_prefix_len, child.copied_blocks = self.exact_prefix_len, set(self.copied_blocks)
        child.num_chunk_hit_tokens, child.num_recomputed_tokens = self.num_chunk_hit_tokens, self.num_recomputed_tokens
        child.num_tier_hit_tokens = dict(self.num_tier_hit_tokens)
        child.status = self.status
        child.metrics = RequestMetrics(self.metrics.arrival_time, self.metrics.first_scheduled_time)
        return child
