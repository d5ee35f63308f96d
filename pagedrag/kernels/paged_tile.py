"""The inner loop shared by the attention kernels: one Q tile over a range of paged K/V.

Cache layout (per layer, K and V alike, contiguous):
    [num_blocks, block_size, num_kv_heads, head_dim]
Position p of a sequence lives in physical block ``block_table[p // block_size]`` at
row ``p % block_size``. A tile of TILE_N positions may span several physical blocks
(or a fraction of one), so every position looks its block up on its own: any
block size works, from 1 to 256, independently of TILE_N.

The Q tile is [BLOCK_M, HEAD_DIM_PAD]: its rows are query heads (decode) or
(token, head) pairs (prefill) that all read the same KV head, so each K/V tile is
loaded once for the whole GQA group. Softmax runs online in base 2: ``qk_scale`` is
the attention scale times log2(e); ``m_i`` is the running row max (log2 domain),
``l_i`` the running row sum of exp2(s - m_i), ``acc`` the unnormalised output, all
fp32.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter computes tl.dot on bf16 operands wrongly; it runs the dots in
# fp32 instead. On a GPU the dots take the input dtype (bf16/fp16 tensor cores).
DOT_IN_FP32 = os.environ.get("TRITON_INTERPRET", "0") == "1"

# Row max before any score has been seen: finite, so exp2(m_old - m_new) never
# evaluates -inf - -inf on a row whose first tile is fully masked.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def attend_range(acc, m_i, l_i, q, q_pos,
                 k_cache_ptr, v_cache_ptr, table_row_ptr, head_offset,
                 lo, hi, qk_scale, stride_block, stride_token,
                 offs_d, d_mask,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                 BOUNDED: tl.constexpr, CAUSAL: tl.constexpr,
                 DOT_FP32: tl.constexpr, PRECISION: tl.constexpr):
    """Fold positions [lo, hi) of one sequence into (acc, m_i, l_i); returns them.

    q [BLOCK_M, HEAD_DIM_PAD] in the dot dtype; q_pos [BLOCK_M] each row's position
    (used when CAUSAL: row r sees position p iff p <= q_pos[r]). BOUNDED masks
    positions >= hi (leave it off only when hi - lo is a multiple of TILE_N).
    head_offset is kv_head * stride_head; offs_d/d_mask span HEAD_DIM_PAD.
    """
    for start in range(lo, hi, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        if BOUNDED:
            in_range = pos < hi
        else:
            in_range = tl.full([TILE_N], 1, tl.int1)
        block = tl.load(table_row_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        rows = block * stride_block + (pos % BLOCK_SIZE) * stride_token + head_offset
        kv_mask = in_range[:, None] & d_mask[None, :]
        kv_offsets = rows[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i
