"""Prefix prefill attention: varlen new tokens attend causally to their paged cache.

Sequence b brings q_len = query_start_loc[b+1] - query_start_loc[b] new tokens at
positions prefix .. context_lens[b] - 1 (prefix = context_lens[b] - q_len); their
K/V are already in the cache, so every key, cached or new, is read from the paged
cache. The work is a flash-attention style tiled online softmax:

* A program owns TOKENS_PER_TILE consecutive new tokens of one sequence and one KV
  head. Its Q tile packs (token, head) pairs of the GQA group into BLOCK_M rows
  (row r = token r // GROUP, head r % GROUP), so each K/V tile is read once for the
  whole group.
* Keys [0, full_end) are visible to every row of the tile (full_end is
  prefix + first token + 1 rounded down to TILE_N): that loop runs unmasked. The
  rest, up to the tile's last position, runs with the causal mask.
* Split-K (split_k.py) when the grid is too small to fill the GPU, as for a few
  new tokens over a long cached prefix (a prefix hit): dimension 2 of the grid
  partitions the keys, and the partials of each token are merged afterwards.

Grid (no host sync, no max length): dimension 0 has
``T // TOKENS_PER_TILE + B`` slots, T = query.shape[0]. Sequence b owns the slots
from ``query_start_loc[b] // TOKENS_PER_TILE + b`` on, at least cdiv(q_len,
TOKENS_PER_TILE) of them; a program finds its sequence by counting the sequences
whose first slot is <= its own, and slots past a sequence's tiles exit at once.
Dimension 1 is the KV head. The split count depends on shapes only: on the grid
size and on ``block_tables.shape[1] * block_size``, the bound on context lengths.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_tile import DOT_IN_FP32, NEG_BIG, attend_range
from .split_k import merge_partials, plan_splits

# Split the keys until the grid has about this many programs per SM, unless the unsplit
# grid already has SATURATED_PER_SM (as in decode_attention). H200, 32 new tokens over a
# 1,312-token context inside a CUDA graph: 6 splits of 704 keys took 20.8 us a layer.
PROGRAMS_PER_SM = 8
SATURATED_PER_SM = 2


@triton.jit
def _prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
        qk_scale, num_seqs, partition, num_splits,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
        stride_block, stride_token, stride_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TOKENS_PER_TILE: tl.constexpr,
        TILE_N: tl.constexpr, SEQS_PAD: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    offs_b = tl.arange(0, SEQS_PAD)
    first_slots = tl.load(query_start_loc_ptr + offs_b, mask=offs_b < num_seqs, other=0)
    first_slots = first_slots // TOKENS_PER_TILE + offs_b
    owns = (first_slots <= slot) & (offs_b < num_seqs)
    seq = tl.sum(owns.to(tl.int32), 0) - 1

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    first_token = (slot - (q_start // TOKENS_PER_TILE + seq)) * TOKENS_PER_TILE
    if first_token >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    prefix = context_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    token = first_token + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_mask = (offs_m < TOKENS_PER_TILE * GROUP) & (token < q_len)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
    tile_end = prefix + last_token + 1  # keys past this are hidden from every row
    lo = split * partition
    hi = tl.minimum(lo + partition, tile_end)
    part = ((q_start + token) * (GROUP * tl.num_programs(1)) + head) * num_splits + split
    if not SINGLE_SPLIT:
        if lo >= tile_end:
            tl.store(part_max_ptr + part, tl.full([BLOCK_M], NEG_BIG, tl.float32), mask=row_mask)
            return

    q = tl.load(q_ptr + (q_start + token)[:, None].to(tl.int64) * stride_qt
                + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix + token

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    table_row = block_tables_ptr + seq * stride_table
    head_offset = kv_head * stride_head
    # lo, partition and full_end are multiples of TILE_N: the first range is whole tiles.
    full_end = (prefix + first_token + 1) // TILE_N * TILE_N
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row, head_offset,
        lo, tl.minimum(hi, full_end), qk_scale, stride_block, stride_token, offs_d, d_mask,
        BLOCK_SIZE, TILE_N, False, False, DOT_FP32, PRECISION)
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr, table_row, head_offset,
        tl.maximum(lo, full_end), hi, qk_scale, stride_block, stride_token, offs_d, d_mask,
        BLOCK_SIZE, TILE_N, True, True, DOT_FP32, PRECISION)

    if SINGLE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + token)[:, None].to(tl.int64) * stride_ot
                 + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        tl.store(part_max_ptr + part, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part, l_i, mask=row_mask)
        tl.store(part_acc_ptr + part[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :], acc,
                 mask=io_mask)


def prefix_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, scale: float,
                             *, num_splits: int | None = None, block_m: int = 64,
                             tile_n: int = 64, num_warps: int = 4,
                             num_stages: int = 3) -> torch.Tensor:
    """Triton version of ``reference.prefix_prefill_attention`` (same arguments and result).

    query [T, heads, head_dim] (last dim contiguous); caches contiguous
    [num_blocks, block_size, kv_heads, head_dim]; block_tables [B, max_blocks] int32
    (any row stride); query_start_loc [B+1] int32; context_lens [B] int32. Returns a
    contiguous [T, heads, head_dim]. Keyword-only arguments are tuning knobs
    (num_splits=None picks one from the shapes); the defaults are the H200 winners.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert query.stride(2) == 1 and block_tables.stride(1) == 1
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    if query.dtype == torch.float32:  # fp32 tiles need twice the registers and shared memory
        block_m, tile_n = min(block_m, 64), min(tile_n, 32)
    block_m = max(block_m, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group
    slots = num_tokens // tokens_per_tile + num_seqs
    max_context = block_tables.shape[1] * block_size
    num_splits, partition, part_acc, part_max, part_sum = plan_splits(
        out, slots * num_kv_heads, max_context, tile_n, num_splits, PROGRAMS_PER_SM, SATURATED_PER_SM)
    _prefill_kernel[(slots, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_acc, part_max, part_sum,
        block_tables, query_start_loc, context_lens,
        scale * math.log2(math.e), num_seqs, partition, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, TOKENS_PER_TILE=tokens_per_tile,
        TILE_N=tile_n, SEQS_PAD=triton.next_power_of_2(num_seqs), SINGLE_SPLIT=num_splits == 1,
        DOT_FP32=DOT_IN_FP32, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        merge_partials(part_acc, part_max, part_sum, out)
    return out
