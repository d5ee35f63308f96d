"""Which replica a request goes to: prefix-cache affinity, bounded by load.

The router estimates each replica's prefix cache by the blocks it sent there: an LRU of
block hashes per replica, bounded. The hashes are the engine's own (chained over the
prompt's full blocks, salted per tenant: core.block_hash), so a request's match on a
replica is the number of its leading blocks found there. Replicas evict on their own, so
the estimate can be stale: that costs a cache miss, never a wrong answer.

The choice is the cache_aware policy of SGLang's router; the default cache_threshold (0.3) was
chosen on the pydoc-topics RAG stream (benchmarks/bench_router.py's simulation: 0.5 loses a
tenth of the hit rate there, as a RAG prompt shares little beyond the system prompt and its
leading chunks):

1. Loads out of balance (max - min > ``balance_abs_threshold`` and max >
   ``balance_rel_threshold`` x min, loads in requests in flight): the least loaded replica.
2. Else, when the longest match covers at least ``cache_threshold`` of the request's
   blocks: the replica holding it (ties: the least loaded).
3. Else the least loaded replica, ties broken towards the smallest estimated cache, so
   that new prefixes spread over the replicas.

``round_robin`` and ``least_loaded`` are there to compare against.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedrag.core.block_hash import BlockHash

POLICIES = ("prefix_affinity", "round_robin", "least_loaded")


@dataclass(frozen=True)
class AffinityThresholds:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    max_blocks_per_replica: int = 1 << 17  # the estimate's bound: 2M tokens of 16-token blocks

    def __post_init__(self) -> None:
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                             f"{self.balance_abs_threshold} and {self.balance_rel_threshold}")
        if self.max_blocks_per_replica < 1:
            raise ValueError(f"max_blocks_per_replica must be >= 1, got {self.max_blocks_per_replica}")


class _CacheEstimate:
    """The block hashes last sent to one replica, least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a request this replica holds (the hashes are chained,
        so a block's presence means its whole prefix was sent here)."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            count += 1
        return count

    def record(self, hashes: Sequence[BlockHash]) -> None:
        for block_hash in hashes:
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class ReplicaChooser:
    """Picks a replica for each request under one policy; replicas are any hashable ids.

    ``choose`` only reads; the caller reports where the request went with ``record`` (the
    affinity estimate learns from it). Loads are the caller's (requests in flight)."""

    def __init__(self, policy: str = "prefix_affinity", thresholds: AffinityThresholds = AffinityThresholds()):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.thresholds = thresholds
        self.estimates: dict[Hashable, _CacheEstimate] = {}
        self._turns = itertools.count()

    def forget(self, replica: Hashable) -> None:
        """A replica restarted (its cache is empty) or left."""
        self.estimates.pop(replica, None)

    def record(self, replica: Hashable, hashes: Sequence[BlockHash]) -> None:
        estimate = self.estimates.setdefault(replica, _CacheEstimate(self.thresholds.max_blocks_per_replica))
        estimate.record(hashes)

    def match(self, replica: Hashable, hashes: Sequence[BlockHash]) -> int:
        estimate = self.estimates.get(replica)
        return estimate.match(hashes) if estimate else 0

    def choose(self, hashes: Sequence[BlockHash], loads: dict[Hashable, int]) -> Hashable:
        """The replica for a request with these block hashes; ``loads``: the candidates
        (at least one) and their requests in flight."""
        if not loads:
            raise ValueError("no replica to route to")
        candidates = list(loads)
        if self.policy == "round_robin":
            return candidates[next(self._turns) % len(candidates)]
        least_loaded = min(candidates, key=lambda r: (loads[r], self._size(r)))
        if self.policy == "least_loaded" or self._imbalanced(loads.values()) or not hashes:
            return least_loaded
        best = max(candidates, key=lambda r: (self.match(r, hashes), -loads[r]))
        if self.match(best, hashes) >= self.thresholds.cache_threshold * len(hashes) and self.match(best, hashes):
            return best
        return least_loaded

    def _imbalanced(self, loads) -> bool:
        low, high = min(loads), max(loads)
        return high - low > self.thresholds.balance_abs_threshold and high > self.thresholds.balance_rel_threshold * low

    def _size(self, replica: Hashable) -> int:
        estimate = self.estimates.get(replica)
        return len(estimate.blocks) if estimate else 0
