"""The stack of KV stores below the device pool, and the threads that move blocks in and out.

``KVTiers`` takes blocks by their chained block hash (core.block_hash) and keys them within its
keyspace (keyspace.block_key). Writes are write-through: every block the pool caches is
offered to every tier once, as the step that completed it ends (so a restarted or a second
engine finds it, even after a SIGKILL); a read tries the tiers in order (store.TIER_NAMES:
host, then disk) and copies a disk hit into the host tier. Reads and writes run on threads of
their own, never on the step loop: the scheduler asks ``read`` for a future and lets the
request wait.

Invariants: a read returns a block only when its stored token ids equal the ones asked for;
everything else (not there, evicted meanwhile, corrupt, another tenant's) is None, a miss. A
read queued behind others checks the cost model again when it starts: once the first reads of
a tier measure it slower than computing (cost_model.slower_tiers, the rule lookups apply too),
the rest of a request's reads from it are misses (its tokens are computed) instead of each
paying the slow read.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagedrag.kv_tiers.cost_model import TierCostModel
from pagedrag.kv_tiers.keyspace import block_key
from pagedrag.kv_tiers.store import HOST_TIER, TIER_NAMES, KVStore, StoredBlock

logger = logging.getLogger("pagedrag")
# The reader and writer threads take the GIL several times a block; while the step loop runs
# Python, each take waits up to the interpreter's switch interval (5 ms by default). Beside a
# busy loop a 2 MiB disk read took 66 ms at 5 ms, 9 ms at 0.5 ms (RESULTS.md, "KV tiers").
GIL_SWITCH_INTERVAL_S = 0.0005
REFRESH_EVERY_S = 30.0  # a pool hit refreshes a block's place in the tiers' LRU at most this often
MAX_REFRESHED = 1 << 16  # blocks whose last refresh is remembered (the oldest forgotten first)


class _ShortSwitchInterval:
    """The process's GIL switch interval, lowered to GIL_SWITCH_INTERVAL_S while anything holds
    it: the first ``hold`` lowers it, the ``release`` of the last holder restores the value the
    first hold found. Thread-safe; each hold must be released exactly once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holders = 0
        self._original = 0.0

    def hold(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._original = sys.getswitchinterval()
                sys.setswitchinterval(min(self._original, GIL_SWITCH_INTERVAL_S))
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                sys.setswitchinterval(self._original)


_SHORT_SWITCH_INTERVAL = _ShortSwitchInterval()


class TierStats:
    """Counters of the tiers' traffic, in tokens, bytes and seconds (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.hit_tokens: Counter[str] = Counter()  # prompt tokens served, by tier (TierLoads.count_tier_hits)
        self.query_tokens = 0  # tokens looked up below the pool (external_prefix_cache_queries)
        self.bytes: Counter[str] = Counter()  # by transfer type: disk_to_host, host_to_device, ...
        self.seconds: Counter[str] = Counter()

    def moved(self, transfer: str, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes[transfer] += num_bytes
            self.seconds[transfer] += seconds

    def served(self, tier: str, num_tokens: int) -> None:
        with self._lock:
            self.hit_tokens[tier] += num_tokens


@dataclass(frozen=True, slots=True)
class CompletedRead:
    """A read served at once (from host memory), answering a Future's ``done`` and ``result``
    without building one: a prefix of 80 host blocks would pay 80 Futures' locks on the step loop."""

    outcome: tuple[StoredBlock | None, str | None]

    def done(self) -> bool:
        return True

    def result(self) -> tuple[StoredBlock | None, str | None]:
        return self.outcome


class KVTiers:
    """``stores``: at most one a tier; kept nearest first (TIER_NAMES order), the host tier, if
    any, first. While an enabled store off host memory is there (its reads run on the reader
    threads) the process holds the short GIL switch interval, until ``close`` or until the
    object is collected, whichever comes first."""

    def __init__(self, stores: Sequence[KVStore], keyspace: str, cost: TierCostModel):
        self.stores = sorted(stores, key=lambda store: TIER_NAMES.index(store.name))
        self.keyspace = keyspace
        self.cost = cost
        self.stats = TierStats()
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pagedrag-kv-read")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedrag-kv-write")  # FIFO
        self._host = next((store for store in self.stores if store.name == HOST_TIER), None)
        self._refreshed: OrderedDict[bytes, float] = OrderedDict()  # block hash -> when refresh last ran for it
        self._release_switch_interval = None  # a weakref.finalize: runs once, by close() or collection
        if any(store.enabled and store is not self._host for store in self.stores):
            _SHORT_SWITCH_INTERVAL.hold()
            self._release_switch_interval = weakref.finalize(self, _SHORT_SWITCH_INTERVAL.release)

    @property
    def enabled(self) -> bool:
        return any(store.enabled for store in self.stores)

    def key(self, block_hash: bytes) -> bytes:
        return block_key(self.keyspace, block_hash)

    def locate(self, block_hash: bytes) -> str | None:
        """The first tier that holds the block (by its key; no data read), or None."""
        key = self.key(block_hash)
        return next((store.name for store in self.stores if store.enabled and store.contains(key)), None)

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, block_hash: bytes, token_ids: Sequence[int],
             slower: frozenset[str] | None = None) -> Future | CompletedRead:
        """A future of (StoredBlock or None, the tier it came from or None). ``slower``: the
        tiers the caller's lookup turned away (cost.slower_tiers(), taken now when None). A
        block in host memory is read at once, under that decision (a lookup: a thread would
        only add its hop), and comes as a CompletedRead; others on a reader thread, which takes
        the decision anew when the read starts: the reads queued before it may have measured a
        tier slower than computing."""
        key = self.key(block_hash)
        if self._host is not None and self._host.contains(key):
            return CompletedRead(self._read(key, tuple(token_ids), slower))
        return self._readers.submit(self._read, key, tuple(token_ids))

    def _read(self, key: bytes, token_ids: tuple[int, ...],
              slower: frozenset[str] | None = None) -> tuple[StoredBlock | None, str | None]:
        if slower is None:
            slower = self.cost.slower_tiers()
        for depth, store in enumerate(self.stores):
            if not (store.enabled and store.contains(key)):
                continue
            if store.name in slower:  # a miss: its tokens are computed
                return None, None
            start = time.perf_counter()
            try:
                block = store.get(key)
            except Exception:  # a store's own bug or an unforeseen medium error: a miss, never a failed step
                logger.exception("kv tiers: a read from the %s tier failed; a miss", store.name)
                block = None
            seconds = time.perf_counter() - start
            if block is None or block.token_ids != token_ids:
                continue
            self.cost.observe_load(store.name, seconds)
            if store is not self._host:  # into host memory ("host" in a transfer label is memory)
                self.stats.moved(f"{store.name}_to_host", block.num_bytes, seconds)
            for upper in self.stores[:depth]:
                upper.put(key, block)
            return (block if store is self._host else self._in_host_memory(key, block)), store.name
        return None, None

    def _in_host_memory(self, key: bytes, block: StoredBlock) -> StoredBlock:
        """The host tier's copy of a block just read from below, where it kept one: pinned on CUDA,
        so the load crosses without holding up the step loop, and beside the blocks of its chain
        read before it (one copy for the run); else ``block`` itself."""
        promoted = None if self._host is None else self._host.get(key)
        return promoted if promoted is not None and promoted.token_ids == block.token_ids else block

    # ---- writes --------------------------------------------------------------------------------
    def write(self, entries: Sequence[tuple[bytes, Sequence[int], bytes]], kv: torch.Tensor,
              ready: torch.cuda.Event | None) -> None:
        """Offer blocks to every tier: ``entries[i]`` is (block hash, token ids, computed_after:
        see StoredBlock) of ``kv[i]``, a host tensor [n, layers, 2, block_size, kv_heads,
        head_dim], complete once ``ready`` fired."""
        if entries and self.enabled:
            self._writer.submit(self._write, list(entries), kv, ready)

    def _write(self, entries, kv: torch.Tensor, ready) -> None:
        try:
            self._write_all(entries, kv, ready)
        except Exception:  # a store's own errors turn it off; anything else must not stop the writer
            logger.exception("kv tiers: a write failed")

    def _write_all(self, entries, kv: torch.Tensor, ready) -> None:
        start = time.perf_counter()
        if ready is not None:
            ready.synchronize()
        self.stats.moved("device_to_host", kv.numel() * kv.element_size(), time.perf_counter() - start)
        for store in self.stores:
            start, num_bytes = time.perf_counter(), 0
            for (block_hash, token_ids, computed_after), block_kv in zip(entries, kv):
                block = StoredBlock(tuple(token_ids), block_kv, computed_after)  # stores copy what they keep
                if store.put(self.key(block_hash), block):
                    num_bytes += block.num_bytes
            if store is not self._host:
                self.stats.moved(f"host_to_{store.name}", num_bytes, time.perf_counter() - start)

    def refresh(self, block_hashes: Sequence[bytes]) -> None:
        """Count a use, in every tier, of blocks the pool served: a block hot in the pool is not
        written again (writes are write-through), so without this the tiers' LRU order would let
        it go by the age of its first write. At most once a block every REFRESH_EVERY_S, on the
        writer thread (in order with the writes)."""
        if not self.enabled:
            return
        now = time.monotonic()
        due = [h for h in block_hashes if now - self._refreshed.get(h, -REFRESH_EVERY_S) >= REFRESH_EVERY_S]
        for block_hash in due:
            self._refreshed[block_hash] = now
            self._refreshed.move_to_end(block_hash)
        while len(self._refreshed) > MAX_REFRESHED:
            self._refreshed.popitem(last=False)
        if due:
            self._writer.submit(self._touch, [self.key(block_hash) for block_hash in due])

    def _touch(self, keys: list[bytes]) -> None:
        for store in self.stores:
            for key in keys:
                store.touch(key)

    def release_reads(self, done) -> None:
        """Blocks read from host memory whose views are gone are read by no device work launched
        after ``done`` (an event, or None: none at all): see host_store.HostStore.release_reads."""
        if self._host is not None:
            self._host.release_reads(done)

    def written(self) -> Future:
        """A future that completes once every write handed over so far is in the tiers (the
        writer is one thread, first in first out)."""
        return self._writer.submit(lambda: None)

    def close(self) -> None:
        """Finish every write handed over (the writer's shutdown runs its queue to the end; a
        new task could not be queued once the interpreter is exiting) and stop the threads."""
        try:
            self._readers.shutdown(wait=True)
            self._writer.shutdown(wait=True)
        finally:
            if self._release_switch_interval is not None:
                self._release_switch_interval()

    def snapshot(self) -> dict:
        """Each tier's use and capacity, the traffic so far and the cost model's figures."""
        return {
            "tiers": {store.name: {"enabled": store.enabled, "used_bytes": store.used_bytes,
                                   "capacity_bytes": store.capacity_bytes, "dropped_files": store.num_dropped}
                      for store in self.stores},
            "hit_tokens": dict(self.stats.hit_tokens),
            "external_prefix_cache_queries": self.stats.query_tokens,
            "external_prefix_cache_hits": sum(self.stats.hit_tokens.values()),
            "bytes": dict(self.stats.bytes), "seconds": dict(self.stats.seconds),
            "cost_model": self.cost.snapshot(),
        }
