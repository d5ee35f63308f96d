"""After sampling: detokenize, check stop conditions, build RequestOutputs.

A caller's request is a RequestGroup of n sequences (Request objects). The
group is finished once each of its sequences is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedrag.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pagedrag.outputs import CompletionOutput, Logprob, RequestOutput, SpecDecodeCounts
from pagedrag.core.request import Request, RequestStatus


@dataclass(eq=False)
class SequenceText:
    """The text side of one sequence: its detokenizer and stop-string checker."""

    detokenizer: IncrementalDetokenizer | None  # None: no tokenizer, or detokenize=False (token ids only)
    stops: StopChecker
    text: str = ""


@dataclass(eq=False)
class RequestGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    sequences: list[Request] = field(default_factory=list)
    texts: dict[str, SequenceText] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.n and all(s.is_finished for s in self.sequences)

    def to_output(self) -> RequestOutput:
        first = self.sequences[0]
        completions = [self._completion(seq) for seq in self.sequences]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             self.finished, max(first.num_cached_tokens, 0), first.metrics,
                             prompt_logprobs=first.prompt_logprobs, num_chunk_hit_tokens=first.num_chunk_hit_tokens,
                             num_recomputed_tokens=first.num_recomputed_tokens,
                             num_tier_hit_tokens=dict(first.num_tier_hit_tokens),
                             spec_decode=_spec_decode_counts(self.sequences))

    def _completion(self, seq: Request) -> CompletionOutput:
        finish = seq.status.value if seq.is_finished else None
        return CompletionOutput(seq.index, self.texts[seq.request_id].text, list(seq.output_token_ids),
                                seq.cumulative_logprob, None if seq.logprobs is None else list(seq.logprobs),
                                finish, seq.stop_reason)


def _spec_decode_counts(sequences: list[Request]) -> SpecDecodeCounts | None:
    """The drafts of every sequence of a request, summed (None: none drafted)."""
    counted = [seq.spec_decode for seq in sequences if seq.spec_decode is not None]
    if not counted:
        return None
    total = SpecDecodeCounts()
    for counts in counted:
        total.merge(counts)
    return total


class StopPolicy:
    """Decides whether a sequence ends after its newest token."""

    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_token(self, seq: Request) -> RequestStatus | None:
        token = seq.token_ids[-1]
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def new_sequence_text(tokenizer, seq: Request) -> SequenceText:
    params = seq.params
    detokenizer = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids, params.skip_special_tokens)
                   if tokenizer is not None and params.detokenize else None)
    return SequenceText(detokenizer, StopChecker(params.stop, params.include_stop_str_in_output))


def update_text(text: SequenceText, seq: Request, finishing: bool, newest_hidden: bool = False
                ) -> RequestStatus | None:
    """Detokenize the newest token (unless ``newest_hidden``: an EOS or stop token that ended
    the sequence, which vLLM leaves out of the text unless include_stop_str_in_output); a
    stop string ends the sequence and trims the text.

    While the sequence runs, ``text.text`` never shows the start of a possible stop
    string; once it finishes, it holds everything (minus a matched stop string).
    """
    if text.detokenizer is None:
        return None
    new_text = "" if newest_hidden else text.detokenizer.append([seq.token_ids[-1]])
    if finishing:
        new_text += text.detokenizer.flush()
    full = text.detokenizer.text
    if seq.num_output_tokens >= seq.params.min_tokens:
        match = text.stops.check(full, len(new_text))
        if match is not None:
            text.text, seq.stop_reason = match.text, match.stop
            return RequestStatus.FINISHED_STOPPED
    text.text = full if finishing else full[:text.stops.streamable_length(full)]
    return None


def record_logprobs(seq: Request, sample, decode: Callable[[int], str] | None) -> None:
    """Add the sampled token's logprob to the running sum, and, when asked for, the sampled
    and top-k tokens as Logprobs (rank, and text when there is a tokenizer)."""
    seq.cumulative_logprob += sample.logprob
    if seq.logprobs is not None:
        seq.logprobs.append(_logprob_entry(sample, decode))


def record_prompt_logprobs(seq: Request, first_token: int, samples: list, decode: Callable[[int], str] | None
                           ) -> None:
    """Store the logprobs of prompt tokens first_token, first_token + 1, ... by position (a
    prompt computed again after a preemption writes the same entries again)."""
    for offset, sample in enumerate(samples):
        seq.prompt_logprobs[first_token + offset] = _logprob_entry(sample, decode)


def _logprob_entry(sample, decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """The sampled (or given) token and the top ones as Logprobs (rank; text with a tokenizer)."""
    def entry(token: int, logprob: float, rank: int) -> Logprob:
        return Logprob(logprob, rank, None if decode is None else decode(token))
    top = {token: entry(token, lp, rank) for rank, (token, lp) in enumerate(sample.top_logprobs.items(), 1)}
    return {**top, sample.token_id: entry(sample.token_id, sample.logprob, sample.rank)}


def mark_first_token(seq: Request) -> float | None:
    """Record the first-token time; returns the TTFT when this was the first token."""
    if seq.metrics.first_token_time is not None:
        return None
    seq.metrics.first_token_time = time.monotonic()
    return seq.metrics.ttft
