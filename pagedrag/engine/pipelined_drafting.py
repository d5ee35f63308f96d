"""Pipelined drafting: speculative decoding that keeps the device busy between steps.

A synchronous verification step leaves the device idle while the host reads what it accepted,
emits the tokens, drafts again and prepares the next step (about 1 ms a step on an H200 at
batch 1, a fifth of the 8B shape's decode step). Where every running request can draft and
verify on the device (worker.pipelined_verification: ``ngram`` drafts, greedy rows whose logits
need no processing), the engine launches step t + 1 first and only then reads step t's
results, as asynchronous scheduling does for plain decodes.

This side decides when, and keeps the books:
- ``runs_pipelined``: asynchronous scheduling on, ``ngram``, one rank, nothing waiting or swapped,
  no sampled token in flight, 1 to ``disable_by_batch_size`` requests running, each of them
  ``pipelinable``; once started, the same requests as when it started.
- Slots: before a launch, each row's table covers every position it may write. The host knows
  a row's tokens up to the step before the one in flight, so it reserves two steps of
  1 + max_draft tokens past them; those slots stay reserved until the pipeline drains. A
  copy-on-write that the reservation makes (n > 1 siblings share a partly filled block) runs
  before the launch.
- Width: a step checks as many drafted positions as the longest limit among the rows still
  drafting, 0 (a plain decode) when none is, so rows that copy nothing pay for no drafted
  positions. A row stops counting as drafting once its lookups found nothing MISSES_TO_STOP times
  in a row (known a step late), and counts again at its next find.
- Results arrive one step late. A request that ends on them (a stop, EOS, max_tokens) has
  computed one step more, which is dropped; the batch then differs, so the next ``step()``
  drains the pipeline (reads the step in flight) and runs an ordinary step, and a later one
  starts the pipeline again from the host's tokens.
"""

from __future__ import annotations

from pagedrag.core.kv_cache_manager import KVCacheManager
from pagedrag.core.request import Request
from pagedrag.core.scheduler import Scheduler
from pagedrag.spec_decode.drafter import Drafter
from pagedrag.worker.pipelined_verification import DeviceDraftRows, PendingVerification, RowResult

# Lookups in a row that find nothing before a row's steps check no drafted positions. Measured on
# the embedded model's RAG answers on CPU (session 48, 5 prompts, 128 tokens): stopping after one
# miss cost 7% of the tokens a step (1.58 against 1.70 never stopping), since answers copy in
# bursts and the first draft of a burst comes a step after a miss.
MISSES_TO_STOP = 4


def pipelinable(request: Request) -> bool:
    """Whether a request's next steps can verify on the device: decoding (every token but the
    last computed, none in flight, no siblings to fork), opted in to drafting, greedy with
    nothing that reshapes its logits, and no logprobs asked for."""
    params = request.params
    return (request.num_computed_tokens == request.num_tokens - 1 and not request.num_inflight_tokens
            and not request.pending_forks and params.speculative_decoding and params.greedy
            and request.grammar is None and not request.bad_words_token_ids
            and params.logprobs is None and not params.logit_bias and params.allowed_token_ids is None
            and not params.uses_penalties and request.num_output_tokens >= params.min_tokens)


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
        self.misses: list[int] = []  # per row: its latest lookups in a row that found nothing

    @property
    def active(self) -> bool:
        """Whether a pipeline runs (``rows`` set, a step in flight)."""
        return self.rows is not None

    @property
    def reach(self) -> int:
        """Tokens past a row's known ones that the step in flight and the next may write."""
        return 2 * (1 + self.config.num_speculative_tokens)

    def runs_pipelined(self, scheduler: Scheduler, tokens_in_flight: bool) -> bool:
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
        if not self._reserve(rows):
            return None
        if self.rows is None:
            self._start(rows)
        self.runner.cache.apply(*self.kv.take_step_transfers())  # the reservation's copy-on-write copies
        self.device_rows.update_tables([self.kv.block_ids(r) for r in rows])
        limits = [self.drafter.limits.get(r.request_id, self.config.num_speculative_tokens) for r in rows]
        width = max((limit for limit, misses in zip(limits, self.misses) if misses < MISSES_TO_STOP), default=0)
        bound = max(r.num_tokens for r in rows) + self.reach
        previous, self.pending = self.pending, self.device_rows.launch(limits, width, bound)
        if previous is None:
            return []
        results = previous.read()
        self.misses = [0 if result.drafts_next else misses + 1 for result, misses in zip(results, self.misses)]
        return list(zip(rows, results))

    def _reserve(self, rows: list[Request]) -> bool:
        """Slots for every position the next launch may write, in each row's table; False when
        the pool is short. Rows reserved before the one that failed give theirs back when
        nothing is in flight (else the drain does)."""
        for index, request in enumerate(rows):
            if not self.kv.allocate_slots(request, request.num_tokens + self.reach - request.num_computed_tokens):
                if not self.active:
                    for reserved in rows[:index]:
                        self.kv.release_unused(reserved)
                return False
        return True

    def _start(self, rows: list[Request]) -> None:
        self.rows = rows
        self.device_rows = DeviceDraftRows(
            self.runner, [r.token_ids for r in rows], self.max_model_len + self.reach,
            self.config.prompt_lookup_min, self.config.prompt_lookup_max, self.config.num_speculative_tokens,
            normalised_logprobs=self.logprobs_mode.endswith("logprobs"))
        self.misses = [0] * len(rows)

    def drain(self) -> list[tuple[Request, RowResult]]:
        """Stop pipelining: the results of the step in flight ([] when idle)."""
        pending, rows = self.pending, self.rows or []
        self.reset()
        return [] if pending is None else list(zip(rows, pending.read()))

    def reset(self) -> None:
        """Forget the pipeline's state (after a failed step its rows start over)."""
        self.rows = self.device_rows = self.pending = None
        self.misses = []
