"""Runs a scheduled step on the device: the forward pass, then sampling.

For each scheduled request the step feeds its runs (tokens [num_computed, num_computed + n),
or with chunk reuse the ranges around the chunks it imports), each run attending as a
sequence of its own over the request's block table: input_ids and positions packed run
after run, each token's cache slot (slot_mapping), the block tables, the context lengths
after the run, and the packed offsets (query_start_loc). Logits are computed only at the last token of
requests whose every token has KV after the step (``step.completing``: those sample), and, for a
request that carries a draft (speculative decoding), at each drafted token too: a row of logits
for every token the verifier may emit.

The step's device work is a ``DevicePlan`` of host data (block moves, the packed token
layout, chunk exports): under tensor parallelism rank 0 broadcasts it and every rank runs
it on its shard (pagedrag.distributed); only rank 0 samples.

The engine calls ``execute`` (launch the forward pass), reads the previous step's
tokens, then ``sample`` with its plan: a sequence's sampling parameters depend on
the tokens read in between (penalties, min_tokens, a stop that ended it).

Nothing here waits for the device: the inputs go over in non-blocking copies, a
decode whose input token is still on the device (sampled by the previous step, not
yet read back) takes it from there, and the samples start back to the host without
waiting (``InflightTokens``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from pagedrag import kernels
from pagedrag.core.block_pool import blocks_for
from pagedrag.core.chunk_cache import KVMove, merge_runs
from pagedrag.core.kv_cache_manager import SwapPlan
from pagedrag.distributed.group import SINGLE, TensorParallelFailure, TensorParallelGroup
from pagedrag.core.scheduler import ScheduledRequest, SchedulerOutput
from pagedrag.models.attention import AttentionMetadata
from pagedrag.core.request import Request
from pagedrag.structured.masks import fill_masks
from pagedrag.worker.chunk_moves import apply_kv_moves
from pagedrag.worker.recompute_selection import candidate_positions, first_tokens, most_deviating, probe_deviation
from pagedrag.worker.cuda_graphs import GraphShape, StepGraphs
from pagedrag.worker.kv_cache import KVCacheTensors
from pagedrag.worker.prompt_logprobs import PromptRows, prompt_rows, prompt_samples
from pagedrag.worker.rejection_sampler import Verified, VerifyRow, verify
from pagedrag.worker.thread_tuner import ThreadTuner
from pagedrag.worker.sampler import Sample, Sampler, SamplerOutput, SamplingBatch, unpack_samples
from pagedrag.worker.transfer import device_to_host, host_to_device


@dataclass(slots=True)
class StepLayout:
    """One step's tokens as host lists, packed run after run over each request's blocks: what
    every tensor-parallel rank turns into the same device inputs."""

    input_ids: list[int]  # 0 where the token is still in flight (filled in on the device)
    positions: list[int]
    slots: list[int]
    context_lens: list[int]  # one per run
    starts: list[int]  # query_start_loc: run i owns rows starts[i]:starts[i + 1]
    tables: list[list[int]]  # one block table per run
    logits_rows: list[int]  # rows whose logits sample
    inflight_rows: list[int]  # rows whose input id is a token still on the device ...
    inflight_sources: list[int]  # ... row inflight_sources[i] of the previous step's samples
    prompt_rows: list[int]  # rows whose logits give prompt logprobs


@dataclass(slots=True)
class BlockMoves:
    """A step's cache moves before its forward pass: KV-tier loads (block id, host K/V), swaps,
    copy-on-write copies, chunk imports."""

    copies: list[tuple[int, int]]
    swaps: SwapPlan
    imports: list[KVMove]
    tier_loads: list = ()


@dataclass(slots=True)
class DevicePlan:
    """Everything the device does in one step, as host data (rank 0 broadcasts it to the
    tensor-parallel workers): moves in, the forward pass over ``layout`` (None: no tokens this
    step), then the chunk exports."""

    moves: BlockMoves
    layout: StepLayout | None
    exports: list[KVMove]

    def for_workers(self) -> DevicePlan:
        """The plan the other ranks are sent: the tier loads' K/V stay behind (rank 0
        broadcasts them on the device group as the loads run: kv_cache.load_blocks)."""
        loads = [(block_id, None) for block_id, _ in self.moves.tier_loads]
        return replace(self, moves=replace(self.moves, tier_loads=loads))


@dataclass(slots=True)
class TierGather:
    """Rank 0 asks every rank for its KV heads of these pool blocks (the KV tiers' writes)."""

    block_ids: list[int]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states whose logits are needed
    prompt_rows: torch.Tensor  # rows whose logits give prompt logprobs (prompt_logprobs)


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


def _known_tokens(item: ScheduledRequest, begin: int, end: int) -> list[int]:
    """Positions begin..end of the request followed by its draft; shorter where the last
    token is still in flight on the device (asynchronous scheduling)."""
    token_ids = item.request.token_ids
    known = len(token_ids)
    return token_ids[begin:end] + item.draft[max(begin - known, 0):max(end - known, 0)]


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
    """The device side of a step: model, KV cache tensors, CUDA graphs and the sampler.

    Under tensor parallelism every rank has one, over its share of the model and of the KV
    heads. Rank 0's ``execute`` plans the step (a DevicePlan), broadcasts the plan and runs
    it; the other ranks run each plan they receive (``follow``) and discard its logits.
    """

    def __init__(self, model: torch.nn.Module, cache: KVCacheTensors, block_size: int,
                 device: torch.device, eos_token_ids: frozenset[int] = frozenset(),
                 recompute_strategy: str = "first", group: TensorParallelGroup = SINGLE,
                 threads: ThreadTuner | None = None, logprobs_mode: str = "raw_logprobs"):
        self.model = model
        self.recompute_strategy = recompute_strategy  # chunk reuse: worker.recompute_selection
        self.cache = cache
        self.block_size = block_size
        self.device = device
        self.eos_token_ids = eos_token_ids  # the model's; min_tokens keeps them from being sampled
        self.group = group
        self.threads = threads  # CPU: the thread count per step size, by measurement
        self.ops = kernels.ops_for(device)
        self.sampler = Sampler(logprobs_mode)
        self.graphs: StepGraphs | None = None
        if device.type == "cpu":
            _store_weights_column_major(model)

    def capture_graphs(self, max_batch: int, max_model_len: int, verification: list[GraphShape] = ()) -> None:
        """Capture CUDA graphs of decode steps (up to max_batch sequences), of small prefills
        and of the ``verification`` step shapes (CUDA only; see worker.cuda_graphs)."""
        max_blocks = blocks_for(max_model_len, self.block_size)
        self.graphs = StepGraphs(self.model, self.cache.device_layers, self.ops, max_batch,
                                 max_blocks, self.device, verification)
        self.graphs.capture()

    def layout(self, step: SchedulerOutput, inflight: InflightTokens | None = None
               ) -> tuple[StepLayout, list[PromptRows]]:
        """Pack the step's tokens over each request's ``block_ids``, and the requests whose
        rows give prompt logprobs.

        A request whose last token is still on the device (asynchronous scheduling)
        decodes it: its row is listed with the row of ``inflight`` that holds the token.
        """
        out = StepLayout([], [], [], [], [0], [], [], [], [], [])
        wanted_prompt_rows = []
        for item in step.scheduled:
            for begin, end in item.runs:  # each run attends as a sequence of its own
                known = _known_tokens(item, begin, end)
                if len(known) < end - begin:  # its in-flight token: filled in on the device
                    out.inflight_rows.append(len(out.input_ids))
                    out.inflight_sources.append(_inflight_row(inflight, item))
                out.input_ids.extend(known + [0] * (end - begin - len(known)))
                out.positions.extend(range(begin, end))
                out.slots.extend(_slots(item.block_ids, begin, end, self.block_size))
                out.context_lens.append(end)
                out.tables.append(item.block_ids)
                wanted = prompt_rows(item.request, begin, end, out.starts[-1])
                if wanted is not None:
                    wanted_prompt_rows.append(wanted)
                    out.prompt_rows.extend(wanted.rows)
                out.starts.append(out.starts[-1] + end - begin)
            if item.completes_sequence:
                out.logits_rows.extend(range(out.starts[-1] - 1 - len(item.draft), out.starts[-1]))
        return out, wanted_prompt_rows

    def to_device(self, layout: StepLayout, inflight: InflightTokens | None = None) -> StepInputs:
        """The layout's tensors on the device (its integer lists in two copies). In-flight
        tokens are copied from ``inflight`` on rank 0, then broadcast to the other ranks."""
        longs = _split_on_device([layout.input_ids, layout.positions, layout.slots, layout.logits_rows,
                                  layout.inflight_rows, layout.inflight_sources, layout.prompt_rows],
                                 torch.int64, self.device)
        input_ids, positions, slots, logits_rows, inflight_rows, inflight_sources, prompt_rows_t = longs
        meta = self._attention_metadata(layout.tables, slots, layout.context_lens, layout.starts)
        if layout.inflight_rows:
            if self.group.is_driver:
                input_ids.index_copy_(0, inflight_rows, inflight.token_ids.index_select(0, inflight_sources))
            self.group.broadcast_tensor(input_ids)
        return StepInputs(input_ids, positions, meta, logits_rows, prompt_rows_t)

    def prepare(self, step: SchedulerOutput, inflight: InflightTokens | None = None) -> StepInputs:
        """The step's device inputs (``layout`` then ``to_device``)."""
        return self.to_device(self.layout(step, inflight)[0], inflight)

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
        """Plan the step, hand the plan to the other ranks and run it; returns the step's
        logits (see StepLogits). ``inflight``: the previous step's tokens, still on the device
        (asynchronous scheduling)."""
        moves = BlockMoves(step.block_copies, step.swaps, [m for item in step.scheduled for m in item.imports],
                           step.tier_loads)
        if self.group.size == 1:
            self.move_in(moves)  # before the layout: the deviation probe (one rank only) reads the imports
        layout, wanted = None, []
        if step.scheduled:
            self._pick_recomputed(step)
            layout, wanted = self.layout(step, inflight)
        plan = DevicePlan(moves, layout, [m for item in step.scheduled for m in item.exports])
        if self.group.size == 1:
            sampling, prompt_logits = self.run(plan, inflight)
        else:
            self.group.broadcast_object(plan.for_workers())
            sampling, prompt_logits = self._in_step(lambda: self._move_in_and_run(plan, inflight))
        prompt = [] if not wanted else prompt_samples(prompt_logits, wanted)
        return StepLogits(sampling, [(e.request, e.first_token, s) for e, s in zip(wanted, prompt)])

    def _move_in_and_run(self, plan: DevicePlan, inflight: InflightTokens | None = None):
        self.move_in(plan.moves)
        return self.run(plan, inflight)

    @staticmethod
    def _in_step(work):
        """``work()`` once the other ranks have rank 0's orders: any error leaves them mid-step."""
        try:
            return work()
        except Exception as error:
            raise TensorParallelFailure(f"a step failed on rank 0 after its orders reached the other "
                                        f"ranks, which can no longer follow: {error!r}") from error

    @torch.inference_mode()
    def gather_for_tiers(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Rank 0: start copying whole pool blocks to the host for the KV tiers
        (kv_cache.gather_blocks), the other ranks sending their heads."""
        if self.group.size == 1:
            return self.cache.gather_blocks(block_ids)
        self.group.broadcast_object(TierGather(block_ids))
        return self._in_step(lambda: self.cache.gather_blocks(block_ids))

    @torch.inference_mode()
    def follow(self, orders: DevicePlan | TierGather) -> None:
        """A tensor-parallel worker's part in rank 0's step plan or tier gather, on its shard."""
        if isinstance(orders, TierGather):
            self.cache.gather_blocks(orders.block_ids)
        else:
            self._move_in_and_run(orders)

    def move_in(self, moves: BlockMoves) -> None:
        """KV-tier loads, swaps, copy-on-write copies and chunk imports, before the forward pass."""
        self.cache.load_blocks(list(moves.tier_loads))
        self.cache.apply(moves.copies, moves.swaps)
        self._move_kv(moves.imports)

    def run(self, plan: DevicePlan, inflight: InflightTokens | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward pass over ``plan.layout`` (a captured graph when one fits), then the
        exports: (logits of the sampling rows, logits of the prompt-logprob rows or None)."""
        if plan.layout is None:
            return torch.empty(0, device=self.device), None
        inputs = self.to_device(plan.layout, inflight)
        with self.step_threads(inputs.input_ids.shape[0]):
            hidden = self.hidden_states(inputs.input_ids, inputs.positions, inputs.meta)
            self._move_kv(plan.exports)
            sampling = self.model.compute_logits(hidden[inputs.logits_indices], self.ops)
            prompt = self.model.compute_logits(hidden[inputs.prompt_rows], self.ops) if plan.layout.prompt_rows \
                else None
        return sampling, prompt

    def step_threads(self, num_tokens: int):
        """The CPU thread count for a step of ``num_tokens`` tokens (worker.thread_tuner), for
        the duration of the with block; nothing elsewhere."""
        return nullcontext() if self.threads is None else self.threads.step(num_tokens)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                      ) -> torch.Tensor:
        """The forward pass over a step's tokens, from device tensors: a captured graph when
        one fits, else eagerly."""
        shape = None if self.graphs is None else self.graphs.shape_for(
            meta.context_lens.shape[0], input_ids.shape[0], meta.decode_only)
        if shape is not None:
            return self.graphs.run(shape, input_ids, positions, meta)
        return self.model(input_ids, positions, self.cache.device_layers, meta)

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
            [r.prompt_id_tensor for r in requests], [r.output_token_ids for r in requests],
            self.device, self.eos_token_ids, [r.bad_words_token_ids for r in requests],
            fill_masks([r.grammar for r in requests], logits.shape[-1], self.device))
        rows = host_to_device([row.logits_row for row in plan], torch.int64, self.device)
        return InflightTokens.start(requests, self.sampler(logits[rows], batch))

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, rows: list[VerifyRow]) -> list[Verified]:
        """Verify the drafts of ``rows`` against their rows of ``logits`` (from ``execute``);
        waits for the results (speculative decoding runs with synchronous scheduling)."""
        return verify(logits, rows, self.eos_token_ids, self.sampler.logprobs_mode) if rows else []
