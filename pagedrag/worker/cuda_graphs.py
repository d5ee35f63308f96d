"""CUDA graphs of small engine steps, captured once per padded shape and replayed with
the step's inputs copied into static buffers.

Three kinds of steps are captured: decode steps (B sequences, one token each) for B up
to max_batch; prefills of up to MAX_PREFILL_TOKENS new tokens in one sequence (what
a prefix hit leaves to compute) or in up to MAX_PREFILL_SEQS (the runs of a chunk-reuse
prompt: each recomputed stretch and the question attend as sequences of their own); and,
with speculative decoding, verification steps: B drafting sequences of 1 + k tokens each
(B up to the drafting gate), whose tokens attend causally through the prefill kernel, each
K/V block read once for all of a sequence's tokens. Larger steps run eagerly: their kernels
are long enough that launch overhead does not matter.

Invariants:
- A replayed graph reads only the static buffers. Padding rows get slot -1 (nothing is
  stored); padded sequences get context length 1 over block 0 (a harmless read);
  padded tokens of a prefill lie past the real sequences' last query row, and padded
  sequences of a prefill own no rows (their query_start_loc entries repeat that row),
  so their attention programs exit at once. Their outputs are dropped.
- Block tables are as wide as max_model_len needs, so one graph serves every context.
- Graphs return hidden states; the caller computes logits for the rows that sample.
"""

from __future__ import annotations

import gc

from dataclasses import dataclass

import torch

from pagedrag.models.attention import AttentionMetadata

MAX_PREFILL_TOKENS = 512
MAX_VERIFICATION_TOKENS = 2048  # a verification step past this runs eagerly (its buffers would be large)


def decode_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


PREFILL_SIZES = (16, 32, 64, 128, 256, MAX_PREFILL_TOKENS)
MAX_PREFILL_SEQS = 8  # below the smallest prefill size, so no prefill shape looks like a decode


@dataclass(frozen=True)
class GraphShape:
    num_seqs: int
    num_tokens: int

    @property
    def decode(self) -> bool:
        return self.num_seqs == self.num_tokens


def verification_shapes(max_drafting: int, max_draft: int) -> list[GraphShape]:
    """Steps of B drafting sequences, B in decode_sizes(max_drafting), each checking 1 + j
    tokens for j = 1, 2, 4, ... up to max_draft (drafts shorten after rejections, so a
    step seldom has every row at max_draft: it pads to the next size, at most ~2x), of at
    most MAX_VERIFICATION_TOKENS tokens in all (so a huge num_speculative_tokens sizes no
    buffer: longer steps run eagerly); none without drafting (max_drafting 0)."""
    if max_drafting < 1:
        return []
    drafts = sorted({2 ** i for i in range(max_draft.bit_length()) if 2 ** i < max_draft} | {max_draft})
    return [GraphShape(b, b * (1 + j)) for b in decode_sizes(max_drafting) for j in drafts
            if b * (1 + j) <= MAX_VERIFICATION_TOKENS]


class StepGraphs:
    def __init__(self, model: torch.nn.Module, kv_layers: list, ops, max_batch: int,
                 max_blocks_per_seq: int, device: torch.device, verification: list[GraphShape] = ()):
        self.model = model
        self.kv_layers = kv_layers
        self.ops = ops
        self.shapes = sorted({GraphShape(b, b) for b in decode_sizes(max_batch)}
                             | {GraphShape(s, t) for s in (1, MAX_PREFILL_SEQS) for t in PREFILL_SIZES}
                             | set(verification), key=lambda s: (s.num_tokens, s.num_seqs))
        max_tokens = max(s.num_tokens for s in self.shapes)
        max_seqs = max(s.num_seqs for s in self.shapes)
        zeros = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = zeros(max_tokens, dtype=torch.int64)
        self.positions = zeros(max_tokens, dtype=torch.int64)
        self.slots = zeros(max_tokens, dtype=torch.int64)
        self.block_tables = zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.context_lens = zeros(max_seqs, dtype=torch.int32)
        self.query_start_loc = zeros(max_seqs + 1, dtype=torch.int32)
        self.graphs: dict[GraphShape, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[GraphShape, torch.Tensor] = {}
        self.pool = None

    def _forward(self, shape: GraphShape) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:shape.num_tokens], self.block_tables[:shape.num_seqs],
                                 self.context_lens[:shape.num_seqs],
                                 self.query_start_loc[:shape.num_seqs + 1], shape.decode, self.ops)
        return self.model(self.input_ids[:shape.num_tokens], self.positions[:shape.num_tokens],
                          self.kv_layers, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every shape, largest first, so that smaller graphs reuse its memory pool.

        Python's cyclic garbage collector is off meanwhile: a collection during a capture
        could free another engine's graphs or tensors, which CUDA forbids while a stream
        captures (it invalidates the capture)."""
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        for shape in reversed(self.shapes):
            self._pad(shape, num_seqs=0, num_tokens=0)
            self._forward(shape)  # warm up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[shape] = self._forward(shape)
            self.pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize()

    def _pad(self, shape: GraphShape, num_seqs: int, num_tokens: int) -> None:
        """Make rows past the real step harmless (see the module docstring)."""
        self.slots[num_tokens:shape.num_tokens].fill_(-1)
        self.context_lens[num_seqs:shape.num_seqs].fill_(1)
        self.block_tables[num_seqs:shape.num_seqs].zero_()
        if shape.decode:
            self.query_start_loc[num_seqs:shape.num_seqs + 1] = torch.arange(
                num_seqs, shape.num_seqs + 1, dtype=torch.int32, device=self.slots.device)
        else:
            self.query_start_loc[num_seqs + 1:shape.num_seqs + 1].fill_(num_tokens)

    def shape_for(self, num_seqs: int, num_tokens: int, decode: bool) -> GraphShape | None:
        """The smallest captured shape that holds this step, or None (run it eagerly)."""
        for shape in self.shapes:
            if shape.decode == decode and shape.num_seqs >= num_seqs and shape.num_tokens >= num_tokens:
                return shape
        return None

    def run(self, shape: GraphShape, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of one step, replayed from its graph."""
        num_tokens, num_seqs = input_ids.shape[0], meta.context_lens.shape[0]
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.slots[:num_tokens].copy_(meta.slot_mapping)
        self.block_tables[:num_seqs, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.context_lens[:num_seqs].copy_(meta.context_lens)
        self.query_start_loc[:num_seqs + 1].copy_(meta.query_start_loc)
        self._pad(shape, num_seqs, num_tokens)
        self.graphs[shape].replay()
        return self.hidden[shape][:num_tokens]
