"""The projection module that multiplies with a low-bit layout instead of a float weight."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from pagedrag.models.lowbit.layouts import Int4Layout, Int8Layout

# Rows above which the float weight is used: torch's low-bit CPU kernels are made for a
# few rows (decode), and a 700-token prefill through the int4 one ran ~10x slower than
# oneDNN's float32 GEMM on the same machine, while 8-row decode batches ran faster.
LOW_BIT_MAX_ROWS = 16


class LowBitLinear(nn.Module):
    """Takes the place of a ``llama.Linear`` / ``MergedLinear``: same call, same result
    dtype as the input, ``shard_sizes`` kept for merged projections' splits.

    Invariants: products of at most LOW_BIT_MAX_ROWS rows (decode steps) read only the
    low-bit ``layout``; larger ones (prefill) go through ``dense``, the float projection
    holding the same weights (the GGUF's dequantized values), when one is kept.
    """

    def __init__(self, layout: Int4Layout | Int8Layout, dense: nn.Linear | None,
                 shard_sizes: list[int] | None = None):
        super().__init__()
        self.layout = layout
        self.dense = dense
        self.shard_sizes = shard_sizes

    def forward(self, x: torch.Tensor, ops: ModuleType) -> torch.Tensor:
        if self.dense is not None and x.shape[0] > LOW_BIT_MAX_ROWS:
            return self.dense(x, ops)
        out = self.layout(x).to(x.dtype)
        bias = None if self.dense is None else self.dense.bias
        return out if bias is None else out + bias
