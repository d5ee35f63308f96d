"""Weights packed for torch's own CPU low-bit matmul kernels.

- :class:`Int4Layout`: ``aten._weight_int4pack_mm_for_cpu``. Per row and group of input
  columns a scale s and a zero point z, in torch's convention w = (q - 8) * s + z with
  q in 0..15; a :class:`Groups` (w = scale * q + offset) maps onto it with s = scale,
  z = offset + 8 * scale. Needs N a multiple of 16.
- :class:`Int8Layout`: ``aten._weight_int8pack_mm``, int8 weights with one scale per
  output row. Needs K a multiple of 16 (other widths gave wrong products or crashed).

A matrix of another shape raises :class:`LayoutShapeError`; the model keeps that projection's
float weights (pagedrag.models.lowbit.apply).

Both multiply bfloat16 activations: on an AVX2 CPU (no AVX-512) torch 2.13's kernels
are vectorized for bfloat16 only, and ran float32 and float16 inputs 10-20x slower
(measured on SmolLM2's projection shapes). So inputs are cast to bfloat16 and results
back to the caller's dtype; the scales and zero points are bfloat16 as well (the kernel
takes them in the activations' dtype), which rounds them to 8 significant bits. The
4-bit codes themselves are never changed.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedrag.models.lowbit.groups import Groups

COMPUTE_DTYPE = torch.bfloat16
INT4_ROW_MULTIPLE = 16  # the CPU packing's requirement on N
INT8_COLUMN_MULTIPLE = 16  # the int8 kernel's requirement on K


class LayoutShapeError(ValueError):
    """A matrix whose shape a CPU low-bit kernel cannot take."""


class Int4Layout(nn.Module):
    """4-bit codes packed for the CPU int4 kernel, with bfloat16 scales and zero points
    [K / group_size, N, 2].

    ``input_copies`` > 1 means the matrix is that many K-wide blocks side by side whose sum
    is the weight (see ``Groups.nibble_planes``); the input is repeated to match.
    Invariants: out_features % 16 == 0; built by ``from_groups``, the packed codes equal the
    Groups' codes.
    """

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int,
                 input_copies: int = 1):
        super().__init__()
        self.group_size = group_size
        self.input_copies = input_copies
        self.out_features = scales_and_zeros.shape[1]
        self.in_features = scales_and_zeros.shape[0] * group_size // input_copies
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @classmethod
    def from_groups(cls, groups: Groups, input_copies: int = 1) -> Int4Layout:
        rows, columns = groups.shape
        if groups.bits != 4:
            raise ValueError(f"the int4 CPU layout needs 4-bit codes, got {groups.bits}-bit ones")
        if rows % INT4_ROW_MULTIPLE or columns % input_copies:
            raise LayoutShapeError(f"the int4 CPU kernel needs out_features divisible by {INT4_ROW_MULTIPLE}, "
                                   f"got {rows}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(groups.codes.to(torch.int32), 1)
        zeros = groups.offsets + 8 * groups.scales
        scales_and_zeros = torch.stack((groups.scales.t(), zeros.t()), dim=-1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, scales_and_zeros, groups.group_size, input_copies)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] (any float dtype) -> [T, out_features] in bfloat16."""
        x = x.to(COMPUTE_DTYPE)
        if self.input_copies > 1:
            x = x.repeat(1, self.input_copies)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scales_and_zeros)


class Int8Layout(nn.Module):
    """int8 weights [N, K] with one scale per row: w = weight * scale[n]."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if self.in_features % INT8_COLUMN_MULTIPLE:
            raise LayoutShapeError(f"the int8 CPU kernel needs in_features divisible by {INT8_COLUMN_MULTIPLE}, "
                                   f"got {self.in_features}")
        self.register_buffer("weight", weight.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] (any float dtype) -> [T, out_features] in bfloat16."""
        return torch.ops.aten._weight_int8pack_mm(x.to(COMPUTE_DTYPE), self.weight, self.scales)


def dequantize(layout: Int4Layout | Int8Layout) -> torch.Tensor:
    """The matrix [N, K] the kernel multiplies with, as it computes it (bfloat16 products of
    the identity), for checks against the source weights."""
    identity = torch.eye(layout.in_features, dtype=COMPUTE_DTYPE)
    return layout(identity).t().float()
