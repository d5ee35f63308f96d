"""Turns a scheduler step into tensors, runs the model and returns logits.

For each scheduled request the step feeds tokens [num_computed, num_computed + n):
input_ids and positions packed request after request, each token's cache slot
(slot_mapping), the block tables, the context lengths after the step, and the
packed offsets (query_start_loc). Logits are computed only at the last token of
requests whose every token has KV after the step (those sample).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..core.scheduler import SchedulerOutput
from ..models.attention import AttentionMetadata
from .cuda_graphs import StepGraphs
from .kv_cache import KVCacheTensors


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed


def _pad_rows(rows: list[list[int]]) -> list[list[int]]:
    width = max(len(row) for row in rows)
    return [row + [0] * (width - len(row)) for row in rows]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCacheTensors, block_size: int,
                 device: torch.device):
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.ops = kernels.ops_for(device)
        self.graphs: StepGraphs | None = None

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture CUDA graphs of decode steps (up to max_batch sequences) and of small
        single-sequence prefills (CUDA only)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = StepGraphs(self.model, self.cache.device_layers, self.ops, max_batch,
                                 max_blocks, self.device)
        self.graphs.capture()

    def prepare(self, step: SchedulerOutput, block_tables: list[list[int]]) -> StepInputs:
        """Pack the step's tokens; block_tables[i] is the table of step.scheduled[i]."""
        input_ids, positions, slots, context_lens, starts, logits_rows = [], [], [], [], [0], []
        for item, table in zip(step.scheduled, block_tables):
            request = item.request
            begin = request.num_computed_tokens
            end = begin + item.num_new_tokens
            input_ids.extend(request.token_ids[begin:end])
            positions.extend(range(begin, end))
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(begin, end))
            context_lens.append(end)
            starts.append(starts[-1] + item.num_new_tokens)
            if item.completes_sequence:
                logits_rows.append(starts[-1] - 1)
        as_tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots, torch.int64),
            block_tables=as_tensor(_pad_rows(block_tables), torch.int32),
            context_lens=as_tensor(context_lens, torch.int32),
            query_start_loc=as_tensor(starts, torch.int32),
            decode_only=all(item.num_new_tokens == 1 for item in step.scheduled),
            ops=self.ops)
        return StepInputs(as_tensor(input_ids, torch.int64), as_tensor(positions, torch.int64),
                          meta, as_tensor(logits_rows, torch.int64))

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, block_tables: list[list[int]]) -> torch.Tensor:
        """Apply the step's block moves, run the model, return logits [num_sampling, vocab]."""
        self.cache.apply(step.block_copies, step.swaps)
        if not step.scheduled:
            return torch.empty(0, device=self.device)
        inputs = self.prepare(step, block_tables)
        shape = None if self.graphs is None else self.graphs.shape_for(
            len(step.scheduled), step.num_tokens, inputs.meta.decode_only)
        if shape is not None:
            hidden = self.graphs.run(shape, inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache.device_layers, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices])
