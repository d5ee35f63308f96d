"""Per-request block tables on top of the block pool: prefix lookup, on-demand
allocation, copy-on-write forks, swap to CPU, and release.

Invariants:
- A request's block table covers at least its computed tokens; block j holds
  positions [j * block_size, (j + 1) * block_size).
- Only full, computed blocks are cached (hashed); the last prompt token is never
  served from the cache, so there are always logits to sample.
- Before a request writes into a block that other requests share (ref_count > 1),
  the block is copied: the copy is queued in ``pending_copies`` as (src, dst) and
  must run before the step's forward pass.
- Only blocks below a request's ``exact_prefix_len`` (chunk reuse) go to the prefix cache
  under their exact hash; the others under a blended key (core.prefix_keys), found only by
  requests that take part in chunk reuse.
- Slots reserved for drafted tokens (speculative decoding) hold KV that counts only once
  the verifier accepts it (num_computed_tokens grows then); after verification the blocks
  past the request's known tokens are freed (``release_unused``), and only verified tokens
  are ever hashed (block hashes cover ``token_ids``, which drafts never enter).
- Once every request is freed, every block is free again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedrag.core.block_hash import BlockHash
from pagedrag.core.block_pool import BlockPool, KVBlock, blocks_for
from pagedrag.core.chunk_cache import ChunkCache
from pagedrag.core.prefix_keys import PrefixKeys
from pagedrag.core.request import Request
from pagedrag.core.tier_loads import TierLoads
from pagedrag.kv_tiers.tiers import KVTiers

POOL = "pool"
"""``cached_prefix``'s label of the tokens whose blocks are in the pool (the tiers under it go by
their TIER_NAMES)."""


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups, counted in tokens, on each request's first scheduling."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class SwapPlan:
    """Block moves for one step: (src, dst) pairs, device->CPU and CPU->device."""

    out: list[tuple[int, int]] = field(default_factory=list)
    into: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_cpu_blocks: int = 0, chunk_reuse: tuple[float, str, int] | None = None,
                 tiers: KVTiers | None = None):
        """``chunk_reuse``: (recompute fraction, model id, question window) to reuse chunks (core.chunk_cache);
        ``tiers``: the KV stores below the pool (core.tier_loads)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.chunks = ChunkCache(self.pool, block_size, *chunk_reuse) if chunk_reuse and enable_caching else None
        self.keys = PrefixKeys(block_size, self.chunks)
        self.cpu_free: list[int] = list(range(num_cpu_blocks))
        self.tables: dict[str, list[KVBlock]] = {}
        self.num_offered: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        self.cpu_tables: dict[str, list[int]] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.swaps = SwapPlan()
        self.prefix_stats = PrefixCacheStats()
        self.tier_loads = TierLoads(self.pool, block_size, tiers, self.chunks, self.keys) \
            if tiers and enable_caching else None
        self.pool.record_newly_cached = self.tier_loads is not None

    # ---- lookup -----------------------------------------------------------
    def computed_blocks(self, request: Request) -> list[KVBlock]:
        """The longest cached run of the request's full blocks (under the keys of
        core.prefix_keys), leaving its last token to compute."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt position's hidden state
        return self._pool_walk(request, (request.num_tokens - 1) // self.block_size)

    def _pool_walk(self, request: Request, stop: int) -> list[KVBlock]:
        """The cached blocks of the request's leading run of full blocks before ``stop``."""
        return self.keys.walk(request, 0, stop, False, lambda index, key: self.pool.lookup(
            key, request.token_ids[index * self.block_size:(index + 1) * self.block_size]))

    def cached_prefix(self, request: Request) -> dict[str, int]:
        """Leading tokens of the request's prompt that would not be computed if it came now, by
        where their blocks are: ``POOL``, then each KV tier holding any past the pool's blocks
        (those the tiers' cost model would load now; TIER_NAMES order). Every full block counts,
        the one holding the last token too. Nothing is touched, read, counted or evicted, so a
        tier's block counts until a request's read finds it damaged (and drops it)."""
        stop = request.num_tokens // self.block_size
        hits = self._pool_walk(request, stop)
        cached = {POOL: len(hits) * self.block_size}
        if self.tier_loads is not None:
            cached.update(self.tier_loads.held_past(request, hits, stop))
        return cached

    def blocks_in_progress(self, requests: list[Request]) -> set[BlockHash]:
        """Hashes of the full prompt blocks these requests have yet to compute (or compute now),
        and with chunk reuse the keys of the chunks they compute (ChunkCache.in_progress)."""
        pending: set[BlockHash] = set()
        for request in requests:
            first = request.num_computed_tokens // self.block_size
            pending.update(request.block_hashes[first:request.num_prompt_tokens // self.block_size])
        if self.chunks is not None:
            pending |= self.chunks.in_progress(requests)
        return pending

    def waits_for(self, request: Request, num_hit_blocks: int, pending: set[BlockHash]) -> bool:
        """Whether the request's first block past its prefix hit, or (chunk reuse) one of its
        uncached chunks, is one that another request is computing: admitted a step later, it
        hits that block or imports that chunk instead of computing it again."""
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return False
        max_blocks = (request.num_tokens - 1) // self.block_size
        if num_hit_blocks < max_blocks and request.block_hashes[num_hit_blocks] in pending:
            return True
        return self.chunks is not None and self.chunks.waits_for(request, num_hit_blocks * self.block_size, pending)

    def computed_after(self, block_hash: BlockHash) -> bytes:
        """For a cached block that begins a chunk (chunk reuse): the key of the segment it was
        computed after; empty otherwise. It goes down the KV tiers with the block."""
        return (self.chunks.computed_after(block_hash) if self.chunks is not None else None) or b""

    def record_prefix_query(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += num_hit_tokens

    # ---- allocation ---------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of the request.

        new_computed_blocks (a prefix hit, first scheduling only) are taken into
        its table. Returns False, changing nothing, when the pool is short.
        """
        table = self.tables.setdefault(request.request_id, [])
        hits = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = blocks_for(total, self.block_size) - len(table) - len(hits)
        shared = self._shared_block_to_write(table, num_computed)
        evictable_hits = sum(1 for block in hits if block.ref_count == 0)
        if num_needed + int(shared is not None) + evictable_hits > self.pool.num_free:
            return False
        self.pool.touch(hits)
        table.extend(hits)
        if shared is not None:
            self._copy_on_write(table, shared)
        table.extend(self.pool.allocate(max(num_needed, 0)))
        return True

    def _shared_block_to_write(self, table: list[KVBlock], num_computed: int) -> int | None:
        """Index in the table of a shared block that the next write would land in."""
        index = num_computed // self.block_size
        if num_computed % self.block_size and index < len(table) and table[index].ref_count > 1:
            return index
        return None

    def _copy_on_write(self, table: list[KVBlock], index: int) -> None:
        source = table[index]
        (copy,) = self.pool.allocate(1)
        self.pending_copies.append((source.block_id, copy.block_id))
        self.pool.free([source])
        table[index] = copy

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        table = self.tables.get(request.request_id, [])
        num_cacheable = request.num_computed_tokens if request.exact_prefix_len is None or self.keys.blends(request) \
            else min(request.num_computed_tokens, request.exact_prefix_len)
        num_full = min(num_cacheable // self.block_size, len(request.block_hashes))
        for index in range(self.num_offered.get(request.request_id, 0), num_full):
            start = index * self.block_size
            self.pool.cache(table[index], self.keys.cache_key(request, index),
                            request.token_ids[start:start + self.block_size],
                            evict_early=self.keys.is_blended(request, index))
        self.num_offered[request.request_id] = max(num_full, self.num_offered.get(request.request_id, 0))

    def release_unused(self, request: Request) -> None:
        """Free, tail first, the blocks past the request's known tokens (slots reserved for
        drafted tokens the verifier rejected)."""
        table = self.tables.get(request.request_id, [])
        keep = blocks_for(request.num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(list(reversed(table[keep:])))
            del table[keep:]

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent (copy-on-write on first write)."""
        blocks = list(self.tables[parent.request_id])
        self.pool.touch(blocks)
        self.tables[child.request_id] = blocks
        self.num_offered[child.request_id] = self.num_offered.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (device and swap space)."""
        table = self.tables.pop(request.request_id, [])
        self.num_offered.pop(request.request_id, None)
        if self.chunks is not None:
            self.chunks.release(request)
        if self.tier_loads is not None:
            self.tier_loads.release(request)
        self.pool.free(list(reversed(table)))
        self.cpu_free.extend(self.cpu_tables.pop(request.request_id, []))

    def block_ids(self, request: Request) -> list[int]:
        return [block.block_id for block in self.tables.get(request.request_id, [])]

    # ---- swap -----------------------------------------------------------------
    def can_swap_out(self, request: Request) -> bool:
        return len(self.tables.get(request.request_id, [])) <= len(self.cpu_free)

    def swap_out(self, request: Request) -> None:
        """Queue the request's blocks for a copy to CPU memory and free them on the device."""
        table = self.tables.pop(request.request_id, [])
        self.num_offered.pop(request.request_id, None)  # fresh blocks come back on swap-in
        cpu_ids = [self.cpu_free.pop() for _ in table]
        self.swaps.out.extend((block.block_id, cpu) for block, cpu in zip(table, cpu_ids))
        self.cpu_tables[request.request_id] = cpu_ids
        self.pool.free(list(reversed(table)))

    def can_swap_in(self, request: Request) -> bool:
        return len(self.cpu_tables[request.request_id]) <= self.pool.num_free

    def swap_in(self, request: Request) -> None:
        """Queue the request's CPU blocks for a copy back into fresh device blocks."""
        cpu_ids = self.cpu_tables.pop(request.request_id)
        table = self.pool.allocate(len(cpu_ids))
        self.swaps.into.extend((cpu, block.block_id) for cpu, block in zip(cpu_ids, table))
        self.tables[request.request_id] = table
        self.cpu_free.extend(cpu_ids)

    def take_step_transfers(self) -> tuple[list[tuple[int, int]], SwapPlan]:
        """Hand over (and clear) this step's copy-on-write copies and swaps."""
        copies, swaps = self.pending_copies, self.swaps
        self.pending_copies, self.swaps = [], SwapPlan()
        return copies, swaps
