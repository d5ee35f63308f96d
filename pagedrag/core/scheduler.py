"""Continuous batching: which requests run this step, and with how many tokens.

Each step the scheduler
1. gives every running request its next tokens (one for a decode, a chunk for a
   prefill in progress), oldest first, within the token budget; when the pool
   is short it preempts the newest running request (recompute: free its blocks,
   keeping their hashes; swap: move them to CPU memory);
2. if nothing was preempted, brings swapped requests back, then admits waiting
   requests in arrival order (FCFS: a request that does not fit blocks those
   behind it, so none starves) while seats (max_num_seqs) and budget remain.
A prompt longer than the remaining budget is split over steps (chunked prefill).
A request whose in-flight sampled token (asynchronous scheduling) is certainly its
last gets no tokens: it ends once that token is read (``_ends_with_inflight_token``).
With speculative decoding (a ``drafter``) a decode also carries the tokens drafted after
its last one, when their slots fit without preempting anyone (``_reserve``) and that last
one is known (not still on the device).
After the model ran the step, ``update_after_step`` records what it computed, and
``accept_drafts`` what the verifier kept of each draft.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedrag.core.chunk_cache import ChunkPlan, KVMove, Recompute
from pagedrag.core.kv_cache_manager import KVCacheManager, SwapPlan
from pagedrag.core.block_pool import KVBlock
from pagedrag.core.request import Request, RequestStatus
from pagedrag.spec_decode.drafter import Drafter


@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: ``num_new_tokens`` tokens, whose KV goes into
    ``block_ids`` (its block table, final once the request is scheduled: later allocations
    this step touch other tables only).

    ``runs`` are the position ranges the model computes, in order: one range from
    ``num_computed_tokens`` on, or, when cached chunks are reused (core.chunk_cache), the
    ranges around them, to which the model runner adds the ``recompute`` tokens it picks
    in them. ``imports`` bring those chunks into the table before the forward pass;
    ``exports`` save the chunks this step completes after it.

    ``draft`` (speculative decoding) are tokens proposed after the request's known ones, fed
    after them; their slots are part of ``num_new_tokens`` and their KV is only kept once the
    verifier accepts them (``Scheduler.accept_drafts``). A drafted decode is one run, computed
    as a short causal prefill over the cached context (on a 2-core CPU with 700 cached tokens
    this beat one decode-attention run per token, which gathers the context once per token).

    ``completes_sequence`` is fixed when the request is scheduled: True when, after the
    step, every token of the request (and of its draft) has KV, so it gets logits rows (one,
    plus one per drafted token) and samples.
    """

    request: Request
    num_new_tokens: int
    block_ids: list[int]
    runs: list[tuple[int, int]] = field(default_factory=list)
    imports: list[KVMove] = field(default_factory=list)
    recompute: list[Recompute] = field(default_factory=list)
    exports: list[KVMove] = field(default_factory=list)
    draft: list[int] = field(default_factory=list)
    completes_sequence: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.runs:
            begin = self.request.num_computed_tokens
            self.runs = [(begin, begin + self.num_new_tokens)]
        self.completes_sequence = self.end == self.request.num_tokens + len(self.draft)

    @property
    def end(self) -> int:
        """The request's computed tokens after the step."""
        return self.runs[-1][1]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: the scheduled requests, in the order the model runner packs them;
    the block copies (copy-on-write), swaps and KV-tier loads (block id, K/V on the host;
    core.tier_loads) to apply before the forward pass; the requests preempted to make room."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swaps: SwapPlan = field(default_factory=SwapPlan)
    tier_loads: list = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def completing(self) -> list[ScheduledRequest]:
        """The requests that sample this step, in the order of their rows in the step's logits
        (1 + len(draft) rows each)."""
        return [item for item in self.scheduled if item.completes_sequence]


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 max_model_len: int | None = None, drafter: Drafter | None = None):
        self.kv = kv
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.swapped: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_fork(self, parent: Request, child: Request) -> None:
        """``child`` (from ``parent.fork``) shares every block of the parent, copy-on-write,
        and joins the running set at its end."""
        self.kv.fork(parent, child)
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request wherever it is and release its blocks at once. A request that ends
        normally first caches the full blocks its last tokens completed: after an asynchronous
        step their ids were read only now, after the step's own caching."""
        request.status = status
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        if status is not RequestStatus.FINISHED_ABORTED:
            self.kv.cache_blocks(request)
        self.kv.free(request)
        if self.drafter is not None:
            self.drafter.finish(request)
        request.metrics.finished_time = time.monotonic()

    # ---- one step -----------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.kv.tier_loads is not None:  # first: this step's admissions may hit what landed
            self.kv.tier_loads.land_finished()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
            self._schedule_waiting(out, budget)
        out.block_copies, out.swaps = self.kv.take_step_transfers()
        if self.kv.tier_loads is not None:
            out.tier_loads = self.kv.tier_loads.take_loads()
        return out

    def update_after_step(self, step: SchedulerOutput, on_error: Callable[[Request, Exception], None]) -> None:
        """After the model ran ``step``: each scheduled request has KV for its new tokens, and
        its newly full blocks go to the prefix cache. An error in one request's caching is
        passed to ``on_error(request, error)`` at once (which fails that request alone); the
        others are updated all the same. Drafted tokens do not count as computed until the
        verifier accepts them (``accept_drafts``)."""
        for item in step.scheduled:
            self._computed(item.request, item.end - len(item.draft), on_error)

    def last_token_computed(self, request: Request, on_error: Callable[[Request, Exception], None]) -> None:
        """After a pipelined step (engine.pipelined_drafting): the request's last known token has
        KV, as ``update_after_step`` records for a scheduled decode."""
        self._computed(request, request.num_tokens, on_error)

    def _computed(self, request: Request, num_computed: int, on_error: Callable[[Request, Exception], None]) -> None:
        request.num_computed_tokens = num_computed
        try:
            self.kv.cache_blocks(request)
            if self.kv.chunks is not None:
                self.kv.chunks.finish_step(request)
        except Exception as error:
            on_error(request, error)

    def accept_drafts(self, request: Request, num_accepted: int, keep_slots: bool = False) -> None:
        """After verification, the request's tokens (the accepted drafted ones and the one
        sampled after them) are appended: the accepted ones' KV is kept and cached, and the
        blocks that only held rejected ones are freed (their slots are written again later),
        unless ``keep_slots`` (a pipelined step in flight writes there: engine.pipelined_drafting)."""
        request.num_computed_tokens += num_accepted
        if not keep_slots:
            self.kv.release_unused(request)
        self.kv.cache_blocks(request)

    def _scheduled(self, request: Request, num_new_tokens: int, plan: ChunkPlan | None = None,
                   imports: list[KVMove] | None = None, draft: list[int] | None = None) -> ScheduledRequest:
        """The step's share of a request whose slots are allocated (its table is final), with
        the exports of the reusable chunks it completes."""
        item = ScheduledRequest(request, num_new_tokens, self.kv.block_ids(request), plan.runs if plan else [],
                                imports or [], plan.recompute if plan else [], draft=draft or [])
        if self.kv.chunks is not None and request.segments and request.num_computed_tokens < request.num_prompt_tokens:
            item.exports = self.kv.chunks.plan_exports(request, request.num_computed_tokens, item.end,
                                                       self.kv.tables[request.request_id])
        return item

    def _chunk(self, request: Request, budget: int, num_computed: int | None = None) -> int:
        """How many of the request's uncomputed tokens fit the budget (0: none)."""
        if num_computed is None:
            num_computed = request.num_computed_tokens
        wanted = request.num_tokens - num_computed
        if wanted <= budget:
            return wanted
        return budget if self.enable_chunked_prefill else 0

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index, batch_size = 0, len(self.running)
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = 0 if self._ends_with_inflight_token(request) else self._chunk(request, budget)
            if num_new == 0:
                index += 1
                continue
            draft = self._reserve(request, num_new, self._draft(request, num_new, budget, batch_size), out)
            if draft is not None:
                out.scheduled.append(self._scheduled(request, num_new + len(draft), draft=draft))
                budget -= num_new + len(draft)
                index += 1
        return budget

    def _draft(self, request: Request, num_new: int, budget: int, batch_size: int) -> list[int]:
        """The drafter's tokens for a decode (one new token, known), within what the request's
        max_tokens and max_model_len and the step's budget leave room for after it. A request
        with siblings still to fork (n > 1, its first token not sampled yet: a prompt whose last
        chunk is one token) does not draft: they fork off the row of that token (LLMEngine)."""
        if self.drafter is None or num_new != 1 or request.num_inflight_tokens or request.pending_forks:
            return []  # a token still on the device (asynchronous step): the drafter cannot see it
        room = budget - 1
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - request.num_output_tokens - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - request.num_tokens - 1)
        return self.drafter.draft(request, room, batch_size)

    def _reserve(self, request: Request, num_new: int, draft: list[int], out: SchedulerOutput) -> list[int] | None:
        """Allocate the request's slots, preempting the newest running requests while the pool
        is short. A draft's slots are kept only if a free block remains for every running
        request's next token, so that drafting never preempts anyone. Returns the draft kept
        ([] when none), None when the request itself was preempted."""
        if draft and self.kv.allocate_slots(request, num_new + len(draft)):
            if self.kv.pool.num_free >= len(self.running):
                return draft
            self.kv.release_unused(request)  # back to the slots of its known tokens
        while not self.kv.allocate_slots(request, num_new):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is request:
                return None
        return []

    def _ends_with_inflight_token(self, request: Request) -> bool:
        """True when the token still on the device (asynchronous scheduling) is certainly the
        request's last (max_tokens or max_model_len reached): it ends once that token is read,
        so computing past it would only be thrown away."""
        if not request.num_inflight_tokens:
            return False
        max_tokens = request.params.max_tokens
        return ((max_tokens is not None and request.num_tokens - request.num_prompt_tokens >= max_tokens)
                or (self.max_model_len is not None and request.num_tokens >= self.max_model_len))

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.num_preemptions += 1
        out.preempted.append(request)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(request):
            self.kv.swap_out(request)
            request.status = RequestStatus.SWAPPED
            self.swapped.appendleft(request)
            return
        self._requeue(request)

    def recompute(self, request: Request) -> None:
        """Start a request over from its known tokens (after a failed step), at the head of
        the waiting queue; its blocks are freed (their hashes stay findable) and a token
        still on the device is forgotten."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
        request.num_inflight_tokens = 0
        self._requeue(request)

    def _requeue(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def schedule_only(self, requests: list[Request]) -> SchedulerOutput:
        """A step for these requests alone (a probe after a failed step): the others keep
        their places and their blocks, and get no tokens this step."""
        chosen = set(requests)
        others = [[r for r in queue if r not in chosen] for queue in (self.running, self.waiting, self.swapped)]
        self.running = [r for r in self.running if r in chosen]
        self.waiting = deque(r for r in self.waiting if r in chosen)
        self.swapped = deque(r for r in self.swapped if r in chosen)
        try:
            return self.schedule()
        finally:
            self.running = others[0] + self.running
            self.waiting = deque([*self.waiting, *others[1]])
            self.swapped = deque([*self.swapped, *others[2]])

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            num_new = self._chunk(request, budget)
            if num_new == 0 or not self.kv.can_swap_in(request):
                break
            self.kv.swap_in(request)
            if not self.kv.allocate_slots(request, num_new):
                # Back out: the request starts over (its blocks are now on the device).
                self.swapped.popleft()
                self._requeue(request)
                break
            self.swapped.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in arrival order. One whose next uncached block another
        request is computing now waits a step (keeping its place) and then hits that block;
        the requests behind it go on."""
        if not self.waiting:
            return
        pending = self.kv.blocks_in_progress(self.running)
        deferred = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hits = self.kv.computed_blocks(request)
            tiers = self.kv.tier_loads
            if tiers is not None:
                if tiers.defers(request, hits):
                    deferred.append(self.waiting.popleft())
                    continue
                hits = self.kv.computed_blocks(request)  # with what landed from host memory just now
            if self.kv.waits_for(request, len(hits), pending):
                deferred.append(self.waiting.popleft())
                continue
            num_scheduled = self._admit(request, hits, budget, out)
            if num_scheduled == 0:
                break
            pending |= self.kv.blocks_in_progress([request])
            budget -= num_scheduled
        self.waiting.extendleft(reversed(deferred))

    def _admit(self, request: Request, hits: list[KVBlock], budget: int, out: SchedulerOutput) -> int:
        """Schedule a waiting request's first tokens after its prefix hit (and, with chunk
        reuse, around its cached chunks); returns the tokens scheduled, 0 when it does not fit.
        A chunk-reuse plan may keep less than the whole prefix hit (ChunkCache.plan): only the
        hits it keeps are taken and counted (num_cached_tokens, the prefix-cache stats)."""
        first_time = request.num_cached_tokens < 0
        plan = self._chunk_plan(request, len(hits) * self.kv.block_size, budget)
        if plan is False:
            return 0
        if plan:
            hits = hits[:plan.num_prefix_tokens // self.kv.block_size]
        num_hit_tokens = len(hits) * self.kv.block_size
        num_new = request.num_tokens - num_hit_tokens if plan else self._chunk(request, budget, num_hit_tokens)
        if plan:
            self.kv.chunks.hold_sources(request, plan)
        if num_new == 0 or not self.kv.allocate_slots(request, num_new, hits):
            if plan:
                self.kv.chunks.release(request)
            return 0
        request.num_computed_tokens = num_hit_tokens
        if self.kv.tier_loads is not None:  # the table holds the loaded blocks now
            if first_time:
                request.num_tier_hit_tokens = self.kv.tier_loads.count_tier_hits(request, hits, plan)
                self.kv.tier_loads.refresh(hits)
            self.kv.tier_loads.release(request)
        request.exact_prefix_len, request.imported_segments, request.copied_blocks = None, set(), set()
        imports = self.kv.chunks.admit(request, plan, self.kv.tables[request.request_id], first_time) if plan else []
        self.kv.keys.admit(request, hits, plan, first_time)
        if first_time:
            request.num_cached_tokens = num_hit_tokens
            self.kv.record_prefix_query(request, num_hit_tokens)
            request.metrics.first_scheduled_time = time.monotonic()
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        item = self._scheduled(request, plan.num_tokens if plan else num_new, plan, imports)
        out.scheduled.append(item)
        return item.num_new_tokens

    def _chunk_plan(self, request: Request, num_hit_tokens: int, budget: int) -> ChunkPlan | None | bool:
        """The request's chunk-reuse plan (None: computed as usual). A plan runs in one step:
        False when it does not fit this step's budget but fits an empty step's (it waits)."""
        if self.kv.chunks is None or not request.segments or request.params.prompt_logprobs is not None:
            return None
        plan = self.kv.chunks.plan(request, num_hit_tokens)
        if plan is None or plan.num_tokens <= budget:
            return plan
        return False if plan.num_tokens <= self.max_num_batched_tokens else None
