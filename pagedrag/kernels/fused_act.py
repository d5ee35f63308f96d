"""SiLU-and-multiply of a merged gate|up projection: out = silu(gate) * up, one launch.

x is [T, 2 * I]: gate = x[:, :I], up = x[:, I:] (the layout of a merged gate_up
GEMM), last dim contiguous, any row stride. out is a new contiguous [T, I] in x's
dtype. Each element is computed as torch computes ``F.silu(gate) * up``:

    out = round(round(g / (1 + exp(-g))) * u)     fp32 math, round() = cast to x.dtype

so bf16/fp16 results equal the torch reference's up to an ulp where Triton's fp32
exp differs from torch's (the division is round-to-nearest, like torch's).

Grid: (T, cdiv(I, BLOCK)); a program does BLOCK columns of one row. Nothing is
read on the host: the launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program (fewer when I is smaller)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, intermediate, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate
    gate_ptr = x_ptr + row * stride_x + offs
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * intermediate + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton version of ``reference.silu_and_mul``: x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:]."""
    num_tokens, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1
    intermediate = width // 2
    out = torch.empty((num_tokens, intermediate), dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block = min(BLOCK, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
            x, out, x.stride(0), intermediate, BLOCK=block, num_warps=4)
    return out
