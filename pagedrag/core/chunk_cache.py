"""Chunk reuse (opt-in, ``enable_chunk_reuse``): a retrieved chunk's KV, cached independent of
where the chunk lands, reused at any position of a later prompt.

A prompt carries its segments (``PromptSegment``): the first is the head (e.g. the system
prompt, served by the exact prefix cache), each later one a reusable chunk unless marked
otherwise. A chunk's KV is kept in pool blocks of its own, laid out as if the chunk began at
position 0 (keys rotated back by its start), under ``chunk_block_hashes`` of (model, cache
salt, head tokens, chunk tokens). Those blocks live in the prefix cache's pool and LRU: free
(ref count 0) but findable until the pool hands them out again.

- Import: a chunk found in the cache is copied into the request's own blocks at its new
  position, keys rotated forward (RoPE is a rotation: K(p + d) = R(d) K(p)), and
  ``recompute_count(length)`` of its tokens are computed again with the full context, which
  restores attention across the chunk boundary. Below a fraction of 1, a chunk that follows
  the same segment it was computed after (``_computed_after``) is imported whole: its KV
  already attends to that neighbour. That relation travels with the chunk's first block
  through the KV tiers, so a restarted engine knows it too. Which ones the model runner decides
  (``Recompute``; worker.recompute_selection): the tokens whose KV deviates most at an early
  layer (as CacheBlend does), or the chunk's first ones (as EPIC does). Below a fraction of
  1, the last ``question_window`` imported tokens before the question are recomputed too,
  whichever chunks they belong to (the question attends most to what is just before it).
  The chunks' other tokens keep the KV of the prompt they were first computed in: an
  approximation, measured in benchmarks/RESULTS.md.
- Export: when a request computes a reusable chunk in full (not imported), its KV is copied,
  after that step's forward pass, into fresh blocks (keys rotated back to position 0), which
  are then registered under the chunk's hashes.

Invariants:
- A request's KV is exact below ``Request.exact_prefix_len`` (its first imported position);
  only blocks below it go to the exact prefix cache, so prefix hits never serve approximate KV.
- The source blocks of an import and the destination blocks of an export are held (ref
  count > 0) from scheduling until the step ran (``finish_step``) or the request is freed
  (``release``), so the pool cannot hand them out in between.
- A segment holding the prompt's last token is never imported: it must produce logits.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedrag.core.block_hash import BlockHash, chunk_block_hashes, chunk_key, head_digest
from pagedrag.core.block_pool import BlockPool, KVBlock, blocks_for
from pagedrag.core.request import PromptSegment, Request

@dataclass(frozen=True, slots=True)
class KVMove:
    """Copy the K/V at ``src_slots`` to ``dst_slots`` (flat slots: block id * block_size +
    offset), rotating the keys by ``delta`` positions."""

    src_slots: list[int]
    dst_slots: list[int]
    delta: int


@dataclass(frozen=True, slots=True)
class Recompute:
    """Tokens of the imported chunk at positions [start, end) to compute again: ``count`` picked
    by the strategy (worker.recompute_selection) among its first end - start - ``tail``, and its
    last ``tail`` (the question window, ChunkCache._with_question_window). count + tail <= end - start."""

    start: int
    end: int
    count: int
    tail: int = 0


@dataclass(slots=True)
class ChunkPlan:
    """How a request's prompt is computed with chunk reuse on its admission: its first
    ``num_prefix_tokens`` tokens are prefix hits (a block multiple, at most the request's whole
    prefix hit: ChunkCache.plan may cut it back); the KV of ``imported`` segments (with their
    cached blocks, held) comes from the chunk cache; the model computes the fresh ``runs``
    (half-open position ranges, in order, the first from ``num_prefix_tokens`` on unless a chunk
    starts there; the last one ends the prompt) and ``recompute`` tokens of the imported chunks."""

    runs: list[tuple[int, int]]
    recompute: list[Recompute]
    imported: list[tuple[int, list[KVBlock]]]  # (segment index, its cached blocks)
    num_imported: int  # tokens whose KV is copied and kept
    num_prefix_tokens: int

    @property
    def num_recomputed(self) -> int:
        return sum(item.count + item.tail for item in self.recompute)

    @property
    def num_tokens(self) -> int:
        return sum(end - begin for begin, end in self.runs) + self.num_recomputed


@dataclass
class ChunkCacheStats:
    """Prompt tokens served by chunk hits and recomputed, on each request's first scheduling."""

    hits: int = 0
    recomputed: int = 0
    blended_hits: int = 0  # prefix hits on blocks chunk reuse made (core.prefix_keys), counted in the prefix's too


@dataclass
class _Export:
    segment: int
    blocks: list[KVBlock]
    hashes: list[BlockHash]
    token_ids: list[int]
    predecessor: BlockHash  # the key of the segment the chunk was computed after (_predecessor)


@dataclass
class _Held:
    """Blocks a request holds for one step: import sources and export destinations."""

    sources: list[KVBlock] = field(default_factory=list)
    exports: list[_Export] = field(default_factory=list)


class ChunkCache:
    def __init__(self, pool: BlockPool, block_size: int, recompute_fraction: float, model_id: str,
                 question_window: int = 0, recompute_strategy: str = "first"):
        self.pool = pool
        self.block_size = block_size
        self.recompute_fraction = recompute_fraction
        self.model_id = model_id
        self.recompute_strategy = recompute_strategy  # which of a chunk's tokens: "first" or "deviation"
        self.min_chunk_tokens = block_size  # shorter chunks are cheaper to compute than to track
        # imported tokens just before the question recomputed on top of each chunk's share
        # (EngineArgs.chunk_recompute_window); at a fraction of 1 every token is recomputed anyway
        self.question_window = question_window if recompute_fraction < 1 else 0
        # what shapes the approximation, in every blended block key (core.prefix_keys)
        self.settings = f"{recompute_fraction!r}/{self.question_window}/{recompute_strategy}".encode()
        self.stats = ChunkCacheStats()
        self._held: dict[str, _Held] = {}
        # chunk key (first block hash) -> the key of the segment it was computed after; at most
        # as many entries as the pool has blocks (no more chunks than that can be cached)
        self._computed_after: OrderedDict[BlockHash, BlockHash] = OrderedDict()

    def recompute_count(self, length: int) -> int:
        """Tokens recomputed at the start of an imported chunk of ``length`` tokens."""
        return min(length, math.ceil(self.recompute_fraction * length))

    # ---- lookup -----------------------------------------------------------------------
    def _hashes(self, request: Request, index: int) -> list[BlockHash]:
        if index not in request.chunk_hashes:
            if request.head_hash is None:
                head = request.segments[0]
                request.head_hash = head_digest(request.token_ids[head.start:head.end])
            chunk = request.segments[index]
            key = chunk_key(self.model_id, request.cache_salt, request.head_hash,
                            request.token_ids[chunk.start:chunk.end])
            request.chunk_hashes[index] = chunk_block_hashes(
                key, request.token_ids[chunk.start:chunk.end], self.block_size)
        return request.chunk_hashes[index]

    def _predecessor(self, request: Request, index: int) -> BlockHash:
        """What identifies the segment before segment ``index`` (the head, for the first chunk):
        its own chunk key, kept on the request like every chunk's hashes."""
        return self._hashes(request, index - 1)[0]

    def _recompute_count_of(self, request: Request, index: int) -> int:
        """Tokens of imported segment ``index`` to compute again: ``recompute_count`` of its
        length, or none below a fraction of 1 when it follows the segment it was computed after."""
        segment = request.segments[index]
        if self.recompute_fraction < 1 and \
                self._computed_after.get(self._hashes(request, index)[0]) == self._predecessor(request, index):
            return 0
        return self.recompute_count(segment.end - segment.start)

    def exportable(self, request: Request, index: int) -> bool:
        """Whether segment ``index`` is a chunk whose KV is saved once computed: marked reusable,
        after the head, at least ``min_chunk_tokens`` long. The prompt's last segment counts: a
        warm-up's prompt (system prompt, chunk) ends with its chunk."""
        segment = request.segments[index]
        return index > 0 and segment.reusable and segment.end - segment.start >= self.min_chunk_tokens

    def reusable(self, request: Request, index: int) -> bool:
        """Whether segment ``index`` may be imported: exportable, and not holding the prompt's
        last token (that one must produce logits)."""
        return self.exportable(request, index) and request.segments[index].end < request.num_prompt_tokens

    def blocks_of(self, request: Request, index: int):
        """(block hash, token ids) of each block of segment ``index``'s chunk, the last maybe partial."""
        segment = request.segments[index]
        for number, block_hash in enumerate(self._hashes(request, index)):
            start = segment.start + number * self.block_size
            yield block_hash, tuple(request.token_ids[start:min(start + self.block_size, segment.end)])

    def lookup(self, request: Request, index: int) -> list[KVBlock] | None:
        """The cached blocks of segment ``index``, or None unless all of them are cached."""
        blocks = []
        for block_hash, token_ids in self.blocks_of(request, index):
            block = self.pool.lookup(block_hash, token_ids)
            if block is None:
                return None
            blocks.append(block)
        return blocks

    # ---- in-step sharing -------------------------------------------------------------------
    def in_progress(self, requests: list[Request]) -> set[BlockHash]:
        """The keys (first block hashes) of the reusable chunks these requests compute and
        have not finished computing; chunks they import are not computed."""
        return {self._hashes(request, index)[0]
                for request in requests for index, segment in enumerate(request.segments)
                if segment.end > request.num_computed_tokens and index not in request.imported_segments
                and self.exportable(request, index)}

    def waits_for(self, request: Request, num_prefix_tokens: int, pending: set[BlockHash]) -> bool:
        """Whether a chunk of the request past its first ``num_prefix_tokens`` tokens is not
        cached but in ``pending`` (another request computes it now)."""
        return any(segment.start >= num_prefix_tokens and self.reusable(request, index)
                   and self._hashes(request, index)[0] in pending and self.lookup(request, index) is None
                   for index, segment in enumerate(request.segments))

    # ---- import -------------------------------------------------------------------------
    def plan(self, request: Request, num_prefix_tokens: int) -> ChunkPlan | None:
        """The plan for a request whose first ``num_prefix_tokens`` tokens (a block multiple) are
        prefix hits, or None when no chunk of it is imported (it is then computed as usual, after
        its whole prefix hit). Changes nothing.

        Chunks may all begin with the same tokens (a "<document source=" tag), so the block
        holding the end of the head and the start of a chunk can be a prefix hit, which then
        ends inside that chunk. Left there, the chunk is computed again; instead the prefix hit
        is cut back to the last block boundary at or before the chunk's start when that imports
        more of the chunk's tokens than it gives up prefix-hit tokens, i.e. when the model
        computes fewer tokens (``_cut_back``). ``ChunkPlan.num_prefix_tokens`` is the prefix hit
        kept: the scheduler takes and counts only that many tokens as prefix hits."""
        plan = self._plan_after(request, num_prefix_tokens)
        cut = self._cut_back(request, num_prefix_tokens)
        if cut is None:
            return plan
        alternative = self._plan_after(request, cut)
        computed = plan.num_tokens if plan is not None else request.num_tokens - num_prefix_tokens
        return alternative if alternative is not None and alternative.num_tokens < computed else plan

    def _cut_back(self, request: Request, num_prefix_tokens: int) -> int | None:
        """The last block boundary at or before the start of the reusable segment inside which
        the prefix hit ends; None when it ends at a segment boundary or in a segment that is
        not reusable."""
        for index, segment in enumerate(request.segments):
            if segment.start < num_prefix_tokens < segment.end and self.reusable(request, index):
                return segment.start // self.block_size * self.block_size
        return None

    def _plan_after(self, request: Request, num_prefix_tokens: int) -> ChunkPlan | None:
        """The plan importing every cached reusable segment past the first ``num_prefix_tokens``
        tokens, or None when there is none."""
        runs: list[tuple[int, int]] = []
        recompute, imported = [], []
        position = num_prefix_tokens
        for index, segment in enumerate(request.segments):
            if segment.start < num_prefix_tokens or not self.reusable(request, index):
                continue
            blocks = self.lookup(request, index)
            if blocks is None:
                continue
            _add_run(runs, position, segment.start)
            recompute.append(Recompute(segment.start, segment.end, self._recompute_count_of(request, index)))
            imported.append((index, blocks))
            position = segment.end
        if not imported:
            return None
        _add_run(runs, position, request.num_tokens)
        recompute = [item for item in self._with_question_window(recompute) if item.count or item.tail]
        num_imported = sum(request.segments[index].end - request.segments[index].start
                           for index, _ in imported) - sum(item.count + item.tail for item in recompute)
        return ChunkPlan(runs, recompute, imported, num_imported, num_prefix_tokens)

    def _with_question_window(self, recompute: list[Recompute]) -> list[Recompute]:
        """The imported chunks (in prompt order) with their last tokens, the ``question_window``
        imported tokens nearest the end of the prompt (where the question is), marked for
        recompute: the question attends most to what is just before it. Tokens the strategy
        already recomputes are not counted twice; a chunk imported whole gets its share too."""
        left, marked = self.question_window, []
        for item in reversed(recompute):
            tail = min(left, item.end - item.start - item.count)
            left -= tail
            marked.append(Recompute(item.start, item.end, item.count, tail))
        return marked[::-1]

    def hold_sources(self, request: Request, plan: ChunkPlan) -> None:
        """Take a reference on the plan's cached blocks until the step ran."""
        sources = [block for _, blocks in plan.imported for block in blocks]
        self.pool.touch(sources)
        self._held.setdefault(request.request_id, _Held()).sources.extend(sources)

    def admit(self, request: Request, plan: ChunkPlan, table: list[KVBlock], first_time: bool) -> list[KVMove]:
        """The plan is scheduled over ``table`` (final): mark the request's approximate region
        and return the copies that bring the chunks in."""
        moves = []
        for index, blocks in plan.imported:
            segment = request.segments[index]
            offsets = range(segment.end - segment.start)
            moves.append(KVMove([_slot(blocks, offset, self.block_size) for offset in offsets],
                                [_slot(table, segment.start + offset, self.block_size) for offset in offsets],
                                segment.start))
        request.imported_segments = {index for index, _ in plan.imported}
        request.exact_prefix_len = request.segments[plan.imported[0][0]].start
        if first_time:
            request.num_chunk_hit_tokens, request.num_recomputed_tokens = plan.num_imported, plan.num_recomputed
            self.stats.hits += plan.num_imported
            self.stats.recomputed += plan.num_recomputed
        return moves

    def copied_ranges(self, request: Request, plan: ChunkPlan) -> list[tuple[int, int]]:
        """The positions whose KV the plan copies from imported chunks and keeps: each imported
        segment less the tokens recomputed at its end (the question window) and, with the
        "first" strategy, at its start (the "deviation" strategy's picks are the model runner's:
        all counted as copied)."""
        recompute = {item.start: item for item in plan.recompute}
        ranges = []
        for index, _ in plan.imported:
            segment = request.segments[index]
            item = recompute.get(segment.start, Recompute(segment.start, segment.end, 0))
            begin = segment.start + (item.count if self.recompute_strategy == "first" else 0)
            if begin < segment.end - item.tail:
                ranges.append((begin, segment.end - item.tail))
        return ranges

    # ---- export -------------------------------------------------------------------------
    def plan_exports(self, request: Request, begin: int, end: int, table: list[KVBlock]) -> list[KVMove]:
        """Copies that save the reusable chunks this step completes (computed in [begin, end),
        not imported, not cached yet) into fresh blocks; none when the pool is short."""
        moves = []
        for index, segment in enumerate(request.segments):
            if not (begin < segment.end <= end and self.exportable(request, index)) \
                    or index in request.imported_segments or self.lookup(request, index) is not None:
                continue
            length = segment.end - segment.start
            if blocks_for(length, self.block_size) > self.pool.num_free:
                break
            hashes, predecessor = self._hashes(request, index), self._predecessor(request, index)
            blocks = self.pool.allocate(blocks_for(length, self.block_size))  # nothing below raises
            token_ids = request.token_ids[segment.start:segment.end]
            self._held.setdefault(request.request_id, _Held()).exports.append(
                _Export(index, blocks, hashes, token_ids, predecessor))
            moves.append(KVMove([_slot(table, segment.start + offset, self.block_size) for offset in range(length)],
                                [_slot(blocks, offset, self.block_size) for offset in range(length)],
                                -segment.start))
        return moves

    # ---- after the step -----------------------------------------------------------------
    def finish_step(self, request: Request) -> None:
        """The step ran: register the chunks it exported and let go of every held block."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        for export in held.exports:
            for number, (block, block_hash) in enumerate(zip(export.blocks, export.hashes)):
                self.pool.cache(block, block_hash,
                                export.token_ids[number * self.block_size:(number + 1) * self.block_size])
            self.remember_computed_after(export.hashes[0], export.predecessor)
        self._let_go(held)

    def computed_after(self, key: BlockHash) -> BlockHash | None:
        """The key of the segment the chunk of key ``key`` (its first block hash) was computed
        after, if known: it goes down the KV tiers with the chunk's first block."""
        return self._computed_after.get(key)

    def remember_computed_after(self, key: BlockHash, predecessor: BlockHash) -> None:
        """Chunk ``key`` was computed after ``predecessor`` (here, or by the engine that wrote the
        chunk to a KV tier): behind that segment it is imported whole."""
        self._computed_after[key] = predecessor
        self._computed_after.move_to_end(key)
        while len(self._computed_after) > self.pool.num_blocks:
            self._computed_after.popitem(last=False)

    def release(self, request: Request) -> None:
        """The request is freed (finished, preempted or failed): let go of its held blocks
        without registering exports that may not have run."""
        held = self._held.pop(request.request_id, None)
        if held is not None:
            self._let_go(held)

    def _let_go(self, held: _Held) -> None:
        for export in held.exports:
            self.pool.free(list(reversed(export.blocks)))
        self.pool.free(held.sources)


def merge_runs(runs: list[tuple[int, int]], positions: list[int]) -> list[tuple[int, int]]:
    """``runs`` and single ``positions`` (disjoint from them) as ordered, merged runs."""
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(runs + [(p, p + 1) for p in positions]):
        _add_run(merged, begin, end)
    return merged


def _add_run(runs: list[tuple[int, int]], begin: int, end: int) -> None:
    """Append [begin, end) to runs, merged with the last run when they touch."""
    if begin >= end:
        return
    if runs and runs[-1][1] == begin:
        runs[-1] = (runs[-1][0], end)
    else:
        runs.append((begin, end))


def _slot(blocks: list[KVBlock], position: int, block_size: int) -> int:
    return blocks[position // block_size].block_id * block_size + position % block_size


__all__ = ["ChunkCache", "ChunkCacheStats", "ChunkPlan", "KVMove", "PromptSegment", "Recompute", "merge_runs"]
