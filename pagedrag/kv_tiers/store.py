"""The one small interface every KV tier below the pool implements (host memory, disk).

A store maps a block key (keyspace.block_key) to a ``StoredBlock``: the tokens the block holds
(a hit is confirmed against them before it is used) and its K/V across every layer, one
tensor [num_layers, 2, block_size, num_kv_heads, head_dim].

Invariants every store keeps:
- ``get`` returns exactly what ``put`` was given for that key, or None. Anything it cannot
  vouch for (a corrupt, truncated, foreign or mismatched entry) is a miss, dropped and counted
  in ``num_dropped``; it never raises for a bad entry.
- ``used_bytes <= capacity_bytes`` after every ``put`` (least recently used entries go first).
- What ``get`` returns is for reading only: a store may hand out its own memory.
- A store that meets an error of its medium (a full disk, a vanished or read-only directory)
  turns itself off (``enabled`` False) with one warning; from then on it holds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

TIER_NAMES = ("host", "disk")
"""The tiers under the pool, nearest first: the order a read tries them in, and the label of
each tier's figures (metrics, ``RequestOutput.num_tier_hit_tokens``)."""
HOST_TIER, DISK_TIER = TIER_NAMES


def tier_hits(*figures: Mapping[str, int] | None) -> dict[str, int]:
    """Per-tier figures (tokens by tier name; None counts as none) added up tier by tier. Every
    tier named in any of them is named in the sum, in the order first met; to name every tier
    of TIER_NAMES, nearest first, pass ``dict.fromkeys(TIER_NAMES, 0)`` first."""
    total: dict[str, int] = {}
    for hits in figures:
        for tier, tokens in (hits or {}).items():
            total[tier] = total.get(tier, 0) + tokens
    return total


@dataclass(slots=True)
class StoredBlock:
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim]
    # a chunk's first block (chunk reuse): the key of the segment its KV was computed after
    # (core.chunk_cache); empty for every other block
    computed_after: bytes = b""

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVStore(Protocol):
    name: str  # one of TIER_NAMES: the label of its metrics
    enabled: bool
    capacity_bytes: int
    num_dropped: int

    def contains(self, key: bytes) -> bool:
        """Whether ``get(key)`` would likely find the block (cheap; no data is read)."""

    def get(self, key: bytes) -> StoredBlock | None: ...

    def put(self, key: bytes, block: StoredBlock) -> bool:
        """Keep the block; True when this put wrote it (False: held already, which counts as a
        use, or refused, or the store is off)."""

    def touch(self, key: bytes) -> None:
        """Count a use of the block, if held: it is then the last its LRU order lets go."""

    @property
    def used_bytes(self) -> int: ...
