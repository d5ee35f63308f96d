"""Pipelined drafting: speculative decoding that keeps the device busy between steps.

A synchronous verification step leaves the device idle while the host reads what it accepted,
emits the tokens, drafts again and prepares the next step (about 1 ms a step on an H200 at
batch 1, a fifth of the 8B shape's decode step). Where every running request can draft and
verify on the device (worker.pipelined_verification: ``ngram`` drafts, greedy rows whose logits
need no processing), the engine launches step t + 1 first and only then reads step t's
results, as asynchronous scheduling does for plain decodes.

This side decides when, and keeps the books:
- ``continues``: asynchronous scheduling on, ``ngram``, one rank, nothing waiting or swapped,
  no sampled token in flight, 1 to ``disable_by_batch_size`` requests running, each of them
  ``pipelinable``; once started, the same requests as when it started.
- Slots: before a launch, each row's table covers every position it may write. The host knows
  a row's tokens up to the step before the one in flight, so it reserves two steps of
  1 + max_draft tokens past them; those slots stay reserved until the pipeline drains.
- Results arrive one step late. A request that ends on them (a stop, EOS, max_tokens) has
  computed one step more, which is dropped; the batch then differs, so the next ``step()``
  drains the pipeline (reads the step in flight) and runs an ordinary step, and a later one
  starts the pipeline again from the host's tokens.
"""

from __future__ import annotations

from pagedrag.core.block_pool import blocks_for
from pagedrag.core.kv_cache_manager import KVCacheManager
from pagedrag.core.request import Request
from pagedrag.core.scheduler import Scheduler
from pagedrag.spec_decode.drafter import Drafter
from pagedrag.worker.pipelined_verification import DeviceDraftRows, PendingVerification, RowResult


def pipelinable(request: Request) -> bool:
    """Whether a request's next steps can verify on the device: decoding (every token but the
    last computed, none in flight, no siblings to fork), opted in to drafting, and greedy with
    nothing that reshapes its logits or asks for more than the chosen token's logprob."""
    params = request.params
    return (request.num_computed_tokens == request.num_tokens - 1 and not request.num_inflight_tokens
            and not request.pending_forks and params.speculative_decoding and params.greedy
            and request.grammar is None and not request.bad_words_token_ids
            and params.logprobs is None and not params.logit_bias and params.allowed_token_ids is None
            and params.presence_penalty == 0 and params.frequency_penalty == 0
            and params.repetition_penalty == 1 and request.num_output_tokens >= params.min_tokens)


class PipelinedDrafting:
    """Owns the rows in the pipeline (``rows``: requests in row order, None when idle), their
    device state and the step in flight."""

    def __init__(self, drafter: Drafter, runner, kv: KVCacheManager, max_model_len: int,
                 max_num_batched_tokens: int, logprobs_mode: str):
        self.drafter = drafter
        self.config = drafter.config
        self.runner = runner
        self.kv = kv
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.logprobs_mode = logprobs_mode
        self.rows: list[Request] | None = None
        self.device_rows: DeviceDraftRows | None = None
        self.pending: PendingVerification | None = None

    @property
    def active(self) -> bool:
        """Whether a pipeline runs (``rows`` set, a step in flight)."""
        return self.rows is not None

    @property
    def reach(self) -> int:
        """Tokens past a row's known ones that the step in flight and the next may write."""
        return 2 * (1 + self.config.num_speculative_tokens)

    def continues(self, scheduler: Scheduler, tokens_in_flight: bool) -> bool:
        """Whether this step runs pipelined (see the module docstring)."""
        running = scheduler.running
        if (tokens_in_flight or scheduler.waiting or scheduler.swapped or not running
                or len(running) > self.config.disable_by_batch_size
                or len(running) * (1 + self.config.num_speculative_tokens) > self.max_num_batched_tokens):
            return False
        if self.active:
            return running == self.rows and all(r.num_tokens + self.reach <= self.max_model_len for r in running)
        return all(pipelinable(r) and r.num_tokens + self.reach <= self.max_model_len for r in running)

    def launch(self, scheduler: Scheduler) -> list[tuple[Request, RowResult]] | None:
        """Reserve the rows' slots and launch a step (starting the pipeline if idle); returns
        the results of the step launched before it ([] when none), or None, launching
        nothing, when the pool is short of slots (the caller drains and steps as usual)."""
        rows = self.rows or list(scheduler.running)
        if not all(self.kv.allocate_slots(r, r.num_tokens + self.reach - r.num_computed_tokens) for r in rows):
            return None
        if self.rows is None:
            self._start(rows)
        tables = [self.kv.block_ids(r) for r in rows]
        self.device_rows.update_tables(tables)
        limits = [self.drafter.limits.get(r.request_id, self.config.num_speculative_tokens) for r in rows]
        bound = min(max(r.num_tokens for r in rows) + self.reach, self.device_rows.history.shape[1])
        previous, self.pending = self.pending, self.device_rows.launch(limits, max(limits), bound)
        return [] if previous is None else list(zip(rows, previous.read()))

    def _start(self, rows: list[Request]) -> None:
        self.rows = rows
        capacity = self.max_model_len + self.reach
        self.device_rows = DeviceDraftRows(
            self.runner, [r.token_ids for r in rows], capacity, blocks_for(self.max_model_len, self.kv.block_size),
            self.config.prompt_lookup_min, self.config.prompt_lookup_max, self.config.num_speculative_tokens,
            normalised_logprobs=self.logprobs_mode.endswith("logprobs"))

    def drain(self) -> list[tuple[Request, RowResult]]:
        """Stop pipelining: the results of the step in flight ([] when idle)."""
        pending, rows = self.pending, self.rows or []
        self.reset()
        return [] if pending is None else list(zip(rows, pending.read()))

    def reset(self) -> None:
        """Forget the pipeline's state (after a failed step its rows start over)."""
        self.rows = self.device_rows = self.pending = None
