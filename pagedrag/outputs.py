"""What the engine hands back, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log probability, as vLLM's: its rank among the vocabulary (1 = the most
    likely) and its text on its own."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SpecDecodeCounts:
    """Speculative decoding's figures, with vLLM's names: verification steps that carried a
    draft, tokens drafted, drafted tokens accepted, and (engine-wide) accepted tokens by their
    position in the draft. Mean acceptance length = tokens a drafting step emitted, on average
    (the accepted ones plus the one the target model adds)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One verified draft of ``num_drafted`` tokens, of which the first ``num_accepted`` were kept."""
        self.merge(SpecDecodeCounts(1, num_drafted, num_accepted, [1] * num_accepted))

    def merge(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (len(other.num_accepted_tokens_per_pos) - len(per_pos)))
        for position, count in enumerate(other.num_accepted_tokens_per_pos):
            per_pos[position] += count

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class CompletionOutput:
    """One of a request's n completions. text and token_ids are cumulative."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled one and the top ones
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token, in seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """A request's state after an engine step; ``finished`` once every completion ended.

    ``error`` is set (and ``finished`` true) when a step failed in a way traced to this
    request, which was aborted; other requests went on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by prefix-cache hits
    metrics: RequestMetrics | None = None
    error: str | None = None
    num_chunk_hit_tokens: int = 0  # prompt tokens whose KV came from the chunk cache (chunk reuse)
    num_recomputed_tokens: int = 0  # tokens of reused chunks computed again
    # of the cached and chunk-hit tokens, those loaded from each KV tier (host, disk)
    num_tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    # with SamplingParams(prompt_logprobs=k): per prompt token (None for the first), as vLLM's
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # speculative decoding, summed over the request's completions (None: nothing was drafted)
    spec_decode: SpecDecodeCounts | None = None
