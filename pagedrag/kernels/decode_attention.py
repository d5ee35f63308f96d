"""Paged decode attention: one query token per sequence, split-K over its context.

Grid: (batch, num_kv_heads, num_splits). A program reads one KV head of one
sequence over positions [split * partition, (split + 1) * partition) and computes
all GROUP = num_heads // num_kv_heads query heads that share it at once (the Q
tile's rows are those heads, padded to at least 16 for the tensor cores), so every
K/V byte is read once. With one split the program writes the normalised output
itself; otherwise it writes fp32 partials that split_k.merge_partials combines
(see split_k.py for their layout).

CUDA graphs: nothing here reads a device value on the host. The number of splits
and the partition size depend only on shapes: the longest context the launch must
cover is bounded by ``block_tables.shape[1] * block_size`` (the engine sizes block
tables per step, or per captured graph), and splits past a sequence's length only
mark themselves empty. context_lens[b] == 0 (a padded graph slot) yields zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .paged_tile import DOT_IN_FP32, NEG_BIG, attend_range
from .split_k import merge_partials, plan_splits

# Split the context until the grid has about this many programs per SM, unless the
# unsplit grid already has SATURATED_PER_SM. H200, 1,376-token contexts in a 4,096-token
# table, inside a CUDA graph: batch 1 (8 programs) 9.8 -> 7.7 us with 32 splits, batch 8
# 24.5 -> 17.3 us with 16; from batch 32 (1.9 programs per SM) splitting gains nothing,
# and at batch 64 one split beats two.
PROGRAMS_PER_SM = 8
SATURATED_PER_SM = 1.9


@triton.jit
def _decode_partition_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
        out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        qk_scale, partition, num_splits,
        stride_qb, stride_qh, stride_ob, stride_oh, stride_table,
        stride_block, stride_token, stride_head,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        SINGLE_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = split * partition
    end = tl.minimum(start + partition, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
    if not SINGLE_SPLIT:
        if start >= context_len:
            tl.store(part_max_ptr + part, tl.full([GROUP_PAD], NEG_BIG, tl.float32), mask=head_mask)
            return

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_mask = head_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int32)  # unused: decode is not causal-masked
    acc, m_i, l_i = attend_range(
        acc, m_i, l_i, q, q_pos, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq * stride_table, kv_head * stride_head,
        start, end, qk_scale, stride_block, stride_token, offs_d, d_mask,
        BLOCK_SIZE, TILE_N, True, False, DOT_FP32, PRECISION)

    if SINGLE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(part_max_ptr + part, m_i, mask=head_mask)
        tl.store(part_sum_ptr + part, l_i, mask=head_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, num_splits: int | None = None, tile_n: int = 64,
                           num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Triton version of ``reference.paged_decode_attention`` (same arguments and result).

    query [B, heads, head_dim] (last dim contiguous); caches contiguous
    [num_blocks, block_size, kv_heads, head_dim]; block_tables [B, max_blocks] int32
    (any row stride); context_lens [B] int32. The keyword-only arguments are tuning
    knobs (num_splits=None picks one from the shapes); the defaults are the H200 winners.
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    assert query.stride(2) == 1 and block_tables.stride(1) == 1
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out

    if query.dtype == torch.float32:  # fp32 tiles need twice the registers and shared memory
        tile_n = min(tile_n, 32)
    max_context = block_tables.shape[1] * block_size
    num_splits, partition, part_acc, part_max, part_sum = plan_splits(
        out, batch * num_kv_heads, max_context, tile_n, num_splits, PROGRAMS_PER_SM, SATURATED_PER_SM)
    _decode_partition_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, context_lens,
        out, part_acc, part_max, part_sum,
        scale * math.log2(math.e), partition, num_splits,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=tile_n, SINGLE_SPLIT=num_splits == 1,
        DOT_FP32=DOT_IN_FP32, PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        merge_partials(part_acc, part_max, part_sum, out)
    return out
