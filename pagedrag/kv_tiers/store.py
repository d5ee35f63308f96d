"""The one small interface every KV tier below the pool implements (host memory, disk).

A store maps a block key (keyspace.block_key) to a ``StoredBlock``: the tokens the block holds
(a hit is confirmed against them before it is used) and its K/V across every layer, one
tensor [num_layers, 2, block_size, num_kv_heads, head_dim].

Invariants every store keeps:
- ``get`` returns exactly what ``put`` was given for that key, or None. Anything it cannot
  vouch for (a corrupt, truncated, foreign or mismatched entry) is a miss, dropped and counted
  in ``num_dropped``; it never raises for a bad entry.
- ``used_bytes <= capacity_bytes`` after every ``put`` (least recently used entries go first).
- A store that meets an error of its medium (a full disk, a vanished or read-only directory)
  turns itself off (``enabled`` False) with one warning; from then on it holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(slots=True)
class StoredBlock:
    token_ids: tuple[int, ...]
    kv: torch.Tensor  # [num_layers, 2, block_size, num_kv_heads, head_dim]

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class KVStore(Protocol):
    name: str  # "host" or "disk": the label of its metrics
    enabled: bool
    capacity_bytes: int
    num_dropped: int

    def contains(self, key: bytes) -> bool:
        """Whether ``get(key)`` would likely find the block (cheap; no data is read)."""

    def get(self, key: bytes) -> StoredBlock | None: ...

    def put(self, key: bytes, block: StoredBlock) -> None: ...

    @property
    def used_bytes(self) -> int: ...
