"""The host-memory tier: blocks in (pinned, on CUDA) host memory, least recently used first out.

On CUDA it sits between the device pool and the disk; on CPU the pool already is host memory,
so a bigger pool does the same job (the tier still works there, which is how tests drive it).
It is kept apart from preemption's swap space: swap space must be there in full for a
preempted request's private, partly filled blocks, where this tier is a cache that may drop
anything at any time.

Blocks live in slots of slabs: host tensors of up to SLAB_BYTES, all allocated when the store
is made, so that no memory is pinned while requests are served (pinning holds up the device's
work). A block put right after another takes the slot after the other's where it is free, so
the blocks one step completed (a prompt's prefix chain, in order) lie back to back and cross to
the device as one copy (worker.transfer.adjacent_runs; on the H200 a load of 80 blocks of 2 MiB
ran at 77-80% of the pinned copy bandwidth one block a copy, 83-84% in runs of blocks).

Invariants:
- ``get`` hands out a view of the block's slot, for reading only; a tensor made from it (a
  slice, a span of adjacent blocks) must not outlive it. The block has readers, and is not
  evicted, while any such view is alive and after the last one died until the device work
  launched by then is done: the engine calls ``release_reads`` after each step's launch with
  an event that fires once that work is done (None where copies finish within their call, as
  on CPU). So a copy that reads a view never sees another block's data.
- ``used_bytes <= capacity_bytes``. Pinned slabs come from torch's pinned-memory allocator,
  which rounds each allocation up to a power of two: the memory held can exceed the capacity
  by that rounding (under 256 MiB in all).
- Every block has the store's ``block_shape`` and ``dtype``; another is dropped (counted in
  ``num_dropped``), as is a put that finds every block with readers. Memory that cannot be
  allocated at the start leaves a smaller tier, with one warning.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from pagedrag.kv_tiers.store import HOST_TIER, StoredBlock

logger = logging.getLogger("pagedrag")

SLAB_BYTES = 256 << 20
"""The most host memory one slab takes (pinned memory is allocated in such pieces)."""


@dataclass(slots=True)
class _Entry:
    token_ids: tuple[int, ...]
    slot: int
    computed_after: bytes


def _view_died(view_slots: dict[weakref.ref, int], dead_views: deque[int], view: weakref.ref) -> None:
    dead_views.append(view_slots.pop(view))


class HostStore:
    name = HOST_TIER

    def __init__(self, capacity_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool = False):
        self.capacity_bytes = int(capacity_bytes)
        self._block_shape, self._dtype = torch.Size(block_shape), dtype
        self._slot_bytes = self._block_shape.numel() * dtype.itemsize
        self.num_dropped = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the step loop and the tiers' reader and writer threads share it
        self._slots_per_slab = max(1, SLAB_BYTES // self._slot_bytes)
        self._slabs = _allocate_slabs(self.capacity_bytes // self._slot_bytes, self._slots_per_slab,
                                      self._block_shape, dtype, pin_memory)
        self._free: set[int] = set(range(sum(len(slab) for slab in self._slabs)))
        self.enabled = bool(self._free)
        self._last_slot = -1  # the slot of the last put: the next one takes the slot after it if it can
        self._readers: dict[int, int] = {}  # slot -> views handed out and not yet released
        self._view_slots: dict[weakref.ref, int] = {}  # the views handed out and alive
        self._dead_views: deque[int] = deque()  # slots of views that died since release_reads
        # called on whichever thread drops a view's last reference; takes no lock, holds no self
        self._view_died = functools.partial(_view_died, self._view_slots, self._dead_views)
        self._draining: deque[tuple[object, list[int]]] = deque()  # (event, slots) in launch order

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self._slot_bytes

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> StoredBlock | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self._readers[entry.slot] = self._readers.get(entry.slot, 0) + 1
        view = self._view(entry.slot)
        self._view_slots[weakref.ref(view, self._view_died)] = entry.slot
        return StoredBlock(entry.token_ids, view, entry.computed_after)

    def release_reads(self, done) -> None:
        """The views that died so far are read by no device work launched after ``done`` (an
        event with ``query()``; None: by none at all): their blocks lose those readers once it fired."""
        slots = []
        while self._dead_views:
            slots.append(self._dead_views.popleft())
        if slots:
            with self._lock:
                self._draining.append((done, slots))

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def put(self, key: bytes, block: StoredBlock) -> bool:
        """Keep a copy of ``block`` (a cache may drop anything: see the module's invariants);
        True when it was copied in."""
        if not self.enabled:
            return False
        with self._lock:
            if key in self._entries:  # a repeated put counts as a use
                self._entries.move_to_end(key)
                return False
        if (block.kv.shape, block.kv.dtype) != (self._block_shape, self._dtype):
            self.num_dropped += 1
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self._view(slot).copy_(block.kv)
        with self._lock:
            if key in self._entries:  # another thread put it meanwhile
                self._free.add(slot)
                return False
            self._entries[key] = _Entry(block.token_ids, slot, block.computed_after)
        return True

    # ---- slots ---------------------------------------------------------------------------------
    def _view(self, slot: int) -> torch.Tensor:
        return self._slabs[slot // self._slots_per_slab][slot % self._slots_per_slab]

    def _take_slot(self) -> int | None:
        """A slot to write: the one after the last put's if free, any free one, or the slot of the
        least recently used block without readers, evicted; None when every block has readers."""
        with self._lock:
            slot = self._free_slot()
            if slot is None:
                victim = next((key for key, entry in self._entries.items() if entry.slot not in self._readers), None)
                if victim is not None:
                    self._free.add(self._entries.pop(victim).slot)
                    slot = self._free_slot()
        return slot

    def _free_slot(self) -> int | None:
        """Under the lock: take a free slot, the one after the last put's first."""
        self._reap()
        if not self._free:
            return None
        slot = self._last_slot + 1 if self._last_slot + 1 in self._free else min(self._free)
        self._free.remove(slot)
        self._last_slot = slot
        return slot

    def _reap(self) -> None:
        """Under the lock: the readers whose device work is done are gone."""
        while self._draining and (self._draining[0][0] is None or self._draining[0][0].query()):
            for slot in self._draining.popleft()[1]:
                self._readers[slot] -= 1
                if not self._readers[slot]:
                    del self._readers[slot]


def _allocate_slabs(num_slots: int, slots_per_slab: int, block_shape: torch.Size, dtype: torch.dtype,
                    pin_memory: bool) -> list[torch.Tensor]:
    """Slabs holding ``num_slots`` blocks in all, ``slots_per_slab`` each (the last fewer); fewer
    slabs, with one warning, where the memory runs out."""
    slabs, allocated = [], 0
    while allocated < num_slots:
        count = min(slots_per_slab, num_slots - allocated)
        try:
            slabs.append(torch.empty((count, *block_shape), dtype=dtype, pin_memory=pin_memory))
        except RuntimeError as error:
            logger.warning("kv host tier: could not allocate %.0f MiB more (%s); it keeps %.2f GiB",
                           count * block_shape.numel() * dtype.itemsize / 2**20, error,
                           allocated * block_shape.numel() * dtype.itemsize / 2**30)
            break
        allocated += count
    return slabs
