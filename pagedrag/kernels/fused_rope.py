"""Rotary position embedding of q and k, in place, in one launch.

Layout ("neox", HF's rotate_half): a head of D = head_dim elements is two halves
x1 = x[:D/2], x2 = x[D/2:], rotated by the angles of its token's position:

    out[:D/2] = round(round(x1 * cos) - round(x2 * sin))
    out[D/2:] = round(round(x2 * cos) + round(x1 * sin))

with cos/sin rounded to q's dtype first and round() the cast to that dtype (a
no-op in fp32): the roundings torch makes in HF's ``q * cos + rotate_half(q) *
sin`` with cos = cat(freqs, freqs).cos() in the model dtype, so bf16/fp16 results
equal the torch reference's.

Inputs:
* q [T, Hq * D] and k [T, Hk * D], same dtype, last dim contiguous, any row
  stride (views of a fused QKV projection's output are fine). Both are
  overwritten and returned.
* positions [T] (int32 or int64), each in [0, max_pos).
* cos_sin_cache [max_pos, D] float32, contiguous: row p is cos(p * inv_freq)
  then sin(p * inv_freq) (D/2 each, attention scaling already applied).

Grid: (T,). A program loads its token's cos/sin once and rotates all Hq + Hk
heads as [heads, D/2] tiles (heads and D/2 padded to powers of two, masked).
Nothing is read on the host: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, cos, sin, NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate the NUM_HEADS heads that start at ``ptr`` (one token's row) in place."""
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]
    first_ptr = ptr + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    dtype = ptr.dtype.element_ty
    x1 = tl.load(first_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first_ptr, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first_ptr + HALF, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, positions_ptr, cos_sin_ptr, stride_q, stride_k,
                   NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    row = cos_sin_ptr + position * (2 * HALF) + offs_d
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(row, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(row + HALF, mask=offs_d < HALF, other=0.0).to(dtype).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_q, cos, sin, NUM_Q_HEADS, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_k, cos, sin, NUM_K_HEADS, HALF, K_HEADS_PAD, HALF_PAD)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``reference.rotary_embedding``, in place: returns q and k themselves.

    q [T, Hq * head_dim], k [T, Hk * head_dim] (last dim contiguous, any row
    stride), positions [T], cos_sin_cache [max_pos, head_dim] float32.
    """
    num_tokens = q.shape[0]
    assert q.dtype == k.dtype and q.stride(-1) == 1 and k.stride(-1) == 1 and head_dim % 2 == 0
    assert q.shape[1] % head_dim == 0 and k.shape[1] % head_dim == 0
    assert cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
    assert cos_sin_cache.shape[1] == head_dim and positions.shape == (num_tokens,)
    if num_tokens == 0:
        return q, k
    num_q_heads, num_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_heads_pad, half_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(head_dim // 2)
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, q.stride(0), k.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, HALF=head_dim // 2,
        Q_HEADS_PAD=q_heads_pad, K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
        HALF_PAD=half_pad, num_warps=min(max(q_heads_pad * half_pad // 512, 1), 8))
    return q, k
