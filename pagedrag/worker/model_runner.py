"""Turns a scheduler step into tensors, runs the model and returns logits.

For each scheduled request the step feeds tokens [num_computed, num_computed + n):
input_ids and positions packed request after request, each token's cache slot
(slot_mapping), the block tables, the context lengths after the step, and the
packed offsets (query_start_loc). Logits are computed only at the last token of
requests whose every token has KV after the step (those sample).

Nothing here waits for the device: the inputs go over in two non-blocking copies,
and a decode whose input token is still on the device (sampled by the previous
step, not yet read back) takes it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import kernels
from ..core.scheduler import ScheduledRequest, SchedulerOutput
from ..models.attention import AttentionMetadata
from .cuda_graphs import StepGraphs
from .kv_cache import KVCacheTensors
from .transfer import host_to_device


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed


@dataclass
class PendingTokens:
    """The previous step's sampled tokens, still on the device: row ``rows[request_id]``
    of ``token_ids`` is that request's pending token."""

    token_ids: torch.Tensor  # [N] int64, on the device
    rows: dict[str, int]


def _pending_source(pending: PendingTokens | None, item: ScheduledRequest) -> int:
    """The row of ``pending`` that holds the input token of ``item``, a one-token decode."""
    request = item.request
    if pending is None or item.num_new_tokens != 1 or request.request_id not in pending.rows:
        raise RuntimeError(f"request {request.request_id!r} is scheduled past its known tokens "
                           "without a pending sampled token to feed")
    return pending.rows[request.request_id]


def _pad_rows(rows: list[list[int]]) -> list[list[int]]:
    width = max(len(row) for row in rows)
    return [row + [0] * (width - len(row)) for row in rows]


def _split_on_device(columns: list[list[int]], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Several integer lists moved to the device in one copy, as views of one tensor."""
    flat = host_to_device([v for column in columns for v in column], dtype, device)
    return list(flat.split([len(column) for column in columns]))


def _store_weights_column_major(model: torch.nn.Module) -> None:
    """Keep every projection matrix (and the embedding, which the tied LM head reads)
    column-major: same shapes and values, transposed strides.

    Measured on a 2-core AMD EPYC over SmolLM2's projections: through oneDNN (what
    ``kernels.reference.linear`` uses on CPU) a column-major matrix takes ~20% less
    time for 8- to 64-row products and ~10% more for one row; through plain BLAS
    (its fallback) ~25% less for one row. 700-row prefills cost the same either way.
    """
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.data = module.weight.data.t().contiguous().t()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, cache: KVCacheTensors, block_size: int,
                 device: torch.device):
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.ops = kernels.ops_for(device)
        self.graphs: StepGraphs | None = None
        if device.type == "cpu":
            _store_weights_column_major(model)

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture CUDA graphs of decode steps (up to max_batch sequences) and of small
        single-sequence prefills (CUDA only)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = StepGraphs(self.model, self.cache.device_layers, self.ops, max_batch,
                                 max_blocks, self.device)
        self.graphs.capture()

    def prepare(self, step: SchedulerOutput, block_tables: list[list[int]],
                pending: PendingTokens | None = None) -> StepInputs:
        """Pack the step's tokens; block_tables[i] is the table of step.scheduled[i].

        A request whose last token is still on the device (asynchronous scheduling)
        decodes it: its input id is copied on the device from ``pending``.
        """
        input_ids, positions, slots, context_lens, starts, logits_rows = [], [], [], [], [0], []
        pending_rows, pending_sources = [], []
        for item, table in zip(step.scheduled, block_tables):
            request = item.request
            begin = request.num_computed_tokens
            end = begin + item.num_new_tokens
            known = request.token_ids[begin:end]
            if len(known) < item.num_new_tokens:  # its pending token: filled in on the device
                pending_rows.append(len(input_ids))
                pending_sources.append(_pending_source(pending, item))
            input_ids.extend(known + [0] * (item.num_new_tokens - len(known)))
            positions.extend(range(begin, end))
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size
                         for p in range(begin, end))
            context_lens.append(end)
            starts.append(starts[-1] + item.num_new_tokens)
            if item.completes_sequence:
                logits_rows.append(starts[-1] - 1)
        longs = _split_on_device([input_ids, positions, slots, logits_rows, pending_rows, pending_sources],
                                 torch.int64, self.device)
        tables = _pad_rows(block_tables)
        ints = _split_on_device([context_lens, starts, [b for row in tables for b in row]],
                                torch.int32, self.device)
        input_ids_t, positions_t, slots_t, logits_rows_t, pending_rows_t, pending_sources_t = longs
        if pending_rows:
            input_ids_t.index_copy_(0, pending_rows_t, pending.token_ids.index_select(0, pending_sources_t))
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=ints[2].view(len(tables), -1),
            context_lens=ints[0],
            query_start_loc=ints[1],
            decode_only=all(item.num_new_tokens == 1 for item in step.scheduled),
            ops=self.ops)
        return StepInputs(input_ids_t, positions_t, meta, logits_rows_t)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, block_tables: list[list[int]],
                pending: PendingTokens | None = None) -> torch.Tensor:
        """Apply the step's block moves, launch the model, return logits [num_completing, vocab]:
        one row per scheduled request whose every token has KV after the step, in order."""
        self.cache.apply(step.block_copies, step.swaps)
        if not step.scheduled:
            return torch.empty(0, device=self.device)
        inputs = self.prepare(step, block_tables, pending)
        shape = None if self.graphs is None else self.graphs.shape_for(
            len(step.scheduled), step.num_tokens, inputs.meta.decode_only)
        if shape is not None:
            hidden = self.graphs.run(shape, inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache.device_layers, inputs.meta)
        return self.model.compute_logits(hidden[inputs.logits_indices], self.ops)
