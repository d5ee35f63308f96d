"""Runs a scheduled step on the device: the forward pass, then sampling.

For each scheduled request the step feeds its runs (tokens [num_computed, num_computed + n),
or with chunk reuse the ranges around the chunks it imports), each run attending as a
sequence of its own over the request's block table: input_ids and positions packed run
after run, each token's cache slot (slot_mapping), the block tables, the context lengths
after the run, and the packed offsets (query_start_loc). Logits are computed only at the last token of
requests whose every token has KV after the step (``step.completing``: those sample).

The engine calls ``execute`` (launch the forward pass), reads the previous step's
tokens, then ``sample`` with its plan: a sequence's sampling parameters depend on
the tokens read in between (penalties, min_tokens, a stop that ended it).

Nothing here waits for the device: the inputs go over in non-blocking copies, a
decode whose input token is still on the device (sampled by the previous step, not
yet read back) takes it from there, and the samples start back to the host without
waiting (``InflightTokens``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrag import kernels
from pagedrag.core.block_pool import blocks_for
from pagedrag.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedrag.models.attention import AttentionMetadata
from pagedrag.core.request import Request
from pagedrag.structured.masks import fill_masks
from pagedrag.core.chunk_cache import merge_runs
from pagedrag.worker.chunk_moves import apply_kv_moves
from pagedrag.worker.recompute_selection import candidate_positions, first_tokens, most_deviating, probe_deviation
from pagedrag.worker.cuda_graphs import StepGraphs
from pagedrag.worker.kv_cache import KVCacheTensors
from pagedrag.worker.prompt_logprobs import PromptRows, prompt_rows, prompt_samples
from pagedrag.worker.sampler import Sample, Sampler, SamplerOutput, SamplingBatch, unpack_samples
from pagedrag.worker.transfer import device_to_host, host_to_device


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed
    prompt_rows: list[PromptRows]  # rows whose logits give prompt logprobs (prompt_logprobs)


@dataclass(slots=True)
class StepLogits:
    """What a forward pass hands back: ``sampling`` [len(step.completing), vocab], row i for
    ``step.completing[i]``; and the prompt logprobs of requests that asked for them."""

    sampling: torch.Tensor
    prompt: list[tuple[Request, int, list[Sample]]]  # (request, first prompt token, one Sample each)


@dataclass(slots=True)
class SamplingRow:
    """One sequence that samples this step: ``request`` draws its next token from row
    ``logits_row`` of the step's logits with its own parameters and generator (n > 1
    siblings forked this step share their parent's row)."""

    request: Request
    logits_row: int


@dataclass(slots=True)
class InflightTokens:
    """A step's sampled tokens, from the sampler until the engine has read them.

    Row i belongs to ``requests[i]`` (``rows`` maps request ids back to rows), whose
    ``num_inflight_tokens`` is 1 from ``start`` until the engine appends the token it
    ``read``. ``token_ids`` stays on the device: with asynchronous scheduling the next
    step's decodes take their input ids from it before the host has the tokens. ``host``
    is the samples' copy (``SamplerOutput.table``), complete once ``ready`` fired.
    """

    requests: list[Request]
    rows: dict[str, int]
    token_ids: torch.Tensor  # [N] int64, on the device
    host: torch.Tensor  # [N, 2 + 2k] float64 on the host, once ready
    ready: torch.cuda.Event | None  # None: the copy is done at once
    num_logprobs: list[int]

    @classmethod
    def start(cls, requests: list[Request], sampled: SamplerOutput) -> InflightTokens:
        """Mark each request's token as in flight and start copying the samples to the host."""
        for request in requests:
            request.num_inflight_tokens = 1
        host, ready = device_to_host(sampled.table())
        rows = {request.request_id: row for row, request in enumerate(requests)}
        return cls(requests, rows, sampled.token_ids, host, ready, sampled.num_logprobs)

    def read(self) -> list[Sample]:
        """Wait for the copy (not for device work queued after it); sample i is requests[i]'s."""
        if self.ready is not None:
            self.ready.synchronize()
        return unpack_samples(self.host, self.num_logprobs)


def _inflight_row(inflight: InflightTokens | None, item: ScheduledRequest) -> int:
    """The row of ``inflight`` that holds the input token of ``item``, a one-token decode."""
    request = item.request
    if inflight is None or item.num_new_tokens != 1 or request.request_id not in inflight.rows:
        raise RuntimeError(f"request {request.request_id!r} is scheduled past its known tokens "
                           "without an in-flight sampled token to feed")
    return inflight.rows[request.request_id]


def _slots(block_ids: list[int], begin: int, end: int, block_size: int) -> list[int]:
    """The flat cache slots of a request's positions [begin, end)."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(begin, end)]


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
    """The device side of a step: model, KV cache tensors, CUDA graphs and the sampler."""

    def __init__(self, model: torch.nn.Module, cache: KVCacheTensors, block_size: int,
                 device: torch.device, eos_token_id: int | None = None, recompute_strategy: str = "first"):
        self.model = model
        self.recompute_strategy = recompute_strategy  # chunk reuse: worker.recompute_selection
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.eos_token_id = eos_token_id  # the tokenizer's; min_tokens keeps it from being sampled
        self.ops = kernels.ops_for(device)
        self.sampler = Sampler()
        self.graphs: StepGraphs | None = None
        if device.type == "cpu":
            _store_weights_column_major(model)

    def capture_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Capture CUDA graphs of decode steps (up to max_batch sequences) and of small
        single-sequence prefills (CUDA only)."""
        max_blocks = blocks_for(max_model_len, self.block_size)
        self.graphs = StepGraphs(self.model, self.cache.device_layers, self.ops, max_batch,
                                 max_blocks, self.device)
        self.graphs.capture()

    def prepare(self, step: SchedulerOutput, inflight: InflightTokens | None = None) -> StepInputs:
        """Pack the step's tokens over each request's ``block_ids``.

        A request whose last token is still on the device (asynchronous scheduling)
        decodes it: its input id is copied on the device from ``inflight``.
        """
        input_ids, positions, slots, context_lens, starts, logits_rows = [], [], [], [], [0], []
        inflight_rows, inflight_sources, wanted_prompt_rows, tables = [], [], [], []
        for item in step.scheduled:
            for begin, end in item.runs:  # each run attends as a sequence of its own
                known = item.request.token_ids[begin:end]
                if len(known) < end - begin:  # its in-flight token: filled in on the device
                    inflight_rows.append(len(input_ids))
                    inflight_sources.append(_inflight_row(inflight, item))
                input_ids.extend(known + [0] * (end - begin - len(known)))
                positions.extend(range(begin, end))
                slots.extend(_slots(item.block_ids, begin, end, self.block_size))
                context_lens.append(end)
                tables.append(item.block_ids)
                wanted = prompt_rows(item.request, begin, end, starts[-1])
                if wanted is not None:
                    wanted_prompt_rows.append(wanted)
                starts.append(starts[-1] + end - begin)
            if item.completes_sequence:
                logits_rows.append(starts[-1] - 1)
        longs = _split_on_device([input_ids, positions, slots, logits_rows, inflight_rows, inflight_sources],
                                 torch.int64, self.device)
        input_ids_t, positions_t, slots_t, logits_rows_t, inflight_rows_t, inflight_sources_t = longs
        meta = self._attention_metadata(tables, slots_t, context_lens, starts)
        if inflight_rows:
            input_ids_t.index_copy_(0, inflight_rows_t, inflight.token_ids.index_select(0, inflight_sources_t))
        return StepInputs(input_ids_t, positions_t, meta, logits_rows_t, wanted_prompt_rows)

    def _attention_metadata(self, tables: list[list[int]], slot_mapping: torch.Tensor,
                            context_lens: list[int], starts: list[int]) -> AttentionMetadata:
        """The step's attention metadata (a row per run); its integer columns go over in one copy."""
        tables = _pad_rows(tables)
        ints = _split_on_device([context_lens, starts, [b for row in tables for b in row]],
                                torch.int32, self.device)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=ints[2].view(len(tables), -1),
            context_lens=ints[0],
            query_start_loc=ints[1],
            decode_only=all(end - start == 1 for start, end in zip(starts, starts[1:])),
            ops=self.ops)

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, inflight: InflightTokens | None = None) -> StepLogits:
        """Apply the step's block moves and launch the model; returns the step's logits (see
        StepLogits). ``inflight``: the previous step's tokens, still on the device
        (asynchronous scheduling)."""
        self.cache.apply(step.block_copies, step.swaps)
        if not step.scheduled:
            return StepLogits(torch.empty(0, device=self.device), [])
        self._move_kv([move for item in step.scheduled for move in item.imports])
        self._pick_recomputed(step)
        inputs = self.prepare(step, inflight)
        shape = None if self.graphs is None else self.graphs.shape_for(
            inputs.meta.context_lens.shape[0], step.num_tokens, inputs.meta.decode_only)
        if shape is not None:
            hidden = self.graphs.run(shape, inputs.input_ids, inputs.positions, inputs.meta)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.cache.device_layers, inputs.meta)
        self._move_kv([move for item in step.scheduled for move in item.exports])
        return StepLogits(self.model.compute_logits(hidden[inputs.logits_indices], self.ops),
                          self._prompt_logprobs(hidden, inputs.prompt_rows))

    def _pick_recomputed(self, step: SchedulerOutput) -> None:
        """Add to each run list the tokens of imported chunks to compute again."""
        items = [item for item in step.scheduled if item.recompute]
        if not items:
            return
        if self.recompute_strategy == "first":
            picked = [first_tokens(item.recompute) for item in items]
        else:
            picked = self._most_deviating(items)
        for item, positions in zip(items, picked):
            item.runs = merge_runs(item.runs, positions)

    def _most_deviating(self, items: list[ScheduledRequest]) -> list[list[int]]:
        """Probe the items' uncomputed spans (worker.recompute_selection) and pick per chunk."""
        spans = [ScheduledRequest(item.request, item.end - item.request.num_computed_tokens, item.block_ids)
                 for item in items]
        probe = self.prepare(SchedulerOutput(spans))
        candidates = [candidate_positions(item.recompute) for item in items]
        slots = host_to_device([slot for item in items for chunk in item.recompute
                                for slot in _slots(item.block_ids, chunk.start, chunk.end, self.block_size)],
                               torch.int64, self.device)
        deviation = probe_deviation(self.model.model, self.cache.device_layers, probe.input_ids,
                                    probe.positions, probe.meta, slots)
        picked, offset = [], 0
        for item, positions in zip(items, candidates):
            picked.append(most_deviating(deviation[offset:offset + len(positions)], item.recompute))
            offset += len(positions)
        return picked

    def _move_kv(self, moves: list) -> None:
        """Chunk reuse's copies (worker.chunk_moves), on the model's rotary frequencies."""
        if moves:
            apply_kv_moves(self.cache.device_pool, self.model.model.rotary.inv_freq, moves)

    def _prompt_logprobs(self, hidden: torch.Tensor, wanted: list[PromptRows]) -> list:
        if not wanted:
            return []
        rows = torch.tensor([r for entry in wanted for r in entry.rows], device=hidden.device)
        samples = prompt_samples(self.model.compute_logits(hidden[rows], self.ops), wanted)
        return [(entry.request, entry.first_token, s) for entry, s in zip(wanted, samples)]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, plan: list[SamplingRow]) -> InflightTokens | None:
        """Sample the next token of every sequence in ``plan`` from its row of ``logits`` (from
        ``execute``) and start copying the tokens to the host; None when nothing samples.
        The grammars' masks are filled here, on the host, while the forward pass runs."""
        if not plan:
            return None
        requests = [row.request for row in plan]
        batch = SamplingBatch.from_params(
            [r.params for r in requests], [r.generator for r in requests],
            [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests],
            self.device, self.eos_token_id, [r.bad_words_token_ids for r in requests],
            fill_masks([r.grammar for r in requests], logits.shape[-1], self.device))
        rows = host_to_device([row.logits_row for row in plan], torch.int64, self.device)
        return InflightTokens.start(requests, self.sampler(logits[rows], batch))
