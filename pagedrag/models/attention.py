"""The attention seam between models and kernels.

A model calls ``PagedAttention.forward(q, k, v, kv_cache, meta)`` once per layer;
which kernels run (Triton on CUDA, torch on CPU) is decided by ``meta.ops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Where the tokens of one engine step go in the paged cache.

    Tokens of the step are packed sequence after sequence: sequence b owns rows
    query_start_loc[b]:query_start_loc[b+1]. context_lens[b] is that sequence's
    length once this step's tokens are in (so >= its query length).
    slot_mapping[t] is the flat cache slot of token t (-1: do not store).
    ``decode_only`` is True when every sequence brings exactly one token.
    """

    slot_mapping: torch.Tensor      # [T] int64
    block_tables: torch.Tensor      # [B, max_blocks] int32
    context_lens: torch.Tensor      # [B] int32
    query_start_loc: torch.Tensor   # [B + 1] int32
    decode_only: bool
    ops: ModuleType                 # pagedrag.kernels.ops_for(device)


class PagedAttention(nn.Module):
    """Stores this step's K/V into the paged cache, then attends over it."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """q [T, heads*dim], k/v [T, kv_heads*dim] -> [T, heads*dim]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        meta.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = meta.ops.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale)
        else:
            out = meta.ops.prefix_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                meta.context_lens, self.scale)
        return out.reshape(-1, self.num_heads * self.head_dim)
