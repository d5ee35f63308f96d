"""The host-memory tier: blocks in (pinned, on CUDA) host memory, least recently used first out.

On CUDA it sits between the device pool and the disk; on CPU the pool already is host memory,
so a bigger pool does the same job (the tier still works there, which is how tests drive it).
It is kept apart from preemption's swap space: swap space must be there in full for a
preempted request's private, partly filled blocks, where this tier is a cache that may drop
anything at any time.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from pagedrag.kv_tiers.store import HOST_TIER, StoredBlock


class HostStore:
    name = HOST_TIER

    def __init__(self, capacity_bytes: int, pin_memory: bool = False):
        self.capacity_bytes = int(capacity_bytes)
        self.pin_memory = pin_memory
        self.enabled = self.capacity_bytes > 0
        self.num_dropped = 0
        self._blocks: OrderedDict[bytes, StoredBlock] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()  # the tiers' reader and writer threads share the store

    @property
    def used_bytes(self) -> int:
        return self._used

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def get(self, key: bytes) -> StoredBlock | None:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return block

    def put(self, key: bytes, block: StoredBlock) -> None:
        """Keep ``block`` (its tensor as given: the caller hands over a copy of its own)."""
        if not self.enabled or block.num_bytes > self.capacity_bytes:
            return
        if self.pin_memory and not block.kv.is_pinned():
            block = StoredBlock(block.token_ids, block.kv.pin_memory())
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = block
            self._used += block.num_bytes
            while self._used > self.capacity_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self._used -= evicted.num_bytes
