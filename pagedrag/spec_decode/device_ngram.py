"""Prompt lookup (``ngram``) on the device: the drafts of several rows at once, from token
histories that never leave the device.

Pipelined verification (engine.pipelined_drafting) drafts a row's next tokens right after the
device verified its last draft, before the host has read which tokens were accepted; so the
lookup runs on the tensors the verifier just wrote. It finds what NgramIndex.continuation
finds: for the longest n in [min_n, max_n] whose last n tokens occurred earlier (ending at
least two tokens before the end), the tokens after the latest such occurrence, continued
with the draft's own tokens where they run into the end (a period repeats).

Work is O(rows x length x (max_n - min_n + 1)) comparisons a step, all on the device: a few
microseconds of GPU time for contexts of thousands of tokens, and no host round trip.
"""

from __future__ import annotations

import torch


def ngram_drafts(history: torch.Tensor, lengths: torch.Tensor, min_n: int, max_n: int, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(drafts [rows, k], draft lengths [rows]: k where a suffix matched, else 0).

    ``history`` [rows, width]: row r's tokens in columns < lengths[r] (the rest is ignored);
    ``lengths`` [rows] int64, each <= width.
    """
    rows, width = history.shape
    best_end = torch.full((rows,), -1, dtype=torch.long, device=history.device)
    found = torch.zeros(rows, dtype=torch.bool, device=history.device)
    for n in range(min(max_n, width), min_n - 1, -1):
        end = _latest_earlier_end(history, lengths, n)
        take = ~found & (end >= 0)
        best_end = torch.where(take, end, best_end)
        found |= take
    start = best_end + 1
    period = (lengths - start).clamp(min=1)  # tokens from the continuation's start to the end
    offsets = torch.arange(k, device=history.device)
    columns = (start.unsqueeze(1) + offsets.unsqueeze(0) % period.unsqueeze(1)).clamp(0, width - 1)
    drafts = history.gather(1, columns)
    return drafts, torch.where(found, k, 0)


def _latest_earlier_end(history: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """Per row, the largest e <= length - 2 where the row's last n tokens also end (-1: none)."""
    width = history.shape[1]
    suffix_columns = (lengths.unsqueeze(1) - n + torch.arange(n, device=history.device)).clamp(min=0)
    suffix = history.gather(1, suffix_columns)  # [rows, n]
    windows = history.unfold(1, n, 1)  # [rows, width - n + 1, n]: window s ends at s + n - 1
    equal = (windows == suffix.unsqueeze(1)).all(dim=-1)
    ends = torch.arange(n - 1, width, device=history.device)
    allowed = (ends.unsqueeze(0) <= lengths.unsqueeze(1) - 2) & (lengths.unsqueeze(1) >= n)
    return torch.where(equal & allowed, ends.unsqueeze(0), -1).amax(dim=1)
