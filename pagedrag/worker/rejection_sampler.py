"""Verify drafted tokens (speculative decoding) against the target model's logits.

A request that carried a draft x_1..x_d has d + 1 logits rows: row j scores the token after
its known tokens and x_1..x_j. Each row is shaped exactly as the Sampler shapes a row
(worker.sampler: allowed tokens, bans, logit_bias, penalties, the grammar, then temperature,
min-p, top-k, top-p), with the row's output history extended by the drafted tokens before it
and its grammar's mask taken after them, so row j sees what a step without speculation would
see once x_1..x_j were accepted.

Row by row, the target token is what the Sampler would pick from that row: the argmax for a
greedy request, else a draw by the Sampler's exponential race, argmax(p / E) with E ~ Exp(1)
from the request's generator. x_j is accepted while it equals the target of the row before
it; the first target that differs from its drafted token (or the target of the last row) is
the token emitted after the accepted ones.

For a one-hot draft this is the standard rule: x is accepted with probability p(x) (the
race picks x), and after a rejection the token is the race's winner among the others, a
draw from p with x removed and renormalised. It is also exact per request: a row's noise
is drawn only when its target is needed, so a generator advances by one race per emitted
token, as without speculation, and a seeded (or greedy) request emits the very tokens it
emits without speculation, whatever was drafted and whatever shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedrag.core.request import Request
from pagedrag.structured.masks import fill_draft_masks
from pagedrag.worker.sampler import (Sample, SamplingBatch, filter_logits, process_logits, reported_values,
                                     sample_from, with_logprobs)
from pagedrag.worker.transfer import host_to_device


@dataclass(slots=True)
class VerifyRow:
    """A request whose draft is verified this step, on logits rows first_row..first_row + len(draft)."""

    request: Request
    first_row: int
    draft: list[int]


@dataclass(slots=True)
class Verified:
    """What a request emits: its accepted drafted tokens, then the token after them."""

    request: Request
    num_drafted: int
    samples: list[Sample]

    @property
    def num_accepted(self) -> int:
        return len(self.samples) - 1


def verify(logits: torch.Tensor, rows: list[VerifyRow], eos_token_ids: frozenset[int],
           logprobs_mode: str = "raw_logprobs") -> list[Verified]:
    """Verify every row's draft (``logits``: the step's logits; rows index into it); the
    samples' logprobs as the Sampler reports them in ``logprobs_mode``."""
    index = [row.first_row + j for row in rows for j in range(len(row.draft) + 1)]
    batch = _draft_batch(rows, logits.shape[-1], logits.device, eos_token_ids)
    raw = logits[host_to_device(index, torch.long, logits.device)].float()
    processed = process_logits(raw, batch)
    greedy = processed.argmax(dim=-1).tolist()
    filtered = None if batch.all_greedy else filter_logits(processed, batch)
    chosen, emitted, offset = [], [], 0
    for row in rows:
        span = len(row.draft) + 1
        tokens = _emitted(row.draft, _target_of(row, offset, greedy, filtered))
        emitted.append(tokens)
        chosen.extend(tokens + [0] * (span - len(tokens)))  # rows past the emitted ones are unread
        offset += span
    token_ids = host_to_device(chosen, torch.long, logits.device)
    samples = with_logprobs(*reported_values(logprobs_mode, raw, processed, filtered, batch), token_ids,
                            batch).to_host()
    return _split(rows, emitted, samples)


def _draft_batch(rows: list[VerifyRow], vocab_size: int, device: torch.device, eos_token_ids: frozenset[int]
                 ) -> SamplingBatch:
    """The sampling batch of every verification row: row j of a request has its parameters, its
    output so far followed by the first j drafted tokens, and its grammar's mask after them."""
    params, generators, prompts, outputs, bad_words = [], [], [], [], []
    for row in rows:
        request, output = row.request, row.request.output_token_ids
        for j in range(len(row.draft) + 1):
            params.append(request.params)
            generators.append(request.generator)
            prompts.append(request.prompt_id_tensor)
            outputs.append(output + row.draft[:j])
            bad_words.append(request.bad_words_token_ids)
    grammar = fill_draft_masks([row.request.grammar for row in rows], [row.draft for row in rows], vocab_size,
                               device)
    return SamplingBatch.from_params(params, generators, prompts, outputs, device, eos_token_ids, bad_words, grammar)


def _target_of(row: VerifyRow, offset: int, greedy: list[int], filtered: torch.Tensor | None
               ) -> Callable[[int], int]:
    """The target token of the request's j-th row (its rows start at ``offset``), as the
    Sampler would pick it; a sampled row draws its noise when called, not before."""
    if row.request.params.greedy:
        return lambda j: greedy[offset + j]
    return lambda j: int(sample_from(filtered[offset + j:offset + j + 1], [row.request.generator])[0])


def _emitted(draft: list[int], target: Callable[[int], int]) -> list[int]:
    """The targets of rows 0, 1, ... up to and including the first that differs from the
    drafted token it checks (or the last row's): the accepted draft, then one token more."""
    tokens = [target(0)]
    while len(tokens) <= len(draft) and tokens[-1] == draft[len(tokens) - 1]:
        tokens.append(target(len(tokens)))
    return tokens


def _split(rows: list[VerifyRow], emitted: list[list[int]], samples: list[Sample]) -> list[Verified]:
    results, offset = [], 0
    for row, tokens in zip(rows, emitted):
        results.append(Verified(row.request, len(row.draft), samples[offset:offset + len(tokens)]))
        offset += len(row.draft) + 1
    return results
