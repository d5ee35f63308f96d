"""Weight-only quantization of a float matrix, for models that ship float weights and opt
in with ``quantization="int4"`` or ``"int8"`` (round to nearest, no calibration data).

- int4: per row and group of INT4_GROUP_SIZE input columns, asymmetric: the group's
  minimum is the offset and (max - min) / 15 the scale, so codes span 0..15.
- int8: per row, symmetric: scale = max |w| / 127 (rounded to the kernel's bfloat16
  first), codes in -127..127.
"""

from __future__ import annotations

import torch

from pagedrag.models.lowbit.groups import Groups
from pagedrag.models.lowbit.layouts import COMPUTE_DTYPE, Int8Layout, LayoutShapeError

INT4_GROUP_SIZE = 32


def int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Groups:
    """``weight`` [N, K] (K a multiple of group_size) as 4-bit asymmetric groups."""
    rows, columns = weight.shape
    if columns % group_size:
        raise LayoutShapeError(f"int4 quantization needs in_features divisible by {group_size}, got {columns}")
    grouped = weight.float().view(rows, columns // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    codes = ((grouped - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
    return Groups(codes.view(rows, columns), scales, low, group_size, 4)


def int8_layout(weight: torch.Tensor) -> Int8Layout:
    """``weight`` [N, K] as int8 codes with one symmetric scale per row."""
    scales = (weight.float().abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    scales = scales.to(COMPUTE_DTYPE).float()  # the kernel's scale, so codes round against it
    codes = (weight.float() / scales[:, None]).round().clamp(-127, 127)
    return Int8Layout(codes, scales)
