"""RMSNorm, optionally fused with the residual add before it: one launch per call.

Grid: (rows,). A program owns one row of H elements (BLOCK = next power of two
>= H, the tail masked) and does, in this order, what the torch reference
(reference.rms_norm, i.e. HF's LlamaRMSNorm with the add in front) does:

    s      = round(x + residual)                  fp32 add, rounded to x.dtype
    normed = round(s * rsqrt(mean(s * s) + eps))  fp32, rounded to x.dtype
    out    = round(normed * weight)               fp32 product, rounded to the
                                                  promoted dtype of x and weight

where round() casts to the 16-bit dtype and back (a no-op in fp32); each step
rounds where torch's separate ops round, so bf16/fp16 results equal the torch
module's up to an ulp where fp32 rsqrt or the sum's order differ.

Layout: x and residual are [rows, H] with the last dim contiguous and any row
stride; the outputs (out, and s when a residual is given) are new contiguous
tensors. Leading dims of more than one (e.g. [T, heads, head_dim] for per-head
q/k norms) are flattened by ``reshape``, which copies only when it must.
Nothing is read on the host: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
                     stride_x, stride_residual, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + offs, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * hidden + offs, x, mask=mask)
        x = x.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.math.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + offs, (normed * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


def _num_warps(block: int) -> int:
    """About 8 to 16 fp32 elements per thread, 1 to 16 warps."""
    return min(max(block // 512, 1), 16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton version of ``reference.rms_norm``.

    x [..., H] (last dim contiguous), weight [H], residual like x (same dtype) or
    None. Returns norm(x) * weight, or (norm(x + residual) * weight, x + residual).
    """
    hidden = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape == (hidden,)
    rows = x.reshape(-1, hidden)
    out = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is None:
        residual_rows, summed = rows, None
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        residual_rows = residual.reshape(-1, hidden)
        summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual_rows, weight, out, out if summed is None else summed,
            rows.stride(0), residual_rows.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block))
    out = out.view(x.shape)
    return out if summed is None else (out, summed.view(x.shape))
