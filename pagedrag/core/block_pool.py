"""The pool of fixed-size physical KV blocks, with ref counts and an LRU free queue.

Invariants:
- A block is either free (ref_count == 0, in the free queue) or held
  (ref_count > 0, not in the queue). num_free + num_used == num_blocks always.
- A free block that carries a hash stays findable through ``lookup`` until the
  pool hands it out again; free blocks are handed out oldest-freed first (LRU),
  so callers free a request's blocks tail first and the deepest blocks of a
  hash chain are evicted before their parents. Blocks with no hash go first, then
  those cached ``evict_early`` (worth less: chunk reuse's blended blocks, found only
  by a prompt of the same documents in the same order), then the rest.
- A cached block's stored token ids are compared on lookup: a hit is confirmed
  before it is used, never taken on the hash alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedrag.core.block_hash import BlockHash


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens (the last one may be partly filled)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens its hash covers (for confirmation)
    evict_early: bool = False  # cached, but evicted before blocks cached without it


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free blocks in the order allocate takes them: those with no cached hash, then cached
        # ones from the least recently freed; the cached ``evict_early`` ones wait apart and are
        # taken after the first but before the second
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_early: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.record_newly_cached = False  # set when KV tiers take every newly cached block
        self._newly_cached: list[KVBlock] = []

    # ---- accounting -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._free_early)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached free blocks count as free)."""
        return self.num_used / self.num_blocks

    # ---- allocation -------------------------------------------------------
    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` free blocks: first those that hold no cached hash, then cached ones
        (``evict_early`` ones first), least recently freed first, evicting their hashes. So a
        block emptied without being cached (a rejected draft's, a finished request's partial
        last block) is reused before any cached block is evicted."""
        if count > self.num_free:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free} free")
        taken = []
        for _ in range(count):
            block = self.blocks[self._next_free().popitem(last=False)[0]]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def _next_free(self) -> OrderedDict[int, None]:
        """The queue whose first block allocate takes next."""
        if not self._free_early or (self._free and self.blocks[next(iter(self._free))].block_hash is None):
            return self._free
        return self._free_early

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_count == 0:
                del (self._free_early if block.evict_early else self._free)[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; pass a request's blocks
        reversed (tail first) so that its deepest blocks are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed while already free")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.evict_early:
                    self._free_early[block.block_id] = None
                    continue
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    # ---- prefix cache -----------------------------------------------------
    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this hash, if its stored tokens match exactly."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int],
              offer_to_tiers: bool = True, evict_early: bool = False) -> None:
        """Make a full, computed block that a request holds findable by its hash (first writer
        wins). With ``record_newly_cached``, the block is also kept for ``take_newly_cached``
        (unless it came from a tier: ``offer_to_tiers`` False). ``evict_early``: once free,
        it is evicted before every cached block without it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        if evict_early and block.ref_count == 0:  # free already: to the queue it now belongs to
            del self._free[block.block_id]
            self._free_early[block.block_id] = None
        block.evict_early = evict_early
        self._cached[block_hash] = block
        if self.record_newly_cached and offer_to_tiers:
            self._newly_cached.append(block)

    def take_newly_cached(self) -> list[tuple[int, BlockHash, tuple[int, ...]]]:
        """(block id, hash, token ids) of the blocks cached since the last call that still hold
        that hash; call before the pool hands out blocks again (the end of a step)."""
        taken = [(block.block_id, block.block_hash, block.token_ids) for block in self._newly_cached
                 if block.block_hash is not None]
        self._newly_cached = []
        return taken

    def num_cached(self) -> int:
        return len(self._cached)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data)."""
        for block in self._cached.values():
            self._forget(block)
        self._cached.clear()
        for block_id in self._free_early:  # free and hashless now: taken first
            self._free[block_id] = None
            self._free.move_to_end(block_id, last=False)
        self._free_early.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        self._forget(block)

    @staticmethod
    def _forget(block: KVBlock) -> None:
        block.block_hash = None
        block.token_ids = None
        block.evict_early = False

    def check_invariants(self) -> None:
        """Assert the pool's invariants (used by tests)."""
        free_ids = set(self._free) | set(self._free_early)
        assert len(free_ids) == self.num_free
        assert all(self.blocks[block_id].evict_early for block_id in self._free_early)
        assert not any(self.blocks[block_id].evict_early for block_id in self._free)
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in free_ids)
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
