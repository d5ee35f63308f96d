"""The CUDA implementation of the paged KV ops and the fused elementwise ops (what
``ops_for("cuda")`` returns).

Each function has its reference's signature (reference.py). What callers
must hand in:

* caches: contiguous [num_blocks, block_size, num_kv_heads, head_dim], K and V of
  one shape and dtype (bf16, fp16 or fp32); block_size any power of two 1..256.
* query / key / value: last dim contiguous; other strides free (views of a fused
  QKV projection are fine). Attention outputs are new contiguous tensors of the
  query's dtype; scores, softmax and accumulators are fp32.
* block_tables [B, max_blocks] int32 (rows may be a strided slice, columns
  contiguous); context_lens [B] int32; query_start_loc [B+1] int32; slot_mapping
  [T] int32 or int64. All on the cache's device.
* store_kv, paged_decode_attention and prefix_prefill_attention read no device
  value on the host, so they can be captured in a CUDA graph. Decode derives its grid from ``block_tables.shape[1] * block_size``, the
  bound on the context length: size block_tables to the longest context of the
  step (or of the graph), not to the whole pool, or decode launches idle splits.

copy_blocks moves every layer's blocks in one launch (block_copy.py); its mapping's
source and destination blocks must be disjoint, as copy-on-write gives them.
swap_blocks runs the same kernel when both caches are on the GPU or in pinned host
memory (the engine pins its swap space), asynchronously on the current stream;
with pageable host memory it falls back to the reference's torch copies.
"""

from __future__ import annotations

import torch

from . import reference
from .block_copy import copy_blocks_between, kernel_device
from .decode_attention import paged_decode_attention as _decode
from .fused_act import silu_and_mul
from .fused_norm import rms_norm
from .fused_rope import rotary_embedding
from .prefill_attention import prefix_prefill_attention as _prefill
from .store_kv import store_kv as _store


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write K/V rows [T, kv_heads, head_dim] into their slots; slot -1 skips the row."""
    _store(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence over its whole cached context: [B, heads, head_dim]."""
    return _decode(query, k_cache, v_cache, block_tables, context_lens, scale)


def prefix_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Varlen new tokens attend causally to their cached prefix and themselves: [T, heads, head_dim]."""
    return _prefill(query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each row (src, dst) of block_mapping [N, 2], copy block src to dst in every layer."""
    caches = [*k_caches, *v_caches]
    copy_blocks_between(caches, caches, block_mapping)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Move blocks between two caches (e.g. GPU and CPU): dst[m[:,1]] = src[m[:,0]]."""
    if kernel_device([src_cache, dst_cache]) is None:
        reference.swap_blocks(src_cache, dst_cache, block_mapping)
    else:
        copy_blocks_between([src_cache], [dst_cache], block_mapping)


# Projections are cuBLAS's (the reference's oneDNN route is for CPU).
linear = torch.nn.functional.linear

# The paged KV ops above, then the model's fused elementwise ops (one launch each,
# same signatures and numerics as their references), then the projections.
__all__ = ["store_kv", "paged_decode_attention", "prefix_prefill_attention",
           "copy_blocks", "swap_blocks", "rms_norm", "rotary_embedding", "silu_and_mul", "linear"]

