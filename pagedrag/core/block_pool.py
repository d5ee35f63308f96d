"""The pool of fixed-size physical KV blocks, with ref counts and an LRU free queue.

Invariants:
- A block is either free (ref_count == 0, in the free queue) or held
  (ref_count > 0, not in the queue). num_free + num_used == num_blocks always.
- A free block that carries a hash stays findable through ``lookup`` until the
  pool hands it out again; free blocks are handed out oldest-freed first (LRU),
  so callers free a request's blocks tail first and the deepest blocks of a
  hash chain are evicted before their parents.
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
        # ones from the least recently freed
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self.record_newly_cached = False  # set when KV tiers take every newly cached block
        self._newly_cached: list[KVBlock] = []

    # ---- accounting -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached free blocks count as free)."""
        return self.num_used / self.num_blocks

    # ---- allocation -------------------------------------------------------
    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` free blocks: first those that hold no cached hash, then cached ones,
        least recently freed first, evicting their hashes. So a block emptied without being
        cached (a rejected draft's, a finished request's partial last block) is reused before
        any cached block is evicted."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        taken = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take one more reference on each block (a prefix hit or a fork)."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each block, in the given order; pass a request's blocks
        reversed (tail first) so that its deepest blocks are evicted first."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed while already free")
            block.ref_count -= 1
            if block.ref_count == 0:
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
              offer_to_tiers: bool = True) -> None:
        """Make a full, computed block findable by its hash (first writer wins). With
        ``record_newly_cached``, the block is also kept for ``take_newly_cached`` (unless it
        came from a tier: ``offer_to_tiers`` False)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
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
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None
        block.token_ids = None

    def check_invariants(self) -> None:
        """Assert the pool's invariants (used by tests)."""
        free_ids = set(self._free)
        assert len(free_ids) == len(self._free)
        for block in self.blocks:
            assert block.ref_count >= 0
            assert (block.ref_count == 0) == (block.block_id in free_ids)
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
