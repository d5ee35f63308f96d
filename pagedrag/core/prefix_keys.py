"""The keys a request's blocks are cached and looked up under, in the pool and the KV tiers
below it: the exact chained block hash, and, with chunk reuse, the *blended* keys of the blocks
whose KV chunk reuse made.

Chunk reuse (core.chunk_cache) builds a prompt's KV from imported chunks (approximate) and
computes the rest over them: each chunk's recomputed share, the question window, the question.
That KV never enters the exact prefix cache, so without more a later prompt of the same tokens
(the same stream after a restart, a follow-up on the same documents) builds it all again, the
window's recomputation included, however often it was built before. Instead each block past a
request's ``exact_prefix_len`` is cached under a blended key (block_hash.blended_block_key): its
exact hash (every token up to the block's end, the tenant's salt), the chunk-reuse settings, and
whether the block is *whole* (every token of it computed by the model over the KV before it:
fresh, recomputed or decoded) or holds KV copied from an imported chunk.

A request that takes part in chunk reuse (it came with segments) looks its blocks up along its
exact chain and, from the first block missing there, along blended keys (never back). A block
that starts within the last ``question_window`` prompt tokens is taken only whole: there chunk
reuse would recompute what it imports, and a whole block is what that recomputation gives over
the same tokens. Further back, a block holding copied KV stands for what importing the same chunk
(and recomputing its share over the same preceding tokens) gives. (The block across the window's
start may be a copied one: for the prompt that made it, its copied tokens lie before the window.)

Invariants:
- Requests without segments, and every request of an engine without chunk reuse, use exact keys
  only: an exact prefix hit never serves approximate KV.
- A request's blocks below its ``exact_prefix_len`` are cached under their exact hash, the others
  under a blended key (whole unless listed in ``Request.copied_blocks``), ``evict_early`` in the
  pool: a blended block serves only prompts of the same documents in the same order, where a
  chunk's KV or an exact prefix serves any prompt that holds it (the tiers below keep them all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from pagedrag.core.block_hash import BlockHash, blended_block_key
from pagedrag.core.chunk_cache import ChunkCache, ChunkPlan
from pagedrag.core.request import Request

Found = TypeVar("Found")


class PrefixKeys:
    def __init__(self, block_size: int, chunks: ChunkCache | None):
        self.block_size = block_size
        self.chunks = chunks

    def blends(self, request: Request) -> bool:
        """Whether the request may take (and makes) blocks that chunk reuse made."""
        return self.chunks is not None and bool(request.segments)

    def walk(self, request: Request, first: int, stop: int, blended: bool,
             find: Callable[[int, BlockHash], Found | None]) -> list[Found]:
        """``find(index, key)`` for the request's blocks ``first``, ``first`` + 1, ... before
        ``stop``, each under the first of its keys found (the exact hash, unless ``blended``
        or a block before it was found under a blended key; then the blended ones), up to the
        first block found under none."""
        found = []
        for index in range(first, stop):
            for key in self._lookup_keys(request, index, blended):
                item = find(index, key)
                if item is not None:
                    break
            else:
                return found
            blended = blended or key != request.block_hashes[index]
            found.append(item)
        return found

    def _lookup_keys(self, request: Request, index: int, blended: bool) -> list[BlockHash]:
        exact = request.block_hashes[index]
        if not self.blends(request):
            return [exact]
        keys = [] if blended else [exact]
        keys.append(blended_block_key(exact, self.chunks.settings, whole=True))
        if index * self.block_size < request.num_prompt_tokens - self.chunks.question_window:
            keys.append(blended_block_key(exact, self.chunks.settings, whole=False))
        return keys

    def is_blended(self, request: Request, index: int) -> bool:
        """Whether the request's block ``index`` is cached under a blended key."""
        return request.exact_prefix_len is not None and (index + 1) * self.block_size > request.exact_prefix_len

    def cache_key(self, request: Request, index: int) -> BlockHash:
        """The key the request's full, computed block ``index`` is cached under."""
        exact = request.block_hashes[index]
        if not self.is_blended(request, index):
            return exact
        return blended_block_key(exact, self.chunks.settings, whole=index not in request.copied_blocks)

    def admit(self, request: Request, hits: list, plan: ChunkPlan | None, first_time: bool) -> None:
        """A blending request is admitted with its prefix ``hits`` (pool blocks) and chunk-reuse
        ``plan`` (already applied: ``exact_prefix_len`` marks its first import): its KV is exact
        only below its first blended hit too, and the blocks it copies KV into are noted."""
        if not self.blends(request):
            return
        first = next((index for index, block in enumerate(hits)
                      if block.block_hash != request.block_hashes[index]), None)
        if first is not None:
            start = first * self.block_size
            request.exact_prefix_len = start if request.exact_prefix_len is None else min(start, request.exact_prefix_len)
            if first_time:
                self.chunks.stats.blended_hits += (len(hits) - first) * self.block_size
        ranges = self.chunks.copied_ranges(request, plan) if plan else []
        request.copied_blocks = {index for begin, end in ranges
                                 for index in range(begin // self.block_size, (end - 1) // self.block_size + 1)}
