"""CUDA graphs for decode steps: captured once per padded batch size, replayed with
the step's inputs copied into static buffers.

Invariants:
- A replayed graph reads only the static buffers below. Rows past the real batch
  get slot -1 (nothing is stored) and context length 1 over block 0 (a harmless
  read); their outputs are dropped.
- Block tables are as wide as max_model_len needs, so one graph serves every
  context length; kernels read each sequence only up to its context length.
"""

from __future__ import annotations

import torch

from ..models.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_layers: list, ops, max_batch: int,
                 max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.kv_layers = kv_layers
        self.ops = ops
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        zeros = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = zeros(self.max_batch, dtype=torch.int64)
        self.positions = zeros(self.max_batch, dtype=torch.int64)
        self.slots = zeros(self.max_batch, dtype=torch.int64)
        self.block_tables = zeros(self.max_batch, max_blocks_per_seq, dtype=torch.int32)
        self.context_lens = zeros(self.max_batch, dtype=torch.int32)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slots[:batch], self.block_tables[:batch], self.context_lens[:batch],
                                 self.query_start_loc[:batch + 1], decode_only=True, ops=self.ops)
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_layers, meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, so that smaller graphs reuse its memory pool."""
        self._reset_padding(0)
        for batch in reversed(self.sizes):
            self._forward(batch)  # warm up: compile kernels, settle allocations
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[batch] = self._forward(batch)
            self.pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def _reset_padding(self, start: int) -> None:
        self.slots[start:].fill_(-1)
        self.context_lens[start:].fill_(1)
        self.block_tables[start:].zero_()

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [batch, vocab] of one decode step (one token per sequence)."""
        batch = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slots[:batch].copy_(meta.slot_mapping)
        width = meta.block_tables.shape[1]
        self.block_tables[:batch, :width].copy_(meta.block_tables)
        self.context_lens[:batch].copy_(meta.context_lens)
        self._reset_padding(batch)
        self.graphs[size].replay()
        return self.logits[size][:batch]
