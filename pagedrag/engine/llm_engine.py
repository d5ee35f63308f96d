"""LLMEngine: requests in, one step per ``step()`` (schedule -> run -> update), outputs out.

Who owns what in a step: the scheduler picks the work and does its bookkeeping
(``update_after_step``); the model runner runs the forward pass and samples; the
engine plans the sampling (forks of n > 1 siblings join their request group) and
turns sampled tokens into outputs (stops, text, metrics).
"""

from __future__ import annotations

from contextlib import nullcontext

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Future
import itertools
import logging
import os
import secrets
import time
import weakref

import torch

from pagedrag.config import EngineArgs
from pagedrag.distributed.launch import start_ranks
from pagedrag.core.kv_cache_manager import KVCacheManager
from pagedrag.core.scheduler import Scheduler, SchedulerOutput
from pagedrag.engine.inputs import InputProcessor, ProcessedPrompt, PromptType, ToolSettings
from pagedrag.metrics import EngineMetrics
from pagedrag.engine.stats_log import StatsLog
from pagedrag.engine.output_processor import (RequestGroup, StopPolicy, mark_first_token, new_sequence_text,
                               record_logprobs, record_prompt_logprobs, update_text)
from pagedrag.outputs import RequestOutput, SpecDecodeCounts
from pagedrag.engine.recovery import EngineDeadError, Probation, check_not_forked, is_device_failure
from pagedrag.kv_tiers.build import build_tiers
from pagedrag.core.request import Request, RequestStatus
from pagedrag.sampling_params import SamplingParams
from pagedrag.engine.pipelined_drafting import PipelinedDrafting
from pagedrag.spec_decode.drafter import Drafter
from pagedrag.worker.device_side import build_device_side
from pagedrag.worker.kv_cache import log_pool
from pagedrag.worker.model_runner import InflightTokens, SamplingRow
from pagedrag.worker.pipelined_verification import RowResult
from pagedrag.worker.rejection_sampler import Verified, VerifyRow
from pagedrag.worker.sampler import Sample
from pagedrag.worker.transfer import queued_work_done

logger = logging.getLogger("pagedrag")


def _stop_in_owner(ranks, owner_pid: int) -> None:
    """Stop the rank workers, from the process that started them only: a forked child that
    exits must not stop its parent's."""
    if os.getpid() == owner_pid:
        ranks.stop()


class LLMEngine:
    """The synchronous engine. Not thread-safe: one thread calls add/abort/step."""

    def __init__(self, args: EngineArgs):
        if args.seed is None:  # as vLLM: a random seed, drawn before the ranks start so that all share it
            args = dataclasses.replace(args, seed=secrets.randbits(63))
        self.args = args
        self._owner_pid = os.getpid()  # a forked child's copy runs nothing (check_not_forked)
        self.tiers = None  # built once the device side is (shutdown() may run before)
        self.ranks = start_ranks(args)  # one rank, or rank 0 of a tensor-parallel group
        # Stops the workers when the engine is dropped or the interpreter exits (no reference to self).
        self._stop_ranks = weakref.finalize(self, _stop_in_owner, self.ranks, os.getpid())
        try:
            side = build_device_side(args, self.ranks.group)
        except BaseException:
            self.shutdown()
            raise
        loaded = side.loaded
        self.device = side.runner.device
        self.dtype = side.shape.dtype
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        # A Logprob's text; bound to the tokenizer, not to self (no reference cycle: an engine
        # dropped by its caller is freed at once, never by a garbage collection later).
        self._decode_token = None if self.tokenizer is None else functools.partial(_decode_one, self.tokenizer)
        self.hf_config = loaded.hf_config
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = set(loaded.eos_token_ids)
        self.vocab_size = loaded.hf_config.vocab_size
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len, args.max_num_seqs,
                                     sorted(self.eos_token_ids),
                                     ToolSettings(args.tool_call_parser, args.enable_auto_tool_choice))
        self.inputs.segment_prompts = args.enable_chunk_reuse
        self.default_params = SamplingParams(**loaded.sampling_defaults)
        self.shape = side.shape
        self.num_blocks = side.num_blocks
        num_cpu_blocks = side.num_cpu_blocks
        chunk_reuse = ((args.chunk_recompute_fraction, self.model_name, args.chunk_recompute_window,
                        args.chunk_recompute_strategy)
                       if args.enable_chunk_reuse else None)
        self.tiers = build_tiers(args, side.weights, loaded.hf_config, self.shape, self.device)
        self.kv = KVCacheManager(self.num_blocks, args.block_size, args.enable_prefix_caching, num_cpu_blocks,
                                 chunk_reuse, self.tiers)
        speculative = args.speculative()
        self.drafter = None if speculative is None else Drafter(speculative, self.inputs.grammars)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs,
                                   args.resolved_max_num_batched_tokens(self.max_model_len, self.device),
                                   args.enable_chunked_prefill, args.preemption_mode, self.max_model_len,
                                   self.drafter)
        self.runner = side.runner
        self.async_scheduling = args.resolved_async_scheduling(self.device)
        self.pipeline = PipelinedDrafting(self.drafter, self.runner, self.kv, self.max_model_len,
                                          self.scheduler.max_num_batched_tokens, args.logprobs_mode) \
            if (self.async_scheduling and speculative is not None and speculative.method == "ngram"
                and self.runner.group.size == 1) else None
        self._inflight: InflightTokens | None = None  # the last step's tokens, not yet read
        self.probation = Probation()
        self._suspects: set[str] = set()  # groups the running step touched (see recovery)
        self._failed_outputs: list[RequestOutput] = []
        self.stop_policy = StopPolicy(self.eos_token_ids, self.max_model_len)
        self.groups: dict[str, RequestGroup] = {}
        self.metrics = EngineMetrics(args.metrics_model_name(self.model_name), args.metrics_prefix)
        self.stats_log = None if args.disable_log_stats else StatsLog()
        self._request_counter = itertools.count()
        log_pool(self.device, self.shape, self.num_blocks, self.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def check_not_forked(self) -> None:
        """EngineDeadError in a process forked from this engine's: its threads, rank workers
        and tier writer stayed in the parent (recovery.check_not_forked)."""
        check_not_forked(self._owner_pid)

    def shutdown(self) -> None:
        """Finish the KV tiers' writes; stop the tensor-parallel workers, if any (also done when
        the engine is dropped). Nothing in a forked child: they are its parent's."""
        if os.getpid() != self._owner_pid:
            return
        try:
            if self.tiers is not None:
                self.tiers.close()
        finally:
            self._stop_ranks()

    def flush_tiers(self) -> None:
        """Wait until every block computed so far is in the KV tiers (host memory, disk)."""
        self.tiers_written().result()

    def tiers_written(self) -> Future:
        """A future that completes once the KV tiers hold every block computed so far (done at
        once without tiers): wait on it off the engine's thread."""
        if self.tiers is None:
            done: Future = Future()
            done.set_result(None)
            return done
        return self.tiers.written()

    # ---- requests -----------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: PromptType | ProcessedPrompt,
                    params: SamplingParams | None = None, cache_salt: str | None = None) -> str:
        """Validate and queue a request; raises ValueError / TypeError (nothing queued) on bad
        input. A ProcessedPrompt (from ``inputs`` on another thread) is queued as it is."""
        self.check_not_forked()
        params = params or self.default_params
        self.inputs.check_params(params)
        request_id = request_id if request_id is not None else str(next(self._request_counter))
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = self.inputs.process(prompt, cache_salt, params.truncate_prompt_tokens)
        request = Request(request_id, prompt.token_ids, params, self.args.block_size, prompt.cache_salt,
                          prompt=prompt.text, generator=self._generator(params, 0), segments=prompt.segments)
        request.pending_forks = params.n - 1
        if params.bad_words:
            request.bad_words_token_ids = self.inputs.bad_words_token_ids(params)
        if params.structured_outputs is not None:
            request.grammar = self.inputs.grammars.matcher(params.structured_outputs)
        group = RequestGroup(request_id, prompt.text, prompt.token_ids, params.n, [request])
        group.texts[request.request_id] = new_sequence_text(self.tokenizer, request)
        self.groups[request_id] = group
        self.scheduler.add(request)
        self.metrics.observe_prompt(len(prompt.token_ids))
        return request_id

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        """A per-sequence RNG: completion i of a seeded request uses seed + i."""
        if params.seed is None:
            return None
        return torch.Generator(self.device).manual_seed(params.seed + index)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (any of its sequences, wherever they are) and free its blocks;
        returns its final output (finish_reason "abort"), or None for an unknown id."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        aborted = [seq for seq in group.sequences if not seq.is_finished]
        for seq in aborted:
            self.scheduler.finish(seq, RequestStatus.FINISHED_ABORTED)
        first = group.sequences[0]
        unforked = [first] * first.pending_forks  # n > 1 siblings not forked yet: each ends too
        for seq in aborted + unforked:  # as each of the n ends once otherwise
            self.metrics.request_finished(RequestStatus.FINISHED_ABORTED.value, seq.metrics, seq.num_output_tokens)
        self._observe_pool()
        output = group.to_output()
        output.finished = True
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a request queued, running or swapped out. A request whose
        token is still on the device stays running until the token is read; an aborted one's
        token is dropped when the next step reads it."""
        return self.scheduler.has_unfinished()

    def cached_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> dict[str, int]:
        """How many leading prompt tokens a request of this prompt under ``cache_salt`` would
        not compute now, by where their blocks are: ``"pool"``, then each KV tier that holds
        what follows and would be read (``"host"``, ``"disk"``). No side effects."""
        probe = Request("probe", list(prompt_token_ids), SamplingParams(), self.args.block_size, cache_salt)
        return self.kv.cached_prefix(probe)

    def cached_prefix_len(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """How many leading prompt tokens the prefix cache holds now, in the pool or the KV
        tiers under it (``cached_prefix``'s sum)."""
        return sum(self.cached_prefix(prompt_token_ids, cache_salt).values())

    def reset_prefix_cache(self) -> None:
        self.kv.pool.reset_prefix_cache()

    # ---- the step -------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, launch the model once, sample, and return the outputs of requests that moved.

        With asynchronous scheduling (the default on CUDA) the tokens sampled by a step stay
        on the device until the next ``step()``: it schedules and launches its model pass
        first (decodes take their input tokens on the device), and only then waits for
        the previous step's tokens and turns them into outputs, so the host's bookkeeping
        overlaps the device's work. Outputs then arrive one step late, and a request that
        stops computes one token more, which is dropped. Without it (the default on CPU,
        where nothing would overlap) each step returns its own tokens; with speculative
        decoding, so does each step after which a request may draft, unless every running
        request drafts and verifies on the device (engine.pipelined_drafting): then the step
        launches its verification first and reads the previous one's after.

        A step that raises fails only the requests it traces to (pagedrag.engine.recovery): their
        outputs come back finished, with ``error`` set. Raises EngineDeadError (or the device's
        error) only when the device or the model is broken.
        """
        self.check_not_forked()
        probing = self.probation.head() if self.probation else None
        try:
            with nullcontext() if self.runner.threads is None else self.runner.threads.caller_threads_kept():
                if probing is not None:
                    outputs = self._probe(probing)
                elif self.pipeline is not None and self.pipeline.runs_pipelined(self.scheduler, self._inflight is not None):
                    outputs = self._pipelined_step()
                else:
                    outputs = self._run_step(self.scheduler.schedule, self.async_scheduling, self._drain_pipeline())
        except Exception as error:
            outputs = self._recover(error, probing)
        else:
            self.probation.record(failed=False)
        failed, self._failed_outputs = self._failed_outputs, []
        return failed + outputs

    def _run_step(self, schedule, asynchronous: bool, touched: set[str] = frozenset()) -> list[RequestOutput]:
        """schedule -> run -> update. The previous step's tokens are read only after this
        step's forward pass is launched, and before it samples: sampling depends on them.
        ``touched``: groups that moved before the step (a drained pipeline), output with its own."""
        previous, self._inflight = self._inflight, None
        self._suspects = {seq.group_id for seq in previous.requests} if previous else set()
        started = time.perf_counter()
        step = schedule()
        self._suspects |= {item.request.group_id for item in step.scheduled}
        self._suspects |= {request.group_id for request in step.preempted}
        logits = self.runner.execute(step, previous)
        self.scheduler.update_after_step(step, self._fail_request)
        self._offer_to_tiers(step, time.perf_counter() - started)
        for request, first_token, samples in logits.prompt:
            record_prompt_logprobs(request, first_token, samples, self._token_text(request))
        touched = set(touched) | (self._complete(previous) if previous else set())
        plan, verifying = self._sampling_plan(step)
        sampled = self.runner.sample(logits.sampling, plan)
        touched |= self._complete_verified(self.runner.verify(logits.sampling, verifying))
        if sampled is not None and not (asynchronous and self._leaves_tokens_in_flight()):
            touched |= self._complete(sampled)
        else:
            self._inflight = sampled
        self._observe(step)
        return [self._output(group_id) for group_id in touched if group_id in self.groups]

    def _pipelined_step(self) -> list[RequestOutput]:
        """Launch the pipeline's next verification, then emit the one before it (see
        engine.pipelined_drafting); an ordinary step where the pool is short of slots."""
        started = time.perf_counter()
        self._suspects = {request.group_id for request in self.scheduler.running}
        results = self.pipeline.launch(self.scheduler)
        if results is None:
            return self._run_step(self.scheduler.schedule, self.async_scheduling, self._drain_pipeline())
        touched = self._complete_pipelined(results, keep_slots=True)
        if all(request.is_finished for request in self.pipeline.rows):  # nothing to continue: free its state now
            self.pipeline.drain()
        self._offer_to_tiers(SchedulerOutput(), time.perf_counter() - started)
        self._observe(SchedulerOutput())
        return [self._output(group_id) for group_id in touched if group_id in self.groups]

    def _drain_pipeline(self) -> set[str]:
        """End pipelining: emit the step in flight; returns the groups that moved."""
        if self.pipeline is None or not self.pipeline.active:
            return set()
        return self._complete_pipelined(self.pipeline.drain(), keep_slots=False)

    def _complete_pipelined(self, results: list[tuple[Request, RowResult]], keep_slots: bool) -> set[str]:
        """A pipelined step's results, for the requests still running: the step computed each
        one's last token (as ``update_after_step`` records), then its verification emits, up to
        what max_tokens leaves (a pipelined draft may run past it: what lies past is not counted
        as accepted)."""
        verified = []
        for request, result in results:
            if request.is_finished:
                continue
            self.scheduler.last_token_computed(request, self._fail_request)
            if request.is_finished:  # caching its blocks failed it
                continue
            samples = [Sample(token, logprob, 0, {}) for token, logprob in zip(result.token_ids, result.logprobs)]
            verified.append(Verified(request, result.num_drafted, samples[:_room(request)]))
        return self._complete_verified(verified, keep_slots)

    def _leaves_tokens_in_flight(self) -> bool:
        """Whether an asynchronous step may leave its tokens on the device: always without
        speculative decoding; with it only where the next step cannot draft (more requests run
        than drafting allows, or none of them drafts). A request whose last token is still on
        the device cannot draft, so where the next step may, this step's tokens are read now."""
        running = self.scheduler.running
        return (self.drafter is None or len(running) > self.drafter.config.disable_by_batch_size
                or not any(request.params.speculative_decoding for request in running))

    def _offer_to_tiers(self, step: SchedulerOutput, seconds: float) -> None:
        """Hand the blocks this step completed to the KV tiers (write-through: a restarted or a
        second engine finds them), and time the step for the tiers' cost model. With nothing
        to run while loads are in flight, wait a little for one to land instead of spinning."""
        if self.tiers is None:
            return
        self.tiers.cost.observe_prefill(step.num_tokens, seconds)
        if step.tier_loads:  # bytes only: the copy runs on the device, untimed here
            self.tiers.stats.moved("host_to_device", sum(kv.numel() * kv.element_size() for _, kv in step.tier_loads), 0.0)
        self.tiers.release_reads(queued_work_done(self.device))
        blocks = self.kv.pool.take_newly_cached()
        if blocks:
            kv, ready = self.runner.gather_for_tiers([block_id for block_id, _, _ in blocks])
            self.tiers.write([(block_hash, token_ids, self.kv.computed_after(block_hash))
                              for _, block_hash, token_ids in blocks], kv, ready)
        if not step.scheduled and self.kv.tier_loads.num_loading:
            self.kv.tier_loads.wait_for_any(timeout=0.05)

    def _probe(self, group_id: str) -> list[RequestOutput]:
        """One synchronous step of a group on probation, alone; it then rejoins the others."""
        group = self.groups.get(group_id)
        if group is None:  # aborted meanwhile
            self.probation.release_head()
            return []
        outputs = self._run_step(lambda: self.scheduler.schedule_only(group.sequences), asynchronous=False)
        self.probation.release_head()
        return outputs

    def _recover(self, error: Exception, probing: str | None) -> list[RequestOutput]:
        """After a failed step: fail the group it traces to, or put its suspects on probation."""
        if is_device_failure(error):
            raise EngineDeadError(f"the device failed during a step: {error!r}") from error
        self.probation.record(failed=True)
        self._inflight = None  # its tokens belong to suspects, which start over
        if self.pipeline is not None:
            self.pipeline.reset()
        suspects = [g for g in self._suspects if g in self.groups] or list(self.groups)
        if probing is not None:
            self.probation.release_head()
            suspects = [probing] if probing in self.groups else []
        if len(suspects) == 1:
            logger.error("an engine step failed; it traces to request %s alone, which is aborted",
                         suspects[0], exc_info=error)
            self._fail_group(suspects[0], error)
        else:
            logger.warning("an engine step with %d requests failed (%r); each runs one step alone "
                           "to find the cause", len(suspects), error)
            for group_id in suspects:
                for seq in self.groups[group_id].sequences:
                    if not seq.is_finished:
                        self.scheduler.recompute(seq)
            self.probation.add(suspects)
        self._observe_pool()
        return []

    def _fail_request(self, request: Request, error: Exception) -> None:
        """An error in one request's own work in a step fails its group alone."""
        logger.error("request %s failed in a step and is aborted", request.group_id, exc_info=error)
        self._fail_group(request.group_id, error)

    def _fail_group(self, group_id: str, error: Exception) -> None:
        """Abort every sequence of the group; its final output carries the error."""
        output = self.abort_request(group_id)
        if output is None:
            return
        output.error = f"the request failed in an engine step and was aborted: {error!r}"
        self._failed_outputs.append(output)

    def _sampling_plan(self, step: SchedulerOutput) -> tuple[list[SamplingRow], list[VerifyRow]]:
        """A row for every sequence that samples this step: each request of ``step.completing``
        (its logits rows follow those of the requests before it), then its n > 1 siblings,
        forked now that its prompt is computed, on the same row; and the requests whose draft
        is verified (speculative decoding: never one that forks, as it decodes). A request that
        finished meanwhile (asynchronous scheduling: its previous token stopped it) leaves its
        row unsampled."""
        plan, verifying, next_row = [], [], 0
        for item in step.completing:
            request, row = item.request, next_row
            next_row += 1 + len(item.draft)
            if request.is_finished:
                continue
            if item.draft:
                verifying.append(VerifyRow(request, row, item.draft))
                continue
            plan.append(SamplingRow(request, row))
            n = request.params.n
            siblings = [self._fork(request, index) for index in range(n - request.pending_forks, n)]
            request.pending_forks = 0
            plan.extend(SamplingRow(sibling, row) for sibling in siblings)
        return plan, verifying

    def _fork(self, parent: Request, index: int) -> Request:
        """Completion ``index`` of an n > 1 request: shares the parent's blocks (copy-on-write)."""
        child = parent.fork(f"{parent.group_id}#{index}", index, self._generator(parent.params, index))
        self.scheduler.add_fork(parent, child)
        group = self.groups[parent.group_id]
        group.sequences.append(child)
        group.texts[child.request_id] = new_sequence_text(self.tokenizer, child)
        return child

    def _complete(self, inflight: InflightTokens) -> set[str]:
        """Wait for a step's sampled tokens and update their sequences (skipping those that
        ended meanwhile: aborted); returns the groups that moved. An error in one sequence's
        update fails its group alone."""
        moved = set()
        for seq, sample in zip(inflight.requests, inflight.read()):
            if seq.is_finished:
                continue
            try:
                self._after_token(seq, sample)
            except Exception as error:
                self._fail_request(seq, error)
            moved.add(seq.group_id)
        return moved

    def _complete_verified(self, results: list[Verified], keep_slots: bool = False) -> set[str]:
        """Emit each verified request's tokens in order until one ends it (a stop, EOS or
        max_tokens inside the accepted run drops the rest); a request that goes on keeps its
        accepted tokens' KV (Scheduler.accept_drafts; ``keep_slots``: a pipelined step still
        writes past them). Returns the groups that moved."""
        moved = set()
        for result in results:
            seq = result.request
            self.drafter.record(seq, result.num_drafted, result.num_accepted)
            try:
                for sample in result.samples:
                    self._after_token(seq, sample)
                    if seq.is_finished:
                        break
                else:
                    self.scheduler.accept_drafts(seq, result.num_accepted, keep_slots)
            except Exception as error:
                self._fail_request(seq, error)
            moved.add(seq.group_id)
        return moved

    def _after_token(self, seq: Request, sample: Sample) -> None:
        seq.append_token(sample.token_id)
        record_logprobs(seq, sample, self._token_text(seq))
        self._observe_latency(seq)
        group = self.groups[seq.group_id]
        stopped_by_token = self.stop_policy.check_token(seq)
        status = stopped_by_token or _advance_grammar(seq)
        hidden = stopped_by_token is RequestStatus.FINISHED_STOPPED and not seq.params.include_stop_str_in_output
        status = update_text(group.texts[seq.request_id], seq, finishing=status is not None,
                             newest_hidden=hidden) or status
        if status is not None:
            self.scheduler.finish(seq, status)
            self.metrics.request_finished(status.value, seq.metrics, seq.num_output_tokens)

    def _token_text(self, seq: Request) -> Callable[[int], str] | None:
        """How logprobs name a token's text (None: no tokenizer, or detokenize=False)."""
        return self._decode_token if seq.params.detokenize else None

    def _observe_latency(self, seq: Request) -> None:
        previous = seq.metrics.last_token_time
        ttft = mark_first_token(seq)
        seq.metrics.last_token_time = time.monotonic()
        self.metrics.observe_token(ttft, None if previous is None else seq.metrics.last_token_time - previous)

    def _output(self, group_id: str) -> RequestOutput:
        group = self.groups[group_id]
        output = group.to_output()
        if output.finished:
            del self.groups[group_id]
        return output

    def _observe(self, step: SchedulerOutput) -> None:
        self._observe_pool()
        self.metrics.preemptions.inc(len(step.preempted))
        self.metrics.observe_cache(self._cache_totals())
        if self.drafter is not None:
            self.metrics.observe_spec_decode(self.drafter.stats)
        if self.tiers is not None:
            self.metrics.observe_tiers(self.tiers.snapshot())
        if self.stats_log is not None:
            self.stats_log.maybe_log(self.stats())

    def _observe_pool(self) -> None:
        """Gauges of the pool and queues (after every step and every abort)."""
        scheduler = self.scheduler
        self.metrics.observe_queues(self.kv.pool.usage(), len(scheduler.running), len(scheduler.waiting),
                                    len(scheduler.swapped))

    def _cache_totals(self) -> dict[str, int]:
        """Prompt tokens by how their KV came to be (metrics.CACHE_COUNTERS), so far."""
        prefix = self.kv.prefix_stats
        chunk_hits, recomputed = (0, 0) if self.kv.chunks is None else \
            (self.kv.chunks.stats.hits, self.kv.chunks.stats.recomputed)
        return {"prefix_cache_queries": prefix.queries, "prefix_cache_hits": prefix.hits,
                "chunk_cache_hits": chunk_hits, "chunk_tokens_recomputed": recomputed,
                "prompt_tokens_computed": prefix.queries - prefix.hits - chunk_hits}

    def stats(self) -> dict:
        """The engine's counters (cache figures in prompt tokens, on first scheduling:
        prompt_tokens_total = prefix_cache_hits + chunk_cache_hits + prompt_tokens_computed)."""
        totals = self._cache_totals()
        pool = self.kv.pool
        return {
            **totals,
            "prompt_tokens_total": totals["prefix_cache_queries"],
            "prefix_cache_hit_rate": self.kv.prefix_stats.hit_rate,
            "kv_cache_usage_perc": pool.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
            "num_gpu_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free,
            "num_cached_blocks": pool.num_cached(),
            "num_evicted_blocks": pool.num_evictions,
            "block_size": self.args.block_size,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "num_requests_swapped": len(self.scheduler.swapped),
            **({} if self.kv.chunks is None else {"blended_prefix_hits": self.kv.chunks.stats.blended_hits}),
            **({} if self.tiers is None else {"kv_tiers": self.tiers.snapshot()}),
            **({} if self.drafter is None else _spec_decode_stats(self.drafter.stats)),
            "max_model_len": self.max_model_len,
            "prompt_tokens": self.metrics.num_prompt_tokens,
            "generation_tokens": self.metrics.num_generation_tokens,
            "device": str(self.device),
        }


def _room(request: Request) -> int | None:
    """The output tokens the request may still emit (None: no max_tokens)."""
    max_tokens = request.params.max_tokens
    return None if max_tokens is None else max(max_tokens - request.num_output_tokens, 1)


def _advance_grammar(seq: Request) -> RequestStatus | None:
    """Feed the newest token to the sequence's grammar; a complete grammar stops it (even
    with ignore_eos). A token the grammar refuses (only possible when the request's own
    bans or allowed_token_ids left no allowed token) fails the request alone."""
    if seq.grammar is None:
        return None
    token = seq.token_ids[-1]
    if not seq.grammar.accept_token(token):
        raise ValueError(f"token {token} does not fit the request's structured output: its other sampling "
                         "constraints (allowed_token_ids, logit_bias, bad_words) left no token the grammar allows")
    return RequestStatus.FINISHED_STOPPED if seq.grammar.is_terminated() else None


def _spec_decode_stats(counts: SpecDecodeCounts) -> dict:
    """stats()'s speculative decoding figures, with vLLM's metric names."""
    return {"spec_decode_num_drafts": counts.num_drafts, "spec_decode_num_draft_tokens": counts.num_draft_tokens,
            "spec_decode_num_accepted_tokens": counts.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(counts.num_accepted_tokens_per_pos),
            "spec_decode_mean_acceptance_length": counts.mean_acceptance_length}


def _decode_one(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)
