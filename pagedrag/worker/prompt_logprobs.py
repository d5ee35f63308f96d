"""Prompt logprobs (SamplingParams.prompt_logprobs): how likely the model found each
prompt token, given the tokens before it, as vLLM reports them.

The hidden state at prompt position p predicts token p + 1, so a step that computes
positions [begin, end) of a prompt of n tokens yields the logprobs of tokens
begin + 1 .. min(end, n - 1); over the prompt's chunks every token but the first gets
one. Such a request computes its whole prompt (no prefix-cache hits: a cached block has
no hidden states), as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrag.core.request import Request
from pagedrag.worker.sampler import Sample


@dataclass(slots=True)
class PromptRows:
    """Hidden rows ``rows`` of one step predict the request's prompt tokens
    ``first_token``, ``first_token + 1``, ... (one per row)."""

    request: Request
    first_token: int
    rows: list[int]


def prompt_rows(request: Request, begin: int, end: int, first_row: int) -> PromptRows | None:
    """The rows of a step that computes positions [begin, end) of ``request`` (its hidden
    rows start at ``first_row``) whose logits predict a prompt token; None if none do."""
    if request.params.prompt_logprobs is None:
        return None
    last = min(end, request.num_prompt_tokens - 1)  # position last - 1 predicts token last
    if last <= begin:
        return None
    return PromptRows(request, begin + 1, list(range(first_row, first_row + last - begin)))


@torch.inference_mode()
def prompt_samples(logits: torch.Tensor, wanted: list[PromptRows]) -> list[list[Sample]]:
    """For each entry of ``wanted`` (its rows' logits stacked in ``logits``, in order), one
    Sample per predicted prompt token: the token, its logprob and rank, and the top ones."""
    targets = [t for entry in wanted
               for t in entry.request.prompt_token_ids[entry.first_token:entry.first_token + len(entry.rows)]]
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    k = max(entry.request.params.prompt_logprobs for entry in wanted)
    top = logprobs.topk(k, dim=-1) if k else None
    rows = zip(targets, chosen.squeeze(1).tolist(), ranks.tolist(),
               top.indices.tolist() if top is not None else [[]] * len(targets),
               top.values.tolist() if top is not None else [[]] * len(targets))
    samples = [Sample(t, lp, r, dict(zip(ids, values))) for t, lp, r, ids, values in rows]
    out, start = [], 0
    for entry in wanted:
        n = entry.request.params.prompt_logprobs
        out.append([Sample(s.token_id, s.logprob, s.rank, dict(list(s.top_logprobs.items())[:n]))
                    for s in samples[start:start + len(entry.rows)]])
        start += len(entry.rows)
    return out
