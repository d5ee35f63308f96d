"""The scheduler's side of the KV tiers (pagedrag.kv_tiers): which of a waiting request's
blocks to bring up into the pool before it runs, and the request's wait while they load.

A request's prefix lookup walks its chain of block hashes through the pool (prefix hits) and
on into the tiers: the blocks found there, up to the first found nowhere, are loaded into
fresh pool blocks; with chunk reuse, so are its chunks that are in a tier in full. Each block
is loaded only where the cost model (kv_tiers.cost_model) says loading it beats computing it:
one decision (``slower_tiers``) taken once a lookup, for all of its blocks.

Invariants:
- A request whose loads are running keeps its place in the waiting queue and waits; the
  others run. Loads run on the tiers' reader threads, never on the step loop.
- The pool blocks a load fills, and the request's own prefix hits, are held (ref count > 0)
  while the load runs, so nothing evicts them meanwhile. Once it lands they are let go:
  cached, at the young end of the pool's LRU queue, found by the request as prefix hits
  when it is admitted. (Held until admission, loaded blocks of requests that cannot be
  admitted yet could fill the pool and stall it.) A load starts only when the pool has room
  for the whole request beyond its hits, so loads never take the room the request itself needs.
- A loaded block enters the pool's cache (``land_finished``, or at once for host memory) only
  once its data is in hand, and its copy onto the device is in the plan of the step being
  scheduled (``take_loads`` -> ``SchedulerOutput.tier_loads``), which runs it before that
  step's forward pass: any request that hits the block reads the loaded values.
- A prefix chain is loaded up to its first block that fails to load; a chunk comes in full
  or not at all. What did not load is freed and computed as usual.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

import torch

from pagedrag.core.block_hash import BlockHash
from pagedrag.core.block_pool import BlockPool, KVBlock, blocks_for
from pagedrag.core.chunk_cache import ChunkCache, ChunkPlan
from pagedrag.core.prefix_keys import PrefixKeys
from pagedrag.core.request import Request
from pagedrag.kv_tiers.store import TIER_NAMES, tier_hits
from pagedrag.kv_tiers.tiers import CompletedRead, KVTiers

_PREFIX = -1  # the chain a load belongs to: the prompt's prefix, or a chunk's segment index


@dataclass(slots=True)
class _Wanted:
    chain: int
    block_hash: BlockHash
    token_ids: tuple[int, ...]
    tier: str  # where the lookup found it
    blended: bool = False  # a prefix block under a blended key (core.prefix_keys)


@dataclass(slots=True)
class _Load:
    wanted: _Wanted
    block: KVBlock
    future: Future | CompletedRead
    tier: str | None = None  # where it came from, once landed


@dataclass
class _Waiting:
    held: list[KVBlock]  # the request's prefix hits, held while its loads run
    loads: list[_Load] = field(default_factory=list)
    done: bool = False  # landed: nothing held any more


class TierLoads:
    def __init__(self, pool: BlockPool, block_size: int, tiers: KVTiers, chunks: ChunkCache | None,
                 keys: PrefixKeys):
        self.pool = pool
        self.block_size = block_size
        self.tiers = tiers
        self.chunks = chunks
        self.keys = keys
        self._waiting: dict[str, _Waiting] = {}
        self._ready: list[tuple[int, torch.Tensor]] = []
        self._loading: set[BlockHash] = set()  # hashes whose loads have not landed

    # ---- admission --------------------------------------------------------------------------
    def defers(self, request: Request, hits: list[KVBlock]) -> bool:
        """Whether the request waits for loads now: on first sight, start loading what the tiers
        hold of it (True when there is any); afterwards, True until those loads are done."""
        waiting = self._waiting.get(request.request_id)
        if waiting is not None:
            return not waiting.done
        slower = self.tiers.cost.slower_tiers()
        wanted = self._wanted(request, hits, slower)
        if not wanted:
            return False
        if any(item.block_hash in self._loading for item in wanted):
            return True  # another request loads them: they are pool hits once landed
        self.pool.touch(hits)
        if blocks_for(request.num_tokens, self.block_size) - len(hits) > self.pool.num_free:
            self.pool.free(list(reversed(hits)))
            return False
        blocks = self.pool.allocate(len(wanted))
        loads = [_Load(item, block, self.tiers.read(item.block_hash, item.token_ids, slower))
                 for item, block in zip(wanted, blocks)]
        waiting = _Waiting(list(hits), loads)
        self._waiting[request.request_id] = waiting
        if all(load.future.done() for load in loads):  # from host memory: lands in this very step
            self._land(waiting)
            return False
        self._loading.update(item.block_hash for item in wanted)
        return True

    def _wanted(self, request: Request, hits: list[KVBlock], slower: frozenset[str]) -> list[_Wanted]:
        """The blocks to load, from tiers not in ``slower`` (the cost model's decision)."""
        if request.params.prompt_logprobs is not None:
            return []  # prompt logprobs compute every prompt position
        if not request.tier_queried:
            request.tier_queried = True
            self.tiers.stats.query_tokens += request.num_tokens - len(hits) * self.block_size
        wanted = self._prefix_wanted(request, hits, slower, (request.num_tokens - 1) // self.block_size)
        if self.chunks is not None and request.segments:
            wanted += self._chunks_wanted(request, (len(hits) + len(wanted)) * self.block_size, slower)
        return wanted

    def _prefix_wanted(self, request: Request, hits: list[KVBlock], slower: frozenset[str],
                       stop: int) -> list[_Wanted]:
        """The prompt's blocks past its prefix ``hits`` and before block ``stop`` that a tier
        holds, up to the first it does not, under the keys of core.prefix_keys. A load stops
        before the block holding the last prompt token: that token is always computed."""
        def find(index: int, key: BlockHash) -> _Wanted | None:
            tier = self.tiers.locate(key)
            if tier is None or tier in slower:
                return None
            start = index * self.block_size
            return _Wanted(_PREFIX, key, tuple(request.token_ids[start:start + self.block_size]), tier,
                           blended=key != request.block_hashes[index])

        blended = bool(hits) and hits[-1].block_hash != request.block_hashes[len(hits) - 1]
        return self.keys.walk(request, len(hits), stop, blended, find)

    def held_past(self, request: Request, hits: list[KVBlock], stop: int) -> dict[str, int]:
        """Tokens by tier (TIER_NAMES order; tiers holding none left out) of the request's blocks
        past its pool ``hits`` and before block ``stop`` that a lookup now would load: the tiers
        hold them and the cost model takes them. A probe: nothing is read or counted, so a block
        whose file turns out damaged when a request reads it is counted here."""
        wanted = self._prefix_wanted(request, hits, self.tiers.cost.slower_tiers(), stop)
        held = tier_hits(dict.fromkeys(TIER_NAMES, 0), *({item.tier: len(item.token_ids)} for item in wanted))
        return {tier: tokens for tier, tokens in held.items() if tokens}

    def _chunks_wanted(self, request: Request, first_position: int, slower: frozenset[str]) -> list[_Wanted]:
        """The blocks of the request's reusable chunks past ``first_position`` that are not in the
        pool but all of whose blocks a tier holds."""
        wanted = []
        for index, segment in enumerate(request.segments):
            if segment.start < first_position or not self.chunks.reusable(request, index) \
                    or self.chunks.lookup(request, index) is not None:
                continue
            blocks = list(self.chunks.blocks_of(request, index))
            tiers = [self.tiers.locate(block_hash) for block_hash, _ in blocks]
            if all(tier is not None and tier not in slower for tier in tiers):
                wanted += [_Wanted(index, block_hash, token_ids, tier)
                           for (block_hash, token_ids), tier in zip(blocks, tiers)]
        return wanted

    # ---- loads that finished ---------------------------------------------------------------
    def land_finished(self) -> None:
        """Register the blocks of every finished load in the pool's cache (what failed to load is
        freed); their K/V waits in ``take_loads`` for the step being scheduled."""
        for waiting in self._waiting.values():
            if not waiting.done and all(load.future.done() for load in waiting.loads):
                self._land(waiting)

    def take_loads(self) -> list[tuple[int, torch.Tensor]]:
        """(block id, K/V) of every block landed since the last call: the step's tier loads."""
        ready, self._ready = self._ready, []
        return ready

    def _land(self, waiting: _Waiting) -> None:
        """Keep the prefix chain up to its first failed block and every chunk that loaded in full."""
        waiting.done = True
        self._loading.difference_update(load.wanted.block_hash for load in waiting.loads)
        results = [_outcome(load.future) for load in waiting.loads]
        broken_chunks = {load.wanted.chain for load, (stored, _) in zip(waiting.loads, results)
                         if stored is None and load.wanted.chain != _PREFIX}
        prefix_broken, kept = False, []
        for load, (stored, tier) in zip(waiting.loads, results):
            if load.wanted.chain == _PREFIX:
                prefix_broken = prefix_broken or stored is None
                usable = not prefix_broken
            else:
                usable = load.wanted.chain not in broken_chunks
            if usable and self._register(load):
                if load.wanted.chain != _PREFIX and stored.computed_after:
                    self.chunks.remember_computed_after(load.wanted.block_hash, stored.computed_after)
                load.tier = tier
                kept.append(load)
                self._ready.append((load.block.block_id, stored.kv))
            else:
                self.pool.free([load.block])
        waiting.loads = kept
        self.pool.free(list(reversed([load.block for load in kept])))
        self.pool.free(list(reversed(waiting.held)))
        waiting.held = []

    def _register(self, load: _Load) -> bool:
        """Put the loaded block into the pool's cache; False when another request cached the
        same hash meanwhile (first writer wins), and the loaded copy is not needed."""
        self.pool.cache(load.block, load.wanted.block_hash, load.wanted.token_ids, offer_to_tiers=False,
                        evict_early=load.wanted.blended)
        return load.block.block_hash == load.wanted.block_hash

    def wait_for_any(self, timeout: float) -> None:
        """Sleep until a running load finishes (or ``timeout`` seconds): for a step with nothing
        else to do. Only loads still running count: a request lands when all of its loads are
        done, so waiting on one already done would return at once, and the step loop would spin
        (holding the interpreter the reader threads need: reads took 20-60x their time alone)."""
        futures = [load.future for waiting in self._waiting.values() if not waiting.done
                   for load in waiting.loads if isinstance(load.future, Future) and not load.future.done()]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    @property
    def num_loading(self) -> int:
        return sum(not waiting.done for waiting in self._waiting.values())

    def count_tier_hits(self, request: Request, hits: list[KVBlock], plan: ChunkPlan | None) -> dict[str, int]:
        """Of the request's cache hits, the tokens its landed loads brought, by tier, added to
        the tiers' counters too (once a request: on its admission): its loaded prefix blocks
        still among its prefix ``hits`` (a loaded block the pool evicted before the request got
        in is not one), and the chunks of ``plan`` (its chunk-reuse plan, None without) that
        came from a tier less their tokens computed again, which are not hits (taken off the
        chunk's first blocks). So the sum never exceeds cached plus chunk-hit tokens, per
        request and over all of them."""
        loads = getattr(self._waiting.get(request.request_id), "loads", [])
        hit_blocks = {id(block) for block in hits}
        imported = {index for index, _ in plan.imported} if plan else set()
        recomputed = {item.start: item.count + item.tail for item in plan.recompute} if plan else {}
        counts = []
        for load in loads:
            tokens = len(load.wanted.token_ids)
            if load.wanted.chain == _PREFIX:
                if id(load.block) not in hit_blocks or load.block.block_hash != load.wanted.block_hash:
                    continue
            elif load.wanted.chain not in imported:
                continue
            else:
                start = request.segments[load.wanted.chain].start
                not_hits = min(recomputed.get(start, 0), tokens)
                recomputed[start] = recomputed.get(start, 0) - not_hits
                tokens -= not_hits
            counts.append({load.tier: tokens})
        served = tier_hits(*counts)
        for tier, tokens in served.items():
            self.tiers.stats.served(tier, tokens)
        return served

    def refresh(self, hits: list[KVBlock]) -> None:
        """An admitted request's pool hits count as uses in the tiers too (KVTiers.refresh)."""
        if hits:
            self.tiers.refresh([block.block_hash for block in hits])

    # ---- release ------------------------------------------------------------------------------
    def release(self, request: Request) -> None:
        """The request was admitted or freed: forget its loads. A load still running is left to
        finish; its blocks and the request's hits are let go now and its result dropped."""
        waiting = self._waiting.pop(request.request_id, None)
        if waiting is None or waiting.done:
            return
        self._loading.difference_update(load.wanted.block_hash for load in waiting.loads)
        self.pool.free(list(reversed(waiting.held)))
        self.pool.free(list(reversed([load.block for load in waiting.loads])))


def _outcome(future: Future | CompletedRead) -> tuple:
    """A finished read's (block or None, tier or None); a read that raised is a miss (the
    tiers log their own errors), so that no request fails and nothing it holds leaks."""
    try:
        return future.result()
    except Exception:
        return None, None
