"""Verification steps chained on the device, for pipelined drafting (engine.pipelined_drafting).

A step here feeds each row its token after the accepted ones and its drafted tokens, checks
the drafts against the target model's greedy choice, appends what it accepted to the row's
token history on the device, and drafts the row's next tokens from that history
(spec_decode.device_ngram). The next step's inputs (its tokens, their positions and cache
slots, the context lengths) are computed from those device tensors, so the host can launch
step t + 1 before it reads what step t accepted, as asynchronous scheduling launches a decode
before reading the previous token.

Only greedy rows whose logits need no processing verify here: a row's target is the argmax of
its raw logits, which is what the Sampler picks for such a row, so the output is token for
token what decoding without speculation emits.

Invariants (row r):
- ``lengths[r]`` tokens are known on the device, the last one (the token after the accepted
  ones) not yet computed: KV exists for positions < lengths[r] - 1.
- ``history[r, :lengths[r]]`` are those tokens; later columns hold leftovers, never read.
- ``drafts[r, :draft_lengths[r]]`` is the n-gram draft for the current history.
- ``tables[r]`` covers every position a step may write (the host reserves the slots), and is
  re-sent whenever the host's table changes (it grows, or a copy-on-write replaces a block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrag.models.attention import AttentionMetadata
from pagedrag.spec_decode.device_ngram import ngram_drafts
from pagedrag.worker.transfer import device_to_host, host_to_device


@dataclass(slots=True)
class RowResult:
    """What one row's verification gives: the accepted drafted tokens and the token after
    them (``token_ids``, with their logprobs), how many tokens were drafted, and whether the
    lookup after it found a draft for the next step."""

    token_ids: list[int]
    logprobs: list[float]
    num_drafted: int
    drafts_next: bool


@dataclass(slots=True)
class PendingVerification:
    """A launched step's results on their way to the host (read them after the next launch)."""

    host: torch.Tensor  # [rows, 2 * (1 + width) + 3] float64: targets, logprobs, accepted, drafted, next
    ready: torch.cuda.Event | None
    width: int

    def read(self) -> list[RowResult]:
        """Wait for the copy; row r's result is results[r]."""
        if self.ready is not None:
            self.ready.synchronize()
        span = 1 + self.width
        results = []
        for row in self.host.tolist():
            emitted = int(row[2 * span]) + 1
            results.append(RowResult([int(t) for t in row[:emitted]], row[span:span + emitted],
                                     int(row[2 * span + 1]), row[2 * span + 2] > 0))
        return results


class DeviceDraftRows:
    """The device state of the rows that draft and verify without the host (see the module
    docstring), and the step that advances it."""

    def __init__(self, runner, token_ids: list[list[int]], capacity: int,
                 min_n: int, max_n: int, max_draft: int, normalised_logprobs: bool):
        self.runner = runner
        self.device = runner.device
        self.min_n, self.max_n, self.max_draft = min_n, max_n, max_draft
        self.normalised_logprobs = normalised_logprobs  # logprobs mode: log-softmax values, else raw logits
        self.history = torch.zeros(len(token_ids), capacity, dtype=torch.long, device=self.device)
        for row, tokens in enumerate(token_ids):
            self.history[row, :len(tokens)] = host_to_device(tokens, torch.long, self.device)
        self.lengths = host_to_device([len(tokens) for tokens in token_ids], torch.long, self.device)
        self.host_tables: list[list[int]] = []
        self.tables = torch.zeros(len(token_ids), 0, dtype=torch.int32, device=self.device)
        self.drafts, self.draft_lengths = self._draft(max(map(len, token_ids)))

    def _draft(self, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' drafts, looking only at the first ``bound`` columns (>= every length)."""
        return ngram_drafts(self.history[:, :bound], self.lengths, self.min_n, self.max_n, self.max_draft)

    def update_tables(self, tables: list[list[int]]) -> None:
        """Send the rows' block tables over when they changed, as wide as the longest."""
        if tables == self.host_tables:
            return
        width = max(map(len, tables))
        self.tables = host_to_device([table + [0] * (width - len(table)) for table in tables], torch.int32,
                                     self.device)
        self.host_tables = [list(table) for table in tables]

    @torch.inference_mode()
    def launch(self, limits: list[int], width: int, bound: int) -> PendingVerification:
        """One step: every row checks ``width`` drafted positions (a row drafts at most its
        limit, fewer where its lookup found less; unused positions are computed and never
        accepted; width 0 is a plain decode step), then drafts again from a history of at
        most ``bound`` tokens."""
        rows, span = self.lengths.shape[0], 1 + width
        drafted = torch.minimum(self.draft_lengths, host_to_device(limits, torch.long, self.device))
        valid = torch.arange(width, device=self.device).unsqueeze(0) < drafted.unsqueeze(1)
        drafts = self.drafts[:, :width]
        targets, logprobs = self._targets(self._logits(drafts.masked_fill(~valid, 0), width))
        targets, logprobs = targets.view(rows, span), logprobs.view(rows, span)
        accepted = ((targets[:, :width] == drafts) & valid).long().cumprod(dim=1).sum(dim=1)
        columns = self.lengths.unsqueeze(1) + torch.arange(span, device=self.device).unsqueeze(0)
        self.history.scatter_(1, columns, targets)
        self.lengths = self.lengths + accepted + 1
        self.drafts, self.draft_lengths = self._draft(bound)
        table = torch.cat([targets, logprobs, accepted.unsqueeze(1), drafted.unsqueeze(1),
                           self.draft_lengths.unsqueeze(1)], dim=1)
        host, ready = device_to_host(table.double())
        return PendingVerification(host, ready, width)

    def _logits(self, drafts: torch.Tensor, width: int) -> torch.Tensor:
        """The forward pass over each row's last token and ``drafts`` [rows, width]: float
        logits [rows * (1 + width), vocab], row by row."""
        rows, span = drafts.shape[0], 1 + width
        positions = (self.lengths - 1).unsqueeze(1) + torch.arange(span, device=self.device).unsqueeze(0)
        block_size = self.runner.block_size
        slots = self.tables.gather(1, positions // block_size).long() * block_size + positions % block_size
        meta = AttentionMetadata(
            slot_mapping=slots.flatten(), block_tables=self.tables, context_lens=(self.lengths + width).int(),
            query_start_loc=(torch.arange(rows + 1, device=self.device) * span).int(),
            decode_only=width == 0, ops=self.runner.ops)
        last = self.history.gather(1, (self.lengths - 1).unsqueeze(1))
        input_ids = torch.cat([last, drafts], dim=1).flatten()
        with self.runner.step_threads(rows * span):
            hidden = self.runner.hidden_states(input_ids, positions.flatten(), meta)
            return self.runner.model.compute_logits(hidden, self.runner.ops).float()

    def _targets(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each logits row's greedy token and its logprob (or raw logit, by the logprobs mode)."""
        targets = logits.argmax(dim=-1)
        values = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
        return targets, values - logits.logsumexp(dim=-1) if self.normalised_logprobs else values
